"""Tensor (and sequence) parallelism: swap a model's linears for column- and row-parallel ones, as its plan says.

Column-parallel layers split output features (heads, MLP columns), row-parallel ones input features; the weights
are laid out as Megatron-Core lays them and tagged as it tags them (`tensor_model_parallel`, `partition_dim`,
`partition_stride`), so gradient finalisation, consolidation, materialisation and checkpoints read them alike.
With sequence parallelism a column-parallel layer all-gathers the tokens before its matmul and a row-parallel one
reduce-scatters after its own. Parameter names are unchanged, so a consolidated state dict has exactly the
one-device keys.

Why not Megatron-Core's ColumnParallelLinear/RowParallelLinear: their collectives run eagerly inside autograd
functions, which torch.compile cannot trace. They broke a compiled block into 19 graphs, and under activation
checkpointing into none at all (dynamo gave up on the whole block, silently). Here every collective is a functional
collective (torch.distributed._functional_collectives), which dynamo records in the block's graph like any other op
and the compiler may overlap with the matmuls around it: a compiled block stays one graph under every layout, with
or without checkpointing (tests/ditcore/parallel/test_compile.py). The process groups stay Megatron-Core's.
"""

from __future__ import annotations

import fnmatch

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from ditcore.models.plan import ColumnParallel, Plan, RowParallel
from ditcore.parallel.dims import ParallelGroups


def is_tp_sharded(p: torch.Tensor) -> bool:
    return bool(getattr(p, "tensor_model_parallel", False))


def shard(full: torch.Tensor, local: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This rank's piece of a full tensor, for a parameter split along `partition_dim`."""
    if not is_tp_sharded(local):
        return full
    return full.chunk(size, dim=local.partition_dim)[rank]


def full_shape(local: torch.Tensor, size: int) -> torch.Size:
    """The one-device shape of a parameter of which this rank holds `local` (the inverse of `shard`)."""
    if not is_tp_sharded(local):
        return local.shape
    if getattr(local, "partition_stride", 1) != 1:
        raise NotImplementedError(f"a parameter split with partition_stride={local.partition_stride}; "
                                  "ditcore's plans split contiguously (stride 1)")
    shape = list(local.shape)
    shape[local.partition_dim] *= size
    return torch.Size(shape)


def _tag(p: nn.Parameter, dim: int) -> nn.Parameter:
    p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, 1
    return p


# --------------------------------------------------------------------------------------------------
# The four moves between replicated, split and partial activations (Megatron-Core's "mappings"), as functional
# collectives. Each holds its group and size as plain attributes: nothing is asked of torch.distributed in forward.


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    return funcol.wait_tensor(funcol.all_reduce(x.contiguous(), "sum", group))


def _all_gather(x: torch.Tensor, group) -> torch.Tensor:
    return funcol.wait_tensor(funcol.all_gather_single(x.contiguous(), 0, group))


def _reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    return funcol.wait_tensor(funcol.reduce_scatter_single(x.contiguous(), "sum", 0, group))


class _CopyToRanks(torch.autograd.Function):
    """Forward: the replicated input as it is. Backward: every rank's gradient of it is partial, so summed."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_reduce(grad, ctx.group), None


class _SumOverRanks(torch.autograd.Function):
    """Forward: sum the ranks' partial outputs. Backward: the summed output was used alike on every rank, so each
    rank's gradient is already whole (an all-reduce here would count it tp times)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _ScatterSum(torch.autograd.Function):
    """Forward: sum the ranks' partial outputs and keep this rank's tokens (dim 0). Backward: all-gather the
    gradients of every rank's tokens. (Written out rather than funcol's autograd variant, whose asynchronous wrapper
    kept tensors alive longer: the memory plan's measurements, tests/ditcore/test_memory.py.)"""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _reduce_scatter(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather(grad, ctx.group), None


class _GatheredLinear(torch.autograd.Function):
    """Sequence parallel, column-parallel: all-gather the tokens (dim 0), then the matmul. Only this rank's tokens
    are kept for backward, which gathers them again for the weight's gradient (as Megatron-Core does): keeping the
    gathered input would cost tp times the memory in every column-parallel layer. The input's gradient is
    reduce-scattered back to the ranks' tokens."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        ctx.save_for_backward(x, weight)
        # autocast applies in here as in F.linear outside: the matmul runs in the autocast dtype
        return F.linear(_all_gather(x, group), weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        total = _all_gather(x, ctx.group).to(grad.dtype)  # (N, B, in): every rank's tokens
        grad_x = _reduce_scatter(grad.matmul(weight.to(grad.dtype)), ctx.group).to(x.dtype)
        grad_w = grad.reshape(-1, grad.shape[-1]).t().matmul(total.reshape(-1, total.shape[-1])).to(weight.dtype)
        return grad_x, grad_w, None


class ColumnParallelLinear(nn.Module):
    """y = x Wᵀ + b with W's rows (output features) split over the TP ranks: each rank computes its features.

    `sequence_parallel`: the input holds this rank's tokens only and is all-gathered first. Otherwise the input is
    replicated (whole on every rank) and its gradient is summed over the ranks in backward.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, groups: ParallelGroups,
                 sequence_parallel: bool, device=None, dtype=None):
        super().__init__()
        tp = groups.dims.tp
        if out_features % tp:
            raise ValueError(f"{out_features} output features cannot be split over {tp} tensor-parallel ranks")
        self.in_features, self.out_features = in_features, out_features // tp  # this rank's
        self.group, self.sequence_parallel = groups.tp_group, sequence_parallel
        self.weight = _tag(nn.Parameter(torch.empty(self.out_features, in_features, device=device, dtype=dtype)), 0)
        self.bias = _tag(nn.Parameter(torch.empty(self.out_features, device=device, dtype=dtype)), 0) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            y = _GatheredLinear.apply(x, self.weight, self.group)
        else:
            y = F.linear(_CopyToRanks.apply(x, self.group), self.weight)
        # the bias after the matmul, in its dtype (as Megatron-Core's layers with ditcore's bias add did: the matmul's
        # output is a tensor of its own, which the memory plan counts, ditcore.memory)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features} (this rank's), " \
               f"sequence_parallel={self.sequence_parallel}"


class RowParallelLinear(nn.Module):
    """y = x Wᵀ + b with W's columns (input features) split over the TP ranks: each rank's input holds its features
    (a column-parallel layer's output) and its product is a partial sum, summed over the ranks — or, under sequence
    parallelism, reduce-scattered so that each rank keeps the sum for its own tokens. The bias is whole on every rank
    and added after the sum (under SP to this rank's tokens only: its gradient is partial, tagged `sequence_parallel`
    as Megatron-Core tags it)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, groups: ParallelGroups,
                 sequence_parallel: bool, device=None, dtype=None):
        super().__init__()
        tp = groups.dims.tp
        if in_features % tp:
            raise ValueError(f"{in_features} input features cannot be split over {tp} tensor-parallel ranks")
        self.in_features, self.out_features = in_features // tp, out_features  # this rank's
        self.group, self.sequence_parallel = groups.tp_group, sequence_parallel
        self.weight = _tag(nn.Parameter(torch.empty(out_features, self.in_features, device=device, dtype=dtype)), 1)
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        if bias:
            self.bias.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        y = (_ScatterSum if self.sequence_parallel else _SumOverRanks).apply(y, self.group)
        return y if self.bias is None else y + self.bias.to(y.dtype)  # in the output's dtype, as nn.Linear's

    def extra_repr(self) -> str:
        return f"in_features={self.in_features} (this rank's), out_features={self.out_features}, " \
               f"sequence_parallel={self.sequence_parallel}"


def _parallel_linear(style: ColumnParallel | RowParallel, linear: nn.Linear, groups: ParallelGroups,
                     sequence_parallel: bool) -> nn.Module:
    out_f, in_f = linear.weight.shape
    cls = ColumnParallelLinear if isinstance(style, ColumnParallel) else RowParallelLinear
    # only this rank's shard is allocated, where the linear lives (on the meta device: shapes only)
    layer = cls(in_f, out_f, linear.bias is not None, groups, sequence_parallel, device=linear.weight.device,
                dtype=linear.weight.dtype)
    if not linear.weight.is_meta:
        with torch.no_grad():
            full = {"weight": linear.weight, "bias": linear.bias}
            for name, p in layer.named_parameters(recurse=False):
                p.copy_(shard(full[name], p, groups.tp_rank, groups.dims.tp))
    return layer


def apply_tensor_parallel(model: nn.Module, plan: Plan, groups: ParallelGroups, sequence_parallel: bool) -> None:
    """Replace the plan's column/row-parallel linears in place and give attention modules their share of heads."""
    tp = groups.dims.tp
    for name, module in list(model.named_modules()):
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in plan.heads):
            module.num_heads //= tp
            if hasattr(module, "num_kv_heads"):  # grouped-query attention: whole groups per rank
                module.num_kv_heads //= tp
        style = plan.module_style(name)
        if isinstance(style, ColumnParallel | RowParallel):
            if not isinstance(module, nn.Linear):
                raise TypeError(f"the plan makes {name} {type(style).__name__}, but it is a "
                                f"{type(module).__name__}, not an nn.Linear")
            parent_name, _, child = name.rpartition(".")
            sp = sequence_parallel and not (isinstance(style, ColumnParallel) and not style.sequence_parallel)
            model.get_submodule(parent_name).register_module(child, _parallel_linear(style, module, groups, sp))
