"""Sigstore-signed model signatures (``model_signing sign sigstore``), verified offline against a given trust root.

model-signing's own Sigstore verifier (sigstore-python underneath) checks the bundle: the signing certificate
chains to the trust config's CA at the log entry's time, its embedded SCT is signed by one of its CT logs, it names
the expected identity and OIDC issuer, the transparency-log entry's inclusion proof, checkpoint and promise are
signed by one of its Rekor logs, and the DSSE envelope is signed by the certificate's key. With a trust config
given, nothing is fetched: no TUF refresh, no Rekor lookup (the entry travels in the bundle).
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

from ..core.units import shown
from ..errors import SigningError

#: model-signing's Sigstore signature and verifier module (it imports sigstore, which the key methods don't need)
MODULE = "model_signing._signing.sign_sigstore"
#: the media type of a trust config model-signing takes (``--trust_config``)
TRUST_CONFIG = "application/vnd.dev.sigstore.clienttrustconfig.v0.1+json"


def signer(identity: str, issuer: str, trust_config: str) -> dict[str, Any]:
    """The signer as the report names it: the identity, its OIDC issuer, and the trust root checked against."""
    return {"method": "sigstore", "identity": identity, "issuer": issuer, "trust_config": trust_config}


def verifier(module: Any, identity: str, issuer: str, trust_config: str) -> Any:
    """model-signing's Sigstore verifier for ``identity`` from ``issuer``, trusting only ``trust_config`` (a
    ClientTrustConfig JSON, as ``model_signing verify sigstore --trust_config`` takes): read here first, so that a
    file that isn't one is refused in one line and never falls back to the network's root."""
    try:
        raw = pathlib.Path(trust_config).read_bytes()
    except OSError as e:
        raise SigningError(f"{shown(trust_config)}: can't read the trust config: {e.strerror or e}") from None
    try:
        media_type = json.loads(raw).get("mediaType")
    except (ValueError, AttributeError):  # not JSON (UnicodeDecodeError is a ValueError), or not an object
        media_type = None
    if media_type != TRUST_CONFIG:
        raise SigningError(f"{shown(trust_config)}: not a Sigstore client trust config ({TRUST_CONFIG}, what "
                           "model_signing's --trust_config takes)")
    try:
        return module.Verifier(identity=identity, oidc_issuer=issuer, trust_config=pathlib.Path(trust_config))
    except Exception as e:  # pydantic's validation errors, sigstore's own: the parser's exception types vary
        raise SigningError(f"{shown(trust_config)}: not a usable Sigstore trust config ({shown(str(e), 200)})") from None


#: what a sigstore-python 4.5.1 verification error says (a piece of its message), and what it means, in the order
#: its verifier checks (sigstore/verify/verifier.py)
REASONS = (
    ("certificate chain", "its certificate is not from the trust config's CA (another trust root)"),
    ("SCT", "its certificate's timestamp is not signed by the trust config's CT logs (another trust root)"),
    ("SANs do not match", "signed by another identity"),
    ("OIDCIssuer does not match", "the identity comes from another OIDC issuer"),
    ("log entry", "its transparency-log entry is not signed by the trust config's Rekor logs (another trust root), "
                  "or does not match the signature"),
    ("DSSE", "the signed statement was altered"),
)


def failure(signature: str, identity: str, issuer: str, reason: str) -> str:
    """The finding for a bundle that doesn't verify: who it was expected from, why it fails (:data:`REASONS`),
    and sigstore's own words."""
    why = next((meaning for piece, meaning in REASONS if piece in reason),
               "another signer, another trust root, or the signature was altered")
    return (f"signature: {shown(signature)} does not verify as {identity} from {issuer} under the given trust "
            f"config: {why} ({shown(reason, 300)})")
