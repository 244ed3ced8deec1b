"""What a tensor in a file is, as plain data: dtype, shape, strides, offset, storage, saved device.

The torch-free structure readers (:func:`ckptfix.formats.describe`) describe a checkpoint with these
instead of tensors on ``meta``, so ``ckptfix inspect`` answers without importing torch (2–3 s, 280 MiB).
:func:`is_tensor` accepts either kind without importing torch: a ``torch.Tensor`` can only exist once
torch is imported.

>>> ckpt = ckptfix.describe("model.pth")                      # doctest: +SKIP
>>> t = ckpt.state_dict["fc.weight"]; t.shape, t.dtype, t.byte_range   # ((10, 4), 'float32', (1152, 1312))
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from .torch_tables import DTYPE_ITEMSIZE


@dataclass(frozen=True, eq=False, slots=True)
class StorageInfo:
    """One storage: its bytes ``path[offset : offset + nbytes]``, saved on ``location`` (``cpu``, ``cuda:1``)."""

    path: str
    key: str  # record key in a torch zip (data/KEY), the tensor's name in a safetensors file
    offset: int
    nbytes: int
    location: str
    record: Any = None  # the torch zip member holding the bytes (core.bytecopy.Recorded), checked when copied


@dataclass(frozen=True, eq=False, slots=True)
class TensorInfo:
    """One tensor as saved, nothing constructed: a view (offset, shape, stride in elements) of a storage.

    Compared by identity, like tensors: two keys holding the same object are tied weights.
    """

    dtype: str  # torch's name without ``torch.``: float32, bfloat16, float8_e4m3fn, …
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    storage: StorageInfo
    requires_grad: bool = False
    is_parameter: bool = False

    @property
    def device(self) -> str:
        """The device it was saved on (a file holds no live device)."""
        return self.storage.location

    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def element_size(self) -> int:
        return DTYPE_ITEMSIZE[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.numel() * self.element_size()

    def is_contiguous(self) -> bool:
        """As torch computes it (c10's ``_compute_contiguous``): a tensor without elements is contiguous,
        whatever its strides; otherwise dimensions of size 1 may have any stride."""
        if 0 in self.shape:
            return True
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride)):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    @property
    def byte_range(self) -> tuple[int, int] | None:
        """``(start, end)`` of the tensor's bytes in the file when they are one contiguous run, else None."""
        if not self.is_contiguous():
            return None
        start = self.storage.offset + self.storage_offset * self.element_size()
        return start, start + self.nbytes


def is_tensor(v: Any) -> bool:
    """A ``TensorInfo`` or a ``torch.Tensor`` (checked only when torch is already imported)."""
    if isinstance(v, TensorInfo):
        return True
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(v, torch.Tensor)


def math_bits(t: Any) -> tuple[bool, bool]:
    """``(conjugate, negative)``: the bits torch's rebuild sets from a file's metadata (``x.conj()``,
    ``torch._neg_view(x)``), which make a tensor's values the conjugate or negation of its stored bytes.
    A TensorInfo has none: the torch-free reader leaves such tensors to torch."""
    if isinstance(t, TensorInfo):
        return False, False
    return bool(t.is_conj()), bool(t.is_neg())


def layout_name(v: Any) -> str | None:
    """``'sparse_csr'`` for a sparse tensor, None for a strided one (and a TensorInfo, always strided)."""
    if isinstance(v, TensorInfo):
        return None
    name = str(v.layout).replace("torch.", "")
    return None if name == "strided" else name


def sparse_parts(t: Any) -> tuple[Any, ...]:
    """The strided tensors a sparse tensor is saved as: its indices (compressed, then plain) and its values."""
    name = layout_name(t)
    if name == "sparse_coo":
        return t._indices(), t._values()
    if name in ("sparse_csr", "sparse_bsr"):
        return t.crow_indices(), t.col_indices(), t.values()
    return t.ccol_indices(), t.row_indices(), t.values()


def shape_and_dtype(v: Any) -> tuple[list[int | None], str]:
    """``([2, 3], 'float32')`` for a TensorInfo or a tensor (:func:`shape_of`)."""
    if isinstance(v, TensorInfo):
        return list(v.shape), v.dtype
    return shape_of(v), str(v.dtype).replace("torch.", "")


def shape_of(t: Any) -> list[int | None]:
    """A tensor's shape; a nested tensor's (``torch.nested``) has no ``shape``: its components' count, then each
    dimension they share, None where they differ (``[2, None, 3]``)."""
    if not t.is_nested:
        return list(t.shape)
    sizes = t._nested_tensor_size().tolist()
    return [len(sizes)] + [column[0] if len(set(column)) == 1 else None for column in zip(*sizes)]
