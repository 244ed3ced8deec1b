"""Detached signatures in the OpenSSF Model Signing format (``model-signing`` 1.1.1): a Sigstore bundle holding a
DSSE-signed in-toto statement over each file's SHA-256, made and checked by model-signing's own classes.

ckptfix hashes the files itself (in parallel; a convert hashes its output while the kernel writes it back) and hands
model-signing the digests, following its serialization rules exactly: a single file is one resource named ``.``,
a directory every regular file under it by its relative POSIX path, except the signature itself and the ``.git*``
paths model-signing ignores by default. ``model_signing verify key`` accepts what :func:`sign` writes, and
:func:`verify_signature` checks what ``model_signing sign`` wrote, naming each file that differs (a Sigstore
bundle against a given trust config: :mod:`ckptfix.safety.sigstore`).

>>> sign("model.safetensors", key="key.pem")                       # doctest: +SKIP
>>> verify_signature("model.safetensors", "model.safetensors.sig", public_key="pub.pem").ok   # doctest: +SKIP
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pathlib
import stat
import sys
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from ..core.atomic import atomic_path, sha256_file
from ..core.units import shown
from ..errors import SigningError
from . import sigstore

#: where a directory's signature goes (model-signing's CLI default), and a file's: beside it, ``OUT.sig``
DIR_SIGNATURE = "model.sig"
FILE_SUFFIX = ".sig"
#: the paths model-signing ignores unless told otherwise (``hashing.Config.hash``), as its manifest records them
GIT_PATHS = (".git", ".gitattributes", ".github", ".gitignore")
#: the curves model-signing's key and certificate signers take
CURVES = {"secp256r1": "P-256", "secp384r1": "P-384", "secp521r1": "P-521"}
INSTALL = "pip install 'ckptfix[sign]'"
#: a single file is one resource of this name (model-signing: the file's path relative to itself)
SINGLE = "."


_IMPORTING = threading.Lock()
#: the modules of model-signing ckptfix uses (pinned 1.1.1: some are private), by the name :func:`library` gives them
_MODULES = {"manifest": "model_signing.manifest", "digest": "model_signing._hashing.hashing",
            "payload": "model_signing._signing.signing", "key": "model_signing._signing.sign_ec_key",
            "bundle": "model_signing._signing.sign_sigstore_pb", "hashing": "model_signing.hashing"}
#: the modules only some methods need, imported on request: the certificate method's (pyOpenSSL) and Sigstore's
_OPTIONAL = {"certificate": "model_signing._signing.sign_certificate", "sigstore": sigstore.MODULE}


def require() -> Any:
    """model-signing's module spec, found without importing it; not installed: the one-line error naming the extra."""
    spec = importlib.util.find_spec("model_signing")
    if spec is None:
        raise SigningError(f"signatures need the model-signing package: {INSTALL}")
    return spec


def library(*optional: str) -> SimpleNamespace:
    """model-signing's own manifest, payload, signer, verifier and bundle modules (and the ``optional`` ones named
    in :data:`_OPTIONAL`), imported without running the package's ``__init__``: it imports sigstore, TUF and boto3 —
    ~0.8 s of CPU that a key signature doesn't use. A later ``import model_signing`` runs it as usual, reusing them."""
    spec = require()
    names = dict(_MODULES, **{name: _OPTIONAL[name] for name in optional})
    with _IMPORTING:  # one thread at a time puts the bare package in place and takes it away
        stub = "model_signing" not in sys.modules
        if stub:  # the package as a bare namespace while its submodules load
            sys.modules["model_signing"] = importlib.util.module_from_spec(spec)
        try:
            return SimpleNamespace(**{name: importlib.import_module(module) for name, module in names.items()})
        except ImportError as e:  # pyOpenSSL, which model-signing's certificate module imports without declaring it
            raise SigningError(f"signatures need {e.name or 'a package model-signing imports'}: {INSTALL}") from None
        finally:
            if stub:
                del sys.modules["model_signing"]


def default_signature(path: str) -> str:
    """Where a signature of ``path`` goes unless told: ``PATH/model.sig`` in a directory, ``PATH.sig`` beside a file."""
    return os.path.join(path, DIR_SIGNATURE) if os.path.isdir(path) else path + FILE_SUFFIX


def ignored_paths(path: str, signature: str) -> list[str]:
    """The paths a signature of ``path`` leaves out, as model-signing's CLI records them: the signature itself
    where it lies inside the model directory, then the ``.git*`` ones."""
    inside = os.path.relpath(os.path.abspath(signature), os.path.abspath(path))
    own = [pathlib.PurePath(inside).as_posix()] if os.path.isdir(path) and not inside.startswith("..") else []
    return own + list(GIT_PATHS)


def model_files(path: str, ignore: Sequence[str]) -> dict[str, str]:
    """Each file model-signing hashes in ``path``, by resource name (its relative POSIX path; ``.`` for a single
    file); a symlink or special file is refused, as model-signing refuses it."""
    _check_entry(path, path)
    if not os.path.isdir(path):
        return {SINGLE: path}
    files: dict[str, str] = {}
    for top, dirs, names in os.walk(path):
        for name in sorted(dirs) + sorted(names):
            full = os.path.join(top, name)
            rel = pathlib.PurePath(os.path.relpath(full, path)).as_posix()
            if any(rel == p or rel.startswith(p.rstrip("/") + "/") for p in ignore):
                continue
            _check_entry(full, path)
            if name in names:
                files[rel] = full
    return files


def _check_entry(full: str, root: str) -> None:
    mode = os.lstat(full).st_mode
    if stat.S_ISLNK(mode):
        raise SigningError(f"{shown(full)}: a symlink in {shown(root)}; model signatures cover regular files only")
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise SigningError(f"{shown(full)}: not a regular file or directory; model signatures cover regular files only")


def hash_files(files: Mapping[str, str]) -> dict[str, str]:
    """Each file's hex SHA-256, the files hashed in parallel (hashlib releases the GIL), each at SHA-256 speed."""
    if len(files) <= 1:
        return {name: sha256_file(p) for name, p in files.items()}
    with ThreadPoolExecutor(max_workers=min(len(files), os.cpu_count() or 1)) as pool:
        futures = {name: pool.submit(sha256_file, p) for name, p in files.items()}
        return {name: f.result() for name, f in futures.items()}


def hash_in_background(path: str) -> Future[str]:
    """The SHA-256 of a file just written, computed on another thread (from the page cache) while the caller
    fsyncs it: what a convert does where its writer couldn't hash behind the copy (torch's writer, a patched header)."""
    pool = ThreadPoolExecutor(max_workers=1)
    try:
        return pool.submit(sha256_file, path)
    finally:
        pool.shutdown(wait=False)


def load_key(key: str, password: str | None = None) -> str:
    """The curve name of the EC private key at ``key`` (PEM); any other key refused in one line."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    try:
        with open(key, "rb") as f:
            private = serialization.load_pem_private_key(f.read(), password.encode() if password else None)
    except OSError as e:
        raise SigningError(f"{shown(key)}: can't read the key: {e.strerror or e}") from None
    except TypeError:
        raise SigningError(f"{shown(key)}: the key is encrypted and no password was given (--key-password-env VAR)"
                           if password is None else f"{shown(key)}: the key is not encrypted; drop the password") from None
    except ValueError as e:
        raise SigningError(f"{shown(key)}: not a PEM private key ckptfix can read ({e})") from None
    if not isinstance(private, ec.EllipticCurvePrivateKey):
        kind = type(private).__name__.removesuffix("PrivateKey").lstrip("_") or "non-EC"
        raise SigningError(f"{shown(key)}: a {kind} key; model signatures take EC keys on P-256, P-384 or P-521")
    if private.curve.name not in CURVES:
        raise SigningError(f"{shown(key)}: an EC key on {private.curve.name}; model signatures take P-256, P-384 "
                           "or P-521")
    return CURVES[private.curve.name]


def manifest_of(path: str, digests: Mapping[str, str], ignore: Sequence[str]) -> Any:
    """model-signing's ``Manifest`` of ``path`` from digests computed here, built with its own classes exactly as
    its file serialization builds it (``hash_type`` sha256, no symlinks, the ignored paths recorded)."""
    ms = library()
    serialization = ms.manifest.SerializationType.from_args(
        {"method": "files", "hash_type": "sha256", "allow_symlinks": False, "ignore_paths": list(ignore)})
    items = [serialization.new_item(name, ms.digest.Digest("sha256", bytes.fromhex(digest)))
             for name, digest in digests.items()]
    return ms.manifest.Manifest(os.path.basename(os.path.abspath(path)), items, serialization)


@dataclass
class Signed:
    """What :func:`sign` wrote: the signature, the signer, and each file's SHA-256 by resource name."""

    path: str
    signature: str
    signer: dict[str, Any]
    files: dict[str, str]

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "signature": self.signature, "signer": self.signer, "files": self.files}

    def format_text(self) -> str:
        return (f"signed {self.path}: {len(self.files)} file(s), SHA-256, {self.signer['method']} "
                f"{self.signer.get('curve', '')}".rstrip() + f" -> {self.signature}")


def sign(path: str, key: str, signature: str | None = None, *, certificate: str | None = None,
         certificate_chain: Sequence[str] = (), password: str | None = None,
         digests: Mapping[str, str] | None = None) -> Signed:
    """Sign ``path`` (a file or a directory) with the EC private key ``key``; the signature goes to ``signature``
    (default :func:`default_signature`). With ``certificate``: model-signing's certificate method (the leaf
    certificate of ``key``, and ``certificate_chain`` up to a root). ``digests`` (resource name → hex SHA-256): the
    files as already hashed (a convert's output); the rest are hashed here, in parallel."""
    curve = load_key(key, password)
    signature = signature or default_signature(path)
    ignore = ignored_paths(path, signature)
    files = model_files(path, ignore)
    known = dict(digests or {})
    hashed = {**known, **hash_files({n: p for n, p in files.items() if n not in known})}
    hashed = {n: hashed[n] for n in sorted(files)}
    signer, description = _signer(key, password, certificate, certificate_chain)
    description["curve"] = curve
    # model-signing's own payload and signer, over digests hashed here (model-transparency#568: its Config hashes
    # the model again)
    bundle = signer.sign(library().payload.Payload(manifest_of(path, hashed, ignore)))
    with atomic_path(signature) as tmp:
        bundle.write(pathlib.Path(tmp))
    return Signed(path, signature, description, hashed)


def _signer(key: str, password: str | None, certificate: str | None,
            chain: Sequence[str]) -> tuple[Any, dict[str, Any]]:
    """model-signing's signer for the key (and certificate), and the signer as the report names it."""
    try:
        if certificate is None:
            # cryptography takes the password as bytes (model-signing's hint says str)
            secret = password.encode() if password is not None else None
            return library().key.Signer(pathlib.Path(key), secret), {"method": "key"}
        signer = library("certificate").certificate.Signer(pathlib.Path(key), pathlib.Path(certificate),
                                                           [pathlib.Path(c) for c in chain])
        return signer, {"method": "certificate", "certificate": certificate}
    except OSError as e:
        raise SigningError(f"can't read {shown(e.filename or certificate or key)}: {e.strerror or e}") from None
    except TypeError:  # model-signing's certificate signer loads the key without a password
        raise SigningError(f"{shown(key)}: model_signing's certificate method takes an unencrypted key") from None
    except ValueError as e:  # a certificate that isn't PEM, or not KEY's
        raise SigningError(f"{shown(certificate or key)}: {shown(str(e), 200)}") from None


@dataclass
class SignatureCheck:
    """The outcome of :func:`verify_signature`: ``files`` maps each resource to ``ok``, ``changed``, ``missing``
    or ``extra``; ``failures`` names each, and a wrong key or a renamed single file."""

    signature: str
    signer: dict[str, Any]
    files: dict[str, str] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    signed_name: str | None = None

    @property
    def ok(self) -> bool:
        return not self.failures

    def to_dict(self) -> dict[str, Any]:
        return {"signature": self.signature, "signer": self.signer, "files": self.files,
                "verdict": "verified" if self.ok else "failed", "signed_name": self.signed_name}


@dataclass(frozen=True)
class SigstoreSigner:
    """Who a Sigstore-signed model must come from: ``identity`` (the certificate's SAN) from the OIDC ``issuer``,
    under ``trust_config`` (a ClientTrustConfig JSON; nothing is fetched)."""

    identity: str
    issuer: str
    trust_config: str


def verify_signature(path: str, signature: str, public_key: str | None = None,
                     certificate_chain: Sequence[str] | None = None,
                     sigstore_signer: SigstoreSigner | None = None) -> SignatureCheck:
    """Check ``path`` against ``signature`` (made by ckptfix or by model_signing), offline: with ``public_key``
    (model-signing's key method), ``certificate_chain`` (its certificate method; empty: the system's roots) or
    ``sigstore_signer`` (its Sigstore method, against the given trust root). A directory's signature given with one
    file of it (a ``save_pretrained`` directory's weights) checks the directory."""
    signer, verifier = _verifier(public_key, certificate_chain, sigstore_signer)
    check = SignatureCheck(signature, signer)
    # a Sigstore verifier takes sigstore's own bundle object; the key and certificate ones, the protobuf one
    reader = library("sigstore").sigstore if sigstore_signer is not None else library().bundle
    try:
        bundle = reader.Signature.read(pathlib.Path(signature))
    except OSError as e:
        raise SigningError(f"{shown(signature)}: can't read the signature: {e.strerror or e}") from None
    except Exception as e:  # not JSON, not a bundle: the parser's own exception types vary
        check.failures.append(f"signature: {shown(signature)} is not a model signature bundle ({shown(str(e), 200)})")
        return check
    try:
        expected = verifier.verify(bundle)
    except Exception as e:  # a wrong key, an altered bundle: the verifier's own exception types vary
        reason = str(e) or type(e).__name__
        if sigstore_signer is not None:
            check.failures.append(sigstore.failure(signature, sigstore_signer.identity, sigstore_signer.issuer, reason))
            return check
        check.failures.append(f"signature: {shown(signature)} does not verify with "
                              f"{shown(public_key) if public_key else 'the certificate chain'}: the wrong key, or "
                              f"the signature was altered ({shown(reason, 200)})")
        return check
    check.signed_name = expected.model_name
    if os.path.isfile(path) and not _single_file(expected):
        path = os.path.dirname(os.path.abspath(path))
    _compare(path, signature, expected, check)
    return check


def _verifier(public_key: str | None, certificate_chain: Sequence[str] | None,
              sigstore_signer: SigstoreSigner | None) -> tuple[dict[str, Any], Any]:
    """The signer as the report names it, and model-signing's verifier for it (a key it can't take: one line)."""
    if sigstore_signer is not None:
        who = (sigstore_signer.identity, sigstore_signer.issuer, sigstore_signer.trust_config)
        return sigstore.signer(*who), sigstore.verifier(library("sigstore").sigstore, *who)
    try:
        if public_key is not None:
            return {"method": "key", "public_key": public_key}, library().key.Verifier(pathlib.Path(public_key))
        chain = list(certificate_chain or ())
        return ({"method": "certificate", "certificate_chain": chain},
                library("certificate").certificate.Verifier([pathlib.Path(c) for c in chain]))
    except OSError as e:
        raise SigningError(f"can't read {shown(e.filename or public_key or '')}: {e.strerror or e}") from None
    except (ValueError, TypeError) as e:
        what = shown(public_key) if public_key is not None else "--certificate-chain"
        raise SigningError(f"{what}: not an EC public key (P-256, P-384 or P-521, PEM) or certificate model signatures "
                           f"take ({shown(str(e), 200)})") from None


def _single_file(manifest: Any) -> bool:
    """The manifest is a single file's: its resources are ``.`` (by file) or ``.:START:END`` (by shard)."""
    return all(_file_of(d.identifier) == SINGLE for d in manifest.resource_descriptors())


def _file_of(resource: str) -> str:
    return resource.rsplit(":", 2)[0] if resource.count(":") >= 2 else resource


def _compare(path: str, signature: str, expected: Any, check: SignatureCheck) -> None:
    """Fill ``check`` with each file's verdict: the signed digests against the files as they are now."""
    params = expected.serialization_type
    ignore = list(dict.fromkeys(ignored_paths(path, signature) + list(params.get("ignore_paths", []))))
    signed = {d.identifier: d.digest.digest_hex for d in expected.resource_descriptors()}
    actual = _actual_digests(path, params, ignore)
    name = os.path.basename(os.path.abspath(path))
    for resource in sorted(signed.keys() | actual.keys()):
        shown_name = shown(name + resource[1:] if _file_of(resource) == SINGLE else resource)
        if resource not in actual:
            check.files[resource] = "missing"
            check.failures.append(f"signature: {shown_name}: signed, but missing from {shown(path)}")
        elif resource not in signed:
            check.files[resource] = "extra"
            check.failures.append(f"signature: {shown_name}: not in the signature (added after signing)")
        elif actual[resource] != signed[resource]:
            check.files[resource] = "changed"
            check.failures.append(f"signature: {shown_name}: its bytes differ from the signed ones (changed after "
                                  "signing, or damaged)")
        else:
            check.files[resource] = "ok"
    if _single_file(expected) and expected.model_name != name:
        check.failures.append(f"signature: {shown(name)} was signed as {shown(expected.model_name)}: renamed after "
                              "signing (model_signing binds no file name; ckptfix does)")


def _actual_digests(path: str, params: Mapping[str, Any], ignore: list[str]) -> dict[str, str]:
    """The files' digests under the signature's serialization: SHA-256 per file here, in parallel; any other
    method (shards, BLAKE2, BLAKE3) by model-signing's own hashing."""
    if params.get("method") == "files" and params.get("hash_type") == "sha256":
        return hash_files(model_files(path, ignore))
    ms = library()
    config = ms.hashing.Config().set_ignored_paths(paths=ignore, ignore_git_paths=False)
    if params.get("method") == "shards":
        # the statement's numbers come back from protobuf as floats: model-signing's own verify trips on 1024.0
        config.use_shard_serialization(hashing_algorithm=params["hash_type"], shard_size=int(params["shard_size"]),
                                       allow_symlinks=params["allow_symlinks"])
    else:
        config.use_file_serialization(hashing_algorithm=params["hash_type"], allow_symlinks=params["allow_symlinks"])
    try:
        manifest = config.hash(path)
    except ValueError as e:
        raise SigningError(f"{shown(path)}: {e}") from None
    return {d.identifier: d.digest.digest_hex for d in manifest.resource_descriptors()}
