"""``s3://BUCKET/KEY``: read with ranged GetObject calls (boto3, imported when an s3:// URL is first used), listed by
prefix, and written with S3's multipart upload.

The client is configured the standard AWS way (``AWS_ENDPOINT_URL``, profiles, …). Every ranged GET is sent with
``If-Match`` the ETag of the first answer, so an object replaced mid-read is refused, not mixed; its body is read
in socket-sized pieces under a :class:`~.common.Pace` (a stall or a deadline ends it). botocore signs each request
itself, for the host it sends that request to: no credential of ckptfix's rides along a redirect. A key with a
``.`` or ``..`` segment is refused before anything is asked.

Writing: the writers seek (a zip's headers, a safetensors header), so the output is first written to a local temp
file (:func:`ckptfix.core.upload.output_path`), then uploaded with S3's multipart API: parts of
``CKPTFIX_UPLOAD_PART_SIZE`` bytes (default 64 MiB, S3's minimum 5 MiB), several in flight, each read from the
temp file as it is sent. Nothing is visible at the key until ``complete_multipart_upload``; any failure, Ctrl-C,
SIGTERM or SIGHUP aborts the upload (no parts left billed). An output of one part or less goes up in one
``put_object`` (atomic too). Without ``force`` an existing object is refused before anything is read, and the
final step is conditional (``If-None-Match: *``), so an object another writer put there meanwhile, or one a HEAD
can't see (a write-only policy, without s3:ListBucket, gets 403s), is not replaced either. After the upload,
``head_object`` checks the size (where the policy lets it). Directory outputs (sharded, DCP) are refused.
"""

from __future__ import annotations

import io
import os
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Any

from ...errors import DestinationError, MissingFileError, RemoteError, pass_flag
from .. import interrupts
from ..positional import ByteSource
from .backend import Backend
from .common import Pace, Transient, changed, import_client, plain_segments, read_body, retries, timeout, with_retries


class S3Backend(Backend):
    """``s3://BUCKET/KEY``: ranged GETs, prefix listings, one-file outputs uploaded in parts."""

    def open(self, location: str) -> ByteSource:
        return S3Source(location)

    def listdir(self, location: str) -> tuple[list[str], int]:
        return s3_list(location)

    def check_writable(self, location: str, directory: bool = False) -> None:
        if directory:
            raise DestinationError(f"{location}: ckptfix writes one .safetensors or .pth file to S3, not a sharded or DCP "
                                   f"directory; write the directory locally and upload it (aws s3 cp --recursive DIR "
                                   f"{location})")

    def check_destination(self, src: str, dst: str, force: bool) -> None:
        check_destination(src, dst, force)

    def upload(self, path: str, url: str, replace: bool) -> tuple[int, int]:
        return upload_file(path, url, replace)


def split_s3(location: str) -> tuple[str, str]:
    """``s3://BUCKET/KEY`` → (bucket, key); a key with ``.`` or ``..`` segments is refused."""
    bucket, _, key = location[len("s3://"):].partition("/")
    plain_segments(location, key, "S3 key", empty=True)
    return bucket, key


_S3_CLIENTS: dict[tuple, Any] = {}


def s3_client() -> Any:
    """A boto3 S3 client configured the standard AWS way (``AWS_ENDPOINT_URL``, profiles, …), one per setting."""
    boto3 = import_client("boto3", "s3:// URLs")
    from botocore.config import Config

    key = (os.environ.get("AWS_ENDPOINT_URL"), os.environ.get("AWS_ENDPOINT_URL_S3"), os.environ.get("AWS_PROFILE"),
           os.environ.get("AWS_ACCESS_KEY_ID"), timeout(), retries())
    if key not in _S3_CLIENTS:
        config = Config(connect_timeout=timeout(), read_timeout=timeout(),
                        retries={"max_attempts": retries() + 1, "mode": "standard"})
        client = boto3.session.Session().client("s3", config=config)
        client.meta.events.register("after-call.s3.ListObjectsV2", _count_listing)
        _S3_CLIENTS[key] = client
    return _S3_CLIENTS[key]


_LISTED = threading.local()  # body bytes of the listings this thread received (S3 sends them chunked: no length)


def _count_listing(http_response: Any = None, **_: Any) -> None:
    if http_response is not None:
        _LISTED.n = getattr(_LISTED, "n", 0) + len(http_response.content)


def _listed() -> int:
    return int(getattr(_LISTED, "n", 0))


def s3_call(name: str, call: Any) -> Any:
    """A boto3 call, its failures as ckptfix errors naming ``name``."""
    from botocore import exceptions as bx

    try:
        return call()
    except bx.ClientError as e:
        code = str(e.response.get("Error", {}).get("Code", ""))
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in ("404", "NoSuchKey", "NotFound", "NoSuchBucket") or status == 404:
            raise MissingFileError(f"{name}: no such object ({code or status})", name) from None
        if code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch") or status == 403:
            raise RemoteError(f"{name}: access denied ({code}); check the AWS credentials (AWS_ACCESS_KEY_ID, "
                              "AWS_PROFILE) and the bucket's policy") from None
        if code in ("PreconditionFailed", "412") or status == 412:
            raise changed(name, "its ETag", "a failed If-Match") from None
        raise RemoteError(f"{name}: S3 error {code or status}: {e}") from None
    except bx.NoCredentialsError:
        raise RemoteError(f"{name}: no AWS credentials found; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                          "or AWS_PROFILE") from None
    except (bx.EndpointConnectionError, bx.ConnectTimeoutError, bx.ReadTimeoutError) as e:
        raise RemoteError(f"{name}: {e}; check AWS_ENDPOINT_URL and the network") from None
    except bx.BotoCoreError as e:
        raise RemoteError(f"{name}: {e}") from None


class S3Source(ByteSource):
    """An S3 object read with ranged GetObject calls, each sent with ``If-Match`` the first ETag."""

    def __init__(self, location: str):
        super().__init__()
        self.name = location
        self.bucket, self.key = split_s3(location)
        client = s3_client()
        head = s3_call(location, lambda: client.head_object(Bucket=self.bucket, Key=self.key))
        self.size, self.etag = int(head["ContentLength"]), head.get("ETag", "")
        self.validator = self.etag or None

    def _fetch(self, offset: int, n: int) -> bytes:
        return with_retries(self.name, lambda: self._get_range(offset, n))

    def _get_range(self, offset: int, n: int) -> bytes:
        from urllib3.exceptions import HTTPError as Urllib3Error  # (botocore's transport)

        client = s3_client()
        extra = {"IfMatch": self.etag} if self.etag else {}
        pace = Pace(self.name)
        r = s3_call(self.name, lambda: client.get_object(Bucket=self.bucket, Key=self.key,
                                                         Range=f"bytes={offset}-{offset + n - 1}", **extra))
        if self.etag and r.get("ETag", self.etag) != self.etag:
            raise changed(self.name, self.etag, r.get("ETag"))
        want = min(n, self.size - offset)
        pace.body()
        try:
            data = read_body(_read1(r["Body"]), want, pace)
        except BaseException as e:
            r["Body"].close()  # (a connection read halfway is not reused)
            if isinstance(e, (Urllib3Error, TimeoutError, ConnectionError)):
                raise Transient(f"timed out or reset while reading ({type(e).__name__}: {e})") from None
            raise
        if len(data) != want:
            raise RemoteError(f"{self.name}: S3 sent {len(data)} bytes for bytes={offset}-{offset + n - 1}: refused")
        return data


def _read1(body: Any) -> Any:
    """``read(n)`` on a GetObject body that returns what one socket read brings (urllib3's ``read1``, under
    botocore's StreamingBody), so a drip reaches the pace; small reads where urllib3 has none (before 2.0)."""
    read1 = getattr(getattr(body, "_raw_stream", None), "read1", None)
    return read1 if read1 is not None else (lambda n: body.read(min(n, 1024)))


def s3_list(location: str) -> tuple[list[str], int]:
    """The names directly under an S3 prefix (a "directory"), and the bytes its listing took (its pages' bodies)."""
    before = _listed()
    bucket, key = split_s3(location)
    prefix = key.rstrip("/") + "/" if key.strip("/") else ""
    client = s3_client()
    names: list[str] = []
    token: dict[str, str] = {}
    while True:
        page = dict(Bucket=bucket, Prefix=prefix, Delimiter="/", **token)
        r = s3_call(location, lambda: client.list_objects_v2(**page))  # noqa: B023 (called before the next page)
        names += [o["Key"][len(prefix):] for o in r.get("Contents", [])]
        names += [p["Prefix"][len(prefix):].rstrip("/") + "/" for p in r.get("CommonPrefixes", [])]
        if not r.get("IsTruncated"):
            return names, _listed() - before
        token = {"ContinuationToken": r["NextContinuationToken"]}


# -- writing ----------------------------------------------------------------------------------------------------

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


def check_destination(src: str, dst: str, force: bool) -> None:
    """:func:`ckptfix.core.atomic.check_destination` for an ``s3://`` URL: the bucket exists, the key names an object
    (not a prefix), is not the source, and holds nothing unless ``force``."""
    bucket, key = split_s3(dst)
    if not bucket or not key or key.endswith("/"):
        raise DestinationError(f"{dst}: names a bucket or prefix; give the object's key, e.g. s3://BUCKET/out.safetensors")
    if src.rstrip("/") == dst.rstrip("/"):
        raise DestinationError(f"{dst}: is the source itself; write to a new key")
    client = s3_client()
    if _answer(dst, lambda: client.head_bucket(Bucket=bucket)) is None:
        raise DestinationError(f"{dst}: bucket {bucket} does not exist (or the endpoint is another: AWS_ENDPOINT_URL)")
    if _answer(dst, lambda: client.head_object(Bucket=bucket, Key=key)) and not force:
        raise DestinationError(f"{dst}: already exists; {pass_flag('force')} to replace it")


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

    return s3_call(url, attempt)


def upload_file(path: str, url: str, replace: bool = False) -> tuple[int, int]:
    """Upload the local file ``path`` to the ``s3://`` ``url`` atomically; (bytes uploaded, parts).

    ``replace``: an object already at the key is replaced (else the upload fails rather than replace one)."""
    client = s3_client()
    bucket, key = split_s3(url)
    size = os.path.getsize(path)
    step = part_size(size)
    condition = {} if replace else {"IfNoneMatch": "*"}
    if size <= step:
        with open(path, "rb") as f, interrupts.held(written=True):  # (at most one part: seconds)
            _conditional(url, lambda: client.put_object(Bucket=bucket, Key=key, Body=f, ContentLength=size,
                                                        **condition))
        parts = 1
    else:
        upload_id = s3_call(url, lambda: client.create_multipart_upload(Bucket=bucket, Key=key))["UploadId"]
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
    bucket, key = split_s3(url)
    try:
        s3_call(url, lambda: client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id))
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
    bucket, key = split_s3(url)
    r = s3_call(url, lambda: client.upload_part(Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number,
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

    return s3_call(url, attempt)


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
