"""Verify's options, declared once, as :class:`ckptfix.ops.convert_options.ConvertOptions` declares convert's.

Each field of :class:`VerifyOptions` is one keyword of :func:`ckptfix.verify` after ``path`` and ``model`` (name,
type, default, and its place: the keywords keep the order they have always had, so a positional call still
works) and carries its command-line :class:`Flag`; ``ckptfix.cli.options`` builds ``ckptfix verify``'s click
options from these fields, in :data:`HELP_ORDER`. What the options must be, alone or together, is :data:`RULES`,
checked when the options are made, before anything is read: the library raises the rule's error, the command line
stops with its usage line (exit 2).

Plain data: it imports only the option declarations and the error types, so ``ckptfix --help`` reads it without
the library.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import Field, dataclass, field, fields
from typing import Any

from ..errors import CkptfixError, DeviceError, GoldenError, InputError, ModelSpecError, SigningError
from ..ops.convert_options import DTYPES, JSON, ConvertOptions, Flag, flag_of, option

#: Seed of the input used for forward checks (the fixtures' own: fixtures/train.py INPUT_SEED).
INPUT_SEED = 1234

_CONVERT = {f.name: f for f in fields(ConvertOptions)}
_TOLERANCE = ("bit-exact against --reference (with --dtype fp16/bf16: that dtype's default); against --golden, the "
              "recorded-value default for the output dtype (float32: atol 1e-6, rtol 1e-5); against --original, the "
              "scheme's step bound")


def own_flag(decls: tuple[str, ...], **kwargs: Any) -> Flag:
    """A flag of verify's own; one that takes a value takes it even where it begins with ``-`` (``--input-range -1,1``)."""
    return Flag(decls, dash_value=not kwargs.get("is_flag", False), **kwargs)


def keyword(default: Any) -> Any:
    """A field without a flag: a library keyword only (the command passes the library's default)."""
    return field(default=default)


@dataclass(frozen=True)
class VerifyOptions:
    """Everything :func:`ckptfix.verify` takes after ``path`` and ``model``, in its signature's order."""

    reference: Any = option(None, own_flag(("--reference",), metavar="REF", kind="path", help=(
        "Compare forward outputs with this checkpoint's (e.g. the original before a conversion).")))
    exact: bool = option(False, own_flag(("--exact",), is_flag=True, help=(
        "Pass only if the serving loader (torch.load(weights_only=True), or safetensors.torch.load_file for "
        "safetensors) + load_state_dict(strict=True) takes the file as saved, dtypes included.")))
    forward: bool = option(True, own_flag(("--no-forward",), is_flag=True, dest="no_forward", negate=True, help=(
        "No model load or forward: keys, shapes, dtypes and NaN/Inf, the values read at read speed.")))
    atol: float | None = option(None, own_flag(("--atol",), metavar="X", kind="tolerance",
                                           help=f"Absolute tolerance ({_TOLERANCE})."))
    rtol: float | None = option(None, own_flag(("--rtol",), metavar="X", kind="tolerance",
                                           help=f"Relative tolerance ({_TOLERANCE})."))
    input_shape: tuple[int, ...] | None = option(None, own_flag(("--input-shape",), metavar="SHAPE", kind="shape", help=(
        "Forward input shape, e.g. 1,3,224,224 (default: inferred).")))
    model_args: dict[str, Any] | None = option(None, own_flag(("--arg",), multiple=True, metavar="NAME=VALUE", kind="model-args",
                                                          help="Keyword for the model builder (a Python literal, else a "
                                                               "string); repeatable."))
    map_location: Any = option("cpu", flag_of(_CONVERT["map_location"]))
    select: str = option("auto", flag_of(_CONVERT["select"]))
    trust: bool = option(False, flag_of(_CONVERT["trust"]))
    seed: int = keyword(INPUT_SEED)
    #: the file's SHA-256 in the report; the command line hashes with --json only (text without the forward: no hash)
    checksum: bool = option(True, JSON)
    dtype: Any = option(None, own_flag(("--dtype",), choices=DTYPES, help=(
        "Serving dtype: the model is built, then cast to it; the forward (and --reference) run in it.")))
    input_dtype: str | None = option(None, own_flag(("--input-dtype",), choices=("float", "long", "int"), help=(
        "float (randn, in the model's dtype; default), or long/int token IDs (default: long when the first layer "
        "is an Embedding).")))
    input_range: tuple[float, float] | None = option(None, own_flag(("--input-range",), metavar="LOW,HIGH", kind="range", help=(
        "Token IDs from LOW to HIGH-1, e.g. 0,30522 (default for long: 0,the Embedding's size); floats: uniform in "
        "[LOW, HIGH).")))
    inputs: Any = option(None, own_flag(("--input",), dest="input_file", metavar="FILE", kind="file", help=(
        "The input itself: a tensor, or a dict of tensors passed as model(**dict) (.pt or .safetensors).")))
    golden: Any = option(None, own_flag(("--golden",), metavar="FILE.safetensors", kind="file", help=(
        "Compare outputs with the ones this file records; if it does not exist, record them in it.")))
    record_golden: bool = option(False, own_flag(("--record-golden",), is_flag=True,
                                             help="Write --golden again from this run, even if it exists."))
    serving_device: str | None = option(None, own_flag(("--serving-device",), metavar="DEV", help=(
        "With --exact: the device the serving code loads on (cpu, cuda, cuda:N); fail when the file's saved "
        "devices differ (default: those of this machine).")))
    #: on stderr: a progress line on a terminal, else one line per phase as it ends (the command: unless --quiet)
    progress: bool = option(False, own_flag(("--quiet",), is_flag=True, dest="quiet", negate=True, help=(
        "Nothing on stderr but errors: no progress line on a terminal, no line per phase (read, build, hash, "
        "values, quantized, original, crc, load, forward) elsewhere.")))
    structure_only: bool = option(False, own_flag(("--structure-only",), is_flag=True, help=(
        "Keys, shapes and dtypes only: reads on meta, no tensor data (no NaN/Inf check, no forward).")))
    serving_loader: str = option("torch", own_flag(("--serving-loader",), choices=("torch", "transformers"), help=(
        "With --exact: the loader the server calls: torch (torch.load/load_file + load_state_dict(strict=True); "
        "default) or transformers (type(model).from_pretrained, which ties the model's tied weights itself).")))
    signature: Any = option(None, own_flag(("--signature",), metavar="SIG", kind="file", help=(
        "Check PATH against this OpenSSF model signature (made by ckptfix or model_signing), offline: fail naming "
        "each changed, missing or extra file, a wrong key, a renamed file (needs ckptfix[sign]).")))
    public_key: Any = option(None, own_flag(("--public-key",), metavar="PUB.pem", kind="file", help=(
        "With --signature: the signer's EC public key (model_signing's key method).")))
    certificate_chain: tuple[Any, ...] = option((), own_flag(("--certificate-chain",), multiple=True, metavar="CHAIN.pem",
                                                             kind="file", help=(
        "With --signature: a certificate-signed signature, checked up to these certificates (repeatable; "
        "model_signing's certificate method).")))
    original: Any = option(None, own_flag(("--original",), metavar="ORIGINAL", kind="path", help=(
        "The unquantized weights: each quantized weight, dequantized, is compared with the original's (max, mean "
        "and relative error); round-to-nearest schemes fail beyond their step bound (others: with --atol/--rtol).")))
    sigstore_identity: str | None = option(None, own_flag(("--sigstore-identity",), metavar="ID", help=(
        "With --signature: a Sigstore-signed signature (model_signing sign sigstore), checked as signed by this "
        "identity (the certificate's email or URI; model_signing's --identity); with --sigstore-issuer and "
        "--trust-config.")))
    sigstore_issuer: str | None = option(None, own_flag(("--sigstore-issuer",), metavar="URL", help=(
        "With --sigstore-identity: the OIDC issuer that vouched for it (model_signing's --identity_provider).")))
    trust_config: Any = option(None, own_flag(("--trust-config",), metavar="TRUST.json", kind="file", help=(
        "With --sigstore-identity: the Sigstore client trust config to check against (model_signing's "
        "--trust_config); offline, nothing is fetched.")))

    def __post_init__(self) -> None:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        rule = broken_rule(values)
        if rule is not None:
            raise rule.error(rule.message.format(**values))


#: the fields' flags in ``ckptfix verify --help`` (after ``--model``); a flag not named here follows them
HELP_ORDER = ("model_args", "exact", "serving_device", "serving_loader", "reference", "original", "input_shape", "input_dtype",
              "input_range", "inputs", "golden", "record_golden", "dtype", "atol", "rtol", "forward", "structure_only",
              "signature", "public_key", "certificate_chain", "sigstore_identity", "sigstore_issuer",
              "trust_config", "map_location", "select", "trust", "checksum", "progress")


def flagged() -> Iterator[Field]:
    """The fields the command line has a flag for, in :data:`HELP_ORDER`."""
    by_name = {f.name: f for f in fields(VerifyOptions) if "flag" in f.metadata}
    yield from (by_name.pop(name) for name in HELP_ORDER)
    yield from by_name.values()


@dataclass(frozen=True)
class Rule:
    """What an option must be, alone or with another: where ``broken(values)`` holds, the library raises ``error``
    with ``message`` and the command line stops with ``usage`` (exit 2), each ``str.format``-ed with the options."""

    broken: Callable[[Mapping[str, Any]], bool]
    error: type[CkptfixError]
    message: str
    usage: str

#: the options that describe a generated input (which ``inputs`` replaces)
_RECIPE = ("input_shape", "input_dtype", "input_range")

#: the options that name a Sigstore signer, all three or none (model_signing verify sigstore's)
SIGSTORE = ("sigstore_identity", "sigstore_issuer", "trust_config")
_SIGSTORE_FLAGS = "--sigstore-identity, --sigstore-issuer and --trust-config"


def _sigstore_given(o: Mapping[str, Any]) -> int:
    """How many of :data:`SIGSTORE` are given."""
    return sum(o[k] is not None for k in SIGSTORE)


RULES = (
    Rule(lambda o: bool(o["record_golden"]) and o["golden"] is None, GoldenError,
         "record_golden needs golden=PATH (--golden PATH): where to write the outputs",
         "--record-golden needs --golden FILE"),
    Rule(lambda o: o["serving_device"] is not None and not o["exact"], DeviceError,
         "serving_device={serving_device!r} (--serving-device) is what --exact's plain load is checked against: "
         "pass exact=True (--exact) too",
         "--serving-device goes with --exact (the plain load it checks)"),
    Rule(lambda o: o["serving_loader"] != "torch" and not o["exact"], ModelSpecError,
         "serving_loader={serving_loader!r} (--serving-loader) names the loader --exact observes: pass exact=True "
         "(--exact) too",
         "--serving-loader goes with --exact (the load it observes)"),
    Rule(lambda o: 0 < _sigstore_given(o) < len(SIGSTORE), SigningError,
         f"sigstore_identity, sigstore_issuer and trust_config name a Sigstore signer together ({_SIGSTORE_FLAGS})",
         f"{_SIGSTORE_FLAGS} go together"),
    Rule(lambda o: bool(_sigstore_given(o)) and (o["public_key"] is not None or bool(o["certificate_chain"])),
         SigningError, "a Sigstore signer (sigstore_identity) excludes public_key and certificate_chain: one signing "
         "method at a time", f"{_SIGSTORE_FLAGS} exclude --public-key and --certificate-chain"),
    Rule(lambda o: o["signature"] is not None and not _sigstore_given(o)
         and (o["public_key"] is None) == (not o["certificate_chain"]),
         SigningError, "signature={signature!r} is checked with one of public_key=PUB (--public-key), "
         "certificate_chain=[CHAIN] (--certificate-chain) or a Sigstore signer (sigstore_identity, sigstore_issuer, "
         "trust_config)",
         f"--signature needs one of --public-key PUB or --certificate-chain CHAIN (or {_SIGSTORE_FLAGS})"),
    Rule(lambda o: o["signature"] is None and bool(_sigstore_given(o)), SigningError,
         "sigstore_identity, sigstore_issuer and trust_config check a signature: pass signature=SIG (--signature) "
         "too", f"{_SIGSTORE_FLAGS} go with --signature SIG"),
    Rule(lambda o: o["signature"] is None and (o["public_key"] is not None or bool(o["certificate_chain"])),
         SigningError, "public_key and certificate_chain check a signature: pass signature=SIG (--signature) too",
         "--public-key and --certificate-chain go with --signature SIG"),
    Rule(lambda o: o["serving_device"] is not None and not _serving_device(o["serving_device"]), DeviceError,
         "serving device {serving_device!r} (--serving-device) is not a device the serving code loads on: use cpu, "
         "cuda or cuda:N",
         "--serving-device {serving_device!r} is not a device the serving code loads on: use cpu, cuda or cuda:N"),
    Rule(lambda o: o["inputs"] is not None and any(o[k] is not None for k in _RECIPE), InputError,
         "--input gives the tensors themselves; drop --input-shape, --input-dtype and --input-range",
         "--input gives the tensors themselves; drop --input-shape, --input-dtype and --input-range"),
)


def _serving_device(tag: Any) -> bool:
    """Whether ``tag`` names a device the serving code loads on (not meta, not a map_location rule)."""
    from ..core.devices import normalise_device  # (plain data at import: see tests/test_layers.py DEFERRED)

    try:
        return normalise_device(tag) != "meta"
    except DeviceError:
        return False


def broken_rule(values: Mapping[str, Any]) -> Rule | None:
    """The first of :data:`RULES` that ``values`` (option name → value) break, or None."""
    return next((rule for rule in RULES if rule.broken(values)), None)


#: the options that mean something only with a model: the serving loader's load, the forward check and its input,
#: the model's dtype. Without a model (``verify PATH``, the model-free gate) each is refused.
NEEDS_MODEL = ("exact", "reference", "golden", "record_golden", "inputs", "input_shape", "input_dtype", "input_range",
               "dtype", "model_args")


def option_needing_model(values: Mapping[str, Any]) -> Field | None:
    """The first of :data:`NEEDS_MODEL` given in ``values`` (set, not its default), or None: without a model, the
    library raises ``ModelSpecError`` and the command line stops with ``--FLAG needs --model`` (exit 2)."""
    by_name = {f.name: f for f in fields(VerifyOptions)}
    return next((by_name[n] for n in NEEDS_MODEL if _given(values.get(n), by_name[n].default)), None)


def _given(value: Any, default: Any) -> bool:
    """``value`` is set: not None, not the default, not an empty ``--arg``/``--input-shape`` (a tensor ``inputs`` is
    never compared, only checked for None)."""
    if value is None or value is default:
        return False
    return bool(value) and value != default if isinstance(value, (bool, tuple, list, dict)) else True


def without_model_error(fld: Field, value: Any) -> ModelSpecError:
    """The library's error for ``fld`` given without a model."""
    flag = flag_of(fld).decls[0]
    return ModelSpecError(f"{fld.name}={value!r} ({flag}) needs a model: pass model= (--model SPEC), or leave it "
                          "out for the model-free gate")
