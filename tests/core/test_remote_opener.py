"""The http backend and urllib's installed opener: a proxy or a header a user installs with
``urllib.request.install_opener`` carries ckptfix's requests, and ckptfix's redirect policy still holds over it
(credentials, its own and the opener's, go only where the request went). Real servers on 127.0.0.1 and 127.0.0.2.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptfix.core.remote.http import HttpSource
from tests.file_server import FileServer
from tests.remote_servers import http_server

SERVERS = (http_server,)  # the fixture, registered by being in this namespace
DATA = bytes(range(256)) * 64


@pytest.fixture
def installed() -> Iterator[None]:
    """Whatever the test installs with ``urllib.request.install_opener`` is uninstalled after it."""
    yield
    urllib.request.install_opener(None)  # type: ignore[arg-type]  # (None: urllib builds its default again)


@pytest.fixture
def other(tmp_path: Path) -> Iterator[FileServer]:
    """A second server, on another loopback host (another origin), serving ``tmp_path / "other"``."""
    (tmp_path / "other").mkdir()
    with FileServer(tmp_path / "other", host="127.0.0.2") as server:
        yield server


def test_an_installed_proxy_carries_the_requests(http_server: FileServer, other: FileServer, installed: None,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A ProxyHandler installed globally: every request goes to the proxy (a FileServer reads the absolute URL a
    client sends a proxy by its path), none to the origin."""
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    (http_server.root / "b.bin").write_bytes(DATA)
    (other.root / "b.bin").write_bytes(DATA)
    urllib.request.install_opener(urllib.request.build_opener(urllib.request.ProxyHandler({"http": other.base_url})))
    assert HttpSource(http_server.url("b.bin")).read(0, len(DATA)) == DATA
    assert other.counts.requests.get("/b.bin", 0) >= 1 and http_server.counts.total_requests == 0


def test_the_redirect_policy_holds_over_an_installed_opener(http_server: FileServer, other: FileServer,
                                                             installed: None) -> None:
    """urllib's default redirect handler (which copies every header) is in the installed opener: the credentials,
    the request's and the opener's own ``addheaders``, still stay on their origin; the opener's other headers go on."""
    (other.root / "b.bin").write_bytes(DATA)
    http_server.redirects["/a.bin"] = other.url("b.bin")
    opener = urllib.request.build_opener()
    opener.addheaders = [*opener.addheaders, ("Cookie", "session=secret"), ("X-Opener", "yes")]
    urllib.request.install_opener(opener)
    assert HttpSource(http_server.url("a.bin"), headers={"Authorization": "Bearer hf_secret"}).read(0, len(DATA)) == DATA
    asked = [h for p, h in http_server.request_headers if p == "/a.bin"]
    got = [h for p, h in other.request_headers if p == "/b.bin"]
    assert asked and all(h.get("authorization") == "Bearer hf_secret" and h.get("cookie") == "session=secret"
                         and h.get("x-opener") == "yes" for h in asked), asked
    assert got and all("authorization" not in h and "cookie" not in h and h.get("x-opener") == "yes" for h in got), got
    assert opener.addheaders[-2:] == [("Cookie", "session=secret"), ("X-Opener", "yes")]  # (the user's, untouched)
