"""Hostile remote sources (issue 27, items 1, 3 and 6), each against real servers on two loopback addresses
(127.0.0.1 and 127.0.0.2: another host to a client, no setup on Linux):

- a redirect that leaves the request's scheme, host and port loses its credentials (the Hub's token on its way to
  the CDN), one that stays keeps them, and https → http is refused in one line naming both URLs, no query string;
- a body that drips is a stall (a minimum rate over a sliding window), a slow one that keeps moving is not, and a
  request may have a deadline: one line naming the URL and the variable to change, within seconds;
- ``.``/``..``/empty segments in a Hub path or S3 key are refused before anything is asked, and a Hub error is one
  ``Error:`` line.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import ckptfix
from ckptfix import errors
from ckptfix.cli import cli
from ckptfix.core.remote.http import HttpSource
from tests.file_server import FileServer
from tests.hub_server import COMMIT, HubServer
from tests.remote_servers import S3Server, http_server, https_server, hub_server, s3_server
from tests.remote_sources import describe_refused_within, one_error_line

SERVERS = (http_server, https_server, hub_server, s3_server)  # the fixtures, registered by being in this namespace

CREDENTIALS = {"Authorization": "Bearer hf_secret", "Cookie": "session=secret", "Proxy-Authorization": "Basic secret"}
SIZE = 48 * 1024


def _payload(root: Path, name: str = "b.bin") -> bytes:
    data = bytes(range(256)) * (SIZE // 256)
    (root / name).write_bytes(data)
    return data


def _seen(server: FileServer, path: str) -> list[dict[str, str]]:
    """The headers of each request ``server`` had for ``path``."""
    return [headers for p, headers in server.request_headers if p == path]


def _sent_credentials(headers: dict[str, str]) -> set[str]:
    return {key for key in ("authorization", "cookie", "proxy-authorization") if key in headers}


@pytest.fixture
def elsewhere(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """Make another server: ``elsewhere(scheme, host)``, on a port of its own, serving ``tmp_path / "other"``
    (https with the https_server's certificate, which names 127.0.0.1, 127.0.0.2 and localhost)."""
    started: list[FileServer] = []

    def make(scheme: str, host: str) -> FileServer:
        root = tmp_path / f"other{len(started)}"
        root.mkdir()
        tls = request.getfixturevalue("https_server").tls if scheme == "https" else None
        started.append(FileServer(root, tls=tls, host=host).start())
        return started[-1]

    yield make
    for server in started:
        server.stop()


# -- item 1: credentials and redirects -----------------------------------------------------------------------------

#: (case, the first server's scheme, where the redirect goes: "same" (this server), or (scheme, host) of another)
REDIRECTS = [("http same origin", "http", "same"), ("http other port", "http", ("http", "127.0.0.1")),
             ("http other host", "http", ("http", "127.0.0.2")), ("https same origin", "https", "same"),
             ("https other host", "https", ("https", "127.0.0.2")), ("http to https", "http", ("https", "127.0.0.2"))]


@pytest.mark.parametrize("case, scheme, target", REDIRECTS, ids=[r[0] for r in REDIRECTS])
def test_credentials_go_only_where_the_request_went(request: pytest.FixtureRequest, elsewhere: Any, case: str,
                                                    scheme: str, target: Any) -> None:
    first: FileServer = request.getfixturevalue(f"{scheme}_server")
    second = first if target == "same" else elsewhere(*target)
    data = _payload(second.root)
    first.redirects["/a.bin"] = second.url("b.bin") + "?X-Amz-Signature=sig"
    source = HttpSource(first.url("a.bin"), headers=CREDENTIALS)
    assert source.read(0, SIZE) == data
    asked, got = _seen(first, "/a.bin"), _seen(second, "/b.bin")
    assert asked and got and all(_sent_credentials(h) == {"authorization", "cookie", "proxy-authorization"}
                                 for h in asked)
    assert all("range" in h for h in got)  # (the other headers follow the redirect)
    if target == "same":
        assert all(h["authorization"] == "Bearer hf_secret" and h["cookie"] == "session=secret" for h in got)
    else:
        assert all(_sent_credentials(h) == set() for h in got), got


def test_https_to_http_is_refused(https_server: FileServer, elsewhere: Any) -> None:
    plain = elsewhere("http", "127.0.0.2")
    _payload(plain.root)
    https_server.redirects["/a.bin"] = plain.url("b.bin") + "?X-Amz-Signature=secret-signature"
    url = https_server.url("a.bin") + "?token=secret-token"
    with pytest.raises(errors.RemoteError) as caught:
        HttpSource(url, headers=CREDENTIALS)
    message = str(caught.value)
    assert f"redirects {https_server.url('a.bin')} to {plain.url('b.bin')}: refused" in message, message
    assert "secret-signature" not in message and "secret-token" not in message.partition(": ")[2]
    assert "\n" not in message and plain.counts.total_requests == 0


@pytest.fixture
def hub_with_token(hub_server: HubServer, monkeypatch: pytest.MonkeyPatch) -> HubServer:
    """The hub_server, HF_TOKEN set (and sent: huggingface_hub's implicit-token switch off), its files redirected to
    a CDN (``redirect_to_cdn``), a safetensors file in the repo."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    monkeypatch.setenv("HF_HUB_DISABLE_IMPLICIT_TOKEN", "0")
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_IMPLICIT_TOKEN", False)
    save_file({"w": torch.arange(4096, dtype=torch.float32)}, str(hub_server.root / "model.safetensors"))
    hub_server.redirect_to_cdn = True
    return hub_server


@pytest.mark.parametrize("cdn_host", [None, "127.0.0.2"], ids=["cdn-same-host", "cdn-other-host"])
def test_hub_token_stays_with_the_hub(hub_with_token: HubServer, cdn_host: str | None) -> None:
    hub = hub_with_token
    cdn = hub if cdn_host is None else HubServer(hub.root, host=cdn_host).start()
    try:
        hub.cdn_url = None if cdn is hub else cdn.base_url
        info = ckptfix.describe("hf://org/name/model.safetensors")
        local = ckptfix.describe(hub.root / "model.safetensors")
    finally:
        if cdn is not hub:
            cdn.stop()
    assert info.state_dict.keys() == local.state_dict.keys() and info.state_dict["w"].shape == (4096,)
    resolved = [h for p, h in hub.request_headers if "/resolve/" in p and "range" in h]
    fetched = [h for p, h in cdn.request_headers if p.startswith("/cdn/")]
    assert resolved and fetched and all(h["authorization"] == "Bearer hf_secret" for h in resolved)
    if cdn is hub:
        assert all(h.get("authorization") == "Bearer hf_secret" for h in fetched)
    else:
        assert all("authorization" not in h for h in fetched), fetched


# -- item 3: stalls and deadlines ---------------------------------------------------------------------------------

def _dripping(kind: str, rate: int, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A safetensors file (64 KiB of values) served by ``kind``'s server at ``rate`` bytes/s: its URL."""
    name = "model.safetensors"
    folder = tmp_path / "src"
    folder.mkdir(exist_ok=True)
    save_file({"w": torch.arange(16384, dtype=torch.float32)}, str(folder / name))
    if kind == "s3":
        s3: S3Server = request.getfixturevalue("s3_server")
        s3.upload(folder / name)
        s3.drip[f"/{s3.bucket}/{name}"] = rate
        return s3.url(name)
    server: FileServer = request.getfixturevalue("hub_server" if kind == "hf" else "http_server")
    (server.root / name).write_bytes((folder / name).read_bytes())
    if isinstance(server, HubServer):
        for revision in ("main", COMMIT):  # (ckptfix pins the commit the first answer names)
            server.drip[server.resolve_path(name, revision)] = rate
        return f"hf://org/name/{name}"
    server.drip[f"/{name}"] = rate
    return server.url(name)


@pytest.mark.parametrize("kind", ["http", "hf", "s3"])
def test_a_dripping_server_is_a_stall(kind: str, request: pytest.FixtureRequest, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch, cli_runner: Any) -> None:
    """20 bytes/s, each read well inside CKPTFIX_REMOTE_TIMEOUT: refused once a 1 s window holds under 1 KiB."""
    monkeypatch.setenv("CKPTFIX_REMOTE_STALL_WINDOW", "1")
    url = _dripping(kind, 20, request, tmp_path)
    describe_refused_within(url, r"the transfer stalled: \d+ bytes in the last 1\.\d s, under CKPTFIX_REMOTE_MIN_RATE "
                                 r"\(1024 bytes/s", 10)
    one_error_line(cli_runner.invoke(cli, ["inspect", url]), url, "the transfer stalled")


@pytest.mark.parametrize("kind", ["http", "s3"])
def test_a_slow_moving_body_is_not_a_stall(kind: str, request: pytest.FixtureRequest, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """32 KiB/s over a 0.3 s window of 1 KiB/s: each 16 KiB+ read takes longer than the window, and passes."""
    monkeypatch.setenv("CKPTFIX_REMOTE_STALL_WINDOW", "0.3")
    url = _dripping(kind, 32 * 1024, request, tmp_path)
    start = time.monotonic()
    info = ckptfix.describe(url)
    assert time.monotonic() - start > 0.4  # (the read was slower than the window)
    assert list(info.state_dict) == ["w"] and info.state_dict["w"].shape == (16384,)


@pytest.mark.parametrize("kind", ["http", "s3"])
def test_a_request_past_its_deadline(kind: str, request: pytest.FixtureRequest, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTFIX_REMOTE_MIN_RATE", "0")
    monkeypatch.setenv("CKPTFIX_REMOTE_DEADLINE", "0.5")
    url = _dripping(kind, 4096, request, tmp_path)
    describe_refused_within(url, r"took more than CKPTFIX_REMOTE_DEADLINE \(0\.5 s\) \(\d+ of \d+ bytes received\); "
                                 r"raise CKPTFIX_REMOTE_DEADLINE", 10)


def test_a_deadline_cuts_the_wait_for_headers(http_server: FileServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that answers after 2 s, a 30 s timeout, a 0.5 s deadline: the deadline's error, within a second."""
    _payload(http_server.root)
    http_server.delay["/b.bin"] = 2.0
    monkeypatch.setenv("CKPTFIX_REMOTE_DEADLINE", "0.5")
    start = time.monotonic()
    with pytest.raises(errors.RemoteError, match=r"took more than CKPTFIX_REMOTE_DEADLINE \(0\.5 s\);"):
        ckptfix.describe(http_server.url("b.bin"))
    assert time.monotonic() - start < 1.9


# -- item 6: path segments and Hub errors ---------------------------------------------------------------------------

BAD_PATHS = [("hf://org/name/../../x", "'..'", "Hub path"), ("hf://org/name/a/../model.safetensors", "'..'", "Hub path"),
             ("hf://org/name/./model.safetensors", "'.'", "Hub path"), ("hf://org/../name/x", "'..'", "Hub path"),
             ("hf://datasets/../org/name/x", "'..'", "Hub path"), ("hf://org//name/x", "empty", "Hub path"),
             ("hf://org/name/a//model.safetensors", "empty", "Hub path"),
             ("s3://ckpt/../model.safetensors", "'..'", "S3 key"), ("s3://ckpt/a/./model.safetensors", "'.'", "S3 key")]


@pytest.mark.parametrize("url, segment, what", BAD_PATHS, ids=[b[0] for b in BAD_PATHS])
def test_dot_segments_are_refused_up_front(url: str, segment: str, what: str, hub_server: HubServer,
                                           s3_server: S3Server, cli_runner: Any, tmp_path: Path) -> None:
    save_file({"w": torch.zeros(4)}, str(hub_server.root / "model.safetensors"))
    s3_server.upload(hub_server.root / "model.safetensors")
    for call in (ckptfix.describe, ckptfix.read, lambda u: ckptfix.convert(u, tmp_path / "out.safetensors")):
        with pytest.raises(errors.RemoteError, match=f"^{url.replace('.', '[.]')}: (a|an) {segment} segment in the {what}: "
                                                     "refused"):
            call(url)
    one_error_line(cli_runner.invoke(cli, ["inspect", url]), url)
    assert hub_server.counts.total_requests == 0 and s3_server.counts.total_requests == 0


def test_an_s3_destination_with_dot_segments_is_refused(s3_server: S3Server, fixtures_dir: Path) -> None:
    with pytest.raises(errors.RemoteError, match="a '..' segment in the S3 key"):
        ckptfix.convert(fixtures_dir / "mlp_safetensors.safetensors", s3_server.url("out/../x.safetensors"))


def test_an_empty_s3_key_segment_is_a_key_like_any(s3_server: S3Server, tmp_path: Path) -> None:
    """S3 keys may hold ``//``: not refused, looked up as written."""
    with pytest.raises(errors.MissingFileError, match="no such object"):
        ckptfix.describe(s3_server.url("a//model.safetensors"))


#: (the endpoint the switch sets, the URL inspected, its status); not a 5xx on the tree (huggingface_hub's own
#: retries of a listing take seconds)
HUB_ERRORS = [("resolve", "hf://org/name/model.safetensors", 500), ("resolve", "hf://org/name/model.safetensors", 418),
              ("resolve", "hf://org/name/model.safetensors", 403), ("tree", "hf://org/name/sub", 418)]


@pytest.mark.parametrize("where, url, code", HUB_ERRORS, ids=[f"{h[0]}-{h[2]}" for h in HUB_ERRORS])
def test_a_hub_error_is_one_line(hub_server: HubServer, cli_runner: Any, monkeypatch: pytest.MonkeyPatch,
                                 where: str, url: str, code: int) -> None:
    monkeypatch.setenv("CKPTFIX_REMOTE_RETRIES", "0")
    save_file({"w": torch.zeros(4)}, str(hub_server.root / "model.safetensors"))
    (hub_server.root / "sub").mkdir()
    path = hub_server.resolve_path("model.safetensors") if where == "resolve" else "/api/models/org/name/tree/main/sub"
    hub_server.status[path] = code
    res = cli_runner.invoke(cli, ["inspect", url])
    one_error_line(res, url, f"the Hub answered HTTP {code} ")
    assert "For more information" not in res.stderr
    assert ("HF_TOKEN" in res.stderr) == (code == 403)
