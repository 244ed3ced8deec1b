"""The DCP checkpoints PyTorch's own ``test/distributed/checkpoint/`` tests write, made again here.

Others' tests keep finding what our own generators miss, so this corpus takes its cases from torch's DCP tests:
each case is named after the upstream test whose checkpoint it makes (its docstring names the file and test), and
saves the same *content* (state dict, writer and its options) with our own code, on the CPU: one process
(``no_dist=True``), or two gloo ranks (``tests/dist_harness.py``, one run for every two-rank case) where the
upstream test saves DTensors or ShardedTensors across ranks. (test_file_system_checkpoint_cpu.py's ZStandard
extension needs ``zstandard`` or ``pyzstd``, not installed here: its Rot13 twin stands for stream extensions.)

``CASES`` maps a name to ``make(tmp_dir) -> Path`` (a directory). The tables say what each case is to a reader:

- ``RISKY``: a bytes entry pickles a class ``torch.load(weights_only=True)`` refuses (``io.BytesIO``, a dataclass);
  DCP's own loader unpickles bytes entries with ``weights_only=False``; ckptfix reads it as an inert placeholder
  (refused inside the selected state dict, beside it kept; ``trust=True`` reads it as DCP does), and ``scan`` reports
  it;
- ``REFUSED``: what ckptfix refuses by design, with why (a one-line CkptfixError; DCP reads them);
- ``HF``: directories of ``HuggingFaceStorageWriter`` (safetensors shards and an index, no ``.metadata``), compared
  with the ``safetensors`` library rather than with DCP's reader;
- ``CONVERTS``: the DCP cases whose state dict is dense tensors ckptfix reads (tests/ops/test_plain_loadable.py
  converts each to every output format).
"""

from __future__ import annotations

import dataclasses
import io
import shutil
import warnings
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from tests import corpus_table

Make = corpus_table.Make
CASES, case = corpus_table.table()


_seed = corpus_table.seeded


def save(state_dict: Any, path: Path, **writer: Any) -> Path:
    """``dcp.save`` in this process alone with a ``FileSystemWriter(path, **writer)``."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
        dcp.save(state_dict, storage_writer=dcp.FileSystemWriter(path, **writer), no_dist=True)
    return path


# -- test_file_system_checkpoint(_cpu).py ---------------------------------------------------------------------

class _FsModule(nn.Module):
    """The module test_file_system_checkpoint(_cpu).py saves (two Linears and an EmbeddingBag)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(5, 5)
        self.linear_2 = nn.Linear(5, 1)
        self.emb = nn.EmbeddingBag(5, 10)


def _fs_state(seed: int = 0) -> dict[str, Any]:
    with _seed(seed):
        return _FsModule().state_dict()


def _only_tensor(threads: int) -> Make:
    def make(tmp: Path) -> Path:
        return save(_fs_state(), tmp / "ckpt", thread_count=threads)
    make.__doc__ = (f"test_file_system_checkpoint_cpu.py test_read_write_only_tensor (thread_count={threads}): a module's "
                    "tensors, one file per rank")
    return make


for _threads in (1, 2):
    case(f"fs-only-tensor-threads-{_threads}")(_only_tensor(_threads))


@case("fs-file-per-item")
def _file_per_item(tmp: Path) -> Path:
    """test_file_system_checkpoint.py test_read_write_only_tensor sets ``single_file_per_rank`` explicitly; its other
    value, one ``.distcp`` file per tensor, over two threads."""
    return save(_fs_state(), tmp / "ckpt", single_file_per_rank=False, thread_count=2)


@case("fs-no-sync-no-copy-ahead")
def _no_sync(tmp: Path) -> Path:
    """test_file_system_checkpoint_cpu.py test_read_write_only_tensor's state dict through FileSystemWriter's other
    documented switches (the upstream tests leave them at their defaults): ``sync_files=False``,
    ``per_thread_copy_ahead=0``, three threads."""
    return save(_fs_state(), tmp / "ckpt", sync_files=False, per_thread_copy_ahead=0, thread_count=3)


class BlobState:
    """test_file_system_checkpoint_cpu.py's BlobState: a Stateful whose state dict holds raw bytes."""

    def __init__(self, value: bytes) -> None:
        self.state = {"blob": value}

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.state = state_dict


@case("fs-tensor-and-blob")
def _blob(tmp: Path) -> Path:
    """test_file_system_checkpoint_cpu.py test_read_write_tensor_and_blob, without its Rot13 extension: a module's
    tensors and a Stateful holding bytes (saved as its state dict, ``{"blob": b"..."}``)."""
    return save({**_fs_state(), "test_blob": BlobState(b"SomeBlobForTesting")}, tmp / "ckpt")


@case("fs-tensor-and-blob-rot13")
def _rot13(tmp: Path) -> Path:
    """test_file_system_checkpoint_cpu.py test_read_write_tensor_and_blob: the same, every record through torch's
    test-only Rot13 stream extension (``_extensions=[Rot13Example()]``; its transform named in ``.metadata``)."""
    from torch.testing._internal.distributed.checkpoint_utils import Rot13Example

    return save({**_fs_state(), "test_blob": BlobState(b"SomeBlobForTesting")}, tmp / "ckpt", _extensions=[Rot13Example()])


@case("fs-save-load-bytes")
def _bytes_only(tmp: Path) -> Path:
    """test_file_system_checkpoint_cpu.py test_save_load_bytes: plain values only, no tensor."""
    return save({"bytes0": [1], "bytes1": "string"}, tmp / "ckpt")


@case("fs-dtype-casting-float32")
def _fp32(tmp: Path) -> Path:
    """test_file_system_checkpoint_cpu.py test_dtype_mismatch_casting: the fp32 checkpoint."""
    with _seed():
        return save({"w": torch.rand(4, 3, dtype=torch.float32)}, tmp / "ckpt")


@case("fs-dtype-casting-bfloat16")
def _bf16(tmp: Path) -> Path:
    """test_file_system_checkpoint_cpu.py test_dtype_mismatch_casting: the bf16 checkpoint."""
    with _seed():
        return save({"w": torch.rand(4, 3, dtype=torch.bfloat16)}, tmp / "ckpt")


# -- test_nested_dict.py, test_traverse.py ------------------------------------------------------------------------

@case("nested-dict-round-trip")
def _nested_round_trip(tmp: Path) -> Path:
    """test_nested_dict.py test_flattening_round_trip: ints, lists, a dict with int keys, tensors inside lists of
    lists beside strings."""
    return save({"key0": 1, "key1": [1, 2], "key2": {1: 2, 2: 3}, "key3": torch.tensor([1]),
                 "key4": [[torch.tensor(2), "x"], [1, 2, 3], {"key6": [44]}]}, tmp / "ckpt")


@case("nested-dict-mapping")
def _nested_mapping(tmp: Path) -> Path:
    """test_nested_dict.py test_mapping: a tensor three levels down a list of lists of dicts."""
    return save({"k0": [1], "k2": [torch.tensor([1]), 99, [{"k3": torch.tensor(1)}]], "k3": ["x", 99, [{"k3": "y"}]]},
                tmp / "ckpt")


@case("traverse-nested-list")
def _nested_list(tmp: Path) -> Path:
    """test_traverse.py test_traverse_nested_list."""
    return save({"key1": [torch.tensor([1]), [33, torch.tensor([2]), [44, 55]], [66, 77]]}, tmp / "ckpt")


@case("traverse-nested-dict")
def _nested_dict(tmp: Path) -> Path:
    """test_traverse.py test_traverse_nested_dict."""
    return save({"key0": {"key1": 99, "key2": torch.tensor([1])}}, tmp / "ckpt")


@case("traverse-intermediate-collections")
def _intermediate(tmp: Path) -> Path:
    """test_traverse.py test_traverse_doesnt_ignore_intermediate_collections: a dict inside a list inside a dict."""
    return save({"key0": [{"key1": {"key2": torch.tensor([1])}}]}, tmp / "ckpt")


@case("traverse-ordered-dict")
def _ordered(tmp: Path) -> Path:
    """test_traverse.py test_traverse_with_ordered_dict."""
    return save(OrderedDict({"key0": [99, torch.tensor([3])]}), tmp / "ckpt")


# -- e2e/test_e2e_save_and_load.py ----------------------------------------------------------------------------

class DummyModel(nn.Module):
    """e2e/test_e2e_save_and_load.py's TestDummyModel: four Linears."""

    def __init__(self) -> None:
        super().__init__()
        self.net1, self.net2, self.net3, self.net4 = nn.Linear(8, 16), nn.Linear(16, 32), nn.Linear(32, 64), nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for net in (self.net1, self.net2, self.net3, self.net4):
            x = torch.relu(net(x))
        return x


class TrainState:
    """e2e's TestTrainState: a 0-dim int32 and float32 tensor, and the losses as a BytesIO of a torch.save."""

    def __init__(self, losses: list[float]) -> None:
        self.losses = losses

    def state_dict(self) -> dict[str, Any]:
        buf = io.BytesIO()
        torch.save(self.losses, buf)
        return {"step": torch.tensor(len(self.losses), dtype=torch.int32),
                "current_loss": torch.tensor(self.losses[-1], dtype=torch.float32), "losses": buf}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise NotImplementedError  # (only saved here)


@case("e2e-model-optimizer-train-state")
def _e2e(tmp: Path) -> Path:
    """e2e/test_e2e_save_and_load.py _run_e2e_test (ModelType.NONE): a model and its Adam optimizer after two steps
    (the optimizer's state keyed by int), a Stateful's tensor, and the train state (0-dim tensors, a BytesIO)."""
    with _seed():
        model = DummyModel()
        optim = torch.optim.Adam(model.parameters(), lr=0.1)
        losses = []
        for _ in range(2):
            loss = model(torch.rand(8, 8)).sum()
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.item())
        data = torch.rand(10, 10)
    return save({"model": model.state_dict(), "optimizer": optim.state_dict(), "s": {"data": data},
                 "train_state": TrainState(losses)}, tmp / "ckpt")


@case("e2e-non-stateful")
def _non_stateful(tmp: Path) -> Path:
    """e2e/test_e2e_save_and_load.py test_stateful_and_non_stateful_loads: a tensor beside a list of ints."""
    with _seed():
        return save({"foo": {"replicated": torch.rand(10, 10), "bytes": [1, 2, 3, 4]}}, tmp / "ckpt")


@case("e2e-no-dist-empty")
def _empty(tmp: Path) -> Path:
    """e2e/test_e2e_save_and_load.py test_no_dist (and the empty Stateful of test_stateful_and_non_stateful_loads):
    an empty state dict."""
    return save({}, tmp / "ckpt")


@case("e2e-overwrite")
def _overwrite(tmp: Path) -> Path:
    """e2e/test_e2e_save_and_load.py test_overwrite: a second save into the same directory (``overwrite=True``); the
    first here wrote a file per tensor, so its other records stay behind, unlisted."""
    with _seed():
        t1, t2, t3 = torch.randn(10), torch.randn(10), torch.randn(10)
    save({"random": t1, "other": t3}, tmp / "ckpt", single_file_per_rank=False)
    return save({"random": t2}, tmp / "ckpt", overwrite=True)


@case("e2e-init-state-dict")
def _init_state_dict(tmp: Path) -> Path:
    """e2e/test_e2e_save_and_load.py test_init_state_dict: get_model_state_dict and get_optimizer_state_dict (the
    optimizer's state keyed by parameter name, before any step)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    with _seed():
        model = DummyModel()
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    return save({"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optim)}, tmp / "ckpt")


# -- test_format_utils.py -------------------------------------------------------------------------------------

class _Uneven(nn.Module):
    """test_format_utils.py's SimpleModelUneven: Linears of uneven sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.net1, self.net2, self.net3, self.net4 = nn.Linear(5, 10), nn.Linear(10, 15), nn.Linear(15, 30), nn.Linear(30, 5)


@case("format-utils-dcp-save-module")
def _dcp_module(tmp: Path) -> Path:
    """test_format_utils.py test_dcp_to_torch_save: ``dcp.save({"model": module})`` (a Stateful module)."""
    with _seed():
        return save({"model": _Uneven()}, tmp / "ckpt")


@case("format-utils-torch-save-to-dcp")
def _from_torch_save(tmp: Path) -> Path:
    """test_format_utils.py test_torch_save_to_dcp: a ``torch.save`` file converted by ``torch_save_to_dcp``."""
    from torch.distributed.checkpoint.format_utils import torch_save_to_dcp

    with _seed():
        torch.save({"model": _Uneven().state_dict()}, tmp / "model.pt")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        torch_save_to_dcp(tmp / "model.pt", tmp / "ckpt")
    return tmp / "ckpt"


# -- test_state_dict_utils.py, test_state_dict_stager.py ---------------------------------------------------------

@case("state-dict-utils-cpu-state-dict")
def _cpu_state_dict(tmp: Path) -> Path:
    """test_state_dict_utils.py test_create_cpu_state_dict: an int64 arange, a BytesIO and the bytes of a torch.save,
    a 0-dim float, a float, a nested list."""
    buf = io.BytesIO()
    torch.save(torch.ones(10), buf)
    return save({"tensor1": torch.arange(10), "tensor2": torch.ones(10), "non_tensor_bytes_io": io.BytesIO(buf.getvalue()),
                 "non_tensor_bytes": buf.getvalue(), "step": torch.tensor(7, dtype=torch.float), "lr": 1.5,
                 "nested": {"list": [1, 2, 3, 4]}}, tmp / "ckpt")


@case("state-dict-utils-complicated-dict")
def _complicated(tmp: Path) -> Path:
    """test_state_dict_utils.py test_complicated_dict, one rank: a list of twenty tensors beside tensors."""
    with _seed():
        items = [t for _ in range(10) for t in (torch.randn(3, 3, 3), torch.ones(10))]
        return save({"local": torch.randn(3, 3, 3), "list": items, "arange": torch.arange(10)}, tmp / "ckpt")


@case("stager-different-dtypes")
def _stager_dtypes(tmp: Path) -> Path:
    """test_state_dict_stager.py test_different_dtypes: float32, float64, int32, int64 and bool tensors."""
    with _seed():
        return save({"float32": torch.randn(4, 4), "float64": torch.randn(4, 4, dtype=torch.float64),
                     "int32": torch.randint(-100, 100, (4, 4), dtype=torch.int32),
                     "int64": torch.randint(-100, 100, (4, 4)), "bool": torch.randint(0, 2, (4, 4)).bool()}, tmp / "ckpt")


#: every dtype DCP's TensorProperties records that torch.save writes (test_different_dtypes' list, widened)
ALL_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
              torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32, torch.uint64,
              torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.float8_e8m0fnu]


@case("stager-every-dtype-raw-bits")
def _every_dtype(tmp: Path) -> Path:
    """test_state_dict_stager.py test_different_dtypes, widened to every dtype torch.save writes, each tensor random
    bytes (NaN payloads, -0.0, subnormals: compared bit for bit), plus bool."""
    with _seed():
        sd: dict[str, Any] = {}
        for dtype in ALL_DTYPES:
            size = torch.empty((), dtype=dtype).element_size()
            sd[str(dtype).removeprefix("torch.")] = torch.randint(0, 256, (3, 4 * size), dtype=torch.uint8).view(dtype)
        sd["bool"] = torch.randint(0, 2, (5,)).bool()
    return save(sd, tmp / "ckpt")


@case("stager-empty-tensors")
def _stager_empty(tmp: Path) -> Path:
    """test_state_dict_stager.py test_empty_tensors: tensors of shape [0], [0, 0], [0, 0, 0] and a 0-dim one."""
    return save({"empty_0d": torch.tensor([], dtype=torch.float32), "empty_1d": torch.tensor([]).reshape(0),
                 "empty_2d": torch.tensor([]).reshape(0, 0), "empty_3d": torch.tensor([]).reshape(0, 0, 0),
                 "zero_dim": torch.tensor(0.0)}, tmp / "ckpt")


@case("stager-complex-storage-sharing")
def _sharing(tmp: Path) -> Path:
    """test_state_dict_stager.py test_complex_storage_sharing: views and strided slices of one storage (DCP writes
    each as its own record)."""
    with _seed():
        base = torch.randn(10, 10)
    view1 = base.view(100)
    return save({"base": base, "view1": view1, "view2": base.view(10, 10), "slice1": base[2:8, 2:8],
                 "slice2": base[:, :5], "slice3": view1[10:60], "transposed": base.t()}, tmp / "ckpt")


@dataclasses.dataclass
class TestStruct:
    """test_state_dict_stager.py's TestStruct: a dataclass holding a tensor."""

    __test__ = False  # (not a pytest class)
    tensor1: torch.Tensor


@case("stager-views-dataclass")
def _views(tmp: Path) -> Path:
    """test_state_dict_stager.py test_views: a tensor and a view of it, and a dataclass holding a narrowed view
    (a bytes entry: DCP pickles what is not a tensor)."""
    with _seed():
        t1, t3 = torch.randn(4, 4), torch.randn(4, 4)
    return save({"tensor1": t1, "tensor2": t1.view(16), "recursive": {"tensor3": t3, "type": TestStruct(t3.narrow(0, 0, 2))}},
                tmp / "ckpt")


# -- test_hf_safetensor_e2e.py / hf_storage (safetensors through DCP's writer) ------------------------------------

@case("hf-storage-writer")
def _hf(tmp: Path) -> Path:
    """test_hf_safetensor_e2e.py TestSingleRankSaveLoad.test_save: ``HuggingFaceStorageWriter`` (rank-0 checkpointing:
    ``model-00001-of-00001.safetensors`` and ``model.safetensors.index.json``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(_fs_state(), storage_writer=dcp.HuggingFaceStorageWriter(path=str(tmp / "ckpt")), no_dist=True)
    return tmp / "ckpt"


@case("hf-storage-writer-two-files")
def _hf_two(tmp: Path) -> Path:
    """test_hf_storage.py test_write_data_hf: two tensors written to two files by ``fqn_to_index_mapping``."""
    with _seed():
        sd = {"tensor_0": torch.rand(4), "tensor_1": torch.rand(10)}
    mapping = {"tensor_0": 1, "tensor_1": 2}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(sd, storage_writer=dcp.HuggingFaceStorageWriter(path=str(tmp / "ckpt"), fqn_to_index_mapping=mapping),
                 no_dist=True)
    return tmp / "ckpt"


# -- two gloo ranks: test_dtensor_checkpoint.py, test_file_system_checkpoint_cpu.py, test_consolidate_hf_safetensors.py

def save_on_two_ranks(rank: int, world: int, root: Path) -> None:
    """Each two-rank case's directory under ``root`` (run on every rank by tests/dist_harness.py)."""
    import torch.distributed as dist
    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.sharded_tensor import Shard as LocalShard, ShardedTensor, ShardedTensorMetadata
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties as ShardProperties
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec, EnumerableShardingSpec, ShardMetadata
    from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))

    def save2(sd: Any, name: str, writer: Any = None) -> None:
        dcp.save(sd, storage_writer=writer or dcp.FileSystemWriter(root / name))
        dist.barrier()

    # test_dtensor_checkpoint.py test_distributed_tensor_planner: Shard(0) and Replicate parameters, extra state
    save2({"rdt": distribute_tensor(torch.arange(4, 8, dtype=torch.float32), mesh, [Replicate()]),
           "sdt": distribute_tensor(torch.arange(0, 4, dtype=torch.float32), mesh, [Shard(0)]),
           "_extra_state": {"extra_state": 1, "extra_state_tensor": torch.zeros(1)}}, "dtensor-planner")
    # test_consolidate_hf_safetensors.py _create_d_tensors, through FileSystemWriter: row- and column-sharded
    full = torch.arange(16, dtype=torch.float32).view(4, 4)
    rows, cols = full[2 * rank:2 * rank + 2].clone(), full[:, 2 * rank:2 * rank + 2].clone()
    pair = {"dtensor": DTensor.from_local(rows, mesh, [Shard(0)], shape=full.shape, stride=(4, 1)),
            "dtensor_col": DTensor.from_local(cols, mesh, [Shard(1)], shape=full.shape, stride=(4, 1))}
    save2(pair, "dtensor-rows-and-columns")
    # the same column sharding, uneven (5 columns: 3 + 2) and along the middle dimension of a 3-D tensor, in each dtype
    save2(uneven_columns(rank, mesh), "dtensor-uneven-columns-dtypes")
    # test_hf_safetensor_e2e.py test_dtensor_checkpoint_resharding_with_empty_shard: one element over two ranks
    save2({"dtensor": distribute_tensor(torch.tensor([0.25]), mesh, [Shard(0)])}, "dtensor-empty-shard")
    # test_file_system_checkpoint_cpu.py test_load_with_different_shard_plan: a [10, 20] ShardedTensor, five uneven shards
    torch.manual_seed(rank)
    boxes = [([0, 0], [2, 20], 0), ([2, 0], [1, 20], 1), ([3, 0], [3, 20], 0), ([6, 0], [3, 20], 1), ([9, 0], [1, 20], 0)]
    spec = EnumerableShardingSpec([ShardMetadata(o, s, f"rank:{r}") for o, s, r in boxes])
    save2({"sharded_tensor": sharded_tensor.rand(spec, 10, 20, init_rrefs=False)}, "sharded-tensor-enumerable")
    # test_file_system_checkpoint_cpu.py test_switch_between_sharded_tensor_to_tensor: 4 chunks on 2 ranks + a tensor
    chunked = ChunkShardingSpec(dim=0, placements=["rank:0", "rank:1", "rank:1", "rank:0"])
    replicated = torch.rand(32)
    dist.broadcast(replicated, src=0)
    save2({"sharded": sharded_tensor.rand(chunked, 32), "replicated": replicated}, "sharded-tensor-chunks")
    # test_planner.py create_sharded_tensor (test_local_plan's state dict): a tensor, a list, a ShardedTensor of
    # four 8-element shards, two per rank
    shards = [LocalShard.from_tensor_and_offsets(torch.rand(8), [8 * i], rank) for i in (2 * rank, 2 * rank + 1)]
    st_md = ShardedTensorMetadata([ShardMetadata([8 * i], [8], f"rank:{i // 2}/cpu") for i in range(4)], torch.Size([32]),
                                  ShardProperties.create_from_tensor(torch.zeros(1)))
    torch.manual_seed(7)
    save2({"tensor": torch.rand(10), "value": [1, 2, 3],
           "st": ShardedTensor._init_from_local_shards_and_global_metadata(shards, st_md)}, "planner-local-plan")
    # test_consolidate_hf_safetensors.py test_consolidate_to_two_files: HF writer, save_distributed, then consolidated
    save2(pair, "", dcp.HuggingFaceStorageWriter(path=str(root / "hf-distributed"), save_distributed=True))
    if rank == 0:
        (root / "hf-consolidated").mkdir()
        consolidate_safetensors_files(str(root / "hf-distributed"), str(root / "hf-consolidated"),
                                      fqn_to_index_mapping={"dtensor": 1, "dtensor_col": 2})
    dist.barrier()


#: the dtypes of the uneven column-sharded case (every one safetensors holds too)
COLUMN_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
                 torch.int64, torch.float8_e4m3fn, torch.float8_e5m2]


def uneven_columns(rank: int, mesh: Any) -> dict[str, Any]:
    """A [3, 5] tensor of random bits per dtype and a [2, 5, 3] one, Shard(1) on two ranks (columns 0-2 and 3-4),
    built with ``DTensor.from_local`` (no collective: gloo has none for float8)."""
    from torch.distributed.tensor import DTensor, Shard

    out: dict[str, Any] = {}
    with _seed(3):
        for dtype in COLUMN_DTYPES:
            for shape in ((3, 5), (2, 5, 3)):
                size = torch.empty((), dtype=dtype).element_size()
                full = torch.randint(0, 256, (*shape[:-1], shape[-1] * size), dtype=torch.uint8).view(dtype)
                part = full[:, :3] if rank == 0 else full[:, 3:]
                out[f"{str(dtype).removeprefix('torch.')}_{len(shape)}d"] = DTensor.from_local(
                    part.clone(), mesh, [Shard(1)], run_check=False, shape=full.shape, stride=full.stride())
        out["bool_2d"] = DTensor.from_local(torch.tensor([[True, False, True]] * 3) if rank == 0 else
                                            torch.tensor([[False, True]] * 3), mesh, [Shard(1)], run_check=False,
                                            shape=torch.Size([3, 5]), stride=(5, 1))
    return out


TWO_RANKS = {
    "dtensor-planner": "test_dtensor_checkpoint.py test_distributed_tensor_planner: a Shard(0) and a Replicate "
                       "DTensor and a module's extra state, two ranks",
    "dtensor-rows-and-columns": "test_consolidate_hf_safetensors.py _create_d_tensors (saved with FileSystemWriter): "
                                "a [4, 4] tensor sharded by rows and one by columns, two ranks",
    "dtensor-uneven-columns-dtypes": "test_consolidate_hf_safetensors.py _create_d_tensors' column sharding, uneven (3 + 2 "
                                     "columns) and along the middle dimension of a 3-D tensor, in ten dtypes and bool",
    "dtensor-empty-shard": "test_hf_safetensor_e2e.py test_dtensor_checkpoint_resharding_with_empty_shard: one element "
                           "Shard(0) over two ranks (rank 1's chunk is empty)",
    "sharded-tensor-enumerable": "test_file_system_checkpoint_cpu.py test_load_with_different_shard_plan: a [10, 20] "
                                 "ShardedTensor in five uneven row shards over two ranks",
    "sharded-tensor-chunks": "test_file_system_checkpoint_cpu.py test_switch_between_sharded_tensor_to_tensor: a "
                             "ShardedTensor chunked four ways over two ranks, beside a replicated tensor",
    "planner-local-plan": "test_planner.py test_local_plan's state dict (create_sharded_tensor): a tensor, a list "
                          "and a ShardedTensor of four shards, two per rank",
    "hf-distributed": "test_consolidate_hf_safetensors.py _create_d_tensors: HuggingFaceStorageWriter(save_distributed=True) "
                      "on two ranks, before consolidation: each rank's shards in its own safetensors file, no index",
    "hf-consolidated": "test_consolidate_hf_safetensors.py test_consolidate_to_two_files: HuggingFaceStorageWriter "
                       "(save_distributed) on two ranks, consolidated into two files with an index",
}
_made_on_two_ranks: dict[str, Path] = {}


def _two_ranks(tmp: Path) -> Path:
    """The two-rank cases' directories, made by one run on two gloo ranks (kept for the session)."""
    root = _made_on_two_ranks.get("root")
    if root is None or not root.exists():
        from tests import dist_harness

        root = tmp / "two-ranks"
        dist_harness.run("tests.public_dcp_corpus:save_on_two_ranks", world=2, workdir=tmp / "two-ranks-run",
                         payload=root)
        _made_on_two_ranks["root"] = root
    return root


def _from_two_ranks(name: str) -> Make:
    def make(tmp: Path) -> Path:
        shutil.copytree(_two_ranks(tmp) / name, tmp / name)
        return tmp / name
    make.__doc__ = TWO_RANKS[name]
    return make


for _name in TWO_RANKS:
    case(f"2ranks-{_name}")(_from_two_ranks(_name))


#: The cases with a bytes entry that pickles what weights_only refuses (DCP unpickles it with weights_only=False).
RISKY = {"e2e-model-optimizer-train-state", "state-dict-utils-cpu-state-dict", "stager-views-dataclass"}
#: What ckptfix refuses by design, with why (DCP's own loader reads them).
REFUSED = {
    "fs-tensor-and-blob-rot13": "records through a stream extension (Rot13): ckptfix reads plain FileSystemWriter records only",
    "2ranks-hf-distributed": "DCP's sharded safetensors layout (HuggingFaceStorageReader reads it): no format ckptfix knows",
}
#: HuggingFaceStorageWriter's output: safetensors files and an index, no .metadata (compared with the safetensors library).
HF = {"hf-storage-writer", "hf-storage-writer-two-files", "2ranks-hf-consolidated"}
#: The DCP cases whose state dict is dense tensors ckptfix reads (convert's input).
CONVERTS = {"fs-only-tensor-threads-1", "fs-file-per-item", "fs-dtype-casting-bfloat16", "format-utils-dcp-save-module",
            "format-utils-torch-save-to-dcp", "stager-different-dtypes", "stager-empty-tensors",
            "stager-complex-storage-sharing", "2ranks-dtensor-rows-and-columns", "2ranks-sharded-tensor-enumerable",
            "2ranks-dtensor-uneven-columns-dtypes"}


def build(tmp: Path) -> Iterator[tuple[str, Path]]:
    """Every case's directory, each made in its own folder under ``tmp``."""
    for name, make in CASES.items():
        (tmp / name).mkdir(parents=True, exist_ok=True)
        yield name, make(tmp / name)
