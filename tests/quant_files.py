"""The real quantized files of fixtures/quant/, as its MANIFEST.json lists them (made by hand, by the publishing
libraries, with fixtures/quant/make_<library>.py; CI never runs those scripts).

Each row: the checkpoint file, the library and its version, the scheme in issue 28's words, the library's own
dequantization of each quantized weight (``reference``: key = the weight's module prefix + ``.weight``, float32),
the torch of the venv that made it, the folder's other files (``companions``) and the bf16 ``original`` every
scheme started from; torchao's pickled files also name ``inner``, each subclass's inner tensors as torchao held
them (key: weight key + ``.`` + attribute).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

QUANT = Path(__file__).resolve().parent.parent / "fixtures" / "quant"
MANIFEST = QUANT / "MANIFEST.json"


@dataclass(frozen=True)
class QuantFile:
    """One row of MANIFEST.json, its paths resolved."""

    path: Path
    library: str
    version: str
    scheme: str
    torch: str
    reference: Path | None
    original: Path | None
    companions: tuple[Path, ...]
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        """The file's path under fixtures/quant (a test id)."""
        return self.path.relative_to(QUANT).as_posix()


def _resolved(value: str | None) -> Path | None:
    return None if value is None else QUANT / value


def files(library: str | None = None, suffix: str | None = None) -> list[QuantFile]:
    """The manifest's files, of one library and with one suffix where given, in the manifest's order."""
    rows = json.loads(MANIFEST.read_text())["files"]
    out = []
    for name, row in rows.items():
        row = dict(row)
        qf = QuantFile(path=QUANT / name, library=row.pop("library"), version=row.pop("version"),
                       scheme=row.pop("scheme"), torch=row.pop("torch"), reference=_resolved(row.pop("reference")),
                       original=_resolved(row.pop("original", None)),
                       companions=tuple(QUANT / c for c in row.pop("companions", ())), extra=row)
        if (library is None or qf.library == library) and (suffix is None or qf.path.suffix == suffix):
            out.append(qf)
    return out


def tensors(path: Path) -> dict[str, Any]:
    """A safetensors file's tensors (a reference, an inner record, an original), read by safetensors."""
    from safetensors.torch import load_file

    return load_file(str(path))
