"""The remote backends of :mod:`ckptfix.core.locations`: ``http(s)://`` (Range requests with the standard library's
client), ``s3://`` (boto3) and ``hf://`` (huggingface_hub), and the few directory questions a reader asks of them
(list a prefix, is there such a file).

Every fetch is a Range request checked three ways: the server honoured the Range (a 200 with the whole body is
refused before its body is read), the bytes are the ones asked for, and the file's validator (ETag or
Last-Modified; on S3 the ETag sent as ``If-Match``; on the Hub the commit) is the first fetch's. Transient failures
(timeouts, resets, 429 and 5xx) are retried with backoff: ``CKPTFIX_REMOTE_RETRIES`` (default 3) more tries,
each waiting ``CKPTFIX_REMOTE_TIMEOUT`` seconds (default 30) at most.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any, NamedTuple

from ..errors import MissingFileError, RemoteError
from .positional import BLOCK, ByteSource, LocalSource

EXTRA = "pip install 'ckptfix[remote]'"
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
_RETRY_STATUS = {429, 500, 502, 503, 504}


def timeout() -> float:
    return float(os.environ.get("CKPTFIX_REMOTE_TIMEOUT", "30"))


def retries() -> int:
    return int(os.environ.get("CKPTFIX_REMOTE_RETRIES", "3"))


def _client(module: str, what: str) -> Any:
    """Import an optional client library, or say which extra installs it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise RemoteError(f"reading {what} needs the {module} package: {EXTRA}") from None


def open_remote(location: str) -> ByteSource:
    """The source for a remote URL, by scheme."""
    scheme = location.split("://", 1)[0].lower()
    if scheme == "s3":
        return S3Source(location)
    if scheme == "hf":
        return hub_source(location)
    return HttpSource(location)


class _Transient(Exception):
    """A failure worth another try (timeout, reset, 429/5xx)."""


def with_retries(name: str, attempt: Any) -> Any:
    """``attempt()`` again after a transient failure, waiting 0.2 s, 0.4 s, … between tries."""
    tries = retries() + 1
    for i in range(tries):
        try:
            return attempt()
        except _Transient as e:
            if i == tries - 1:
                raise RemoteError(f"{name}: {e} ({tries} tries); check the URL and the network, "
                                  "or raise CKPTFIX_REMOTE_TIMEOUT / CKPTFIX_REMOTE_RETRIES") from None
            time.sleep(0.2 * 2**i)
    raise AssertionError("unreachable")


def changed(name: str, before: Any, after: Any) -> RemoteError:
    return RemoteError(f"{name}: the file changed while it was being read (validator {before!r}, now {after!r}): "
                       "refused rather than mixing two versions; run the command again")


class HttpSource(ByteSource):
    """An http(s) URL read with Range requests; ``headers`` go with every request (the Hub's token)."""

    def __init__(self, url: str, headers: dict[str, str] | None = None, name: str | None = None):
        super().__init__()
        self.url, self.name, self.headers = url, name or url, dict(headers or {})
        self.validator: tuple[str, str] | None = None
        self.size = 1  # until the first response says
        data = self._get(0, BLOCK)  # one round trip: size, validator and the head sniffing reads
        with self._lock:
            self._blocks[0] = data[:BLOCK]

    def _fetch(self, offset: int, n: int) -> bytes:
        return with_retries(self.name, lambda: self._request(offset, n))

    def _request(self, offset: int, n: int) -> bytes:
        headers = {**self.headers, "Range": f"bytes={offset}-{offset + n - 1}", "Accept-Encoding": "identity"}
        req = urllib.request.Request(self.url, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout()) as r:
                return self._answer(r, offset, n)
        except urllib.error.HTTPError as e:
            raise self._status_error(e.code, e.reason) from None
        except urllib.error.URLError as e:
            if isinstance(e.reason, (socket.timeout, TimeoutError, ConnectionError)):
                raise _Transient(f"{type(e.reason).__name__}: {e.reason}") from None
            raise RemoteError(f"{self.name}: can't connect ({e.reason})") from None
        except (TimeoutError, ConnectionError) as e:
            raise _Transient(f"timed out or reset ({type(e).__name__}: {e})") from None

    def _status_error(self, code: int, reason: Any) -> Exception:
        reason = " ".join(str(reason).split())  # (one line)
        if code == 404 or code == 410:
            return MissingFileError(f"{self.name}: no such file (HTTP {code})", self.name)
        if code in (401, 403):
            return RemoteError(f"{self.name}: access denied (HTTP {code} {reason}); check the URL, or give credentials "
                               "(HF_TOKEN for the Hub, AWS_* for S3)")
        if 300 <= code < 400:
            return RemoteError(f"{self.name}: the server redirects in a loop (HTTP {code} back to a URL already "
                               "visited, or more than 10 redirects); check the URL in a browser")
        if code == 412:
            return changed(self.name, self.validator, "a failed If-Match")
        if code == 416 and self.validator is None:
            return RemoteError(f"{self.name}: the server refuses Range requests for this file (HTTP 416)")
        if code == 416:  # a range inside the size the first answer gave: the file is shorter now
            return changed(self.name, self.validator, f"a file shorter than its {self.size} bytes (HTTP 416)")
        if code in _RETRY_STATUS:
            return _Transient(f"the server failed (HTTP {code} {reason})")
        return RemoteError(f"{self.name}: the server answered HTTP {code} {reason}")

    def _answer(self, r: Any, offset: int, n: int) -> bytes:
        validator = _validator(r.headers)
        if r.status == 200:  # the whole body: refuse before reading it
            length = r.headers.get("Content-Length")
            raise RemoteError(
                f"{self.name}: the server ignores Range requests (it answered 200 with the whole file"
                f"{f', {int(length)} bytes' if length and length.isdigit() else ''}): ckptfix reads a remote file's "
                "headers only and does not download it whole; download it and give the local path")
        if r.status != 206:
            raise RemoteError(f"{self.name}: unexpected HTTP {r.status} to a Range request")
        m = _CONTENT_RANGE.fullmatch(r.headers.get("Content-Range", "").strip())
        if m is None or int(m.group(1)) != offset:
            raise RemoteError(f"{self.name}: the server sent bytes {r.headers.get('Content-Range')!r} for "
                              f"bytes={offset}-{offset + n - 1}: refused")
        total = int(m.group(3)) if m.group(3) != "*" else None
        if self.validator is None:
            self.validator = validator
            if total is not None:
                self.size = total
        elif validator != self.validator or total is not None and total != self.size:
            raise changed(self.name, self.validator, validator if validator != self.validator else f"size {total}")
        want = min(n, self.size - offset)
        try:
            data = r.read(want)
        except (TimeoutError, ConnectionError) as e:
            raise _Transient(f"timed out or reset while reading ({e})") from None
        if len(data) != want:
            raise _Transient(f"the connection ended after {len(data)} of {want} bytes")
        return data


def _validator(headers: Any) -> tuple[str, str] | None:
    for name in ("ETag", "Last-Modified"):
        value = headers.get(name)
        if value:
            return name, value
    return None


def split_s3(location: str) -> tuple[str, str]:
    bucket, _, key = location[len("s3://"):].partition("/")
    return bucket, key


_S3_CLIENTS: dict[tuple, Any] = {}


def s3_client() -> Any:
    """A boto3 S3 client configured the standard AWS way (``AWS_ENDPOINT_URL``, profiles, …), one per setting."""
    boto3 = _client("boto3", "s3:// URLs")
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
        client = s3_client()
        extra = {"IfMatch": self.etag} if self.etag else {}
        r = s3_call(self.name, lambda: client.get_object(Bucket=self.bucket, Key=self.key,
                                                         Range=f"bytes={offset}-{offset + n - 1}", **extra))
        if self.etag and r.get("ETag", self.etag) != self.etag:
            raise changed(self.name, self.etag, r.get("ETag"))
        data = r["Body"].read()
        if len(data) != min(n, self.size - offset):
            raise RemoteError(f"{self.name}: S3 sent {len(data)} bytes for bytes={offset}-{offset + n - 1}: refused")
        return bytes(data)


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


class HubPath(NamedTuple):
    """A Hub URL's parts: ``hf://[datasets/|spaces/]org/repo[@revision]/path`` as huggingface_hub's HfFileSystem
    spells them (a model repo has no prefix)."""

    repo_id: str
    revision: str | None
    path: str
    repo_type: str = "model"


#: HfFileSystem's URL prefixes of the repo types other than models
_HUB_PREFIXES = {"datasets": "dataset", "spaces": "space"}


def split_hub(location: str) -> HubPath:
    """``hf://org/repo[@revision]/path`` (or ``hf://datasets/…``, ``hf://spaces/…``) → its :class:`HubPath`."""
    parts = location[len("hf://"):].strip("/").split("/")
    repo_type = _HUB_PREFIXES.get(parts[0], "model")
    if repo_type != "model":
        parts = parts[1:]
    if len(parts) < 2:
        raise RemoteError(f"{location}: a Hub URL is hf://ORG/REPO[@REVISION]/PATH (a dataset's hf://datasets/ORG/REPO…, "
                          "a Space's hf://spaces/ORG/REPO…)")
    repo, _, revision = parts[1].partition("@")
    return HubPath(f"{parts[0]}/{repo}", revision or None, "/".join(parts[2:]), repo_type)


def _hub_settings() -> tuple[str | None, str | None]:
    """``HF_ENDPOINT`` and the HF cache directory as the environment says now (huggingface_hub reads them once,
    when imported)."""
    cache = os.environ.get("HF_HUB_CACHE") or (os.path.join(os.environ["HF_HOME"], "hub") if os.environ.get("HF_HOME")
                                                else None)
    return os.environ.get("HF_ENDPOINT") or None, cache


def hub_source(location: str) -> ByteSource:
    """A file on the Hub: from the local HF cache when it is there, else over HTTP, pinned to one commit."""
    hub = _client("huggingface_hub", "hf:// URLs")
    endpoint, cache = _hub_settings()
    repo_id, revision, filename, repo_type = split_hub(location)
    cached = hub.try_to_load_from_cache(repo_id, filename, cache_dir=cache, revision=revision, repo_type=repo_type)
    if isinstance(cached, str) and os.path.isfile(cached):
        local = LocalSource(cached)
        local.name = location
        return local
    try:
        meta = hub.get_hf_file_metadata(hub.hf_hub_url(repo_id, filename, repo_type=repo_type, revision=revision,
                                                       endpoint=endpoint), endpoint=endpoint, timeout=timeout())
    except hub.errors.EntryNotFoundError:
        raise MissingFileError(f"{location}: no such file in {repo_id}", location) from None
    except (hub.errors.RepositoryNotFoundError, hub.errors.RevisionNotFoundError) as e:
        raise MissingFileError(f"{location}: no such repository or revision ({type(e).__name__}); for a private "
                               "repository set HF_TOKEN", location) from None
    except hub.errors.HfHubHTTPError as e:
        raise RemoteError(f"{location}: the Hub answered {e}") from None
    except OSError as e:
        raise RemoteError(f"{location}: can't reach the Hub ({e}); check HF_ENDPOINT and the network") from None
    pinned = hub.hf_hub_url(repo_id, filename, repo_type=repo_type, revision=meta.commit_hash or revision,
                            endpoint=endpoint)
    return HttpSource(pinned, hub.utils.build_hf_headers(), name=location)


def hub_list(location: str) -> tuple[list[str], int]:
    """The names directly under a folder of a Hub repository (folders end in ``/``), and the bytes the listing took
    (its pages' bodies)."""
    hub = _client("huggingface_hub", "hf:// URLs")
    repo_id, revision, folder, repo_type = split_hub(location)
    api = hub.HfApi(endpoint=_hub_settings()[0])
    hub.utils.build_hf_headers()  # (its user-agent probe, huggingface_hub's own once a process, is not the listing)
    with _responses_counted(hub.utils.get_session()) as fetched:
        try:
            items = api.list_repo_tree(repo_id, folder or None, revision=revision, repo_type=repo_type)
            names = [item.path.rsplit("/", 1)[-1] + ("/" if type(item).__name__ == "RepoFolder" else "") for item in items]
        except hub.errors.EntryNotFoundError:
            names = []
        except (hub.errors.RepositoryNotFoundError, hub.errors.RevisionNotFoundError) as e:
            raise MissingFileError(f"{location}: no such repository or revision ({type(e).__name__})", location) from None
        except hub.errors.HfHubHTTPError as e:
            raise RemoteError(f"{location}: the Hub answered {e}") from None
    return names, fetched[0]


@contextlib.contextmanager
def _responses_counted(client: Any) -> Iterator[list[int]]:
    """The body bytes of the responses huggingface_hub's shared HTTP client receives in this thread meanwhile
    (``[n]``): a response hook, on that client only while inside."""
    me, fetched = threading.get_ident(), [0]

    def hook(response: Any) -> None:
        if threading.get_ident() == me:
            response.read()  # (read before the client would: what it downloaded is then known)
            fetched[0] += response.num_bytes_downloaded

    hooks = client.event_hooks
    hooks.setdefault("response", []).append(hook)
    try:
        yield fetched
    finally:
        hooks["response"].remove(hook)
