"""Verify a checkpoint against a model: keys, shapes, dtypes, values, tied weights, forward outputs.

The keys are first adapted to the model with the repair ckptfix knows (:mod:`ckptfix.statedict.repair`).
Without ``exact`` the checkpoint passes when the repaired state dict loads strictly (dtypes are
cast, so they are warnings); with ``exact`` it must load as saved through the serving code's own
loader — plain ``torch.load(weights_only=True)`` for a torch file, ``safetensors.torch.load_file``
for a safetensors file — and ``load_state_dict(strict=True)``, every dtype the model's (in the
serving ``dtype`` when one is given). Forward outputs are compared with a ``reference`` checkpoint's
and with ``golden`` outputs (:mod:`ckptfix.model.golden`).

>>> ckptfix.verify("run.pth", "torchvision:resnet18", reference="orig.pth").ok   # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from ..core import locations
from ..ops.convert_options import takes
from . import checks, gate as gates
from .findings import VerifyReport, add
from .verify_options import VerifyOptions, option_needing_model, without_model_error


@takes(VerifyOptions)
def verify(path: Any, model: Any = None, *args: Any, **kwargs: Any) -> VerifyReport:
    """Check checkpoint ``path`` against ``model`` (an nn.Module, a spec such as
    ``'torchvision:resnet18'`` with ``model_args``, or a factory); without one (None), the model-free gate: the
    checks that need no model (:func:`ckptfix.model.gate.model_free`: the file's hash, CRC-32s, NaN/Inf, ``_metadata``,
    every quantized group intact and finite after dequantization, and with ``original`` each dequantized weight
    against the unquantized one). ``exact``, ``reference``, ``golden``, the input and ``dtype`` need a model.

    ``forward=False`` loads and runs no model: keys, shapes, dtypes, and NaN/Inf on the values as read; with
    ``checksum=False`` too, nothing is hashed (``sha256`` is then None). ``structure_only=True`` reads on ``meta``:
    keys, shapes and dtypes only, no value checked (``nonfinite`` is None). A torch zip's CRC-32s are checked
    either way. ``path`` may be a ``save_pretrained`` directory (one ``model.safetensors`` or
    ``pytorch_model.bin``): its file is verified.

    ``dtype`` (``"fp16"``, ``"bf16"``, ``"fp32"`` or a torch dtype): the serving dtype. The model is
    built, then ``.to(dtype)``: its dtypes are the ones ``exact`` demands, and the forward runs in it
    (a ``reference`` too, its weights cast to it).

    The input is ``inputs`` (a file path, a tensor, or a dict of tensors → ``model(**dict)``), else a
    recipe seeded with ``seed``: ``input_shape``, ``input_dtype`` (``"float"``, ``"long"``, ``"int"``)
    and ``input_range`` (``(0, 30522)``), inferred where unambiguous
    (:func:`ckptfix.model.inputs.resolve_input`).

    ``golden`` (a ``.safetensors`` path): when it exists, the outputs are compared with the ones it
    records, on the input it records; when it doesn't (or ``record_golden``), this run's outputs are
    written to it — only if everything else passed (``report.golden`` says which).

    ``atol``/``rtol`` (None or 0: not given): with none given, the output is compared bit for bit with
    ``reference``'s (both computed in this run) — within the default of the serving dtype
    (:data:`ckptfix.model.forward.RECORDED_TOLERANCE`) when ``dtype`` is half precision — and within the
    recorded-value default for its dtype with ``golden``'s (recorded elsewhere); given, they apply to
    every comparison. Each ``forward['against']`` row says the atol/rtol it used and why.

    ``exact`` also takes the devices as saved (``report.devices``: where the plain loader puts the tensors,
    no map_location): each must be ``serving_device`` (``"cpu"``, ``"cuda"``, ``"cuda:N"``; the CPU always
    does) or, without one, exist on this machine. Tied keys the file holds once pass only where the
    model ties them again after loading (:mod:`ckptfix.model.serving`). ``progress``: on stderr, a progress
    line on a terminal while the file is hashed and the values checked; elsewhere (a CI log) one line per phase as
    it ends (``ckptfix verify: read (1.2 s)``: read, build, hash, values, quantized, original, crc, observe, load, forward).
    """
    options = VerifyOptions(*args, **kwargs)  # the options checked first
    modelled = None if model is not None else option_needing_model({f.name: getattr(options, f.name) for f in fields(options)})
    if modelled is not None:
        raise without_model_error(modelled, getattr(options, modelled.name))
    with locations.holding():  # the file's read leases held until the last check has read it (no SIGBUS)
        gate = gates.open_gate(path, model, options)
        try:
            report = gates.first_report(gate)
            for check in checks.CHECKS:
                if model is not None or not gates.needs_model(check):
                    add(report, check(gate, report))
        finally:
            if isinstance(gate, gates.Gate):
                gate.close()
    report.ok = not report.failures
    return report
