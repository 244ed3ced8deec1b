"""OpenSSF model signatures against the real model-signing 1.1.1 library and CLI: ckptfix's signatures (``convert
--sign``, ``ckptfix sign``) verify with ``model_signing verify key`` for every output kind, its digests equal
model-signing's own manifest, model-signing's signatures verify with ckptfix, and each tampering fails naming the
file. Nothing reaches the network: the CLI runs in a network namespace without interfaces where the machine allows
it, and in this process every socket connect raises."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import datetime
from pathlib import Path
from typing import Any

import pytest

ms = pytest.importorskip("model_signing")
pytest.importorskip("OpenSSL")  # model-signing imports it without declaring it

from cryptography import x509  # noqa: E402  (installed with model-signing)
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402

import ckptfix  # noqa: E402
from ckptfix.cli import cli  # noqa: E402
from ckptfix.safety import signing  # noqa: E402
from tests.offline import model_signing_cli, refuse_connections  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MLP_SPEC = str(ROOT / "fixtures" / "train.py") + ":mlp"
#: every output kind a convert writes: DST name, convert keywords, where its signature goes
KINDS = {
    "pth": ("out.pth", {}, "out.pth.sig"),
    "safetensors": ("out.safetensors", {}, "out.safetensors.sig"),
    "sharded": ("sharded", {"max_shard_size": "1KB"}, "sharded/model.sig"),
    "dcp": ("dcp", {"format": "dcp"}, "dcp/model.sig"),
}


@pytest.fixture(autouse=True)
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Signing and verifying are offline: any connection attempt in this process fails the test."""
    refuse_connections(monkeypatch)


def _pem(private: Any, password: bytes | None = None) -> bytes:
    encryption = (serialization.BestAvailableEncryption(password) if password else serialization.NoEncryption())
    return private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption)


def _public_pem(private: Any) -> bytes:
    return private.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Keys made with cryptography: the signer's (P-256), another P-384 public key, and kinds model signing refuses."""
    d = tmp_path_factory.mktemp("keys")
    signer, other = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP384R1())
    files = {
        "key": _pem(signer), "pub": _public_pem(signer), "other_pub": _public_pem(other),
        "encrypted": _pem(ec.generate_private_key(ec.SECP384R1()), b"s3cret"),
        "rsa": _pem(rsa.generate_private_key(public_exponent=65537, key_size=2048)),
        "ed25519": _pem(ed25519.Ed25519PrivateKey.generate()),
        "p224": _pem(ec.generate_private_key(ec.SECP224R1())),
    }
    for name, data in files.items():
        (d / f"{name}.pem").write_bytes(data)
    return {name: d / f"{name}.pem" for name in files}


@pytest.fixture(scope="module")
def signed(tmp_path_factory: pytest.TempPathFactory, keys: dict[str, Path], fixtures_dir: Path) -> dict[str, Path]:
    """Each output kind written by ``convert --sign`` (the library call) from the MLP fixture."""
    d = tmp_path_factory.mktemp("signed")
    for kind, (name, options, sig) in KINDS.items():
        report = ckptfix.convert(str(fixtures_dir / "mlp_single.pth"), str(d / name), sign=str(keys["key"]), **options)
        assert report.signature == str(d / sig), kind
    return {kind: d / name for kind, (name, _, _) in KINDS.items()}


def _signature_of(path: Path) -> Path:
    return path / signing.DIR_SIGNATURE if path.is_dir() else Path(f"{path}{signing.FILE_SUFFIX}")


def test_model_signing_cli_verifies_every_output_kind(signed: dict[str, Path], keys: dict[str, Path]) -> None:
    """``model_signing verify key OUT --signature SIG --public_key PUB`` accepts each output ``convert --sign`` wrote,
    and rejects one changed after signing."""
    argvs = [["verify", "key", str(p), "--signature", str(_signature_of(p)), "--public_key", str(keys["pub"])]
             for p in signed.values()]
    tampered = signed["safetensors"].with_name("tampered.safetensors")
    _flip_last_byte(shutil.copy(signed["safetensors"], tampered))
    argvs.append(["verify", "key", str(tampered), "--signature", str(_signature_of(signed["safetensors"])),
                  "--public_key", str(keys["pub"])])
    *accepted, rejected = model_signing_cli(*argvs)
    for kind, (code, text) in zip(signed, accepted):
        assert (code, "Verification succeeded" in text) == (0, True), f"{kind}: {text}"
    assert rejected[0] == 1 and "Hash mismatch" in rejected[1]


@pytest.mark.parametrize("kind", KINDS)
def test_digests_equal_model_signings_manifest(signed: dict[str, Path], kind: str) -> None:
    """The manifest ckptfix signed (read back from the bundle) equals the one model-signing computes itself, with
    the same ignored paths (the signature, the .git* ones) and the same payload statement fields."""
    path, sig = signed[kind], _signature_of(signed[kind])
    ignored = [sig.relative_to(path)] if path.is_dir() else []
    own = ms.hashing.Config().set_ignored_paths(paths=ignored).hash(path)
    payload = json.loads(base64.b64decode(json.loads(sig.read_text())["dsseEnvelope"]["payload"]))
    assert payload["predicateType"] == "https://model_signing/signature/v1.0"
    signed_manifest = ms._signing.signing.dsse_payload_to_manifest(payload)
    assert signed_manifest == own
    assert [d.identifier for d in signed_manifest.resource_descriptors()] == \
        ([signing.SINGLE] if path.is_file() else sorted(p.name for p in path.iterdir() if p.name != "model.sig"))
    assert payload["subject"][0]["name"] == own.model_name == path.name
    assert payload["predicate"]["serialization"]["ignore_paths"][-4:] == list(signing.GIT_PATHS)


@pytest.mark.parametrize("method", ["files", "shards"])
def test_model_signings_signatures_verify_with_ckptfix(signed: dict[str, Path], keys: dict[str, Path],
                                                        tmp_path: Path, method: str) -> None:
    """Signatures model-signing's library makes (by file, and by 1 KB shard: its own hashing then) check with
    ckptfix, a file and a directory alike."""
    for kind in ("safetensors", "sharded"):
        model = Path(shutil.copytree(signed[kind], tmp_path / kind) if signed[kind].is_dir()
                     else shutil.copy(signed[kind], tmp_path / signed[kind].name))
        sig = tmp_path / f"{kind}.sig"
        hashing = ms.hashing.Config()
        if method == "shards":
            hashing.use_shard_serialization(shard_size=1024)
        ms.signing.Config().use_elliptic_key_signer(private_key=keys["key"]).set_hashing_config(hashing).sign(model, sig)
        check = signing.verify_signature(str(model), str(sig), public_key=str(keys["pub"]))
        assert check.ok, check.failures
        assert check.files and set(check.files.values()) == {"ok"}


def _flip_last_byte(path: Any) -> None:
    data = bytearray(Path(path).read_bytes())
    data[-1] ^= 1
    Path(path).write_bytes(data)


def _shard(path: Path) -> Path:
    return sorted(path.glob("model-0000*.safetensors"))[0]


def _flip_in_file(path: Path) -> tuple[Path, str]:
    _flip_last_byte(path)
    return path, "out.safetensors: its bytes differ"


def _flip_in_dir(path: Path) -> tuple[Path, str]:
    _flip_last_byte(_shard(path))
    return path, f"{_shard(path).name}: its bytes differ"


def _remove_from_dir(path: Path) -> tuple[Path, str]:
    name = _shard(path).name
    _shard(path).unlink()
    return path, f"{name}: signed, but missing"


def _add_to_dir(path: Path) -> tuple[Path, str]:
    (path / "notes.txt").write_text("x")
    return path, "notes.txt: not in the signature"


def _rename(path: Path) -> tuple[Path, str]:
    return path.rename(path.with_name("renamed.safetensors")), "renamed.safetensors was signed as out.safetensors"


#: each tampering: the output kind it alters, and how (it returns the path to verify and what the failure says)
TAMPERINGS = {"flipped byte, file": ("safetensors", _flip_in_file), "flipped byte, dir": ("sharded", _flip_in_dir),
              "missing file": ("sharded", _remove_from_dir), "extra file": ("dcp", _add_to_dir),
              "renamed file": ("safetensors", _rename)}


@pytest.mark.parametrize("case", TAMPERINGS)
def test_each_tampering_fails_naming_the_file(signed: dict[str, Path], keys: dict[str, Path], tmp_path: Path,
                                              case: str) -> None:
    kind, tamper = TAMPERINGS[case]
    src = signed[kind]
    copy = Path(shutil.copytree(src, tmp_path / src.name) if src.is_dir() else shutil.copy(src, tmp_path / src.name))
    sig = shutil.copy(_signature_of(src), tmp_path / "sig")
    path, expected = tamper(copy)
    check = signing.verify_signature(str(path), str(sig), public_key=str(keys["pub"]))
    assert not check.ok and len(check.failures) == 1 and expected in check.failures[0], check.failures
    assert list(check.files.values()).count("ok") == len(check.files) - (case != "renamed file")


def test_verify_gate_signature_check(signed: dict[str, Path], keys: dict[str, Path], cli_runner: Any,
                                     tmp_path: Path) -> None:
    """``verify --signature``: exit 0 with a verified ``signature`` object in the JSON; a wrong key: exit 3, the key
    named; a changed file: exit 3, the file named."""
    path = signed["safetensors"]
    argv = ["verify", str(path), "--model", MLP_SPEC, "--structure-only", "--quiet", "--json",
            "--signature", str(_signature_of(path))]
    ok = cli_runner.invoke(cli, [*argv, "--public-key", str(keys["pub"])])
    assert ok.exit_code == 0, ok.output
    report = json.loads(ok.output)["signature"]
    assert report["verdict"] == "verified" and report["files"] == {".": "ok"} and report["signer"]["method"] == "key"
    wrong = cli_runner.invoke(cli, [*argv, "--public-key", str(keys["other_pub"])])
    assert wrong.exit_code == 3 and json.loads(wrong.output)["signature"]["verdict"] == "failed"
    assert any("does not verify with" in f and "other_pub.pem" in f for f in json.loads(wrong.output)["failures"])
    changed = shutil.copy(path, tmp_path / path.name)
    _flip_last_byte(changed)
    text = cli_runner.invoke(cli, ["verify", str(changed), "--model", MLP_SPEC, "--structure-only", "--quiet",
                                   "--signature", str(_signature_of(path)), "--public-key", str(keys["pub"])])
    assert text.exit_code == 3 and "FAIL: signature: out.safetensors: its bytes differ" in text.output


@pytest.mark.parametrize("flags, usage", [
    (["--signature", "x.sig"], "--signature needs one of --public-key PUB or --certificate-chain CHAIN"),
    (["--public-key", "pub.pem"], "--public-key and --certificate-chain go with --signature SIG"),
])
def test_verify_signature_options_go_together(cli_runner: Any, fixtures_dir: Path, flags: list[str],
                                              usage: str) -> None:
    res = cli_runner.invoke(cli, ["verify", str(fixtures_dir / "mlp_single.pth"), "--model", MLP_SPEC, *flags])
    assert res.exit_code == 2 and usage in res.output


@pytest.mark.parametrize("key, says", [
    ("rsa", "a RSA key; model signatures take EC keys"),
    ("ed25519", "a Ed25519 key; model signatures take EC keys"),
    ("p224", "an EC key on secp224r1"),
    ("encrypted", "the key is encrypted and no password was given"),
    ("pub", "not a PEM private key"),
])
def test_sign_refuses_other_keys_in_one_line(signed: dict[str, Path], keys: dict[str, Path], cli_runner: Any,
                                             tmp_path: Path, key: str, says: str) -> None:
    res = cli_runner.invoke(cli, ["sign", str(signed["pth"]), "--key", str(keys[key]),
                                  "--signature", str(tmp_path / "x.sig")])
    assert res.exit_code == 1 and says in res.output and len(res.output.strip().splitlines()) == 1, res.output
    assert not (tmp_path / "x.sig").exists()


def test_sign_with_an_encrypted_key(signed: dict[str, Path], keys: dict[str, Path], cli_runner: Any,
                                    tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--key-password-env VAR``: an encrypted key signs; the certificate method (which loads keys without one)
    refuses it in one line."""
    public = serialization.load_pem_private_key(keys["encrypted"].read_bytes(), b"s3cret")
    (tmp_path / "pub.pem").write_bytes(_public_pem(public))
    model = shutil.copy(signed["pth"], tmp_path / "out.pth")
    monkeypatch.setenv("KEY_PASSWORD", "s3cret")
    argv = ["sign", str(model), "--key", str(keys["encrypted"]), "--key-password-env", "KEY_PASSWORD"]
    res = cli_runner.invoke(cli, [*argv, "--json"])
    assert res.exit_code == 0 and json.loads(res.output)["signer"] == {"method": "key", "curve": "P-384"}, res.output
    assert signing.verify_signature(str(model), f"{model}.sig", public_key=str(tmp_path / "pub.pem")).ok
    res = cli_runner.invoke(cli, [*argv, "--certificate", str(keys["pub"])])
    assert res.exit_code == 1 and "certificate method takes an unencrypted key" in res.output


def test_sign_with_a_certificate(signed: dict[str, Path], keys: dict[str, Path], cli_runner: Any,
                                 tmp_path: Path) -> None:
    """model-signing's certificate method: a directory signed with KEY's CA-signed certificate verifies with the
    CA as the chain, and not with another root."""
    key = serialization.load_pem_private_key(keys["key"].read_bytes(), None)
    root_key, root = _certificate("root", ec.generate_private_key(ec.SECP256R1()), None, ca=True)
    _, leaf = _certificate("signer", key, (root_key, root), ca=False)
    _, other = _certificate("other", ec.generate_private_key(ec.SECP256R1()), None, ca=True)
    for name, cert in {"root": root, "leaf": leaf, "other": other}.items():
        (tmp_path / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    model = shutil.copytree(signed["sharded"], tmp_path / "model")
    res = cli_runner.invoke(cli, ["sign", str(model), "--key", str(keys["key"]), "--certificate",
                                  str(tmp_path / "leaf.pem"), "--certificate-chain", str(tmp_path / "root.pem")])
    assert res.exit_code == 0, res.output
    sig = str(model / "model.sig")
    assert signing.verify_signature(str(model), sig, certificate_chain=[str(tmp_path / "root.pem")]).ok
    assert not signing.verify_signature(str(model), sig, certificate_chain=[str(tmp_path / "other.pem")]).ok


def _certificate(name: str, key: Any, issuer: tuple[Any, Any] | None, ca: bool) -> tuple[Any, Any]:
    """A certificate for ``key`` (self-signed without ``issuer``), usable for signing."""
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    signer_key, signer_cert = issuer if issuer else (key, None)
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject)
            .issuer_name(signer_cert.subject if signer_cert else subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=ca,
                                         crl_sign=ca, encipher_only=False, decipher_only=False), critical=True)
            .sign(signer_key, hashes.SHA256()))
    return key, cert


def test_convert_sign_refuses_before_writing(keys: dict[str, Path], fixtures_dir: Path, cli_runner: Any,
                                             tmp_path: Path) -> None:
    """A key model signing can't take, or a URL destination: refused before any output is written."""
    out = tmp_path / "out.safetensors"
    res = cli_runner.invoke(cli, ["convert", str(fixtures_dir / "mlp_single.pth"), str(out), "--sign", str(keys["rsa"])])
    assert res.exit_code == 1 and "a RSA key" in res.output and not out.exists()
    res = cli_runner.invoke(cli, ["convert", str(fixtures_dir / "mlp_single.pth"), "s3://bucket/out.safetensors",
                                  "--sign", str(keys["key"])])
    assert res.exit_code == 1 and "--sign writes the signature beside a local output" in res.output


def test_without_model_signing_one_line_names_the_extra(signed: dict[str, Path], keys: dict[str, Path],
                                                        cli_runner: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "model_signing", None)  # import model_signing now raises ImportError
    res = cli_runner.invoke(cli, ["sign", str(signed["pth"]), "--key", str(keys["key"])])
    assert res.exit_code == 1 and "pip install 'ckptfix[sign]'" in res.output
    assert len(res.output.strip().splitlines()) == 1


def test_sign_hashes_a_directorys_files_in_parallel_as_model_signing_names_them(tmp_path: Path,
                                                                                keys: dict[str, Path]) -> None:
    """Nested files by POSIX path, the .git* paths and the signature left out, a symlink refused."""
    (tmp_path / "m" / "sub").mkdir(parents=True)
    (tmp_path / "m" / "a.bin").write_bytes(os.urandom(3000))
    (tmp_path / "m" / "sub" / "b.bin").write_bytes(b"b")
    (tmp_path / "m" / ".gitattributes").write_text("*.bin lfs")
    (tmp_path / "m" / ".git").mkdir()
    (tmp_path / "m" / ".git" / "HEAD").write_text("ref")
    report = signing.sign(str(tmp_path / "m"), str(keys["key"]))
    assert sorted(report.files) == ["a.bin", "sub/b.bin"]
    assert ms.hashing.Config().set_ignored_paths(paths=["model.sig"]).hash(tmp_path / "m") == \
        ms.verifying.Config().use_elliptic_key_verifier(public_key=keys["pub"])._verifier.verify(
            ms._signing.sign_sigstore_pb.Signature.read(Path(report.signature)))
    (tmp_path / "m" / "link").symlink_to("a.bin")
    with pytest.raises(ckptfix.errors.SigningError, match="a symlink"):
        signing.sign(str(tmp_path / "m"), str(keys["key"]))


#: a signed convert in a fresh process: model-signing's heavy imports (sigstore, TUF, boto3) stay out, and a later
#: ``import model_signing`` works as usual, its verifier accepting the signature
_FRESH = """
import sys, ckptfix
ckptfix.convert(sys.argv[1], sys.argv[2], sign=sys.argv[3])
heavy = sorted({m.split(".")[0] for m in sys.modules} & {"sigstore", "tuf", "boto3", "torch"})
import model_signing
model_signing.verifying.Config().use_elliptic_key_verifier(public_key=sys.argv[4]).verify(sys.argv[2], sys.argv[2] + ".sig")
print(heavy)
"""


def test_a_signed_convert_imports_only_what_it_signs_with(fixtures_dir: Path, keys: dict[str, Path],
                                                          tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-c", _FRESH, str(fixtures_dir / "mlp_single.pth"),
                          str(tmp_path / "o.safetensors"), str(keys["key"]), str(keys["pub"])],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr
