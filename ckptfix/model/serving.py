"""What the serving code's own loader makes of a file (``verify --exact``): the keys it returns, the tied
aliases the model re-ties itself, and the devices it puts the tensors on.

The serving loader is the registry's ``exact_loader``: ``torch.load(PATH, weights_only=True)`` (no
``map_location``: each storage goes back to the device it was saved on) or
``safetensors.torch.load_file(PATH)`` (every tensor on the CPU, only the tensors its header names),
then ``model.load_state_dict(sd, strict=True)``. A tied parameter that the file holds under one key only
fails that strict load (torch reports every missing name, shared parameter or not) unless the model ties it
again itself after loading: a model with ``tie_weights()`` (Hugging Face's, which ``from_pretrained`` calls
after loading the weights; ``save_pretrained`` writes such aliases once).

>>> ckptfix.verify("model.safetensors", "mypkg:build_gpt2", exact=True, serving_device="cpu")   # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..core.devices import available_devices, normalise_device
from ..core.units import few
from ..errors import DeviceError
from ..parse.format_registry import get as format_of
from ..parse.safetensors_header import read_header
from ..safety.subclasses import SERVING_NEEDS
from ..statedict import repair
from .findings import Findings
from .spec import unwrap_model

#: how many key names a failure line shows before "and N more"
SHOWN_KEYS = 3


def plainly_loaded(ckpt: Any) -> Mapping[str, Any]:
    """The state dict as the plain loader returns it: for safetensors, only the header's tensors and no
    ``_metadata`` (ckptfix's tied-weight aliases and module metadata are ckptfix's reader's, not load_file's)."""
    if not format_of(ckpt.format).stores_aliases:
        return ckpt.state_dict

    _, entries, _ = read_header(ckpt.path)
    return {k: v for k, v in ckpt.state_dict.items() if k in entries}


def retie_hook(model: Any) -> str | None:
    """``'GPT2LMHeadModel.tie_weights()'`` when the model ties its tied parameters again after loading, else None."""
    inner = unwrap_model(model)
    return f"{type(inner).__name__}.tie_weights()" if callable(getattr(inner, "tie_weights", None)) else None


@dataclass
class Aliases:
    """Tied model keys the serving loader does not return while their twin is there (model key → twin)."""

    retied: dict[str, str] = field(default_factory=dict)  #: the model ties them again itself: they load
    absent: dict[str, str] = field(default_factory=dict)  #: nothing ties them again: the strict load fails
    stored: list[str] = field(default_factory=list)  #: of ``absent``: in the file as ckptfix's aliases (convert --untie)
    hidden: list[str] = field(default_factory=list)  #: of both: ckptfix's reader restores them, the serving loader doesn't
    hook: str | None = None


def check_aliases(read: Mapping[str, Any], loaded: Mapping[str, Any], to_model: Callable[[str], str],
                  target: repair.Target, hook: str | None, serving_loader: str = "torch") -> Aliases:
    """Which tied keys ``loaded`` (what the serving loader returns) lacks, of those ``read`` (ckptfix's read)
    may hold, with their keys renamed to the model's by ``to_model`` (the repair). Only ``from_pretrained``
    (``serving_loader='transformers'``) calls the model's ``hook``: a plain strict load reports the key missing."""
    have = {to_model(k) for k in loaded}
    in_file = {to_model(k) for k in read}
    out = Aliases(hook=hook)
    reties = hook is not None and serving_loader == "transformers"
    for group in target.tied:
        twin = next((k for k in group if k in have), None)
        for key in group:
            if twin is None or key in have:
                continue
            (out.retied if reties else out.absent)[key] = twin
            if key in in_file:
                out.hidden.append(key)
                if not reties:
                    out.stored.append(key)
    return out


def has_loader(fmt: str) -> bool:
    """Whether a serving loader reads ``fmt`` as saved: a file's ``exact_loader``, or a sharded checkpoint's
    shards one by one (as transformers' ``load_sharded_checkpoint`` does)."""
    spec = format_of(fmt)
    return bool(spec.exact_loader or spec.index_name)


def loader_hint(obs: Any, aliases: Aliases) -> str:
    """What the server would need where the observed load failed: the loader that re-ties a tied key, the global
    the weights-only unpickler refused allowed."""
    error = obs.error or ""
    if aliases.absent and aliases.hook is not None and obs.stage == "strict":
        return (f" ({aliases.hook} ties {', '.join(aliases.absent)} again only in from_pretrained: if the server calls "
                "it, verify with --serving-loader transformers; else write every tied name, e.g. convert --untie)")
    if ("Weights only load failed" in error or "weights_only" in error) and "torchao." in error:
        return f" (a torchao tensor class: {SERVING_NEEDS})"
    if "Weights only load failed" in error or "weights_only" in error:
        return (" (the weights-only unpickler refuses it: the server would need torch.serialization.add_safe_globals "
                "for what it names, or a file without it: ckptfix convert writes one)")
    return ""


def as_served(report: Any, aliases: Aliases) -> Findings:
    """The report as the serving loader sees the keys: a tied key it lacks is missing unless the model ties it
    again itself (then tolerated, with a note); ``matched`` counts only the keys it returns."""
    tolerated = [t for t in report.tolerated if t["key"] not in aliases.absent and t["key"] not in aliases.retied]
    tolerated += [{"key": k, "kind": "tied", "reason": f"tied to {twin}, which is present; the model ties it "
                                                      "again after loading"} for k, twin in aliases.retied.items()]
    found = Findings(fields={"missing": report.missing + [k for k in aliases.absent if k not in report.missing],
                             "matched": report.matched - len(aliases.hidden), "tolerated": tolerated})
    if aliases.retied:
        twins = ", ".join(dict.fromkeys(aliases.retied.values()))
        found.notes.append(f"{', '.join(aliases.retied)}: not among the keys {loader(report.format)} returns; "
                           f"{aliases.hook} ties it to {twins} after "
                           "loading (from_pretrained calls it): serve with from_pretrained, or call it after "
                           "load_state_dict(…, strict=False); a plain strict load_state_dict reports the key missing")
    return found


def loader(fmt: str) -> str:
    """How the serving code loads ``fmt``: the registry's ``exact_loader`` (torch.load for a file without one)."""
    return format_of(fmt).exact_loader or "torch.load(weights_only=True)"


def alias_reason(key: str, a: Aliases, fmt: str) -> str:
    """Why the serving loader lacks ``key``, and what writes a file that has it."""
    twin = a.absent[key]
    if key in a.stored:
        return (f"{key} is tied to {twin}; the file stores it once, as ckptfix's alias, which "
                f"{format_of(fmt).exact_loader} does not return (convert --untie stores it under its own key)")
    if a.hook is not None:
        return (f"{key} is tied to {twin} and the file holds only {twin} (as save_pretrained writes it); {a.hook} "
                "ties it again, but a plain strict load_state_dict does not call it: serve with from_pretrained "
                "(verify it with --serving-loader transformers), or save every tied name (the model's state dict as "
                "it is; convert --untie for a file ckptfix wrote)")
    return (f"{key} is tied to {twin} and the file holds only {twin} (the alias dropped, as safetensors' save_model "
            "does) and the model does not tie it again after loading (no tie_weights()): serve it with "
            "safetensors.torch.load_model(model, PATH), which skips tied names, or save the model's state dict as it is")


def named(what: str, keys: list[str]) -> str:
    """``'2 missing: fc.weight, fc.bias'``: a count and the first keys (:func:`shown`)."""
    return f"{len(keys)} {what}: {shown(keys)}"


def shown(keys: list[str]) -> str:
    """``'a, b, c and 4 more'``: the first :data:`SHOWN_KEYS` keys."""
    return few(keys, SHOWN_KEYS)


def device_of(tag: str) -> str | None:
    """The device a location tag (or ``--serving-device``) names, as torch restores it; None for none."""
    try:
        dev = normalise_device(tag)
    except DeviceError:
        return None
    return "cuda:0" if dev == "cuda" else dev  # torch restores a bare "cuda" tag onto the current device


def device_failures(devices: Mapping[str, int], serving_device: str | None, loader: str) -> list[str]:
    """Why the serving loader can't put the tensors where they were saved: a device the serving machine lacks
    (``serving_device``; without one, this machine), or one other than the serving device."""
    out = []
    serving = None if serving_device is None else device_of(serving_device)
    if serving_device is not None and serving in (None, "meta"):
        raise DeviceError(f"serving device {serving_device!r} (--serving-device) is not a device the serving code "
                          "loads on: use cpu, cuda or cuda:N")
    here = available_devices()
    for tag, n in devices.items():
        dev = device_of(tag)
        if dev in ("cpu", "meta") or dev == serving or (serving is None and dev in here):
            continue
        if serving is None:
            why = (f"which this machine lacks (available: {', '.join(d for d in here if d != 'meta')}): it raises "
                   "'Attempting to deserialize object on a CUDA device …' here; name the serving machine's device with "
                   "--serving-device, or write a copy that loads anywhere")
        else:
            why = (f"not on the serving device {serving} (--serving-device {serving_device}): "
                   + ("it raises 'Attempting to deserialize object on a CUDA device …' there"
                      if serving == "cpu" else "they take another device's memory there, or it raises where that "
                                               "device is absent")
                   + "; write a copy that loads anywhere")
        out.append(f"exact: {loader} puts {n} tensor(s) on {tag} (as saved), {why} "
                   "(convert --map-location cpu: the fix command)")
    return out
