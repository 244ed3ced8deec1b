"""Safe loading: the allow-list of harmless globals, and the static check run before any load.

(Interim version: the static pickle scanner and zip structure checks land with the safety issue.)
"""

from __future__ import annotations

from typing import Any


def allowed_globals() -> list[Any]:
    """Globals torch's weights_only unpickler may build beyond its own defaults."""
    import argparse
    import collections

    return [argparse.Namespace, collections.OrderedDict, collections.defaultdict,
            collections.Counter, collections.deque]


def ensure_safe(path: str, fmt: str) -> None:
    """Raise UnsafeCheckpointError naming every global outside the allow-list (scanner pending)."""
    return None
