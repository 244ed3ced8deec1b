"""``hf://datasets/ORG/REPO[@REV]/PATH`` and ``hf://spaces/…`` (issue 19): a checkpoint in a dataset or Space repo,
as huggingface_hub's HfFileSystem spells it, is described from its header like a model repo's, through
tests/hub_server.py serving that repo type; the bytes the Hub sent (files and listings) are the bytes fetched."""

from __future__ import annotations

import pytest
from safetensors.torch import save_file

import ckptfix
from ckptfix import errors
from ckptfix.core.remote.hub import HubPath, split_hub
from tests.hub_server import COMMIT, REPO, HubServer
from tests.remote_servers import hub_server
from tests.remote_sources import assert_same_as_local, hub_bytes, random_state_dict, write_checkpoints

SERVERS = (hub_server,)  # the fixture, registered by being in this module's namespace

PREFIX = {"dataset": "datasets/", "space": "spaces/"}


@pytest.mark.parametrize("location, parts", [
    ("hf://org/name/model.safetensors", HubPath("org/name", None, "model.safetensors", "model")),
    ("hf://datasets/org/name@main/sub/model.pth", HubPath("org/name", "main", "sub/model.pth", "dataset")),
    ("hf://spaces/org/name/model.safetensors", HubPath("org/name", None, "model.safetensors", "space")),
    ("hf://datasets/org/name", HubPath("org/name", None, "", "dataset")),
])
def test_split_hub_reads_hffilesystem_paths(location: str, parts: HubPath) -> None:
    assert split_hub(location) == parts


def test_a_bare_prefix_is_not_a_repo() -> None:
    with pytest.raises(errors.RemoteError, match="hf://datasets/ORG/REPO"):
        split_hub("hf://datasets/org")


@pytest.mark.parametrize("repo_type", ["dataset", "space"])
@pytest.mark.parametrize("kind", ["safetensors", "zip"])
def test_describe_a_checkpoint_in_a_dataset_or_space_repo(hub_server: HubServer, repo_type: str, kind: str) -> None:
    hub_server.repo_type = repo_type
    names = write_checkpoints(hub_server.root)
    local = hub_server.root / names[kind]
    for url in (f"hf://{PREFIX[repo_type]}{REPO}/{names[kind]}", f"hf://{PREFIX[repo_type]}{REPO}@main/{names[kind]}"):
        hub_server.counts.reset()
        info = ckptfix.describe(url)
        assert info.bytes_fetched == hub_bytes(hub_server) > 0
        assert hub_server.counts.requests.get(hub_server.resolve_path(names[kind], COMMIT))
        got = info.to_dict()
        got["notes"] = [n.replace(url, str(local)) for n in got["notes"]]
        assert_same_as_local(got, ckptfix.describe(local).to_dict())


def test_a_dataset_is_not_the_model_of_the_same_name(hub_server: HubServer) -> None:
    hub_server.repo_type = "dataset"
    save_file(random_state_dict(2), str(hub_server.root / "model.safetensors"))
    assert ckptfix.describe(f"hf://datasets/{REPO}/model.safetensors").num_tensors == 2
    with pytest.raises(errors.MissingFileError, match="no such repository"):
        ckptfix.describe(f"hf://{REPO}/model.safetensors")
