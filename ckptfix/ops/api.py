"""The library's verbs: read, load, inspect, convert, load_into.

Data flows one way: path → sniff → read (safe, mapped) → select the state dict → rename keys
(wrappers, prefixes; ``_metadata`` in step) → write atomically, or load into a model.
"""

from __future__ import annotations

import os
import time
import warnings
from typing import Any

from .convert import steps as conversion
from .load_into import loading
from .load_into.loading import LoadOptions
from .. import formats
from ..statedict import metadata, transforms
from ..core import locations, torch_free
from ..core.limits import collector_paused
from ..errors import NeedsLocalCopy
from ..core.torch_free import NeedsTorch
from . import quantized
from .convert_options import ConvertOptions, takes
from .reading import read_checkpoint, summarise
from ..reports import Checkpoint, ConvertReport, LoadReport
from ..safety import digests


def read(path: Any, map_location: Any = "cpu", trust: bool = False, select: str = "auto",
         allow: tuple[str, ...] | list[str] = ()) -> Checkpoint:
    """The whole checkpoint: state dict (as saved, wrappers and all), the rest, and its summary.

    A DeepSpeed ZeRO checkpoint (its directory, a tag directory, or a model_states file with its
    optim_states beside it) gives the fp32 master weights, consolidated as zero_to_fp32.py does;
    ``select='module'`` the training-dtype copy. A file that can't give them raises DeepSpeedZeroError.

    >>> ckpt = ckptfix.read("ddp.pth")   # doctest: +SKIP
    >>> ckpt.wrappers, ckpt.devices      # (['module'], {'cuda:0': 62})

    Globals outside the allow-list beside the state dict (a project's config object) come back as inert
    placeholders (:mod:`ckptfix.parse.inert`), never imported; inside it they are refused unless ``allow``
    names them (``allow=('myproj.config.RunConfig',)``). OmegaConf configs come back as plain dicts and lists.

    ``path`` may be a URL (``https://``, ``s3://bucket/key``, ``hf://org/repo[@revision]/path``): its structure read
    from its headers, each storage's bytes fetched once into memory (no temp file, no ``torch.load`` of the file),
    the tensors those of ``torch.load(weights_only=True)`` of the same file; ``bytes_fetched`` says how many bytes
    came over the network. A file only ``torch.load`` reads whole (legacy, DeepSpeed) or ``trust=True`` raises
    RemoteError.
    """
    return read_checkpoint(os.fspath(path), map_location, trust, select, refuse=True, allow=allow, whole=True)


def inspect(path: Any, trust: bool = False, select: str = "auto", allow: tuple[str, ...] | list[str] = ()) -> Checkpoint:
    """Summary of a checkpoint without reading tensor data (tensors come back on ``meta``), with the digests and
    lineage a ckptfix output records (``provenance``)."""
    with locations.session() as s:  # (a URL's digests and lineage: from the blocks its read fetched, counted)
        ckpt = _with_provenance(read_checkpoint(os.fspath(path), "meta", trust, select, refuse=False, allow=allow,
                                                whole=True))
        if s.remote:
            ckpt.bytes_fetched = s.bytes_fetched
    return ckpt


def _with_provenance(ckpt: Checkpoint) -> Checkpoint:
    """``ckpt`` with what its file records of digests and lineage (a URL's: from the header or the zip's records,
    by Range requests)."""
    ckpt.provenance = digests.provenance(ckpt.path, ckpt.format)
    return ckpt


def describe(path: Any, select: str = "auto", allow: tuple[str, ...] | list[str] = ()) -> Checkpoint:
    """``inspect`` without importing torch where the file allows it: tensors come back as
    :class:`~ckptfix.core.tensorinfo.TensorInfo` (plain data: dtype, shape, stride, byte range); a file only
    torch can describe exactly (legacy, TorchScript, DeepSpeed, DCP values other than plain data and
    tensors, tensor subclasses …) goes through ``inspect``, so the summary, and any refusal, is the same
    either way.

    A remote ``path`` (``https://``, ``s3://bucket/key``, ``hf://org/repo[@revision]/path``) is described from the
    byte ranges its headers take (``bytes_fetched`` says how many); one only torch can describe raises NeedsLocalCopy.
    """
    path = os.fspath(path)
    remote = locations.is_remote(path)
    with locations.session() as s, s.reporting(), collector_paused():
        path, fmt = formats.resolve(path)
        if torch_free.enabled() or remote:
            try:
                raw = formats.describe(path, fmt, select)
            except NeedsTorch as e:
                if remote:
                    raise NeedsLocalCopy(path, f"describing this {fmt} checkpoint", f"torch describes it: {e}") from None
            else:
                ckpt = _with_provenance(summarise(path, fmt, raw, select, refuse=False, allow=allow, whole=True))
                if remote:
                    ckpt.bytes_fetched = s.bytes_fetched
                return ckpt
    return inspect(path, select=select, allow=allow)


def load(
    path: Any,
    map_location: Any = "cpu",
    to: str = "single",
    select: str = "auto",
    trust: bool = False,
    strip_prefix: str | None = None,
    add_prefix: str | None = None,
    rename: tuple[str, ...] | list[str] = (),
    dtype: str | None = None,
    allow_overflow: bool = False,
    allow: tuple[str, ...] | list[str] = (),
    dequantize: bool = False,
    cast_unknown_quantized: bool = False,
    check_digests: bool | None = LoadOptions.check_digests,
) -> Any:
    """The model's state dict with wrapper segments normalised to ``to`` (default: none).

    ``rename`` takes ``'REGEX=REPLACEMENT'`` rules (full match, in order); ``dtype`` casts
    floating-point tensors (fp32/fp16/bf16), never integer or bool buffers, nor a quantized group's weight and
    scales (kept as stored; float8 or packed tensors beside scales of no known scheme are refused unless
    ``cast_unknown_quantized``). ``dequantize`` gives each quantized group (block FP8, NVFP4, MXFP4, GPTQ …, as
    ``ckptfix inspect`` names them) as one plain ``MODULE.weight`` in ``dtype`` (default: the ``torch_dtype`` of the
    ``config.json`` beside the file if bfloat16 or float16, else float32), its scales dropped: what
    ``convert --dequantize`` writes. A file that records per-tensor
    digests (ckptfix's outputs, docs/digests.md) is checked against them with ``check_digests=True`` (one CRC-32 pass
    over its bytes first; a URL's by default, on the bytes its read fetched), a mismatch a FormatError naming the
    tensor; ``check_digests=False`` skips it.

    ``path`` may be a URL, read as :func:`read` reads one. Its ``_metadata`` comes back as torch's loaders take it
    (:mod:`ckptfix.statedict.metadata`): whatever else it held is dropped with a UserWarning naming each part.

    >>> model.load_state_dict(ckptfix.load("ddp_compiled.pth"))   # doctest: +SKIP
    """
    with locations.session():  # (a URL's digests: checked on the storages its read fetched)
        ckpt = read(path, map_location=map_location, trust=trust, select=select, allow=allow)
        ckpt.require_state_dict()
        # (a file ckptfix wrote: each tensor's bytes against its recorded digest; by default only where the read
        # fetched them anyway, a URL's: a local file's would be a pass of its own)
        if check_digests or (check_digests is None and locations.is_remote(ckpt.path)):
            digests.check(ckpt.path, ckpt.format)
    if ckpt.metadata_dropped:
        warnings.warn(f"{ckpt.path}: " + "; ".join(map(metadata.note, ckpt.metadata_dropped)), UserWarning, stacklevel=2)
    sd, _notes = conversion.normalise_keys(ckpt, to, strip_prefix, add_prefix, rename)
    applied = quantized.apply(sd, ckpt.path, quantized.read_configs(ckpt.path), dtype, dequantize,
                              cast_unknown_quantized, f"dtype={dtype!r}")
    sd = applied.state_dict
    if dtype is not None:
        sd, _report = transforms.cast_floating(sd, dtype, allow_overflow, keep=applied.keep)
    return sd


@takes(ConvertOptions)
def convert(src: Any, dst: Any, **options: Any) -> ConvertReport:
    """Read ``src``, normalise its keys and write ``dst`` atomically (format by extension or ``format``).

    From a torch zip or safetensors file to CPU (the default), tensor bytes are never loaded:
    the structure is read (without importing torch where no tensor needs computing) and each
    tensor's bytes are copied from ``src`` into ``dst`` in the kernel, so time and memory stay
    close to ``cp``'s. ``progress`` draws a progress line on stderr when it is a terminal.

    ``rename`` (``'REGEX=REPLACEMENT'`` rules), ``by_order`` (an ``nn.Module`` whose key names are
    given to the checkpoint's tensors by position) and ``dtype`` (fp32/fp16/bf16, floating-point
    tensors only) transform the state dict; ``hash`` appends the first 8 hex digits of the output's
    SHA-256 to its name (torch.hub's convention); ``checksums`` reports both files' SHA-256.

    ``max_shard_size`` (bytes, or ``"5GB"``) writes a Hugging Face sharded directory at ``dst``;
    ``format="dcp"`` a torch.distributed.checkpoint directory. Into an existing directory (``force``)
    only the output's own files are replaced; the report's notes list what was kept and removed.

    ``src`` may be a URL (``https://``, ``s3://``, ``hf://``) of a torch zip, safetensors file or sharded
    checkpoint: its tensor bytes are fetched range by range straight into the output, each zip record's CRC-32
    checked as they arrive (``bytes_fetched`` says how many); a request that needs torch raises RemoteError.
    """
    start = time.perf_counter()
    with locations.session() as s, s.reporting():
        req = conversion.validate(os.fspath(src), os.fspath(dst), ConvertOptions(**options))
        report = conversion.run(req, start)
    if s.remote:
        report.bytes_fetched = s.bytes_fetched
    return report


@takes(LoadOptions)
def load_into(model: Any, path: Any, *args: Any, **options: Any) -> LoadReport:
    """Load a checkpoint into ``model`` whatever the wrapping of either (plain, DP/DDP, compiled), however
    the model was built: on a device, on ``meta``, or sharded as DTensors (FSDP2, tensor parallel).

    The keys get the repair ``verify`` would choose (wrapper segments matched to the model's, a framework's
    leading prefix such as Lightning's ``model.`` removed); a checkpoint that still doesn't fit raises
    LoadError with a short report instead of torch's wall of keys. All or nothing: everything that can fail
    is checked before the model is touched, and a failure leaves its tensors as they were.

    Tensors are read once from the mapped file. A built model's tensors are filled in place; a model built
    on ``meta`` gets its tensors assigned (``assign=True`` does that for a built one too, as torch's
    ``load_state_dict(assign=True)``): zero-copy views of the file where the target is the CPU and the
    dtype as stored, else materialised on ``map_location`` (``auto``: where they were saved, if this
    machine has it, else the CPU); tied parameters stay tied. With DTensor parameters (call it on every
    rank), each rank reads only its own shards' bytes.

    A quantized checkpoint (block FP8, NVFP4, GPTQ …) loads as stored, bit-exact, into a model that holds the
    quantized form (its weight and scale parameters); into a model whose parameter is a plain float ``.weight``,
    ``dequantize=True`` loads each such group dequantized to that parameter's dtype (a note says so), and without
    it LoadError names the key: a cast of the stored values would drop their scales.

    NaN/Inf values are loaded with a UserWarning naming the keys (and listed in the report's ``nonfinite``;
    the check is fused into the copy, ``check_values=False`` skips it); with ``strict_values=True`` they
    raise LoadError and nothing is loaded. A file that records per-tensor digests (ckptfix's outputs) is
    checked against them before the model is touched, by default where that rides on a pass the load makes anyway
    (a model built on meta: the value check's pass; a URL: its fetch), with ``check_digests=True`` a built model's
    too (one CRC-32 pass of its own before the fill) and a DTensor-sharded model's (each rank checks a share of the
    digests: docs/digests.md); a mismatch a FormatError naming the tensor, nothing loaded; ``check_digests=False``
    skips it.

    ``path`` may be a URL (as :func:`read` takes one): each tensor's bytes are fetched once, before the model is
    touched, and a DTensor rank fetches only its own shards' ranges; ``LoadReport.bytes_fetched`` counts them.

    >>> with torch.device("meta"): model = Net()                       # doctest: +SKIP
    >>> ckptfix.load_into(model, "ddp.pth").fix                          # 'strip module.'
    """
    return loading.load_into(model, path, LoadOptions(*args, **options))
