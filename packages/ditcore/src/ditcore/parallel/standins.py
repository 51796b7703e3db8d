"""A rank of a tensor-, sequence- or context-parallel layout on one process, for the estimators that run the model at
one rank's shapes (ditcore.memory, ditcore.traffic): the layers and row splits of ditcore.parallel.tensor_parallel and
context_parallel as their memory on that rank looks, without process groups (`rank_share`), the row split's
`permutation` (a model's regrouping of tokens between blocks) included, so an architecture needs no stand-in of its
own. A change to what those layers keep or make belongs here too.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ditcore.layout import reorder
from ditcore.models import plan_for
from ditcore.models.attention import RowSplit
from ditcore.models.plan import ColumnParallel, NormOverHeads, RowParallel
from ditcore.parallel.tensor_parallel import in_compute_dtype


class _Gathered(torch.autograd.Function):
    """A sequence-parallel column-parallel matmul's memory (ditcore.parallel.tensor_parallel._GatheredLinear): the
    rank's tokens gathered tp times, and only its own kept for backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, tp: int) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return F.linear(x.repeat(tp, *[1] * (x.ndim - 1)), weight)

    @staticmethod
    def backward(ctx, grad):  # never run: the record is a forward
        raise NotImplementedError


class _RankLinear(nn.Module):
    """A tensor-parallel rank's linear as ditcore.parallel.tensor_parallel makes it, on one process: its share of the
    weight, the matmul's output a tensor of its own (the bias added after it), a row-parallel output summed (a new
    tensor), or under sequence parallelism reduce-scattered to the rank's tokens; a column-parallel output whose
    features are gathered (`gather`: adaLN's) all-gathered into a new tensor of every rank's features."""

    def __init__(self, linear: nn.Linear, column: bool, tp: int, sp: int, gather: bool = False):
        super().__init__()
        out_f, in_f = linear.weight.shape
        self.column, self.sp, self.gather = column, sp, tp if gather else 1
        self.weight = nn.Parameter(torch.empty(out_f // tp if column else out_f, in_f if column else in_f // tp,
                                               device=linear.weight.device))
        self.bias = None if linear.bias is None else nn.Parameter(
            torch.empty(out_f // tp if column else out_f, device=linear.weight.device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.column:
            y = _Gathered.apply(in_compute_dtype(x), self.weight, self.sp) if self.sp > 1 else F.linear(x, self.weight)
        else:
            y = F.linear(x, self.weight)
            y = y[: y.shape[0] // self.sp].clone()  # summed over the ranks: a tensor of its own (its tokens)
        y = y if self.bias is None else y + self.bias.to(y.dtype)
        return y.repeat(*[1] * (y.ndim - 1), self.gather) if self.gather > 1 else y


def rank_share(model: nn.Module, tp: int, sp: int, cp: int) -> None:
    """Make a meta model one rank's: the layers its TP plan splits cut to their share and its attention modules'
    heads divided (as ditcore.parallel.tensor_parallel does), and its rows split over sequence- and context-parallel
    ranks (`_RankRows`)."""
    if tp > 1:
        plan = plan_for(model)
        for name, module in list(model.named_modules()):
            if any(fnmatch.fnmatchcase(name, pattern) for pattern in plan.heads):
                module.num_heads //= tp
                if hasattr(module, "num_kv_heads"):
                    module.num_kv_heads //= tp
            style = plan.module_style(name)
            if isinstance(style, ColumnParallel | RowParallel):
                column = isinstance(style, ColumnParallel)
                gathers = sp if not column or (style.sequence_parallel and not style.gather_output) else 1
                layer = _RankLinear(module, column, tp, gathers, gather=column and style.gather_output)
                parent, _, child = name.rpartition(".")
                model.get_submodule(parent).register_module(child, layer)
            elif isinstance(style, NormOverHeads) and isinstance(module, nn.RMSNorm):  # its heads' share; the
                heads, head_dim = module.normalized_shape  # summed statistics are one value a token
                module.normalized_shape = (heads // tp, head_dim)
                module.weight = nn.Parameter(torch.empty(heads // tp, head_dim, device=module.weight.device))
    if sp * cp > 1:
        model.rows = _RankRows(sp, cp)


class _RankRows(RowSplit):
    """A rank's slice of every row, on one process (ditcore.parallel.context_parallel.SplitRows): its queries are
    the row's 1/cp, the tokens it holds a 1/sp of those, the keys and values gathered whole (new tensors), the output
    too. A model that regroups tokens between blocks (ST-DiT, planned at the rows a rank holds: ditcore.memory) moves
    them by `permutation`, as the split does: the ranks' pieces gathered, moved, and this rank's piece kept."""

    def __init__(self, sp: int, cp: int):
        self.sp, self.cp = sp, cp

    def spans(self, n: int) -> tuple[slice, slice]:
        return slice(0, n // self.cp), slice(0, n // (self.cp * self.sp))

    def keys_values(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (k, v) if self.cp == 1 else (k.repeat(1, 1, self.cp, 1), v.repeat(1, 1, self.cp, 1))

    def gather(self, out: torch.Tensor) -> torch.Tensor:
        return out.repeat(self.cp * self.sp, 1, 1)

    def permutation(self, index: torch.Tensor, inverse: torch.Tensor, counts) -> Callable[[torch.Tensor], torch.Tensor]:
        def move(x: torch.Tensor) -> torch.Tensor:
            return reorder(x.repeat(self.sp, 1, 1), index, inverse)[: x.shape[0]].clone()

        return move
