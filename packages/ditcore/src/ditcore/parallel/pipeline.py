"""Pipeline parallelism: the transformer blocks split into `pp` consecutive stages, one per pipeline rank.

Every stage loads the same batch and draws the same noise (its data-parallel rank is its peers'), so each one
computes the per-sample conditioning itself (noise level, class, fps, text embedders, positions, masks): only the
hidden states (n, B, D) of this rank's tokens travel from stage to stage, and their gradients back. The first stage
also holds the patch embedder, the last one the final layer; the conditioning embedders are on every stage, and
their gradients, partial on each, are summed over the stages (`reduce_grads`).

- `split_stages` prunes a one-device model (real or meta) to this rank's stage, keeping the one-device names;
- `one_f_one_b` runs a step's micro-batches through the stages, forward and backward interleaved (1F1B: at most
  `pp` micro-batches in flight on the first stage, one on the last);
- `reduce_grads` completes the gradients after it (no DDP: see `ditcore.parallel.fabric`);
- `PipelinedModel` is the forward alone, for sampling: every stage returns the last stage's output.

Point-to-point transfers go through torch.distributed's batch_isend_irecv over the pipeline group (NCCL on GPUs,
gloo on a CPU): all of one exchange posted together before any is waited for, as Megatron-Core's schedules do, so
that no ordering can deadlock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist
from torch import nn

from ditcore.errors import ConfigError
from ditcore.models import plan_for
from ditcore.parallel.dims import ParallelGroups
from ditcore.parallel.expert_parallel import is_expert_sharded
from ditcore.parallel.fsdp import is_fsdp, local


def stage_blocks(depth: int, pp: int, stage: int) -> range:
    """The blocks of one stage: consecutive, as even as possible, the later stages taking one more when depth is not
    a multiple of pp (the first stage keeps the most micro-batches' activations in flight)."""
    base, extra = divmod(depth, pp)
    start = stage * base + max(0, stage - (pp - extra))
    return range(start, start + base + (stage >= pp - extra))


class Elsewhere(nn.Module):
    """A block that another pipeline stage holds: no parameters, and the hidden states pass through unchanged."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return x


def split_stages(model: nn.Module, groups: ParallelGroups) -> nn.Module:
    """Prune `model` in place to this rank's stage: other stages' blocks become `Elsewhere`, the patch embedder stays
    on the first stage only, the final layer on the last. Names are kept (`blocks.7.mlp.0.weight` on the stage that
    holds block 7), so initialisation, checkpoints and exports see one-device names."""
    pp, stage = groups.dims.pp, groups.pp_rank
    split = plan_for(model).pipeline
    if split is None:
        raise ConfigError("pp", pp, f"1: {type(model).__name__}'s plan (its registration) does not say how it "
                                    "splits into pipeline stages")
    layers: nn.ModuleList = model.get_submodule(split.layers)
    held = stage_blocks(len(layers), pp, stage)
    for i in range(len(layers)):
        if i not in held:
            layers[i] = Elsewhere()
    for names, kept in ((split.first, stage == 0), (split.last, stage == pp - 1)):
        for name in names if not kept else ():
            setattr(model, name, None)
    return model


def is_shared(model: nn.Module, name: str) -> bool:
    """Is the parameter on every stage (a conditioning embedder), rather than on one stage only?"""
    split = plan_for(model).pipeline
    owned = (split.layers, *split.first, *split.last)
    return not any(name == o or name.startswith(o + ".") for o in owned)


# --------------------------------------------------------------------------------------------------
# Point to point


def _exchange(groups: ParallelGroups, send: dict[int, torch.Tensor], recv: dict[int, torch.Tensor]) -> None:
    """Send and receive between this stage and its neighbours ({stage offset: tensor}, -1 previous, +1 next): posted
    as one batch, then waited for. One batch matters on NCCL, whose sends and receives to one peer would otherwise
    run in the order posted, each side's receive waiting for a send queued behind the other side's receive."""
    ranks, stage = groups.pp_ranks, groups.pp_rank
    ops = [dist.P2POp(dist.irecv, t, ranks[stage + k], group=groups.pp_group) for k, t in recv.items()]
    ops += [dist.P2POp(dist.isend, t.contiguous(), ranks[stage + k], group=groups.pp_group) for k, t in send.items()]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def wire_dtype(device: torch.device) -> torch.dtype:
    """The dtype hidden states travel in: autocast's when it is on (bf16 activations), else float32."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return torch.float32


# --------------------------------------------------------------------------------------------------
# Training: one step's micro-batches, 1F1B


def one_f_one_b(groups: ParallelGroups, micro_batches: int, forward: Callable[[int, torch.Tensor | None], torch.Tensor],
                shape: Callable[[int], tuple[int, ...]], dtype: torch.dtype, device: torch.device,
                no_sync: Callable[[bool], AbstractContextManager] | None = None) -> None:
    """Forward and backward of `micro_batches` micro-batches through the stages, gradients accumulated in `.grad`.

    forward(i, hidden) runs micro-batch i on this stage: `hidden` is what the previous stage sent (None on the
    first stage), and it returns the hidden states to send on, or on the last stage the loss to call backward on
    (already divided by the number of micro-batches). shape(i) is the shape of micro-batch i's hidden states,
    (n, B, D); it is asked before forward(i) and may load the micro-batch. Hidden states and their gradients travel
    in `dtype`. The non-interleaved 1F1B schedule: stage s runs pp − s − 1 forwards ahead, then alternates one
    forward and one backward, then drains, so that it holds at most pp − s micro-batches' activations.

    no_sync(enabled): a context around each backward, enabled on all but the step's last one (Fabric's backward-sync
    control): a stage sharded with FSDP's sync="step" (`ditcore.parallel.fsdp.accumulating`) then keeps its
    parameters gathered and its gradients unreduced until that last backward. With sync="micro_batch" each
    backward reduce-scatters its micro-batch's gradients as it finishes, while the schedule goes on.
    """
    pp, stage = groups.dims.pp, groups.pp_rank
    first, last = stage == 0, stage == pp - 1
    warmup = min(pp - stage - 1, micro_batches)
    inputs: deque = deque()
    outputs: deque = deque()
    backwards = 0

    def empty(i: int) -> torch.Tensor:
        return torch.empty(shape(i), dtype=dtype, device=device)

    def run_forward(i: int, hidden: torch.Tensor | None) -> torch.Tensor:
        out = forward(i, hidden)
        inputs.append(hidden)
        outputs.append(out)
        return out if last else out.to(dtype)

    def run_backward(grad: torch.Tensor | None) -> torch.Tensor | None:
        nonlocal backwards
        hidden, out = inputs.popleft(), outputs.popleft()
        backwards += 1
        with no_sync(backwards < micro_batches) if no_sync else nullcontext():
            if last:
                out.backward()
            else:
                torch.autograd.backward(out, grad.to(out.dtype))
        return None if first else hidden.grad.to(dtype)

    def recv_forward(i: int) -> torch.Tensor | None:
        if first:
            return None
        t = empty(i)
        _exchange(groups, {}, {-1: t})
        return t.requires_grad_()

    for i in range(warmup):
        out = run_forward(i, recv_forward(i))
        if not last:
            _exchange(groups, {+1: out.detach()}, {})
    hidden = recv_forward(warmup) if warmup < micro_batches else None
    for i in range(warmup, micro_batches):
        out = run_forward(i, hidden)
        oldest = i - warmup  # the micro-batch whose backward comes next
        grad = None
        if not last:  # send this forward's output, receive the gradient of the oldest one in flight
            grad = empty(oldest)
            _exchange(groups, {+1: out.detach()}, {+1: grad})
        grad_in = run_backward(grad)
        hidden = None
        if not first:
            if i == micro_batches - 1:
                _exchange(groups, {-1: grad_in}, {})
            else:
                hidden = empty(i + 1)
                _exchange(groups, {-1: grad_in}, {-1: hidden})
                hidden.requires_grad_()
    for k in range(warmup):  # drain: the backwards of the warm-up forwards
        grad = empty(micro_batches - warmup + k)
        _exchange(groups, {}, {+1: grad})
        grad_in = run_backward(grad)
        if not first:
            _exchange(groups, {-1: grad_in}, {})


def reduce_grads(model: nn.Module, groups: ParallelGroups) -> None:
    """Complete the gradients after `one_f_one_b`, before `finalize_grads`: averaged over DP×CP (the model is not
    wrapped in DDP, whose hooks assume one backward per forward; sharded with FSDP2, each backward has already
    reduce-scattered them, averaged), and the stage-shared (conditioning) parameters' summed over the stages, so that
    every stage takes the same step with them (experts split over EP excepted: ditcore.parallel.expert_parallel's
    reduce_expert_grads, in finalize_grads, averages them). Under FSDP that sum is of the local shards: the pipeline
    group joins ranks of the same DP×CP rank, which hold the same piece of every parameter. A parameter that got no
    gradient this step gets zeros, as in DDP's buckets."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    for _, p in params:  # e.g. cross-attention in a step without any text: every rank must reduce the same tensors
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if not is_fsdp(model) and dist.get_world_size(groups.dp_cp_group) > 1:
        # an expert-parallel rank's experts are not its DP×CP peers': finalize_grads averages them over their own
        grads = [local(p.grad) for _, p in params if not is_expert_sharded(p)]
        _all_reduce(grads, groups.dp_cp_group)
        torch._foreach_div_(grads, float(dist.get_world_size(groups.dp_cp_group)))
    if groups.dims.pp > 1:
        _all_reduce([local(p.grad) for n, p in params if is_shared(model, n)], groups.pp_group)


def _all_reduce(tensors: list[torch.Tensor], group, bucket: int = 2**25) -> None:
    """Sum tensors over `group` in place, a few flat buckets of at most `bucket` elements (one tensor may exceed it)
    at a time rather than one collective per tensor."""
    start = 0
    while start < len(tensors):
        end, size = start, 0
        while end < len(tensors) and (end == start or size + tensors[end].numel() <= bucket):
            size += tensors[end].numel()
            end += 1
        chunk = tensors[start:end]
        flat = torch.cat([t.reshape(-1) for t in chunk])
        dist.all_reduce(flat, group=group)
        torch._foreach_copy_(chunk, [s.view_as(t) for t, s in zip(chunk, flat.split([t.numel() for t in chunk]),
                                                                     strict=True)])
        start = end


# --------------------------------------------------------------------------------------------------
# Sampling: the forward alone


class PipelinedModel(nn.Module):
    """A stage's model that answers like the whole one: the hidden states go through the stages, and the last stage's
    output is broadcast to all of them (each runs the same sampler and needs the same denoised tokens)."""

    def __init__(self, model: nn.Module, groups: ParallelGroups):
        super().__init__()
        self.model, self.groups = model, groups

    @property
    def cfg(self):
        return self.model.cfg

    @property
    def null_class(self) -> int:
        return self.model.null_class

    def forward(self, x: torch.Tensor, c_noise: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        g = self.groups
        B, N, _ = x.shape
        dtype = wire_dtype(x.device)
        hidden = None
        if not g.first_stage:
            n = len(range(N)[self.model.rows.spans(N)[1]])  # the tokens this rank holds
            hidden = torch.empty((n, B, self.model.cfg.hidden_size), dtype=dtype, device=x.device)
            _exchange(g, {}, {-1: hidden})
        out = self.model(x, c_noise, *args, hidden=hidden, **kwargs)
        if not g.last_stage:
            _exchange(g, {+1: out.to(dtype)}, {})
            out = torch.empty((B, N, self.model.cfg.out_dim), dtype=dtype, device=x.device)
        else:
            out = out.to(dtype).contiguous()  # (B, N, F) as a transposed view: broadcast its (B, N, F) order
        dist.broadcast(out, src=g.pp_ranks[-1], group=g.pp_group)
        return out
