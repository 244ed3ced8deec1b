"""Remote destinations: a one-file output (``.safetensors``, ``.pth``) written to ``s3://BUCKET/KEY``.

The writers seek (a zip's headers, a safetensors header), so the output is first written to a local temp file
(in ``TMPDIR``: it needs the output's size free there), then uploaded with S3's multipart API: parts of
``CKPTFIX_UPLOAD_PART_SIZE`` bytes (default 64 MiB, S3's minimum 5 MiB), several in flight, each read from the
temp file as it is sent. Nothing is visible at the key until ``complete_multipart_upload``; any failure, Ctrl-C,
SIGTERM or SIGHUP aborts the upload (no parts left billed) and removes the temp file. An output of one part or
less goes up in one ``put_object`` (atomic too). Without ``force`` an existing object is refused before anything
is read, and the final step is conditional (``If-None-Match: *``), so an object another writer put there meanwhile,
or one a HEAD can't see (a write-only policy, without s3:ListBucket, gets 403s), is not replaced either. After the
upload, ``head_object`` checks the size (where the policy lets it).

Directory outputs (sharded, DCP) to S3 are refused, and so are ``https://`` (no standard write) and ``hf://``
(``huggingface-cli upload``) destinations. A local destination goes to :mod:`ckptfix.core.atomic`.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Any

from . import atomic, interrupts, remote
from .locations import is_remote
from ..errors import DestinationError, MissingFileError, RemoteError, pass_flag

#: bytes per uploaded part (S3 allows 10,000 parts: 640 GB at this size; larger files get larger parts)
PART_SIZE = 64 * 2**20
#: S3's smallest part (all but the last)
MIN_PART = 5 * 2**20
#: parts in flight at once
UPLOAD_WORKERS = 8
_MAX_PARTS = 10_000


def part_size(size: int) -> int:
    """Bytes per part for a file of ``size`` bytes: ``CKPTFIX_UPLOAD_PART_SIZE`` (at least S3's 5 MiB), grown to
    keep within S3's 10,000 parts."""
    wanted = max(int(os.environ.get("CKPTFIX_UPLOAD_PART_SIZE", PART_SIZE)), MIN_PART)
    return max(wanted, -(-size // _MAX_PARTS))


def check_scheme(dst: str) -> None:
    """Refuse a remote destination ckptfix can't write: only ``s3://`` is written."""
    if not is_remote(dst) or dst.lower().startswith("s3://"):
        return
    if dst.lower().startswith("hf://"):
        raise DestinationError(f"{dst}: ckptfix does not write to the Hugging Face Hub; write a local file and upload "
                               "it with `huggingface-cli upload ORG/REPO FILE PATH`")
    raise DestinationError(f"{dst}: an http(s) URL can't be written (HTTP has no standard upload); write a local file, "
                           "or an s3://BUCKET/KEY destination")


def check_destination(src: str, dst: str, force: bool) -> None:
    """:func:`ckptfix.core.atomic.check_destination`, for a local path or an ``s3://`` URL: the bucket exists, the key
    names an object (not a prefix), is not the source, and holds nothing unless ``force``."""
    if not is_remote(dst):
        atomic.check_destination(src, dst, force)
        return
    check_scheme(dst)
    bucket, key = remote.split_s3(dst)
    if not bucket or not key or key.endswith("/"):
        raise DestinationError(f"{dst}: names a bucket or prefix; give the object's key, e.g. s3://BUCKET/out.safetensors")
    if is_remote(src) and src.rstrip("/") == dst.rstrip("/"):
        raise DestinationError(f"{dst}: is the source itself; write to a new key")
    client = remote.s3_client()
    if _answer(dst, lambda: client.head_bucket(Bucket=bucket)) is None:
        raise DestinationError(f"{dst}: bucket {bucket} does not exist (or the endpoint is another: AWS_ENDPOINT_URL)")
    if _answer(dst, lambda: client.head_object(Bucket=bucket, Key=key)) and not force:
        raise DestinationError(f"{dst}: already exists; {pass_flag('force')} to replace it")


def check_destination_dir(src: str, dst: str, force: bool, output: atomic.DirOutput | None = None) -> None:
    """:func:`ckptfix.core.atomic.check_destination_dir`; a remote directory output is refused."""
    if is_remote(dst):
        check_scheme(dst)
        raise DestinationError(f"{dst}: ckptfix writes one .safetensors or .pth file to S3, not a sharded or DCP "
                               f"directory; write the directory locally and upload it (aws s3 cp --recursive DIR {dst})")
    atomic.check_destination_dir(src, dst, force, output)


def _answer(url: str, head: Callable[[], Any]) -> Any:
    """A HEAD's response; None for a 404; ``{}`` for a 403 (S3 says neither yes nor no without s3:ListBucket, which a
    write-only policy lacks: the upload goes on, its If-None-Match still guarding an existing object)."""
    from botocore.exceptions import ClientError

    def attempt() -> Any:
        try:
            return head()
        except ClientError as e:
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status in (403, 404):
                return None if status == 404 else {}
            raise

    return remote.s3_call(url, attempt)


@contextlib.contextmanager
def output_path(dst: str, finalize: Callable[[str], str] | None = None, notes: list[str] | None = None,
                force: bool = False) -> Iterator[str]:
    """:func:`ckptfix.core.atomic.atomic_path` for a local path or an ``s3://`` URL: yield a local temp path to
    write; on clean exit it is renamed onto ``dst`` (local) or uploaded to it (``finalize(tmp)`` may name another
    key). On any exception, interrupts included, the temp file is removed and any upload aborted."""
    if not is_remote(dst):
        with atomic.atomic_path(dst, finalize, notes) as tmp:
            yield tmp
        return
    check_scheme(dst)
    with interrupts.signals_as_interrupts():
        try:
            folder = tempfile.mkdtemp(prefix="ckptfix-upload-")
        except OSError as e:
            raise DestinationError(f"{dst}: can't create a temp directory for the upload in {tempfile.gettempdir()}: "
                                   f"{e.strerror or e}; set TMPDIR") from None
        try:
            tmp = os.path.join(folder, dst.rstrip("/").rsplit("/", 1)[-1])
            yield tmp
            final = finalize(tmp) if finalize is not None else dst
            sent, parts = upload_file(tmp, final, replace=force)
            if notes is not None:
                notes.append(f"uploaded {sent} bytes to {final} ({parts} part{'s' if parts != 1 else ''}); it was "
                             f"written to a temp file in {tempfile.gettempdir()} first, now removed")
        except BaseException as e:
            with interrupts.held():
                shutil.rmtree(folder, ignore_errors=True)
            atomic.reraise_write_failure(e, dst)
        with interrupts.held():
            shutil.rmtree(folder, ignore_errors=True)


def upload_file(path: str, url: str, replace: bool = False) -> tuple[int, int]:
    """Upload the local file ``path`` to the ``s3://`` ``url`` atomically; (bytes uploaded, parts).

    ``replace``: an object already at the key is replaced (else the upload fails rather than replace one)."""
    client = remote.s3_client()
    bucket, key = remote.split_s3(url)
    size = os.path.getsize(path)
    step = part_size(size)
    condition = {} if replace else {"IfNoneMatch": "*"}
    if size <= step:
        with open(path, "rb") as f, interrupts.held(written=True):  # (at most one part: seconds)
            _conditional(url, lambda: client.put_object(Bucket=bucket, Key=key, Body=f, ContentLength=size,
                                                        **condition))
        parts = 1
    else:
        upload_id = remote.s3_call(url, lambda: client.create_multipart_upload(Bucket=bucket, Key=key))["UploadId"]
        try:
            done = _send_parts(client, path, url, upload_id, size, step)
            with interrupts.held(written=True):  # the object appears now: a signal waits, then says so
                _conditional(url, lambda: client.complete_multipart_upload(
                    Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": done}, **condition))
        except BaseException:
            with interrupts.held():
                abort(client, url, upload_id)
            raise
        parts = len(done)
    head = _answer(url, lambda: client.head_object(Bucket=bucket, Key=key))
    stored = None if head is None else head.get("ContentLength", size)  # (a 403: S3 accepted it whole, can't say more)
    if stored != size:
        raise RemoteError(f"{url}: S3 holds {stored} bytes after the upload of {size}: the upload did not arrive whole; "
                          "run the conversion again")
    return size, parts


def abort(client: Any, url: str, upload_id: str) -> None:
    """Abort a multipart upload (its parts deleted, not billed); a failure to is reported, as parts may be left."""
    bucket, key = remote.split_s3(url)
    try:
        remote.s3_call(url, lambda: client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id))
    except MissingFileError:  # (already completed or aborted)
        pass
    except RemoteError as e:
        raise RemoteError(f"{e}; aborting the multipart upload {upload_id} failed too: its parts may be left (and "
                          "billed): `aws s3api list-multipart-uploads --bucket BUCKET` lists them") from None


def _send_parts(client: Any, path: str, url: str, upload_id: str, size: int, step: int) -> list[dict[str, Any]]:
    """Every part of ``path`` uploaded, ``UPLOAD_WORKERS`` at a time; the first failure stops the rest."""
    stop = threading.Event()
    with open(path, "rb") as f:
        pool = ThreadPoolExecutor(UPLOAD_WORKERS, thread_name_prefix="ckptfix-upload")
        futures: list[Future] = []
        try:
            for number, offset in enumerate(range(0, size, step), start=1):
                futures.append(pool.submit(send_part, client, url, upload_id, number,
                                           _Slice(f.fileno(), offset, min(step, size - offset)), stop))
            wait(futures, return_when=FIRST_EXCEPTION)
            return [{"PartNumber": n, "ETag": fut.result()} for n, fut in enumerate(futures, start=1)]
        finally:
            stop.set()
            for fut in futures:
                fut.cancel()
            with interrupts.held():  # parts in flight finish (or fail) before the abort: none is left behind it
                pool.shutdown(wait=True)


def send_part(client: Any, url: str, upload_id: str, number: int, body: _Slice, stop: threading.Event) -> str:
    """Upload one part; its ETag."""
    if stop.is_set():
        raise RemoteError(f"{url}: upload stopped")
    bucket, key = remote.split_s3(url)
    r = remote.s3_call(url, lambda: client.upload_part(Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number,
                                                       Body=body, ContentLength=body.size))
    return str(r["ETag"])


def _conditional(url: str, call: Callable[[], Any]) -> Any:
    """An S3 write sent with ``If-None-Match: *``: its 412 means another writer put an object there meanwhile."""
    from botocore.exceptions import ClientError

    def attempt() -> Any:
        try:
            return call()
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("PreconditionFailed", "412"):
                raise DestinationError(f"{url}: an object is at this key already (put there during the conversion, "
                                       "or hidden from a HEAD without s3:ListBucket), and S3 kept it; "
                                       f"{pass_flag('force')} to replace it") from None
            raise

    return remote.s3_call(url, attempt)


class _Slice(io.RawIOBase):
    """``size`` bytes of a file from ``offset``, as a seekable stream (botocore reads it for the checksum, rewinds,
    sends it, and rewinds again to retry): one part, read with ``pread`` so parts share the descriptor."""

    def __init__(self, fd: int, offset: int, size: int):
        super().__init__()
        self.fd, self.offset, self.size, self.pos = fd, offset, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        n = min(len(view), self.size - self.pos)
        if n <= 0:
            return 0
        data = os.pread(self.fd, n, self.offset + self.pos)
        view[:len(data)] = data
        self.pos += len(data)
        return len(data)

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = min(max(base + pos, 0), self.size)
        return self.pos

    def tell(self) -> int:
        return self.pos
