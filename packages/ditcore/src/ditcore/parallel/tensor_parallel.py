"""Tensor (and sequence) parallelism: swap a model's linears for column- and row-parallel ones, as its plan says.

Column-parallel layers split output features (heads, MLP columns, adaLN's modulations, which every rank then
gathers whole), row-parallel ones input features, a norm over every head's features (Wan's QK norm) the heads' scales,
summing its statistics over the ranks; the weights
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
from typing import Literal

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from ditcore.models.plan import ColumnParallel, NormOverHeads, Plan, RowParallel
from ditcore.parallel.dims import ParallelGroups


def is_tp_sharded(p: torch.Tensor) -> bool:
    return bool(getattr(p, "tensor_model_parallel", False))


def shard(full: torch.Tensor, local: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This rank's piece of a full tensor, for a parameter split along `partition_dim` over TP, or an expert
    parameter split along dim 0 over EP (its tags: ditcore.parallel.expert_parallel)."""
    if getattr(local, "expert_parallel", False):
        full = full.chunk(local.ep_size)[local.ep_rank]
    if not is_tp_sharded(local):
        return full
    return full.chunk(size, dim=local.partition_dim)[rank]


def full_shape(local: torch.Tensor, size: int) -> torch.Size:
    """The one-device shape of a parameter of which this rank holds `local` (the inverse of `shard`)."""
    if getattr(local, "expert_parallel", False):
        return torch.Size([local.shape[0] * local.ep_size, *local.shape[1:]])
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


def in_compute_dtype(x: torch.Tensor) -> torch.Tensor:
    """x as autocast's matmul reads it (cast to the autocast dtype when autocast is on): gathering it so moves the
    bytes the matmul needs, not an fp32 copy of them, and changes no value the matmul sees."""
    device = x.device.type
    return x.to(torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else x


class _GatheredLinear(torch.autograd.Function):
    """Sequence parallel, column-parallel: all-gather the tokens (dim 0), then the matmul. Only this rank's tokens
    are kept for backward, which gathers them again for the weight's gradient (as Megatron-Core does): keeping the
    gathered input would cost tp times the memory in every column-parallel layer. The input's gradient is
    reduce-scattered back to the ranks' tokens. Under autocast the caller passes x in the compute dtype
    (`in_compute_dtype`): both gathers and the kept tokens are then half the bytes of fp32."""

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


class _GatherFeatures(torch.autograd.Function):
    """Forward: all-gather the ranks' output features (the last dim) in rank order, which for contiguous column
    shards is the one-device column order. Backward: this rank's features' gradient, which is whole on every rank
    when what follows ran alike on every rank (`sum_grad` False), or, when each rank applied the output to its own
    tokens only (sequence parallelism), a partial sum: reduce-scattered."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, group, rank: int, size: int, sum_grad: bool) -> torch.Tensor:
        ctx.group, ctx.rank, ctx.size, ctx.sum_grad = group, rank, size, sum_grad
        gathered = _all_gather(y.movedim(-1, 0), group)  # (size·F, ...): rank r's features at rows r·F..(r+1)·F
        return gathered.movedim(0, -1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.movedim(-1, 0)
        mine = _reduce_scatter(grad, ctx.group) if ctx.sum_grad else grad.chunk(ctx.size)[ctx.rank]
        return mine.movedim(0, -1).contiguous(), None, None, None, None


class ColumnParallelLinear(nn.Module):
    """y = x Wᵀ + b with W's rows (output features) split over the TP ranks: each rank computes its features.

    `sequence_parallel`: the input holds this rank's tokens only and is all-gathered first. Otherwise the input is
    replicated (whole on every rank) and its gradient is summed over the ranks in backward.

    `gather_output` (with a replicated input): the ranks' output features are all-gathered, so every rank gets the
    whole output, for small per-sample outputs such as adaLN's modulations: the weight is divided by TP, the
    output is not. "split": what follows runs alike on every rank, each keeps its features' gradient; "sum": each
    rank applies the output to its own tokens only (sequence parallelism), so the gradients are summed.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, groups: ParallelGroups,
                 sequence_parallel: bool, device=None, dtype=None,
                 gather_output: Literal["split", "sum"] | None = None):
        super().__init__()
        tp = groups.dims.tp
        if out_features % tp:
            raise ValueError(f"{out_features} output features cannot be split over {tp} tensor-parallel ranks")
        if sequence_parallel and gather_output:
            raise ValueError("a column-parallel linear gathers either its input tokens (sequence_parallel) or its "
                             "output features (gather_output), not both")
        self.in_features, self.out_features = in_features, out_features // tp  # this rank's
        self.group, self.sequence_parallel = groups.tp_group, sequence_parallel
        self.gather_output, self.rank, self.size = gather_output, groups.tp_rank, tp
        self.weight = _tag(nn.Parameter(torch.empty(self.out_features, in_features, device=device, dtype=dtype)), 0)
        self.bias = _tag(nn.Parameter(torch.empty(self.out_features, device=device, dtype=dtype)), 0) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            y = _GatheredLinear.apply(in_compute_dtype(x), self.weight, self.group)
        else:
            y = F.linear(_CopyToRanks.apply(x, self.group), self.weight)
        # the bias after the matmul, in its dtype (as Megatron-Core's layers with ditcore's bias add did: the matmul's
        # output is a tensor of its own, which the memory plan counts, ditcore.memory)
        y = y if self.bias is None else y + self.bias.to(y.dtype)
        if self.gather_output:
            y = _GatherFeatures.apply(y, self.group, self.rank, self.size, self.gather_output == "sum")
        return y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features} (this rank's), " \
               f"sequence_parallel={self.sequence_parallel}, gather_output={self.gather_output}"


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


class RMSNormOverRanks(nn.Module):
    """An RMS norm over (heads, head_dim) whose heads are split over the TP ranks (plan style NormOverHeads: Wan's QK
    norm): each rank holds its heads' scales and features, and normalises them by the mean square over every head,
    its sum of squares summed over the ranks in float32. That sum is used alike by every rank, each for its own
    features, so its gradient on a rank is a part: all-reduced in backward as in forward."""

    def __init__(self, norm: nn.RMSNorm, groups: ParallelGroups):
        super().__init__()
        heads, head_dim = norm.normalized_shape
        tp = groups.dims.tp
        self.group, self.features = groups.tp_group, heads * head_dim
        self.eps = torch.finfo(torch.float32).eps if norm.eps is None else norm.eps  # nn.RMSNorm's default
        self.weight = _tag(nn.Parameter(torch.empty(heads // tp, head_dim, device=norm.weight.device,
                                                    dtype=norm.weight.dtype)), 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., this rank's heads, head_dim), in x's dtype
        squares = x.float().square().sum((-2, -1), keepdim=True)
        mean = _SumOverRanks.apply(_CopyToRanks.apply(squares, self.group), self.group) / self.features
        return x * torch.rsqrt(mean + self.eps).to(x.dtype) * self.weight.to(x.dtype)

    def extra_repr(self) -> str:
        return f"heads={self.weight.shape[0]} (this rank's), head_dim={self.weight.shape[1]}, eps={self.eps}"


def _parallel_norm(norm: nn.Module, groups: ParallelGroups) -> nn.Module:
    if not isinstance(norm, nn.RMSNorm) or len(norm.normalized_shape) != 2:
        raise TypeError(f"the plan makes a {type(norm).__name__} NormOverHeads: expected an RMS norm over (heads, "
                        "head_dim)")
    layer = RMSNormOverRanks(norm, groups)
    if not norm.weight.is_meta:
        with torch.no_grad():
            layer.weight.copy_(shard(norm.weight, layer.weight, groups.tp_rank, groups.dims.tp))
    return layer


def _parallel_linear(style: ColumnParallel | RowParallel, linear: nn.Linear, groups: ParallelGroups,
                     sequence_parallel: bool) -> nn.Module:
    out_f, in_f = linear.weight.shape
    # only this rank's shard is allocated, where the linear lives (on the meta device: shapes only)
    where = dict(device=linear.weight.device, dtype=linear.weight.dtype)
    if isinstance(style, RowParallel):
        layer = RowParallelLinear(in_f, out_f, linear.bias is not None, groups, sequence_parallel, **where)
    elif style.gather_output:  # the input replicated; the output used for this rank's tokens only under SP
        layer = ColumnParallelLinear(in_f, out_f, linear.bias is not None, groups, False, **where,
                                     gather_output="sum" if sequence_parallel else "split")
    else:
        sp = sequence_parallel and style.sequence_parallel
        layer = ColumnParallelLinear(in_f, out_f, linear.bias is not None, groups, sp, **where)
    if not linear.weight.is_meta:
        with torch.no_grad():
            full = {"weight": linear.weight, "bias": linear.bias}
            for name, p in layer.named_parameters(recurse=False):
                p.copy_(shard(full[name], p, groups.tp_rank, groups.dims.tp))
    return layer


def apply_tensor_parallel(model: nn.Module, plan: Plan, groups: ParallelGroups, sequence_parallel: bool) -> None:
    """Replace the plan's column/row-parallel linears and norms over heads in place and give attention modules their
    share of heads."""
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
            layer = _parallel_linear(style, module, groups, sequence_parallel)
            model.get_submodule(parent_name).register_module(child, layer)
        elif isinstance(style, NormOverHeads) and next(module.parameters(), None) is not None:  # (not qk_norm's
            parent_name, _, child = name.rpartition(".")  # Identity)
            model.get_submodule(parent_name).register_module(child, _parallel_norm(module, groups))
