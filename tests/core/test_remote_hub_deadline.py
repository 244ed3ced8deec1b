"""The Hub's metadata and listing calls (core/remote/hub.py) keep ``CKPTFIX_REMOTE_DEADLINE`` as body reads do: the
Hub stand-in made to stall before it answers, a 30 s timeout, a 0.5 s deadline: the deadline's one-line error within
seconds, not the stall's length (huggingface_hub's own retries don't outlast it)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from ckptfix.cli import cli
from tests.hub_server import HubServer
from tests.remote_servers import hub_server
from tests.remote_sources import describe_refused_within, one_error_line

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
    describe_refused_within(url, rf"^{url}: the request took more than CKPTFIX_REMOTE_DEADLINE \(0\.5 s\); raise "
                                 "CKPTFIX_REMOTE_DEADLINE", 3.5)
    one_error_line(cli_runner.invoke(cli, ["inspect", url]), url, "the request took more")
