"""``hf://[datasets/|spaces/]ORG/REPO[@REVISION]/PATH``: a file on the Hugging Face Hub (huggingface_hub, imported
when an hf:// URL is first used: ``HF_ENDPOINT``, ``HF_TOKEN``).

A file already in the local HF cache is read from there; else over HTTP (:class:`~.http.HttpSource`), pinned to
the commit the first answer names, so a push mid-read changes nothing (the Hub's token goes only where the Hub
itself is: a redirect to its CDN drops it, :mod:`.http`). Folders are listed with the Hub's tree API; the repository
itself is a directory. The metadata and listing calls run under a :class:`~.common.Pace` as body reads do: each
call (its redirects, retries and pages) within ``CKPTFIX_REMOTE_DEADLINE``, each body at the minimum rate. A URL
with ``.``, ``..`` or empty segments is refused before anything is asked. Nothing is written to the Hub
(``huggingface-cli upload`` does that).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

from ...errors import DestinationError, MissingFileError, RemoteError
from ..positional import ByteSource, LocalSource
from .backend import Backend
from .common import Pace, import_client, plain_segments, timeout
from .http import HttpSource


class HubBackend(Backend):
    """``hf://``: read from the HF cache or over HTTP, folders listed, never written."""

    def open(self, location: str) -> ByteSource:
        return hub_source(location)

    def listdir(self, location: str) -> tuple[list[str], int]:
        return hub_list(location)

    def is_dir(self, location: str) -> bool | None:
        return True if not split_hub(location).path else None  # the repository itself

    def check_writable(self, location: str, directory: bool = False) -> None:
        raise DestinationError(f"{location}: ckptfix does not write to the Hugging Face Hub; write a local file and "
                               "upload it with `huggingface-cli upload ORG/REPO FILE PATH`")


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
    plain_segments(location, location[len("hf://"):].strip("/"), "Hub path")
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
    hub = import_client("huggingface_hub", "hf:// URLs")
    endpoint, cache = _hub_settings()
    repo_id, revision, filename, repo_type = split_hub(location)
    cached = hub.try_to_load_from_cache(repo_id, filename, cache_dir=cache, revision=revision, repo_type=repo_type)
    if isinstance(cached, str) and os.path.isfile(cached):
        local = LocalSource(cached)
        local.name = location
        return local
    try:
        with paced(hub.utils.get_session(), location):
            meta = hub.get_hf_file_metadata(hub.hf_hub_url(repo_id, filename, repo_type=repo_type, revision=revision,
                                                           endpoint=endpoint), endpoint=endpoint, timeout=timeout())
    except RemoteError:
        raise
    except hub.errors.EntryNotFoundError:
        raise MissingFileError(f"{location}: no such file in {repo_id}", location) from None
    except (hub.errors.RepositoryNotFoundError, hub.errors.RevisionNotFoundError) as e:
        raise MissingFileError(f"{location}: no such repository or revision ({type(e).__name__}); for a private "
                               "repository set HF_TOKEN", location) from None
    except hub.errors.HfHubHTTPError as e:
        raise hub_error(location, e) from None
    except OSError as e:
        raise RemoteError(f"{location}: can't reach the Hub ({' '.join(str(e).split())}); check HF_ENDPOINT and the "
                          "network") from None
    pinned = hub.hf_hub_url(repo_id, filename, repo_type=repo_type, revision=meta.commit_hash or revision,
                            endpoint=endpoint)
    return HttpSource(pinned, hub.utils.build_hf_headers(), name=location)


def hub_list(location: str) -> tuple[list[str], int]:
    """The names directly under a folder of a Hub repository (folders end in ``/``), and the bytes the listing took
    (its pages' bodies)."""
    hub = import_client("huggingface_hub", "hf:// URLs")
    repo_id, revision, folder, repo_type = split_hub(location)
    api = hub.HfApi(endpoint=_hub_settings()[0])
    hub.utils.build_hf_headers()  # (its user-agent probe, huggingface_hub's own once a process, is not the listing)
    with paced(hub.utils.get_session(), location) as fetched:
        try:
            items = api.list_repo_tree(repo_id, folder or None, revision=revision, repo_type=repo_type)
            names = [item.path.rsplit("/", 1)[-1] + ("/" if type(item).__name__ == "RepoFolder" else "") for item in items]
        except hub.errors.EntryNotFoundError:
            names = []
        except (hub.errors.RepositoryNotFoundError, hub.errors.RevisionNotFoundError) as e:
            raise MissingFileError(f"{location}: no such repository or revision ({type(e).__name__})", location) from None
        except hub.errors.HfHubHTTPError as e:
            raise hub_error(location, e) from None
    return names, fetched[0]


def hub_error(location: str, error: Any) -> RemoteError:
    """huggingface_hub's HTTP error as one line: the status and what the Hub said, without httpx's "For more
    information check: …" or the lines huggingface_hub adds."""
    response = getattr(error, "response", None)
    code = getattr(response, "status_code", None)
    status = f"HTTP {code} {getattr(response, 'reason_phrase', '')}".strip() if code else type(error).__name__
    said = " ".join(str(getattr(error, "server_message", None) or "").split())
    said = f" ({said[:200]}{'…' if len(said) > 200 else ''})" if said else ""
    hint = "; for a private or gated repository set HF_TOKEN" if code in (401, 403) else ""
    return RemoteError(f"{location}: the Hub answered {status}{said}{hint}")


@contextlib.contextmanager
def paced(client: Any, name: str) -> Iterator[list[int]]:
    """huggingface_hub's calls in this thread meanwhile under one :class:`~.common.Pace` (hooks on its shared HTTP
    client, there only while inside): each request waits no longer than the deadline leaves, each body is read at
    the minimum rate, and the body bytes received are counted (``[n]``). A call cut short past the deadline is the
    deadline's error, whatever huggingface_hub made of it."""
    me, fetched, pace = threading.get_ident(), [0], Pace(name)

    def on_request(request: Any) -> None:
        if threading.get_ident() != me or pace.deadline <= 0:
            return
        left = pace.deadline - (time.monotonic() - pace.start)
        if left <= 0:  # (huggingface_hub's retry after a wait the deadline cut short)
            raise pace.late()
        waits = request.extensions.get("timeout") or dict.fromkeys(("connect", "read", "write", "pool"))
        request.extensions["timeout"] = {key: left if wait is None else min(wait, left) for key, wait in waits.items()}

    def on_response(response: Any) -> None:
        if threading.get_ident() == me:
            pace.body()
            response.stream = _paced_stream(response.stream, pace)
            response.read()  # (read before the client would: what it downloaded is then known)
            fetched[0] += response.num_bytes_downloaded

    hooks = client.event_hooks
    hooks.setdefault("request", []).append(on_request)
    hooks.setdefault("response", []).append(on_response)
    try:
        yield fetched
    except RemoteError:
        raise
    except Exception:
        if pace.overdue():
            raise pace.late() from None
        raise
    finally:
        hooks["request"].remove(on_request)
        hooks["response"].remove(on_response)


def _paced_stream(stream: Any, pace: Pace) -> Any:
    """``stream`` (an httpx response's body) checked against ``pace`` after each chunk; the client's own
    ``SyncByteStream`` type (found on the stream: huggingface_hub picks the httpx it uses)."""
    base = next(cls for cls in type(stream).__mro__ if cls.__name__ == "SyncByteStream")

    class Paced(base):  # type: ignore[misc, valid-type]
        def __iter__(self) -> Iterator[bytes]:
            got = 0
            for chunk in stream:
                got += len(chunk)
                pace.check(got)
                yield chunk

        def close(self) -> None:
            stream.close()

    return Paced()
