"""Sigstore-signed model signatures, verified offline against a given trust root, with a private Sigstore
(tests/sigstore_pki.py): model-signing's own CLI accepts the fabricated bundles (the PKI is right), ckptfix
verifies them, and a flipped byte, another identity, another issuer and another trust root each exit 3 naming
why. Nothing reaches the network: the CLIs run in a network namespace without interfaces where the machine allows
it, and in this process every socket connect raises."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("model_signing")
pytest.importorskip("OpenSSL")  # model-signing imports it without declaring it
pytest.importorskip("sigstore")

from ckptfix.cli import cli  # noqa: E402
from ckptfix.safety import signing  # noqa: E402
from tests.offline import model_signing_cli, offline, refuse_connections  # noqa: E402
from tests.sigstore_pki import PrivateSigstore  # noqa: E402

IDENTITY = "releaser@example.com"
ISSUER = "https://issuer.example"


@pytest.fixture(autouse=True)
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    refuse_connections(monkeypatch)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, fixtures_dir: Path) -> dict[str, Path]:
    """A single-file model and a directory, each signed by the private Sigstore; its trust config, another
    Sigstore's, the same CA with another CT log, the same CA and CT log with another Rekor log; a bundle whose
    statement was altered after signing."""
    d = tmp_path_factory.mktemp("sigstore")
    pki = PrivateSigstore()
    model = Path(shutil.copy(fixtures_dir / "mlp_safetensors.safetensors", d / "model.safetensors"))
    directory = d / "hf"
    directory.mkdir()
    shutil.copy(fixtures_dir / "mlp_safetensors.safetensors", directory / "model.safetensors")
    (directory / "config.json").write_text('{"hidden": 4}')
    pki.sign_model(model, d / "model.safetensors.sig", IDENTITY, ISSUER)
    pki.sign_model(directory, directory / signing.DIR_SIGNATURE, IDENTITY, ISSUER)
    bundle = json.loads((d / "model.safetensors.sig").read_text())
    statement = json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"]))
    statement["predicate"]["resources"][0]["digest"] = "0" * 64
    bundle["dsseEnvelope"]["payload"] = base64.b64encode(json.dumps(statement).encode()).decode()
    (d / "altered.sig").write_text(json.dumps(bundle))
    others = {"other_trust": PrivateSigstore(),
              "other_ct": PrivateSigstore(ca_key=pki.ca_key, rekor_key=pki.rekor_key),
              "other_rekor": PrivateSigstore(ca_key=pki.ca_key, ct_key=pki.ct_key)}
    return {"file": model, "file_sig": d / "model.safetensors.sig", "dir": directory,
            "dir_sig": directory / signing.DIR_SIGNATURE, "trust": pki.write_trust_config(d / "trust.json"),
            "altered_sig": d / "altered.sig",
            **{name: other.write_trust_config(d / f"{name}.json") for name, other in others.items()}}


def _flags(world: dict[str, Path], **changed: str) -> list[str]:
    given = {"--sigstore-identity": IDENTITY, "--sigstore-issuer": ISSUER, "--trust-config": str(world["trust"]),
             **{f"--{k.replace('_', '-')}": v for k, v in changed.items()}}
    return [x for item in given.items() for x in item]


def test_model_signing_verifies_the_private_sigstores_bundles(world: dict[str, Path]) -> None:
    """The fabricated PKI is a correct Sigstore: model-signing's own `verify sigstore` accepts its bundles, offline,
    and refuses another identity."""
    def argv(kind: str, identity: str = IDENTITY) -> list[str]:
        return ["verify", "sigstore", str(world[kind]), "--signature", str(world[f"{kind}_sig"]), "--identity",
                identity, "--identity_provider", ISSUER, "--trust_config", str(world["trust"])]

    (file_code, file_out), (dir_code, dir_out), (other_code, _) = model_signing_cli(
        argv("file"), argv("dir"), argv("file", "someone@else.example"))
    assert (file_code, dir_code) == (0, 0), (file_out, dir_out)
    assert other_code != 0


@pytest.mark.parametrize("kind, files", [("file", {".": "ok"}),
                                         ("dir", {"config.json": "ok", "model.safetensors": "ok"})])
def test_ckptfix_verifies_a_sigstore_signature(world: dict[str, Path], kind: str, files: dict[str, str]) -> None:
    who = signing.SigstoreSigner(IDENTITY, ISSUER, str(world["trust"]))
    check = signing.verify_signature(str(world[kind]), str(world[f"{kind}_sig"]), sigstore_signer=who)
    assert check.ok, check.failures
    assert check.to_dict()["signer"] == {"method": "sigstore", "identity": IDENTITY, "issuer": ISSUER,
                                         "trust_config": str(world["trust"])}
    assert check.files == files and check.to_dict()["verdict"] == "verified"


def test_the_verify_command_offline(world: dict[str, Path]) -> None:
    """`ckptfix verify --signature … --sigstore-identity …` in a network namespace: the gate's JSON names the signer."""
    argv = [sys.executable, "-m", "ckptfix", "verify", str(world["file"]), "--signature", str(world["file_sig"]),
            *_flags(world), "--json", "--quiet"]
    res = subprocess.run(offline(argv), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads(res.stdout)["signature"]
    assert report["verdict"] == "verified" and report["files"] == {".": "ok"}
    assert (report["signer"]["identity"], report["signer"]["issuer"]) == (IDENTITY, ISSUER)


@pytest.mark.parametrize("change, says", [
    ("flip", "signature: model.safetensors: its bytes differ from the signed ones"),
    ("identity", f"does not verify as someone@else.example from {ISSUER} under the given trust config: signed by "
                 "another identity (Certificate's SANs do not match someone@else.example"),
    ("issuer", f"does not verify as {IDENTITY} from https://other.example under the given trust config: the "
               "identity comes from another OIDC issuer (Certificate's OIDCIssuer does not match"),
    ("other_trust", "its certificate is not from the trust config's CA (another trust root) (failed to build"),
    ("other_ct", "its certificate's timestamp is not signed by the trust config's CT logs"),
    ("other_rekor", "its transparency-log entry is not signed by the trust config's Rekor logs"),
    ("altered", "the signed statement was altered (DSSE: invalid signature)"),
])
def test_each_mismatch_exits_3_naming_why(world: dict[str, Path], cli_runner: Any, tmp_path: Path, change: str,
                                          says: str) -> None:
    model, signature = world["file"], world["altered_sig" if change == "altered" else "file_sig"]
    if change == "flip":
        model = Path(shutil.copy(model, tmp_path / model.name))
        data = bytearray(model.read_bytes())
        data[-1] ^= 1  # the last tensor's last byte: the file still reads, its bytes differ
        model.write_bytes(bytes(data))
    changed = {"identity": {"sigstore_identity": "someone@else.example"},
               "issuer": {"sigstore_issuer": "https://other.example"},
               **{k: {"trust_config": str(world[k])} for k in ("other_trust", "other_ct", "other_rekor")}}
    res = cli_runner.invoke(cli, ["verify", str(model), "--signature", str(signature), "--quiet",
                                  *_flags(world, **changed.get(change, {}))])
    assert res.exit_code == 3 and says in " ".join(res.output.split()), res.output


@pytest.mark.parametrize("content, says", [
    (b"\xb0 not even text", "not a Sigstore client trust config"),
    (b'{"mediaType": "application/vnd.dev.sigstore.trustedroot+json;version=0.1"}', "not a Sigstore client trust"),
    (b'{"mediaType": "application/vnd.dev.sigstore.clienttrustconfig.v0.1+json"}', "not a usable Sigstore trust"),
])
def test_a_file_that_is_not_a_trust_config_is_refused_in_one_line(world: dict[str, Path], tmp_path: Path,
                                                                  content: bytes, says: str) -> None:
    (tmp_path / "trust.json").write_bytes(content)
    who = signing.SigstoreSigner(IDENTITY, ISSUER, str(tmp_path / "trust.json"))
    with pytest.raises(signing.SigningError, match=says) as e:
        signing.verify_signature(str(world["file"]), str(world["file_sig"]), sigstore_signer=who)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("flags, usage", [
    (["--signature", "s.sig", "--sigstore-identity", IDENTITY, "--trust-config", "t.json"],
     "--sigstore-identity, --sigstore-issuer and --trust-config go together"),
    (["--signature", "s.sig", "--public-key", "p.pem", "--sigstore-identity", IDENTITY, "--sigstore-issuer", ISSUER,
      "--trust-config", "t.json"], "--sigstore-identity, --sigstore-issuer and --trust-config exclude --public-key"),
    (["--sigstore-identity", IDENTITY, "--sigstore-issuer", ISSUER, "--trust-config", "t.json"],
     "--sigstore-identity, --sigstore-issuer and --trust-config go with --signature SIG"),
])
def test_the_sigstore_options_go_together(cli_runner: Any, fixtures_dir: Path, flags: list[str], usage: str) -> None:
    res = cli_runner.invoke(cli, ["verify", str(fixtures_dir / "mlp_single.pth"), *flags])
    assert res.exit_code == 2 and usage in res.output, res.output
