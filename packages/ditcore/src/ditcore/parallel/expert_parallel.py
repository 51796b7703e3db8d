"""Expert parallelism (`ParallelDims.ep`): a mixture of experts' experts split over the EP group, tokens sent to them
and back by all-to-alls of a static shape.

The EP group is ep consecutive ranks of the DP×CP group (ranks that hold the same TP shard and see different tokens,
ditcore.parallel.dims). EP rank r holds experts r·E/ep to (r + 1)·E/ep − 1 of every MoE block (`GroupedExperts`'
w_in and w_out, dim 0); the router and everything else stay whole on every rank.

The dispatch (`ExpertDispatch`, the experts' `dispatch`) asks nothing of the host: an all-to-all whose split sizes
depend on the routing would need them read back, so each rank sends every EP peer a buffer of a fixed C rows,
C = ceil(moe.capacity_factor · T·k / ep) for its T tokens and top_k = k. Its (token, choice) rows are placed in the
slots by gathers (each slot's source row; an empty slot reads a zero row) and their local expert ids travel in a
second, integer all-to-all. A receiver sorts the rows by expert and runs them through one grouped matmul, the empty
slots last, in the last expert's group: a zero row gives exactly zero through MLPs without biases, so grouped_mm
never reads an uninitialised row, and those outputs are masked to zero anyway. The reverse all-to-all brings the
outputs back to their slots, which are gathered back into (token, choice) order and weighted as on one process
(`ditcore.models.moe.combine`). Every move is a gather whose backward is the inverse gather: nothing is scattered.

Drops: a rank's rows for one peer fill its C slots in (token, choice) order, earliest tokens first; a row past C is
dropped and contributes zero to its token's output (its weight's gradient then is zero too). With capacity_factor
>= ep a peer's slots hold every row a rank has, nothing is dropped, and EP computes what one process computes. With
fewer slots what a token gets depends on the tokens before it on its rank: packed == alone no longer holds. The
share of rows dropped is logged (`Routing.metrics`' moe_dropped).

The routing losses: each rank computes them over its own tokens (as Megatron-Core by default, per micro-batch), and
data parallelism averages their gradients: they equal one process's over the same rows per rank, not over the
global batch.

Gradients: the experts' gradients are complete for the tokens of the whole EP group (the combine's backward sends them
back); `reduce_expert_grads` sums them over the expert-data-parallel group (the ranks holding the same experts) and
divides by dp·cp, which leaves them as DDP leaves the others. DDP itself skips them (`apply_expert_parallel` lists
them as its parameters to ignore). Under FSDP the experts are sharded over the expert-data-parallel group
(ditcore.parallel.fsdp), whose reduce-scatter averages their gradients over it: `reduce_expert_grads` only rescales
those.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from ditcore.layout import reorder
from ditcore.models.moe import GroupedExperts, combine, compute_dtype
from ditcore.parallel.comm import all_to_all
from ditcore.parallel.dims import ParallelGroups


def is_expert_sharded(p: torch.Tensor) -> bool:
    return bool(getattr(p, "expert_parallel", False))


def apply_expert_parallel(model: nn.Module, groups: ParallelGroups) -> None:
    """Keep this rank's experts of every MoE block (meta or real weights) and give the blocks the dispatch. The
    parameters keep their one-device names; their tags (expert_parallel, ep_rank, ep_size) tell materialize,
    load_consolidated, gather_full and the checkpoint views which rows of dim 0 they are."""
    ep, rank = groups.dims.ep, groups.ep_rank
    names = []
    for prefix, module in model.named_modules():
        if not isinstance(module, GroupedExperts):
            continue
        dispatch = ExpertDispatch(groups, model.cfg.moe.capacity_factor)
        for key, p in list(module.named_parameters(recurse=False)):
            n = p.shape[0] // ep
            mine = nn.Parameter(p.detach()[rank * n:(rank + 1) * n].clone(), requires_grad=p.requires_grad)
            mine.expert_parallel, mine.ep_rank, mine.ep_size = True, rank, ep
            setattr(module, key, mine)
            names.append(f"{prefix}.{key}")
        module.dispatch = dispatch
    # DDP averages over DP×CP; these are averaged over their own ranks by reduce_expert_grads
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)


def reduce_expert_grads(model: nn.Module, groups: ParallelGroups) -> None:
    """Sum the experts' gradients over the expert-data-parallel group, one collective, and divide by dp·cp (module
    docstring): then they are what DDP's average over DP×CP makes of the others. Experts sharded by FSDP over that
    group come averaged over it (a sum / (dp·cp/ep); FSDP2 does not divide over one rank, ep = dp·cp): their local
    pieces are divided by ep."""
    experts = [p.grad for p in model.parameters() if p.grad is not None and is_expert_sharded(p)]
    sharded = [g.to_local() for g in experts if isinstance(g, DTensor)]
    if sharded:
        torch._foreach_mul_(sharded, 1.0 / groups.dims.ep)
    grads = [g for g in experts if not isinstance(g, DTensor)]
    if not grads:
        return
    if groups.dims.dp * groups.dims.cp > groups.dims.ep:
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=groups.edp_group)
        torch._foreach_copy_(grads, [s.view_as(g) for g, s in zip(grads, flat.split([g.numel() for g in grads]),
                                                                     strict=True)])
    torch._foreach_mul_(grads, 1.0 / (groups.dims.dp * groups.dims.cp))


class _Take(torch.autograd.Function):
    """Rows of x by index, index == len(x) giving a zero row; its backward takes the gradient's rows by `back` the
    same way. For a one-to-one placement (each row to at most one slot, each slot from at most one row) that is the
    exact backward, and a gather, where index_select's would scatter-add."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor, back: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(back)
        return F.pad(x, (0, 0, 0, 1)).index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (back,) = ctx.saved_tensors
        return F.pad(grad, (0, 0, 0, 1)).index_select(0, back), None, None


class ExpertDispatch:
    """The experts' forward under EP (module docstring): GroupedExperts.forward hands itself and its inputs here."""

    def __init__(self, groups: ParallelGroups, capacity_factor: float):
        self.group, self.size, self.capacity_factor = groups.ep_group, groups.dims.ep, capacity_factor

    def __deepcopy__(self, memo):  # holds a process group, which cannot be copied: model copies (EMA) share it
        return self

    def capacity(self, rows: int) -> int:
        """Slots per EP peer for a rank's `rows` (token, choice) rows."""
        return math.ceil(self.capacity_factor * rows / self.size)

    def __call__(self, experts: GroupedExperts, x: torch.Tensor, chosen: torch.Tensor,
                 weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        T, k = chosen.shape
        ep, L, R = self.size, experts.w_in.shape[0], T * k  # L: experts on this rank
        C = self.capacity(R)
        device = chosen.device
        flat = chosen.reshape(-1)  # (R,) the expert of (token t, choice j) at t·k + j
        peer = flat // L
        to_peer = peer[:, None] == torch.arange(ep, device=device)  # (R, ep)
        place = (to_peer.cumsum(0) * to_peer).sum(1) - 1  # (R,) among the rows to the same peer, earliest first
        kept = place < C
        slot = torch.where(kept, peer * C + place, ep * C)  # (R,) its slot in the send buffer; ep·C: dropped
        # each slot's row (R: empty); dropped rows all write the extra slot, which is cut off. (An integer scatter
        # without a gradient: what moves values below is gathers.)
        source = torch.full((ep * C + 1,), R, device=device).scatter_(0, slot, torch.arange(R, device=device))[:-1]
        ids = F.pad(flat % L, (0, 1), value=L)[source].to(torch.int32)  # (ep·C,) local expert; L: empty slot

        dtype = compute_dtype(x)
        rows = x.to(dtype)[:, None].expand(T, k, -1).reshape(R, -1)  # its backward sums the k choices: no scatter
        sent = _Take.apply(rows, source, slot)  # (ep·C, D) C rows per peer
        splits = [C] * ep
        got = all_to_all(sent, splits, splits, self.group)  # (ep·C, D) C rows from each peer
        got_ids = all_to_all(ids, splits, splits, self.group)
        order = got_ids.argsort(stable=True)  # by local expert, the empty slots last
        inverse = order.argsort()
        ends = torch.searchsorted(got_ids[order], torch.arange(L, device=device, dtype=torch.int32), right=True)
        ends = torch.cat([ends[:-1], ends.new_full((1,), ep * C)]).to(torch.int32)  # the empty slots: last group
        y = reorder(experts.mlps(reorder(got, order, inverse), ends), inverse, order)  # (ep·C, D) in arrival order
        y = torch.where((got_ids < L)[:, None], y, 0)
        back = all_to_all(y, splits, splits, self.group)  # (ep·C, D) the outputs of the slots this rank sent
        out = _Take.apply(back, slot, source)  # (R, D) in (t, j) order; a dropped row: zero
        return combine(out, weights), 1 - kept.float().mean()
