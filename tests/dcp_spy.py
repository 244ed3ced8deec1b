"""ScratchSpy: counts the scratch mappings the DCP reader makes, or refuses them (a streamed read makes none)."""

from __future__ import annotations

from typing import Any

import pytest

from ckptfix.formats.dcp import chunks


class ScratchSpy:
    """Counts the scratch mappings made (or refuses them): the streamed path must make none."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, refuse: bool):
        self.made: list[int] = []
        real = chunks.Scratch.__init__

        def init(scratch: Any, nbytes: int) -> None:
            if nbytes:
                self.made.append(nbytes)
                if refuse:
                    raise AssertionError(f"a {nbytes}-byte scratch mapping was asked for")
            real(scratch, nbytes)

        monkeypatch.setattr(chunks.Scratch, "__init__", init)
