"""The Hub's metadata and listing calls (core/remote/hub.py) keep ``CKPTFIX_REMOTE_DEADLINE`` as body reads do: the
Hub stand-in made to stall before it answers, a 30 s timeout, a 0.5 s deadline: the deadline's one-line error within
seconds, not the stall's length (huggingface_hub's own retries don't outlast it)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import ckptfix
from ckptfix import errors
from ckptfix.cli import cli
from tests.hub_server import HubServer
from tests.remote_servers import hub_server

SERVERS = (hub_server,)  # the fixture, registered by being in this namespace

#: (the call, the URL it asks about, the Hub endpoint that stalls)
STALLS = [("metadata", "hf://org/name/model.safetensors", "/org/name/resolve/main/model.safetensors"),
          ("listing", "hf://org/name/sub", "/api/models/org/name/tree/main/sub")]


@pytest.mark.parametrize("call, url, path", STALLS, ids=[s[0] for s in STALLS])
def test_a_stalled_hub_call_meets_the_deadline(hub_server: HubServer, monkeypatch: pytest.MonkeyPatch,
                                               cli_runner: Any, call: str, url: str, path: str) -> None:
    save_file({"w": torch.zeros(4)}, str(hub_server.root / "model.safetensors"))
    (hub_server.root / "sub").mkdir()
    save_file({"w": torch.zeros(4)}, str(hub_server.root / "sub" / "model.safetensors"))
    monkeypatch.setenv("CKPTFIX_REMOTE_DEADLINE", "0.5")
    hub_server.delay[path] = 4.0
    start = time.monotonic()
    with pytest.raises(errors.RemoteError, match=rf"^{url}: the request took more than CKPTFIX_REMOTE_DEADLINE "
                                                 r"\(0\.5 s\); raise CKPTFIX_REMOTE_DEADLINE"):
        ckptfix.describe(url)
    assert time.monotonic() - start < 3.5
    res = cli_runner.invoke(cli, ["inspect", url])
    assert res.exit_code == 1 and res.stdout == "", res.output
    assert res.stderr.startswith(f"Error: {url}: the request took more") and res.stderr.count("\n") == 1, res.stderr
