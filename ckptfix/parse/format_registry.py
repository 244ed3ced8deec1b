"""The format registry: every checkpoint format ckptfix knows, declared once, as plain data.

Each :class:`Format` names what :func:`ckptfix.parse.sniff.sniff` calls it and its recogniser (a function
of :mod:`ckptfix.parse.recognise`, asked in the order :data:`RECOGNISED_BY_BYTES` / :data:`RECOGNISED_BY_LISTING`
give), what it can do (read with torch, describe without torch, stream its byte ranges, be written, with or
without torch, under which ``--format`` names and extensions), what serving code loads it with
(``verify --exact``), which verbs read it from a URL without a local copy, and which family under
:mod:`ckptfix.formats` implements it.
It imports nothing, so every layer that asks a capability question (the scanner, ops, verify, text, the
CLI's ``--format`` choices) reads it without importing a format module; :mod:`ckptfix.formats` resolves
``family`` to its module by name only when a read or write needs it, so a conversion imports the modules
of the formats it touches and no others. Adding a format is one entry here, its recogniser and its family's verbs.
"""

from __future__ import annotations

from dataclasses import dataclass

TORCH_ZIP = "torch-zip"
TORCH_LEGACY = "torch-legacy"
TORCHSCRIPT = "torchscript"
SAFETENSORS = "safetensors"
SHARDED_SAFETENSORS = "sharded-safetensors"
SHARDED_PTH = "sharded-pth"
DCP = "dcp"
DEEPSPEED = "deepspeed"


@dataclass(frozen=True)
class Format:
    """One format: its name, how it is recognised, what ckptfix can do with it, and where that lives."""

    name: str
    family: str  #: the module or package under ckptfix.formats with its verbs (read, describe, write, plan_write)
    scanner: str  #: which scan ``ckptfix scan`` runs (a key of the scanner's table)
    recogniser: str  #: the function of ckptfix.parse.recognise that says whether bytes (or a listing) are this format
    zip: bool = False  #: zip archive(s) torch's reader opens: mapped when loaded, a CRC-32 per member (verify checks them)
    describe: bool = False  #: described without torch (:func:`ckptfix.formats.describe`)
    copy_without_torch: bool = False  #: its description gives byte ranges a torch-free conversion copies
    stream: bool = False  #: a structure read gives every storage's byte range(s): conversions can stream
    write_names: tuple[str, ...] = ()  #: ``--format`` values that write it, the first the one shown
    extensions: tuple[str, ...] = ()  #: destination extensions that choose it (the ones error messages suggest)
    other_extensions: tuple[str, ...] = ()  #: destination extensions that choose it too, not suggested
    write_without_torch: bool = False  #: written from TensorInfo values (``plan_write``), torch never imported
    writes_from_refs: bool = False  #: its writer copies tensor bytes from a structure read's byte ranges
    directory_output: bool = False  #: written as a directory (``--hash`` does not apply)
    keeps_objects: bool = False  #: holds Python objects beside tensors (``--keep-extra``)
    refuses_stand_ins: bool = False  #: can't store ckptfix's stand-ins (mmengine objects) under their own names
    record_keys: bool = False  #: tensor bytes sit in named records (torch zip): an output keeps their keys
    stores_aliases: bool = False  #: tied tensors stored once; the aliases in ckptfix's metadata, not the header
    default_device: str | None = None  #: every storage's device when the file saves none
    exact_loader: str | None = None  #: what serving code loads it with (``verify --exact``)
    fixed_ext: str = ".pth"  #: the extension ``verify`` suggests for a fixed copy
    inspect_layout: str | None = None  #: ``inspect``'s layout line when the format says more than "plain"
    shards_as: str | None = None  #: a file of this format is a shard of that sharded format
    index_name: str | None = None  #: a sharded format's index file
    shard_pattern: str | None = None  #: a sharded format's shard names (``{suffix}``: ``-00001-of-00003``)
    shard_format: str | None = None  #: the single-file format a sharded format's shards are written in
    label: str = ""  #: how messages name it, where not by ``name``
    from_url: frozenset[str] = frozenset()  #: the verbs (:data:`URL_VERBS`) that read it from a URL, no local copy


#: what a URL may be given to: ``describe``; ``scan``; ``read`` (read, load, load_into, inspect, verify, diff);
#: ``convert`` (as the source)
URL_VERBS = ("describe", "scan", "read", "convert")
_ALL = frozenset(URL_VERBS)

FORMATS: dict[str, Format] = {f.name: f for f in (
    Format(TORCH_ZIP, "torchsave", "torch-zip", recogniser="torch_zip", describe=True, copy_without_torch=True,
           stream=True, write_names=("pth", "pt", "bin", "torch"), extensions=(".pth", ".pt", ".bin"),
           other_extensions=(".ckpt", ".tar"),
           write_without_torch=True, writes_from_refs=True, keeps_objects=True, record_keys=True,
           exact_loader="torch.load(weights_only=True)", shards_as=SHARDED_PTH, zip=True, from_url=_ALL),
    Format(TORCH_LEGACY, "torchsave", "torch-legacy", recogniser="torch_legacy",
           exact_loader="torch.load(weights_only=True)", shards_as=SHARDED_PTH),
    Format(TORCHSCRIPT, "torchscript", "torchscript", recogniser="torchscript", zip=True,
           inspect_layout="TorchScript archive (tensors listed without running its code)", from_url=frozenset({"scan"})),
    Format(SAFETENSORS, "safetensors", "safetensors", recogniser="safetensors", describe=True,
           copy_without_torch=True, stream=True, write_names=("safetensors",), extensions=(".safetensors",),
           write_without_torch=True, writes_from_refs=True, stores_aliases=True, default_device="cpu",
           exact_loader="safetensors.torch.load_file", fixed_ext=".safetensors", shards_as=SHARDED_SAFETENSORS,
           from_url=_ALL),
    Format(SHARDED_SAFETENSORS, "sharded", "sharded", recogniser="sharded_safetensors",
           describe=True, copy_without_torch=True, stream=True, default_device="cpu", fixed_ext=".safetensors",
           index_name="model.safetensors.index.json", shard_pattern="model{suffix}.safetensors",
           shard_format=SAFETENSORS, label="sharded safetensors", from_url=_ALL),
    Format(SHARDED_PTH, "sharded", "sharded", recogniser="sharded_pth",
           describe=True, copy_without_torch=True, stream=True, record_keys=True, zip=True,
           index_name="pytorch_model.bin.index.json", shard_pattern="pytorch_model{suffix}.bin",
           shard_format=TORCH_ZIP, label="sharded pth", from_url=_ALL),
    Format(DCP, "dcp", "dcp", recogniser="dcp", describe=True, stream=True, write_names=("dcp",),
           directory_output=True, keeps_objects=True, refuses_stand_ins=True, default_device="cpu",
           from_url=frozenset({"describe", "scan", "read"})),
    Format(DEEPSPEED, "deepspeed", "deepspeed", recogniser="deepspeed", stream=True),
)}

#: the formats a file's bytes are recognised as, in the order sniffing asks their recognisers: every one is
#: asked, and bytes two of them claim are refused as ambiguous (the order says whose damage is reported first)
RECOGNISED_BY_BYTES = (TORCHSCRIPT, TORCH_ZIP, SAFETENSORS, TORCH_LEGACY)
#: the formats a directory (or a sharded index json) is recognised as by its listing, in the order sniffing asks
#: them: the first that claims it names it (layouts nest, and each question may list a remote directory)
RECOGNISED_BY_LISTING = (DCP, DEEPSPEED, SHARDED_SAFETENSORS, SHARDED_PTH)

#: the sharded formats, in the order a directory's index files are looked for (safetensors first)
SHARDED = tuple(f.name for f in FORMATS.values() if f.index_name)
#: every ``--format`` name, the shown ones first (the CLI's choices)
WRITE_NAMES = tuple(f.write_names[0] for f in FORMATS.values() if f.write_names)


def get(name: str) -> Format:
    """The registered format ``name`` (KeyError for a name nothing registered)."""
    return FORMATS[name]


def by_write_name(name: str) -> Format | None:
    """The format ``--format NAME`` writes (``pth``, ``pt``, ``safetensors``, ``dcp`` …), or None."""
    return next((f for f in FORMATS.values() if name in f.write_names), None)


def by_extension(ext: str) -> Format | None:
    """The format a destination ending in ``ext`` (``.pth``) is written in, or None."""
    return next((f for f in FORMATS.values() if ext in f.extensions + f.other_extensions), None)


def sharded_as(shard_format: str) -> Format:
    """The sharded format whose shards are written as ``shard_format``."""
    found = next((f for f in FORMATS.values() if f.shard_format == shard_format), None)
    if found is None:
        raise KeyError(shard_format)
    return found
