"""A private Sigstore, offline: a Fulcio-like root CA, a CT log and a Rekor log made with ``cryptography``, the
trust config naming them, and bundles signed the way ``model_signing sign sigstore`` signs (a DSSE envelope over
model-signing's in-toto statement, a leaf certificate carrying the identity and its OIDC issuer, an embedded SCT,
a Rekor dsse/0.0.1 entry with an inclusion proof in a 1-leaf tree, a signed checkpoint and an inclusion promise).

Each part is what sigstore-python 4.5.1's ``Verifier.verify_dsse`` checks (sigstore/verify/verifier.py): the
chain at the entry's integrated time, the SCT over the precertificate (RFC 6962), key usage and code-signing EKU,
the identity policy (SAN + 1.3.6.1.4.1.57264.1.1), the Merkle proof, the checkpoint's note signature, the SET,
and the entry body's payload hash and signatures.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import rfc8785
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID, ObjectIdentifier

#: Fulcio's OIDC-issuer extensions: the legacy raw string (what sigstore's Identity policy checks) and the DER one
ISSUER_V1 = ObjectIdentifier("1.3.6.1.4.1.57264.1.1")
ISSUER_V2 = ObjectIdentifier("1.3.6.1.4.1.57264.1.8")
#: RFC 6962's embedded SCT list extension
SCT_LIST = ObjectIdentifier("1.3.6.1.4.1.11129.2.4.2")
P256 = "PKIX_ECDSA_P256_SHA_256"
ORIGIN = "rekor.ckptfix.test - 1"
#: the note signer's name (no spaces: a signature line is "— NAME SIG")
LOG_NAME = "rekor.ckptfix.test"
NOW = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _der(key: ec.EllipticCurvePublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def key_id(key: ec.EllipticCurvePublicKey) -> bytes:
    """RFC 6962's key ID: the SHA-256 of the key's DER SubjectPublicKeyInfo (what sigstore names logs by)."""
    return hashlib.sha256(_der(key)).digest()


def _utf8_der(text: str) -> bytes:
    raw = text.encode()
    assert len(raw) < 128
    return bytes([0x0C, len(raw)]) + raw


@dataclass
class PrivateSigstore:
    """A root CA, a CT log key and a Rekor log key; :meth:`trust_config` names them, :meth:`sign` makes bundles."""

    ca_key: ec.EllipticCurvePrivateKey = field(default_factory=lambda: ec.generate_private_key(ec.SECP256R1()))
    ct_key: ec.EllipticCurvePrivateKey = field(default_factory=lambda: ec.generate_private_key(ec.SECP256R1()))
    rekor_key: ec.EllipticCurvePrivateKey = field(default_factory=lambda: ec.generate_private_key(ec.SECP256R1()))

    def __post_init__(self) -> None:
        name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "ckptfix test"),
                          x509.NameAttribute(NameOID.COMMON_NAME, "ckptfix test fulcio")])
        public = self.ca_key.public_key()
        self.ca_cert = (
            x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(public)
            .serial_number(x509.random_serial_number())
            .not_valid_before(NOW - datetime.timedelta(days=1)).not_valid_after(NOW + datetime.timedelta(days=3650))
            .add_extension(x509.BasicConstraints(ca=True, path_length=1), critical=True)
            .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
            .sign(self.ca_key, hashes.SHA256()))

    def trust_config(self) -> dict[str, Any]:
        """The ClientTrustConfig JSON (protobuf JSON names) whose trusted root holds only this PKI's keys."""
        start = (NOW - datetime.timedelta(days=1)).strftime("%Y-%m-%dT%H:%M:%SZ")

        def log(key: ec.EllipticCurvePrivateKey, url: str) -> dict[str, Any]:
            return {"baseUrl": url, "hashAlgorithm": "SHA2_256", "logId": {"keyId": _b64(key_id(key.public_key()))},
                    "publicKey": {"rawBytes": _b64(_der(key.public_key())), "keyDetails": P256,
                                  "validFor": {"start": start}}}

        root = {
            "mediaType": "application/vnd.dev.sigstore.trustedroot+json;version=0.1",
            "tlogs": [log(self.rekor_key, "https://rekor.ckptfix.invalid")],
            "ctlogs": [log(self.ct_key, "https://ctfe.ckptfix.invalid")],
            "certificateAuthorities": [{
                "subject": {"organization": "ckptfix test", "commonName": "ckptfix test fulcio"},
                "uri": "https://fulcio.ckptfix.invalid", "validFor": {"start": start},
                "certChain": {"certificates": [{"rawBytes": _b64(self.ca_cert.public_bytes(serialization.Encoding.DER))}]},
            }],
            "timestampAuthorities": [],
        }
        service = {"majorApiVersion": 1, "validFor": {"start": start}, "operator": "ckptfix test"}
        signing = {"mediaType": "application/vnd.dev.sigstore.signingconfig.v0.2+json",
                   "caUrls": [dict(service, url="https://fulcio.ckptfix.invalid")],
                   "oidcUrls": [dict(service, url="https://oauth2.ckptfix.invalid")],
                   "rekorTlogUrls": [dict(service, url="https://rekor.ckptfix.invalid")],
                   "rekorTlogConfig": {"selector": "ANY"}, "tsaUrls": [], "tsaConfig": {"selector": "ANY"}}
        return {"mediaType": "application/vnd.dev.sigstore.clienttrustconfig.v0.1+json",
                "trustedRoot": root, "signingConfig": signing}

    def write_trust_config(self, path: Path) -> Path:
        path.write_text(json.dumps(self.trust_config()))
        return path

    def leaf(self, identity: str, issuer: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
        """A Fulcio-like signing certificate for ``identity`` (an email SAN) from ``issuer``, with its embedded SCT."""
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder().subject_name(x509.Name([])).issuer_name(self.ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(NOW - datetime.timedelta(minutes=5)).not_valid_after(NOW + datetime.timedelta(minutes=10))
            .add_extension(x509.KeyUsage(True, False, False, False, False, False, False, False, False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CODE_SIGNING]), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.ca_key.public_key()), critical=False)
            .add_extension(x509.SubjectAlternativeName([x509.RFC822Name(identity)]), critical=True)
            .add_extension(x509.UnrecognizedExtension(ISSUER_V1, issuer.encode()), critical=False)
            .add_extension(x509.UnrecognizedExtension(ISSUER_V2, _utf8_der(issuer)), critical=False))
        # the precertificate: the same TBS without the SCT list (added last, so removing it leaves the rest as is)
        precert = builder.sign(self.ca_key, hashes.SHA256())
        sct = self._sct(precert.tbs_certificate_bytes)
        sct_list = struct.pack("!HH", len(sct) + 2, len(sct)) + sct
        octets = bytes([0x04]) + _der_length(len(sct_list)) + sct_list
        cert = builder.add_extension(x509.UnrecognizedExtension(SCT_LIST, octets), critical=False).sign(
            self.ca_key, hashes.SHA256())
        assert cert.tbs_precertificate_bytes == precert.tbs_certificate_bytes
        return key, cert

    def _sct(self, tbs: bytes) -> bytes:
        """A v1 precert SCT by the CT log key over ``tbs`` (RFC 6962 3.2), TLS-encoded."""
        timestamp = int(NOW.timestamp() * 1000)
        issuer_key_id = key_id(self.ca_key.public_key())
        entry = issuer_key_id + struct.pack("!I", len(tbs))[1:] + tbs
        signed = struct.pack(f"!BBQH{len(entry)}sH", 0, 0, timestamp, 1, entry, 0)
        signature = self.ct_key.sign(signed, ec.ECDSA(hashes.SHA256()))
        return (struct.pack("!B32sQH", 0, key_id(self.ct_key.public_key()), timestamp, 0)
                + struct.pack("!BBH", 4, 3, len(signature)) + signature)

    def sign(self, statement: bytes, identity: str, issuer: str) -> str:
        """The Sigstore bundle (v0.3 JSON) of a DSSE envelope over ``statement`` (an in-toto statement's JSON),
        signed by a fresh leaf for ``identity``/``issuer`` and entered in this PKI's Rekor log."""
        key, cert = self.leaf(identity, issuer)
        payload_type = "application/vnd.in-toto+json"
        pae = f"DSSEv1 {len(payload_type)} {payload_type} {len(statement)} ".encode() + statement
        signature = key.sign(pae, ec.ECDSA(hashes.SHA256()))
        cert_der = cert.public_bytes(serialization.Encoding.DER)
        cert_pem = cert.public_bytes(serialization.Encoding.PEM)
        envelope = {"payload": _b64(statement), "payloadType": payload_type,
                    "signatures": [{"sig": _b64(signature), "keyid": ""}]}
        body = json.dumps({"apiVersion": "0.0.1", "kind": "dsse", "spec": {
            "envelopeHash": {"algorithm": "sha256", "value": hashlib.sha256(json.dumps(envelope).encode()).hexdigest()},
            "payloadHash": {"algorithm": "sha256", "value": hashlib.sha256(statement).hexdigest()},
            "signatures": [{"signature": _b64(signature), "verifier": _b64(cert_pem)}]}},
            separators=(",", ":")).encode()
        return json.dumps({
            "mediaType": "application/vnd.dev.sigstore.bundle.v0.3+json",
            "verificationMaterial": {"certificate": {"rawBytes": _b64(cert_der)},
                                     "tlogEntries": [self._entry(body)], "timestampVerificationData": {}},
            "dsseEnvelope": envelope,
        })

    def sign_model(self, model: Path, signature: Path, identity: str, issuer: str) -> None:
        """Sign ``model`` as ``model_signing sign sigstore`` does: its hashing config (the signature and the
        ``.git*`` paths ignored), its payload's in-toto statement, then :meth:`sign` in place of Fulcio and Rekor."""
        from google.protobuf import json_format
        from model_signing import hashing
        from model_signing._signing import signing as ms_signing

        ignored = [signature.relative_to(model)] if signature.is_relative_to(model) else []
        manifest = hashing.Config().set_ignored_paths(paths=ignored, ignore_git_paths=True).hash(model)
        statement = json_format.MessageToJson(ms_signing.Payload(manifest).statement.pb).encode()
        signature.write_text(self.sign(statement, identity, issuer))

    def _entry(self, body: bytes) -> dict[str, Any]:
        """A Rekor v1 entry for ``body``: index 0 of a 1-leaf tree (the root is the leaf hash), a checkpoint
        signed as a note by the log key, and the signed entry timestamp over the RFC 8785 entry."""
        log_id = key_id(self.rekor_key.public_key())
        root = hashlib.sha256(b"\x00" + body).digest()
        integrated = int(NOW.timestamp())
        note = f"{ORIGIN}\n1\n{_b64(root)}\n"
        note_sig = self.rekor_key.sign(note.encode(), ec.ECDSA(hashes.SHA256()))
        checkpoint = f"{note}\n\u2014 {LOG_NAME} {_b64(log_id[:4] + note_sig)}\n"
        promise = rfc8785.dumps({"body": _b64(body), "integratedTime": integrated, "logID": log_id.hex(),
                                 "logIndex": 0})
        return {
            "logIndex": "0", "logId": {"keyId": _b64(log_id)},
            "kindVersion": {"kind": "dsse", "version": "0.0.1"}, "integratedTime": str(integrated),
            "inclusionPromise": {"signedEntryTimestamp": _b64(self.rekor_key.sign(promise,
                                                                                  ec.ECDSA(hashes.SHA256())))},
            "inclusionProof": {"logIndex": "0", "rootHash": _b64(root), "treeSize": "1", "hashes": [],
                               "checkpoint": {"envelope": checkpoint}},
            "canonicalizedBody": _b64(body),
        }


def _der_length(n: int) -> bytes:
    if n < 128:
        return bytes([n])
    raw = n.to_bytes((n.bit_length() + 7) // 8, "big")
    return bytes([0x80 | len(raw)]) + raw
