"""Tensor, sequence and context parallelism for a built DiT, and the gradient/weight bookkeeping they need.

`parallelize(model, groups)` turns a one-device DiT (real or meta weights) into this rank's shard:
- TP: the attention projections (self and cross) and the MLP become Megatron-Core Column/RowParallelLinear
  layers; heads are split across TP ranks. The adaLN modulation stays replicated: it runs once per sample,
  not per token, so splitting it would add a collective per block and save almost nothing.
- SP (with TP): tokens are split over TP ranks outside attention. Megatron's layers all-gather before the
  column-parallel matmuls and reduce-scatter after the row-parallel ones.
- CP: each rank holds a contiguous slice of every row; attention all-gathers keys and values.

Parameter names are unchanged, so a consolidated (unsharded) state dict has exactly the one-device keys.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

from ditcore.models.dit import DiT, Sharding
from ditcore.parallel.dims import ParallelGroups

# Which linears are split, and how. Column: output features split (heads / MLP columns); row: input features.
# Names are relative to a DiTBlock.
COLUMN = ("attn.qkv", "cross.q", "cross.kv", "mlp.0")
ROW = ("attn.proj", "cross.proj", "mlp.2")
TEXT_SIDE = ("cross.kv",)  # reads text tokens, which are never sequence-split


@functools.cache
def _parallel_linear_classes():
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    class Column(ColumnParallelLinear):
        def forward(self, x):  # Megatron returns (output, bias); like nn.Linear, return the output, bias added
            return super().forward(x)[0]

    class Row(RowParallelLinear):
        def forward(self, x):
            return super().forward(x)[0]

    return Column, Row


def _megatron_linear(kind: str, linear: nn.Linear, groups: ParallelGroups, sequence_parallel: bool) -> nn.Module:
    from megatron.core import ModelParallelConfig

    Column, Row = _parallel_linear_classes()
    config = ModelParallelConfig(
        tensor_model_parallel_size=groups.dims.tp,
        sequence_parallel=sequence_parallel,
        use_cpu_initialization=True,  # allocate on the host, then move; works with and without CUDA
        perform_initialization=True,  # tags the weights as sharded; the values are overwritten below
        params_dtype=linear.weight.dtype,
        gradient_accumulation_fusion=False,
    )
    out_f, in_f = linear.weight.shape
    kw = dict(config=config, init_method=nn.init.zeros_, bias=linear.bias is not None, skip_bias_add=False,
              tp_group=groups.tp_group)
    if kind == "column":
        layer = Column(in_f, out_f, gather_output=False, **kw)
    else:
        layer = Row(in_f, out_f, input_is_parallel=True, **kw)
    if linear.weight.device.type != "meta":
        with torch.no_grad():
            full = {"weight": linear.weight, "bias": linear.bias}
            for name, p in layer.named_parameters(recurse=False):
                p.copy_(shard(full[name], p, groups.tp_rank, groups.dims.tp))
    return layer.to(linear.weight.device)


def is_tp_sharded(p: torch.Tensor) -> bool:
    return bool(getattr(p, "tensor_model_parallel", False))


def shard(full: torch.Tensor, local: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This rank's piece of a full tensor, for a parameter Megatron split along `partition_dim`."""
    if not is_tp_sharded(local):
        return full
    return full.chunk(size, dim=local.partition_dim)[rank]


def parallelize(model: DiT, groups: ParallelGroups) -> DiT:
    """Shard `model` in place for this rank (see the module docstring) and return it."""
    dims = groups.dims
    dims.check_model(model.cfg.num_heads)
    sp = dims.sequence_parallel and dims.tp > 1
    if dims.tp > 1:
        for block in model.blocks:
            block.attn.num_heads = model.cfg.num_heads // dims.tp
            if model.cfg.text_dim:
                block.cross.num_heads = model.cfg.num_heads // dims.tp
            for kind, names in (("column", COLUMN), ("row", ROW)):
                for name in names:
                    if name.startswith("cross.") and not model.cfg.text_dim:
                        continue
                    parent_name, _, child = name.rpartition(".")
                    parent = block.get_submodule(parent_name)
                    linear = parent.get_submodule(child)
                    parent.register_module(child, _megatron_linear(kind, linear, groups, sp and name not in TEXT_SIDE))
    model.sharding = Sharding(
        cp_group=groups.cp_group if dims.cp > 1 else None, cp_rank=groups.cp_rank, cp_size=dims.cp,
        sp_group=groups.tp_group if sp else None, sp_rank=groups.tp_rank if sp else 0, sp_size=dims.tp if sp else 1,
    )
    _tag_partial_gradients(model, dims.tp > 1, sp)
    return model


def _tag_partial_gradients(model: DiT, tp: bool, sp: bool) -> None:
    """Mark replicated parameters whose gradient on one TP rank is only part of the whole.

    - QK-norm weights are shared by all heads, and each TP rank holds only some heads.
    - Under SP every replicated parameter applied to (or upstream of) this rank's share of the tokens sees
      only those tokens: embedders, adaLN, norms, row-parallel biases, the final layer. Not the text
      projection: it feeds only the column-parallel cross-attention K/V, whose input gradient Megatron
      already all-reduces over TP.
    """
    for name, p in model.named_parameters():
        p.tp_partial_grad = False
        if not tp or is_tp_sharded(p):
            continue
        if "q_norm" in name or "k_norm" in name or (sp and not name.startswith("text_embedder.")):
            p.tp_partial_grad = True


def finalize_grads(model: nn.Module, groups: ParallelGroups | None) -> None:
    """Complete the gradients after backward (and after DDP's averaging over DP×CP), before clipping/stepping.

    1. Sum partial gradients of replicated parameters over TP (see `_tag_partial_gradients`).
    2. Context parallel: every CP rank computed the full loss but only its slice of the tokens, so its
       gradients are partial sums; DDP averaged them over DP×CP, which divides by cp once too often.
    """
    if groups is None:
        return
    partial = [p.grad for p in model.parameters() if p.grad is not None and getattr(p, "tp_partial_grad", False)]
    if partial and groups.dims.tp > 1:
        flat = torch.cat([g.reshape(-1) for g in partial])
        dist.all_reduce(flat, group=groups.tp_group)  # one collective for all of them
        for g, summed in zip(partial, flat.split([g.numel() for g in partial]), strict=True):
            g.copy_(summed.view_as(g))
    if groups.dims.cp > 1:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        torch._foreach_mul_(grads, float(groups.dims.cp))


def grad_norm(model: nn.Module, groups: ParallelGroups | None) -> torch.Tensor:
    """Global L2 norm of the gradients: sharded parameters' squares are summed over TP, replicated ones once."""
    sharded = torch.zeros((), dtype=torch.float64)
    replicated = torch.zeros((), dtype=torch.float64)
    for p in model.parameters():
        if p.grad is None:
            continue
        sq = p.grad.detach().double().square().sum().cpu()
        if is_tp_sharded(p):
            sharded += sq
        else:
            replicated += sq
    if groups is not None and groups.dims.tp > 1:
        dist.all_reduce(sharded, group=groups.tp_group)
    return (sharded + replicated).sqrt()


def clip_grad_norm_(model: nn.Module, max_norm: float, groups: ParallelGroups | None) -> torch.Tensor:
    norm = grad_norm(model, groups)
    scale = max_norm / (float(norm) + 1e-6)
    if scale < 1.0:
        torch._foreach_mul_([p.grad for p in model.parameters() if p.grad is not None], scale)
    return norm


# --------------------------------------------------------------------------------------------------
# Consolidated (unsharded) weights


def gather_full(model: nn.Module, tensors: dict[str, torch.Tensor], groups: ParallelGroups | None):
    """Unshard tensors named and shaped like `model`'s parameters/buffers (weights or gradients).

    Collective over TP: call on every rank. Rank 0 gets the one-device tensors on CPU, the others None.
    CP and DP ranks hold copies, so TP shards are all there is to gather.
    """
    params = dict(model.named_parameters())
    full = {}
    for k, v in tensors.items():
        p = params.get(k)
        if groups is not None and groups.dims.tp > 1 and p is not None and is_tp_sharded(p):
            parts = [torch.empty_like(v) for _ in range(groups.dims.tp)]
            dist.all_gather(parts, v.detach().contiguous(), group=groups.tp_group)
            full[k] = torch.cat(parts, dim=p.partition_dim).cpu()
        else:
            full[k] = v.detach().cpu().clone()
    if groups is not None and dist.get_rank() != 0:
        return None
    return full


def consolidated_state_dict(model: nn.Module, groups: ParallelGroups | None) -> dict[str, torch.Tensor] | None:
    """The one-device state dict of a model of any layout. Collective; rank 0 gets it, the others None."""
    local = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    return gather_full(model, local, groups)


def load_consolidated(model: nn.Module, state: dict[str, torch.Tensor], groups: ParallelGroups | None) -> None:
    """Load a one-device state dict into a model of any layout: each rank takes its shard."""
    params = dict(model.named_parameters())
    tp, rank = (groups.dims.tp, groups.tp_rank) if groups is not None else (1, 0)
    expected = {k for k in model.state_dict() if not k.endswith("_extra_state")}
    missing, unexpected = expected - state.keys(), state.keys() - expected
    if missing or unexpected:
        raise KeyError(f"state dict does not fit this model: missing {sorted(missing)[:5]}, "
                       f"unexpected {sorted(unexpected)[:5]} — is it a checkpoint of another architecture?")
    with torch.no_grad():
        for k, v in model.state_dict().items():
            if k.endswith("_extra_state"):
                continue
            p = params.get(k)
            src = shard(state[k], p, rank, tp) if p is not None else state[k]
            if src.shape != v.shape:
                raise ValueError(f"{k}: checkpoint shape {tuple(state[k].shape)} does not fit this model's "
                                 f"{tuple(v.shape)} (shard of tp={tp})")
            v.copy_(src)


def partition_dim(name: str) -> int | None:
    """Split dimension of a parameter of a parallelized DiT, from its name (None: replicated)."""
    module, _, kind = name.rpartition(".")
    if not module.startswith("blocks."):  # only the blocks' linears are split (t_embedder.mlp.0 is not)
        return None
    if any(module.endswith(f".{c}") for c in COLUMN):
        return 0  # column parallel: weight rows and bias split
    if kind == "weight" and any(module.endswith(f".{r}") for r in ROW):
        return 1  # row parallel: weight columns split, bias replicated
    return None


def consolidate_shard_files(files: list, key: str = "model") -> dict[str, torch.Tensor]:
    """One-device state dict from a checkpoint's per-TP-shard files, offline (no process groups needed).

    Files are model_parallel_rank_XX.pt in rank order; `key` picks the state inside ("model" or "ema").
    """
    if not files:
        raise FileNotFoundError("no model_parallel_rank_*.pt files: not a training checkpoint folder")
    shards = [torch.load(f, map_location="cpu", weights_only=False)[key] for f in files]
    full = {}
    for name, first in shards[0].items():
        if name.endswith("_extra_state"):
            continue
        dim = partition_dim(name) if len(shards) > 1 else None
        full[name] = first if dim is None else torch.cat([s[name] for s in shards], dim=dim)
    return full
