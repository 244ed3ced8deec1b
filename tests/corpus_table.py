"""What the public corpora (tests/public_torch_corpus.py, tests/public_dcp_corpus.py) share: a table of cases filled by
a decorator (``CASES, case = table()``; ``@case("name")`` on ``make(tmp_dir) -> Path``), and seeded randomness that
leaves the caller's generator as it was."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

Make = Callable[[Path], Path]


def table() -> tuple[dict[str, Make], Callable[[str], Callable[[Make], Make]]]:
    """An empty table of cases and the decorator that registers one under a name (each name once)."""
    cases: dict[str, Make] = {}

    def case(name: str) -> Callable[[Make], Make]:
        def register(make: Make) -> Make:
            assert name not in cases, name
            cases[name] = make
            return make
        return register

    return cases, case


@contextmanager
def seeded(n: int = 0) -> Iterator[None]:
    """torch's global generator seeded with ``n`` inside, restored after."""
    with torch.random.fork_rng():
        torch.manual_seed(n)
        yield
