"""Where the files of a directory checkpoint are: a Hugging Face sharded index, a DCP directory, a
DeepSpeed tag directory, a ``save_pretrained`` directory's one weights file. Paths and names only, no tensor
bytes: the scanner (:mod:`ckptfix.safety`) and the format readers (:mod:`ckptfix.formats`) both need them, so
they sit below both."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any

from ..core import locations
from ..core.units import few
from ..errors import DeepSpeedZeroError, FormatError, MissingFileError, RemoteError
from .format_registry import SHARDED, SHARDED_PTH, get

#: the file torch.distributed.checkpoint writes its metadata to
METADATA = ".metadata"
#: DeepSpeed's file naming the latest tag, and its model_states / optim_states files
LATEST = "latest"
DEEPSPEED_MODEL = re.compile(r"(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt")
DEEPSPEED_OPTIM = re.compile(r"(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")


def no_duplicate_keys(what: str) -> Any:
    """A ``json`` ``object_pairs_hook`` refusing a key listed twice (JSON allows it; a checkpoint
    index or header must not: which of the two would a reader take?)."""

    def hook(pairs: list[tuple[str, Any]]) -> dict:
        seen: dict[str, Any] = {}
        for k, v in pairs:
            if k in seen:
                raise FormatError(f"{what}: duplicate key {k!r}: it is listed twice")
            seen[k] = v
        return seen

    return hook


# -- Hugging Face sharded checkpoints ------------------------------------------------------------------

def find_index(path: str) -> str | None:
    """The index json for ``path``: ``path`` itself if it is one (``*.index.json``), else the
    safetensors or torch index in the directory ``path`` (safetensors when both); else None."""
    if path.endswith(".index.json") if locations.is_remote(path) else os.path.isfile(path):  # (a file: a URL's name says)
        return path if path.endswith(".index.json") and locations.is_file(path) else None
    name = locations.first_file(path, [str(get(fmt).index_name) for fmt in SHARDED])
    return locations.join(path, name) if name is not None else None


def index_format(index_path: str) -> str:
    """The sharded format of an index json: the one whose index name it ends like (``…safetensors.index.json``),
    else torch's (any other ``*.index.json``)."""
    for fmt in SHARDED:
        if index_path.endswith(str(get(fmt).index_name).partition(".")[2]):
            return fmt
    return SHARDED_PTH


def member_path(root: str, rel: Any, source: str, what: str = "shard") -> str:
    """``root/rel`` after checking it stays inside ``root``: not absolute, no ``..``, no symlink
    leading out. Shared by the directory formats (sharded index, DCP)."""
    if not isinstance(rel, str) or not rel:
        raise FormatError(f"{source}: {what} name {rel!r} is not a file name")
    parts = re.split(r"[/\\]", rel)
    if os.path.isabs(rel) or rel.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", rel):
        raise FormatError(f"{source}: {what} path {rel!r} is absolute; shards must sit inside {root}")
    if ".." in parts:
        raise FormatError(f"{source}: {what} path {rel!r} leaves the directory ('..'); shards must sit inside {root}")
    if locations.is_remote(root):
        if "\\" in rel or "://" in rel:
            raise FormatError(f"{source}: {what} path {rel!r} is not a plain name; shards must sit inside {root}")
        path = locations.join(root, rel)
        if not locations.is_file(path):
            raise MissingFileError(f"{source}: {what} {rel!r} is missing from {root}", path)
        return path
    path = os.path.join(root, rel)
    real_root = os.path.realpath(root)
    if not os.path.realpath(path).startswith(real_root.rstrip(os.sep) + os.sep):
        raise FormatError(
            f"{source}: {what} {rel!r} is a symlink to {os.path.realpath(path)}, outside {root}; "
            "copy the file into the directory"
        )
    if not os.path.isfile(path):
        raise MissingFileError(f"{source}: {what} {rel!r} is missing from {root} (the download or save did not finish?)",
                               path)
    return path


def load_index(index_path: str) -> dict[str, str]:
    """The validated ``weight_map`` (key → shard file name, in file order) of an index json."""
    try:
        index = json.loads(locations.read_all(index_path).decode("utf-8"), object_pairs_hook=no_duplicate_keys(index_path))
    except (MissingFileError, RemoteError):
        raise
    except OSError as e:
        raise FormatError(f"{index_path}: can't be read: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise FormatError(f"{index_path}: is not valid JSON ({e})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise FormatError(f"{index_path}: has no \"weight_map\" object: not a sharded-checkpoint index")
    for key, shard in weight_map.items():
        if not isinstance(shard, str):
            raise FormatError(f"{index_path}: key {key!r} maps to {shard!r}, not a shard file name")
    return weight_map


# -- save_pretrained directories (one weights file, no index) ----------------------------------------------

#: the one weights file of a ``save_pretrained`` directory that has no index, in transformers' preference: each
#: sharded format's index name less ``.index.json`` (``model.safetensors``, then ``pytorch_model.bin``)
SINGLE_NAMES = tuple(str(get(fmt).index_name).removesuffix(".index.json") for fmt in SHARDED)
#: how a weights file's name ends: another one beside the single file leaves open which the caller means
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pth", ".pt")
#: what transformers' Trainer saves beside the weights in its ``checkpoint-N`` directories: training state, not
#: weights (``from_pretrained`` reads the single file there too)
TRAINER_STATE = re.compile(r"training_args\.bin|optimizer\.(?:pt|bin)|scheduler\.pt|scaler\.pt|rng_state(?:_\d+)?\.pth")


def single_weights(directory: str) -> str | None:
    """The file a ``save_pretrained`` directory (no index) stands for: its ``model.safetensors``, else its
    ``pytorch_model.bin``; None where it holds neither. FormatError where other weights files lie beside it
    (which one is the checkpoint?): every verb reads such a directory as that one file, or refuses it."""
    name = locations.first_file(directory, SINGLE_NAMES)
    if name is None:
        return None
    listed = locations.listdir(directory) or []  # (None: a URL that can't be listed, https: the names asked for)
    others = [n for n in listed if n.endswith(WEIGHT_SUFFIXES) and n not in SINGLE_NAMES and not TRAINER_STATE.fullmatch(n)]
    if others:
        raise FormatError(f"{directory}: holds {few(others)} beside {name}: which is the checkpoint? Give the file "
                          f"itself, or move the other weights files out of the directory")
    return locations.join(directory, name)


# -- torch.distributed.checkpoint -----------------------------------------------------------------------

def is_dcp_dir(path: str) -> bool:
    """A directory holding a DCP ``.metadata`` file."""
    return locations.first_file(path, [METADATA]) is not None


# -- DeepSpeed -------------------------------------------------------------------------------------------

@dataclass
class Layout:
    """One checkpoint tag's files, each list in rank order."""

    tag_dir: str
    tag: str
    model_files: list[str]
    optim_files: list[str]


def names_matching(directory: str, pattern: re.Pattern) -> list[str]:
    """The sorted names in ``directory`` that ``pattern`` matches whole ([] when it can't be listed)."""
    try:
        return sorted(n for n in os.listdir(directory) if pattern.fullmatch(n))
    except OSError:
        return []


def deepspeed_beside(path: str) -> bool:
    """Whether ``path`` is named as a DeepSpeed model_states file with optim_states files beside it."""
    return bool(DEEPSPEED_MODEL.fullmatch(os.path.basename(path))) and \
        bool(names_matching(os.path.dirname(os.path.abspath(path)), DEEPSPEED_OPTIM))


def is_deepspeed_dir(path: str) -> bool:
    """A directory holding DeepSpeed's ``latest`` file or model_states files."""
    return os.path.isdir(path) and (os.path.isfile(os.path.join(path, LATEST))
                                    or bool(names_matching(path, DEEPSPEED_MODEL)))


def locate(path: str) -> Layout:
    """The tag directory ``path`` means (the checkpoint directory via ``latest``, a tag directory, or a
    model_states file in one) and its files; DeepSpeedZeroError saying what is missing."""
    if os.path.isfile(path):
        tag_dir = os.path.dirname(os.path.abspath(path))
    elif os.path.isfile(os.path.join(path, LATEST)):
        tag_dir = os.path.join(path, _read_tag(path))
    else:
        tag_dir = path
    models = names_matching(tag_dir, DEEPSPEED_MODEL)
    if not models:
        raise DeepSpeedZeroError(f"{path}: no DeepSpeed *_model_states.pt files in {tag_dir}; give the checkpoint "
                                 "directory (the one holding `latest`) or one of its tag directories")
    optims = names_matching(tag_dir, DEEPSPEED_OPTIM)
    if any(_part(DEEPSPEED_MODEL, n, 2) != "00" for n in models) or \
            any(_part(DEEPSPEED_OPTIM, n, 3) != "00" for n in optims):
        raise DeepSpeedZeroError(f"{tag_dir}: holds model-parallel ranks other than mp_rank_00: ckptfix (like "
                                 "zero_to_fp32.py) consolidates data-parallel ZeRO checkpoints only")
    if len({_part(DEEPSPEED_OPTIM, n, 1) for n in optims}) > 1:
        raise DeepSpeedZeroError(f"{tag_dir}: holds both bf16_zero_pp_rank_* and zero_pp_rank_* optim_states files "
                                 "(two runs saved into one tag?); keep one set")
    return Layout(tag_dir, os.path.basename(os.path.normpath(tag_dir)),
                  [os.path.join(tag_dir, n) for n in _by_rank(models, DEEPSPEED_MODEL, 1, tag_dir)],
                  [os.path.join(tag_dir, n) for n in _by_rank(optims, DEEPSPEED_OPTIM, 2, tag_dir)])


def _read_tag(path: str) -> str:
    latest = os.path.join(path, LATEST)
    try:
        with open(latest, encoding="utf-8") as f:
            tag = f.read(4096).strip()
    except (OSError, UnicodeDecodeError) as e:
        raise FormatError(f"{latest}: can't be read: {e}") from None
    if not tag or tag in (".", "..") or "/" in tag or "\\" in tag or "\0" in tag:
        raise DeepSpeedZeroError(f"{latest}: names {tag!r}, not a tag directory inside {path}; give the tag directory itself")
    tag_dir = os.path.join(path, tag)
    if not os.path.isdir(tag_dir):
        raise DeepSpeedZeroError(f"{latest}: names tag {tag!r} but {tag_dir} is not a directory; give an existing tag directory")
    if os.path.dirname(os.path.realpath(tag_dir)) != os.path.realpath(path):
        raise DeepSpeedZeroError(f"{tag_dir}: is a symlink out of {path}; give the directory it points to yourself")
    return tag


def _part(pattern: re.Pattern, name: str, group: int) -> str | None:
    """Group ``group`` of ``name``, one :func:`names_matching` found (``pattern`` matches it whole)."""
    match = pattern.fullmatch(name)
    return match.group(group) if match else None


def _by_rank(names: list[str], pattern: re.Pattern, group: int, where: str) -> list[str]:
    """The names in rank order, refusing gaps (zero_pp_rank_0, _2 without _1)."""
    ranked = sorted((int(_part(pattern, n, group) or 0), n) for n in names)
    if [r for r, _ in ranked] != list(range(len(ranked))):
        raise DeepSpeedZeroError(f"{where}: rank files {', '.join(n for _, n in ranked)} are not ranks 0..{len(ranked) - 1}: "
                                 "a rank's file is missing (the save did not finish?)")
    return [n for _, n in ranked]
