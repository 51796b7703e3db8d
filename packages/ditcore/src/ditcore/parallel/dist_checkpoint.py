"""Training state in one layout-free form, written and read with torch.distributed.checkpoint (DCP).

Every tensor of the state (model and EMA weights, AdamW moments) is given to DCP as a DTensor of its one-device
shape over a (tp, dp_cp) mesh of all ranks — of its pipeline stage's ranks under PP, each stage holding its own
blocks: `Shard(partition_dim)` or `Replicate()` over TP (as the plan splits it), `Shard(0)` (FSDP) or `Replicate()`
over DP×CP. The DTensors are views of the live tensors, so nothing is copied. Each rank writes only the pieces it
holds (a replicated piece once, by one rank) and reads exactly the pieces its own layout needs: a checkpoint
written with one layout resumes with any other (TP=2 → FSDP over DP=2, FSDP over 2 → one process, TP=2 → two
pipeline stages), and `read_full` gives the one-device tensors without any process group.

Keys are the one-device names: `model.blocks.0.attn.qkv.weight`, `ema.…`, `optim.<parameter>.exp_avg`. Plain
values (step, loss history, learning-rate schedule, optimizer hyper-parameters) are pickled under their own keys.
"""

from __future__ import annotations

import functools
import pickle
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor, Replicate, Shard

from ditcore.parallel.consolidate import without_extra_state
from ditcore.parallel.dims import ParallelGroups
from ditcore.parallel.fsdp import local
from ditcore.parallel.tensor_parallel import full_shape, is_tp_sharded

MODEL, EMA, OPTIM = "model", "ema", "optim"
METADATA = ".metadata"  # DCP's index of every piece; written last by rank 0
VALUES = "values"  # the plain values, pickled


def state_tensors(model: nn.Module, ema: nn.Module | None, optimizer: torch.optim.Optimizer | None,
                  groups: ParallelGroups, device_type: str) -> dict[str, torch.Tensor]:
    """The model's, EMA's and optimizer's tensors as layout-free views (collective: creates a mesh once)."""
    mesh = _mesh(groups, device_type)
    params = dict(model.named_parameters())
    out = _module_tensors(MODEL, model, params, groups, mesh)
    if ema is not None:
        out |= _module_tensors(EMA, ema, params, groups, mesh)  # the same structure and layout as the model
    if optimizer is not None:
        init_optimizer_state(optimizer)
        for name, p in params.items():
            for key, value in optimizer.state[p].items():
                if torch.is_tensor(value):  # AdamW: step (0-d, the same on every rank), exp_avg, exp_avg_sq
                    out[f"{OPTIM}.{name}.{key}"] = _global(value, p, groups, mesh) if value.ndim else value
    return out


def optimizer_hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict]:
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def load_optimizer_hyperparameters(optimizer: torch.optim.Optimizer, saved: list[dict]) -> None:
    if len(saved) != len(optimizer.param_groups):
        raise ValueError(f"the checkpoint's optimizer has {len(saved)} parameter groups, this one "
                         f"{len(optimizer.param_groups)}")
    for group, values in zip(optimizer.param_groups, saved, strict=True):
        group.update(values)


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create AdamW's state for parameters that have none yet (zeros: what its first step would create), so that a
    checkpoint can be loaded into it before any step."""
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        raise TypeError(f"checkpoints hold Adam/AdamW state; got {type(optimizer).__name__}")
    for group in optimizer.param_groups:
        on_device = group["fused"] or group["capturable"]
        for p in group["params"]:
            if optimizer.state[p]:
                continue
            state = {"step": torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu"),
                     "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                     "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
            if group["amsgrad"]:
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            optimizer.state[p] = state


def save(ckpt: Path, tensors: dict[str, torch.Tensor], values: dict) -> None:
    """Collective: every rank writes its pieces into `ckpt` (one file per rank, fsynced); rank 0 the index.

    `values` (the same on every rank) are pickled as one object, which DCP stores once.
    """
    writer = dcp.FileSystemWriter(str(ckpt), single_file_per_rank=True, sync_files=True)
    dcp.save({**tensors, VALUES: pickle.dumps(values)}, storage_writer=writer)


def load(ckpt: Path, tensors: dict[str, torch.Tensor]) -> dict:
    """Collective: fill `tensors` in place from `ckpt`, whatever layout wrote it; returns the plain values."""
    state = {**tensors, VALUES: b""}
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(ckpt)))
    return pickle.loads(state[VALUES])


def files_of_rank(ckpt: Path, rank: int) -> list[str]:
    """The files of a checkpoint folder that DCP's writer on `rank` wrote (rank 0 also writes the index)."""
    names = sorted(p.name for p in Path(ckpt).glob(f"__{rank}_*.distcp"))
    return names + ([METADATA] if rank == 0 and (Path(ckpt) / METADATA).is_file() else [])


def stored_shapes(ckpt: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint holds, by key, with its one-device shape (from DCP's index; no tensor is read)."""
    meta = dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    return {k: tuple(m.size) for k, m in meta.items() if hasattr(m, "size")}


def model_mismatch(stored: dict[str, tuple[int, ...]], wanted: dict[str, tuple[int, ...]]) -> str | None:
    """How the model and EMA tensors a checkpoint holds (`stored`) differ from those a model wants (`wanted`, the
    same keys and one-device shapes), in words; None if they are the same. DCP alone would load the keys the model
    asks for and drop the others, so a smaller model would load "fine"."""
    prefixes = tuple(f"{p}." for p in (MODEL, EMA))
    stored = {k: v for k, v in stored.items() if k.startswith(prefixes)}
    wanted = {k: v for k, v in wanted.items() if k.startswith(prefixes)}
    if stored == wanted:
        return None
    blocks = [len({k.split(".")[2] for k in keys if k.startswith(f"{MODEL}.blocks.")}) for keys in (stored, wanted)]
    if blocks[0] != blocks[1]:
        return f"the checkpoint's model has {blocks[0]} blocks, this one {blocks[1]} (model.depth, model.preset)"
    extra, missing = sorted(stored.keys() - wanted.keys()), sorted(wanted.keys() - stored.keys())
    shapes = sorted(k for k in stored.keys() & wanted.keys() if stored[k] != wanted[k])
    parts = []
    if extra:
        parts.append(f"the checkpoint has {len(extra)} tensors this model lacks (e.g. {extra[0]})")
    if missing:
        parts.append(f"this model has {len(missing)} tensors the checkpoint lacks (e.g. {missing[0]})")
    if shapes:
        k = shapes[0]
        parts.append(f"{len(shapes)} tensors differ in shape (e.g. {k}: checkpoint {list(stored[k])}, this model "
                     f"{list(wanted[k])})")
    return "; ".join(parts)


def checkpoint_error(e: BaseException) -> str:
    """DCP's CheckpointException (a BaseException, with every rank's error and traceback in its text) as one line:
    the first rank's error."""
    if isinstance(e, CheckpointException) and e.failures:
        e = next(iter(e.failures.values()))[0]
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def read_full(ckpt: Path, prefix: str) -> dict[str, torch.Tensor]:
    """The one-device tensors under `prefix` (e.g. "ema"), on the CPU, without process groups: `{name: tensor}`."""
    reader = dcp.FileSystemReader(str(ckpt))
    meta = reader.read_metadata().state_dict_metadata
    start = prefix + "."
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
             if k.startswith(start) and hasattr(m, "size")}
    if not state:
        raise KeyError(f"the checkpoint holds no '{prefix}' tensors")
    _load_here(state, reader)
    return {k[len(start):]: v for k, v in state.items()}


def read_values(ckpt: Path) -> dict:
    """The plain values of a checkpoint (step, loss history, …), without process groups."""
    state = {VALUES: b""}
    _load_here(state, dcp.FileSystemReader(str(ckpt)))
    return pickle.loads(state[VALUES])


def _load_here(state: dict, reader) -> None:
    """dcp.load in this process alone, whatever process group exists."""
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=reader, no_dist=True)


def _module_tensors(prefix: str, module: nn.Module, params: dict, groups: ParallelGroups, mesh) -> dict:
    out = {}
    for name, value in without_extra_state(module.state_dict()).items():
        like = params.get(name, value)  # a parameter carries its TP tags; a buffer is whole on every rank
        out[f"{prefix}.{name}"] = _global(value, like, groups, mesh)
    return out


def _global(value: torch.Tensor, like: torch.Tensor, groups: ParallelGroups, mesh) -> DTensor:
    """`value` (this rank's piece, or a DTensor over DP×CP) as a DTensor of its one-device shape over all ranks."""
    piece = local(value).detach()
    tp = Shard(like.partition_dim) if is_tp_sharded(like) else Replicate()
    dp = Shard(0) if isinstance(value, DTensor) else Replicate()
    shape = full_shape(like, groups.dims.tp)
    return DTensor.from_local(piece, mesh, [tp, dp], run_check=False, shape=shape,
                              stride=torch.empty(shape, device="meta").stride())


@functools.cache
def _mesh(groups: ParallelGroups, device_type: str):
    """This pipeline stage's ranks (all ranks without PP) as a (tp, dp_cp) mesh over Megatron's own TP and DP×CP
    groups (no new communicators). Megatron puts TP peers next to each other and stages outermost:
    rank = tp_rank + tp·dp_cp_rank + tp·dp_cp·pp_rank. A tensor that every stage holds (the conditioning
    embedders) is then one replicated piece per stage, and DCP writes it once."""
    from torch.distributed.device_mesh import DeviceMesh

    world, tp, pp = dist.get_world_size(), groups.dims.tp, groups.dims.pp
    ranks = torch.arange(world).reshape(pp, world // (tp * pp), tp)[groups.pp_rank].T
    mesh = DeviceMesh.from_group([groups.tp_group, groups.dp_cp_group], device_type, mesh=ranks,
                                 mesh_dim_names=("tp", "dp_cp"))
    if tuple(mesh.get_coordinate()) != (groups.tp_rank, groups.dp_cp_rank):
        raise RuntimeError(f"rank {dist.get_rank()}: the checkpoint mesh puts it at {mesh.get_coordinate()}, "
                           f"Megatron at tp {groups.tp_rank}, dp×cp {groups.dp_cp_rank}")
    return mesh
