"""Writing to S3 in the tests (tests/ops/test_remote_write.py, tests/cli/test_cli_remote_write.py): the sources, the
object at a key and the multipart uploads left in the bucket, an output compared with the local one, a failing part.
"""

from __future__ import annotations

import io
import struct
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from ckptfix.core.remote import s3 as s3_backend
from tests.remote_servers import S3Server


def sources(root: Path, mib: int) -> dict[str, Path]:
    """A torch zip and a safetensors file of about ``mib`` MiB of float32 tensors, written by torch and safetensors."""
    g = torch.Generator().manual_seed(1)
    sd = {f"module.block.{i}.weight": torch.randn(mib * 2**18 // 4, generator=g) for i in range(4)}
    sd["module.head.bias"] = torch.randn(10, generator=g)
    torch.save({"state_dict": sd, "epoch": 1}, root / "model.pth")
    save_file({k: v.clone() for k, v in sd.items()}, str(root / "model.safetensors"))
    return {"pth": root / "model.pth", "safetensors": root / "model.safetensors"}


def object_bytes(s3: S3Server, key: str) -> bytes | None:
    """The object at ``key``, or None when there is none."""
    try:
        return s3.client().get_object(Bucket=s3.bucket, Key=key)["Body"].read()
    except s3.client().exceptions.NoSuchKey:
        return None


def same_output(got: bytes | None, want: bytes) -> bool:
    """``got`` is ``want`` byte for byte, but for a torch zip's ``.data/serialization_id`` (an id of the save, not of
    its tensors: its 40 bytes and their CRC-32, in the local header and the central directory)."""
    if got is None or len(got) != len(want):
        return False
    if not zipfile.is_zipfile(io.BytesIO(want)):
        return got == want
    masked = []
    for data in (got, want):
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            info = next(i for i in z.infolist() if i.filename.endswith(".data/serialization_id"))
            crc, directory = struct.pack("<I", info.CRC), z.start_dir
        head = info.header_offset
        name_len, extra_len = struct.unpack_from("<HH", data, head + 26)
        start = head + 30 + name_len + extra_len
        out = bytearray(data)
        out[head + 14:head + 18] = bytes(4)  # the local header's CRC-32
        out[start:start + info.file_size] = bytes(info.file_size)
        tail = bytes(out[directory:])
        assert tail.count(crc) == 1
        out[directory:] = tail.replace(crc, bytes(4))  # the central directory's
        masked.append(bytes(out))
    return masked[0] == masked[1]


def uploads(s3: S3Server) -> list[Any]:
    """The bucket's multipart uploads not completed or aborted."""
    return s3.client().list_multipart_uploads(Bucket=s3.bucket).get("Uploads", [])


def failing_part(monkeypatch: pytest.MonkeyPatch, on_part: int, action: Callable[[], None]) -> list[int]:
    """``s3_backend.send_part`` runs ``action`` instead of sending part ``on_part``; the parts sent, in order."""
    real, sent = s3_backend.send_part, []

    def send_part(client: Any, url: str, upload_id: str, number: int, body: Any, stop: Any) -> str:
        if number == on_part:
            action()
        etag = real(client, url, upload_id, number, body, stop)
        sent.append(number)
        return etag

    monkeypatch.setattr(s3_backend, "send_part", send_part)
    return sent
