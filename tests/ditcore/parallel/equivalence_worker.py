"""Run under `torchrun --nproc-per-node 2`: each parallel layout vs one process, on identical data and weights.

For every case both ranks build the same one-device reference (same seed), compute its output, loss and
gradients and take one optimizer step; then build the parallel model from the reference's consolidated state
dict, do the same, consolidate, and record the largest differences. Rank 0 writes them as JSON to argv[1].
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from ditcore import runs
from ditcore.data.packing import TokenSample
from ditcore.diffusion import EDMLoss, EDMPrecond
from ditcore.eval.heldout import heldout_batches, heldout_totals, sigma_buckets
from ditcore.inputs import Inputs
from ditcore.layout import grid_positions
from ditcore.models import apply_activation_checkpointing, build, preset, register
from ditcore.models.moe import MoEConfig
from ditcore.parallel import (
    ParallelDims,
    consolidated_state_dict,
    context_parallel,
    dist_checkpoint,
    finalize_grads,
    grad_norm,
    load_consolidated,
    materialize,
    parallelize,
)
from ditcore.parallel.consolidate import gather_full
from ditcore.parallel.counting import CollectiveCounter
from ditcore.parallel.expert_parallel import is_expert_sharded
from ditcore.parallel.fabric import MegatronStrategy
from ditcore.parallel.fsdp import apply_fsdp, local, local_piece
from ditcore.parallel.pipeline import PipelinedModel, one_f_one_b, reduce_grads
from ditcore.training import stage_forward

CFG = preset("DiT-Tiny", hidden_size=64, depth=2, num_heads=4, in_channels=4, num_classes=5, text_dim=16,
             fps_cond=True)
# "moviegen:CASE" runs CASE on MovieGen's blocks (grouped-query attention: 4 query heads in 2 groups, SwiGLU),
# "stdit:CASE" on ST-DiT's (spatial and temporal blocks; its CP moves frames to time-lines by all-to-all)
DATA = dict(in_channels=4, num_classes=5, text_dim=16, fps_cond=True)
# ("stdit_cut": ST-DiT on the DiT's packed rows, whose halves cut a 3x3-token image: its CP gathers instead)
CONFIGS = {"dit": CFG, "moviegen": preset("MovieGen-Tiny", **DATA), "stdit": preset("ST-DiT-Tiny", **DATA)}
# "wan:CASE": Wan's blocks (ditcore.models.wan: QK norms over both heads, summed over TP ranks; one time projection;
# zero-padded text), its 2 heads one a rank under TP
CONFIGS["wan"] = preset("Wan-Tiny", **DATA)
CONFIGS["stdit_cut"] = CONFIGS["stdit"]
CONFIGS["embedders"] = CFG.replace(block_embedders=True)  # "embedders:CASE": each later block its own embedders
# "moe:CASE": every other block a mixture of 4 experts, top 2, with a capacity that drops nothing under ep=2
CONFIGS["moe"] = CFG.replace(moe=MoEConfig(experts=4, top_k=2, every=2, capacity_factor=2.0))
CONFIGS["deep"] = CFG.replace(depth=4)  # "deep:CASE": two blocks a stage under pp=2, the first resharded by FSDP
B, GRID = 4, (2, 4, 4)  # 4 rows of 32 tokens


def unpacked_batch(g):
    n = GRID[0] * GRID[1] * GRID[2]
    L = 6
    return dict(
        x=torch.randn(B, n, CFG.patch_dim, generator=g) * 0.5,
        noise=torch.randn(B, n, CFG.patch_dim, generator=g),
        sigma=torch.exp(torch.randn(B, 1, generator=g) * 1.2 - 1.2),
        cond=dict(pos=grid_positions(GRID), class_labels=torch.randint(0, 6, (B, 1), generator=g),
                  fps=torch.rand(B, 1, generator=g) * 24, text=torch.randn(B, L, 16, generator=g),
                  text_seg=torch.where(torch.arange(L) < torch.randint(1, L + 1, (B, 1), generator=g), 0, -1)),
        seg=None, mask=None,
    )


# (T, H, W) grids of the samples packed in each of 2 rows of 32 tokens. ST-DiT's: a clip across the middle of each
# row, whose frames (and time-lines) CP=2 splits between the ranks, with images and another clip beside it.
PACKED = {"dit": [[(1, 4, 4), (1, 2, 4), (1, 2, 2)], [(2, 2, 3), (1, 3, 3)]],
          "stdit": [[(1, 2, 4), (2, 2, 4), (1, 2, 2)], [(2, 2, 2), (2, 2, 4)]]}


def packed_batch(g, rows=PACKED["dit"]):
    """2 rows of 32 tokens, each packing samples of different grids and text lengths, with padding."""
    N, Lmax, S = 32, 12, 3
    x, noise = torch.randn(2, N, CFG.patch_dim, generator=g) * 0.5, torch.randn(2, N, CFG.patch_dim, generator=g)
    pos, seg = torch.zeros(2, N, 3, dtype=torch.long), torch.full((2, N), -1)
    text, text_seg = torch.randn(2, Lmax, 16, generator=g), torch.full((2, Lmax), -1)
    for r, row in enumerate(rows):
        n = t = 0
        for s, grid in enumerate(row):
            k, L = grid[0] * grid[1] * grid[2], 2 + 2 * s
            pos[r, n:n + k], seg[r, n:n + k], text_seg[r, t:t + L] = grid_positions(grid), s, s
            n, t = n + k, t + L
    return dict(
        x=x, noise=noise, sigma=torch.exp(torch.randn(2, S, generator=g) * 1.2 - 1.2), seg=seg, mask=seg >= 0,
        cond=dict(pos=pos, class_labels=torch.randint(0, 6, (2, S), generator=g),
                  fps=torch.rand(2, S, generator=g) * 24, text=text, text_seg=text_seg),
    )


SENT = [0]  # tokens this rank's all-to-alls (ST-DiT's CP) sent to other ranks in forward passes

# A held-out set of images and clips (ditcore.eval.heldout), packed into rows of 32 tokens, 2 rows a batch,
# scored in the cases that cover each kind of layout (the held-out loss is forward passes only)
HELDOUT_CASES = ("dp2", "tp2_sp_packed", "cp2_packed", "fsdp_dp2", "pp2_packed", "fsdp_tp2_sp_dp2", "hsdp_dp4",
                 "pp2_tp2_sp_packed")
HELDOUT_GRIDS = [(1, 4, 4), (1, 2, 4), (2, 2, 3), (1, 3, 3), (1, 2, 2), (2, 4, 4)]


def heldout_losses_of(model, groups=None) -> torch.Tensor:
    """The DiT's held-out loss per level: with `groups`, each data-parallel rank scores every dp-th sample and the
    (sum, count) pairs are reduced over the data-parallel group; under PP through the stages."""
    g = torch.Generator().manual_seed(11)
    samples = [TokenSample(key=f"{i:08d}", tokens=torch.randn(t * h * w, CFG.patch_dim, generator=g) * 0.5,
                           pos=grid_positions((t, h, w)), grid=(t, h, w), text=torch.randn(2 + i, 16, generator=g),
                           meta={"fps": 8.0} | ({"label": i % 6 - 1} if i % 6 else {}), caption="")
               for i, (t, h, w) in enumerate(HELDOUT_GRIDS)]
    dp, rank = (groups.dims.dp, groups.dp_rank) if groups else (1, 0)
    mine = list(range(len(samples)))[rank::dp]
    batches = heldout_batches([samples[i] for i in mine], mine, seed=3, seq_length=32, rows=2)
    if groups is not None and groups.dims.pp > 1:
        model = PipelinedModel(model, groups)
    sums, counts = heldout_totals(EDMPrecond(model), batches, sigma_buckets(3), EDMLoss(), device="cpu",
                                  cfg=CFG, group=groups.dp_group if groups else None)
    return sums / counts


def counting_all_to_all(x, send, recv, group):
    SENT[0] += sum(send) - send[dist.get_rank(group)]
    return all_to_all(x, send, recv, group)


all_to_all, context_parallel.all_to_all = context_parallel.all_to_all, counting_all_to_all


class Recording(EDMPrecond):
    """The preconditioned model, keeping every output it gives."""

    def __init__(self, model):
        super().__init__(model)
        self.outputs = []

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        self.outputs.append(out.detach())
        return out


def step(model, batch, module=None, micro: int = 1, no_sync=None, between: dict | None = None):
    """Output, loss and gradients of one EDM training step (module: the DDP wrapper, when there is one), its rows
    in `micro` micro-batches whose gradients accumulate (the loss: their mean). no_sync(enabled): a context around
    each micro-batch's forward and backward, enabled on all but the last (Fabric's backward-sync control); between:
    filled with what the first micro-batch left on the model (`held_between`)."""
    denoiser, losses = Recording(module or model), []
    for i, part in enumerate(micro_batches(batch, micro)):
        with no_sync(i < micro - 1) if no_sync else contextlib.nullcontext():
            loss = EDMLoss()(denoiser, part["x"], inputs_of_part(part), mask=part["mask"], sigma=part["sigma"],
                             noise=part["noise"])
            (loss / micro).backward()
        losses.append(loss.detach())
        if between is not None and i == 0 and micro > 1:
            between.update(held_between(model))
    return torch.cat(denoiser.outputs), torch.stack(losses).mean()


def held_between(model) -> dict:
    """Under FSDP, between two micro-batches: parameters still gathered (not DTensors: FSDP2 registers the unsharded
    ones while they are gathered) and gradients already reduce-scattered (DTensors)."""
    params = list(model.parameters())
    return {"gathered_between": sum(not isinstance(p, DTensor) for p in params),
            "reduced_between": sum(isinstance(p.grad, DTensor) for p in params), "params": len(params)}


def counted_groups(model, groups) -> dict:
    """The groups the counter names beyond the layout's own: FSDP2's mesh groups, expert parallelism's."""
    experts = {"ep": groups.ep_group, "edp": groups.edp_group} if groups.dims.ep > 1 else {}
    return fsdp_groups(model) | experts


def fsdp_groups(model) -> dict:
    """The groups of FSDP2's mesh, which the counter names fsdp (HSDP: the shard group) and replicate."""
    mesh = next((p.device_mesh for p in model.parameters() if isinstance(p, DTensor) and not is_expert_sharded(p)),
                None)  # the experts' mesh is the expert-data-parallel group (counted_groups' edp)
    if mesh is None:
        return {}
    if mesh.ndim == 1:
        return {"fsdp": mesh.get_group()}
    return {"fsdp": mesh.get_group("shard"), "replicate": mesh.get_group("replicate")}


def inputs_of_part(part: dict) -> Inputs:
    """The model's inputs of a batch (or its rows): its seg and conditioning."""
    return Inputs(seg=part["seg"], **part["cond"])


def micro_batches(batch, micro: int) -> list[dict]:
    n = batch["x"].shape[0] // micro
    return [rows(batch, slice(i * n, (i + 1) * n)) for i in range(micro)]


def pipeline_step(model, batch, groups, micro: int, counter, no_sync=None):
    """`step` through the pipeline stages (1F1B): every stage gets the output and the loss, from the last one. The
    schedule runs inside `counter` (the broadcasts after it are this test's, not training's); no_sync as `step`'s,
    around each backward."""
    parts = micro_batches(batch, micro)
    denoiser, losses, g = Recording(model), [], groups
    n = len(range(batch["x"].shape[1])[model.rows.spans(batch["x"].shape[1])[1]])

    def forward(i, hidden):
        p = parts[i]
        out = stage_forward(EDMLoss(), denoiser, p["x"], inputs_of_part(p), last=g.last_stage, hidden=hidden,
                            mask=p["mask"], sigma=p["sigma"], noise=p["noise"])
        if g.last_stage:
            losses.append(out.detach())
            return out / micro
        return out

    shape = (n, parts[0]["x"].shape[0], CFG.hidden_size)
    with counter:
        one_f_one_b(g, micro, forward, lambda i: shape, torch.float32, torch.device("cpu"), no_sync)
    out, loss = torch.zeros_like(batch["x"]), torch.zeros(())
    if g.last_stage:
        out, loss = torch.cat(denoiser.outputs), torch.stack(losses).mean()
    for t in (out, loss):
        dist.broadcast(t, src=g.pp_ranks[-1], group=g.pp_group)
    return out, loss


def optimizer(model):
    # SGD with momentum: its step is linear in the gradient, so the updated weights show whether every
    # shard was updated by its own gradient. (Adam's first step, lr·g/(|g| + eps), is a sign function of
    # near-zero gradients and would magnify float-rounding differences instead.)
    return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


def rows(batch, part: slice):
    """The rows `part` of a batch (data parallel: each rank gets its own rows)."""
    def cut(v):
        return v[part] if torch.is_tensor(v) and v.ndim >= 2 and v.shape[0] == batch["x"].shape[0] else v

    out = {k: cut(v) for k, v in batch.items() if k != "cond"}
    out["cond"] = {k: cut(v) for k, v in batch["cond"].items()}
    return out


def diff(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    d = (a.double() - b.double()).abs().max().item()
    return d, d / max(b.double().abs().max().item(), 1e-30)


def run_case(arch: str, dims: ParallelDims, packed: bool, checkpointing: str = "none", fsdp: bool = False,
             per_row: bool = False, shard: int | None = None, sync: str = "micro_batch", heldout: bool = False) -> dict:
    """per_row: a micro-batch per row, whose gradients accumulate (the reference does the same). shard, sync: FSDP's
    (HSDP's shard group; gathers and reductions every micro-batch or once per step). heldout: compare the held-out
    loss too."""
    cfg, g = CONFIGS[arch], torch.Generator().manual_seed(7)
    batch = packed_batch(g, PACKED.get(arch, PACKED["dit"])) if packed else unpacked_batch(g)

    torch.manual_seed(0)
    ref = build(cfg)
    with torch.no_grad():  # move every weight off its (partly zero) initialisation
        for p in ref.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    init = {k: v.clone() for k, v in ref.state_dict().items()}
    ref_heldout = heldout_losses_of(ref) if heldout else None
    ref_out, ref_loss = step(ref, batch, micro=len(batch["x"]) if per_row else 1)
    ref_grads = {k: p.grad.clone() for k, p in ref.named_parameters()}
    optimizer(ref).step()
    ref_after = ref.state_dict()

    groups = dims.initialize()
    model = build(cfg)
    parallelize(model, groups)
    load_consolidated(model, init, groups)
    apply_activation_checkpointing(model, checkpointing)  # recomputes the sharded linears and their collectives
    no_sync = None
    if fsdp:  # parameters, gradients and optimizer state split again over DP×CP
        apply_fsdp(model, groups, "cpu", shard=shard, sync=sync)
        wrapper, no_sync = None, MegatronStrategy(dims, fsdp=True)._backward_sync_control.no_backward_sync
        no_sync = lambda enabled, control=no_sync: control(model, enabled)
    elif dims.pp == 1:
        wrapper = DistributedDataParallel(model, process_group=groups.dp_cp_group)
    dp_size, dp_rank = groups.dims.dp, groups.dp_rank
    per_rank = batch["x"].shape[0] // dp_size
    mine = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    micro = per_rank if per_row else 1
    par_heldout = heldout_losses_of(model, groups) if heldout else None
    SENT[0] = 0
    between = {}
    # what the training step sends (ditcore.traffic models it): the consolidations between its parts are this test's
    counter = CollectiveCounter(groups, fsdp=fsdp, extra=counted_groups(model, groups))
    if dims.pp == 1:
        with counter:
            out, loss = step(model, rows(batch, mine), wrapper, micro, no_sync, between)
    else:  # no DDP: its hooks assume one backward per forward; the schedule's gradients are reduced after it
        out, loss = pipeline_step(model, rows(batch, mine), groups, micro, counter, no_sync)
        unreduced = gather_full(model, {k: p.grad for k, p in model.named_parameters()}, groups)
        with counter, counter.during("step"):
            reduce_grads(model, groups)
    unfinished = gather_full(model, {k: p.grad for k, p in model.named_parameters()}, groups)
    with counter, counter.during("step"):
        finalize_grads(model, groups)
    grads = gather_full(model, {k: p.grad for k, p in model.named_parameters()}, groups)
    with counter, counter.during("step"):
        norm = grad_norm(model, groups)
        optimizer(model).step()
    after = consolidated_state_dict(model, groups)

    # The loss each rank reports is its own rows' mean; DP averages them (equal token counts here).
    loss_avg = loss.clone()
    dist.all_reduce(loss_avg, group=groups.dp_cp_group)
    loss_avg /= dist.get_world_size(groups.dp_cp_group)
    result = {"output": diff(out, ref_out[mine]), "loss": diff(loss_avg, ref_loss), "all_to_all_tokens": SENT[0],
              "between": between}
    if ref_heldout is not None:
        result["heldout"] = diff(par_heldout, ref_heldout)
    traffic = [None] * dist.get_world_size()  # every rank's: pipeline stages send differently
    dist.all_gather_object(traffic, [dataclasses.asdict(c) for c in counter.traffic().collectives])
    result["traffic"] = traffic
    if fsdp:
        mesh = next(p for p in model.parameters() if isinstance(p, DTensor) and not is_expert_sharded(p)).device_mesh
        result["mesh"] = [dist.get_process_group_ranks(mesh.get_group(d)) for d in range(mesh.ndim)]
    if grads is not None:
        result["grad"] = max((diff(grads[k], ref_grads[k]) for k in ref_grads), key=lambda d: d[1])
        result["grad_max_param"] = max(ref_grads, key=lambda k: diff(grads[k], ref_grads[k])[1])
        result["weights_after_step"] = max(diff(after[k], ref_after[k]) for k in ref_after)
        result["grads_nonzero"] = sum(int(v.abs().sum() > 0) for v in grads.values())
        # what finalize_grads fixed: without it, partial gradients (TP) and DDP's average (CP) are wrong
        result["grad_before_finalize"] = max(diff(unfinished[k], ref_grads[k]) for k in ref_grads)
        ref_norm = torch.cat([g.reshape(-1) for g in ref_grads.values()]).double().norm()
        result["grad_norm"] = diff(norm, ref_norm)
        if dims.pp > 1:  # what reduce_grads fixed: the stages' partial gradients of the embedders (and DP's)
            result["grad_before_reduce"] = max(diff(unreduced[k], ref_grads[k]) for k in ref_grads)
        result["params"] = len(grads)
    if fsdp or dims.pp > 1:  # built on the meta device and materialised piece by piece: the one-device init
        with torch.device("meta"):
            meta = build(cfg)
        parallelize(meta, groups)
        if fsdp:
            apply_fsdp(meta, groups, "cpu", shard=shard)
        materialize(meta, 3, "cpu", groups)
        built = consolidated_state_dict(meta, groups)
        if built is not None:
            one = build(cfg)
            one.init_weights(3)
            expected = one.state_dict()
            result["materialized_equals_init"] = built.keys() == expected.keys() and all(
                torch.equal(built[k], expected[k]) for k in expected)
    return result


def count_bf16(arch: str, dims: ParallelDims, packed: bool, checkpointing: str = "none", fsdp: bool = False) -> dict:
    """Only the traffic of a training step under bf16 autocast (what dit-train runs on a GPU), with FSDP gathering in
    bf16: the dtypes each collective moves (ditcore.traffic's dtype rule). No reference: bf16 is not compared."""
    cfg, g = CONFIGS[arch], torch.Generator().manual_seed(7)
    batch = packed_batch(g, PACKED.get(arch, PACKED["dit"])) if packed else unpacked_batch(g)
    groups = dims.initialize()
    torch.manual_seed(0)
    model = parallelize(build(cfg), groups)
    apply_activation_checkpointing(model, checkpointing)
    wrapper = None
    if fsdp:
        apply_fsdp(model, groups, "cpu", param_dtype=torch.bfloat16)
    else:
        wrapper = DistributedDataParallel(model, process_group=groups.dp_cp_group)
    per_rank = batch["x"].shape[0] // groups.dims.dp
    counter = CollectiveCounter(groups, fsdp=fsdp, extra=counted_groups(model, groups))
    with counter, torch.autocast("cpu", torch.bfloat16):
        step(model, rows(batch, slice(groups.dp_rank * per_rank, (groups.dp_rank + 1) * per_rank)), wrapper)
    with counter, counter.during("step"):
        finalize_grads(model, groups)
        grad_norm(model, groups)
    traffic = [None] * dist.get_world_size()
    dist.all_gather_object(traffic, [dataclasses.asdict(c) for c in counter.traffic().collectives])
    return {"traffic": traffic}


CASES = {
    "tp2": (ParallelDims(tp=2), False),
    "tp2_sp": (ParallelDims(tp=2, sequence_parallel=True), False),
    "cp2": (ParallelDims(cp=2), False),
    "dp2": (ParallelDims(), False),
    "tp2_packed": (ParallelDims(tp=2), True),
    "tp2_sp_packed": (ParallelDims(tp=2, sequence_parallel=True), True),
    "cp2_packed": (ParallelDims(cp=2), True),
    "tp2_packed_selective": (ParallelDims(tp=2), True, "selective"),  # replays the row-parallel all-reduce
    "tp2_sp_packed_block": (ParallelDims(tp=2, sequence_parallel=True), True, "block"),
    "cp2_packed_selective": (ParallelDims(cp=2), True, "selective"),
    "fsdp_dp2": (ParallelDims(), False, "none", True),
    "fsdp_tp2_sp_packed": (ParallelDims(tp=2, sequence_parallel=True), True, "none", True),  # FSDP over one rank
    "fsdp_cp2_packed_selective": (ParallelDims(cp=2), True, "selective", True),
    "fsdp_tp2_sp_dp2": (ParallelDims(tp=2, sequence_parallel=True), False, "block", True),  # 4 processes
    # 2 micro-batches a rank (a row each): gathered and reduced every micro-batch, or once per step
    "fsdp_dp2_accumulate": (ParallelDims(), False, "none", True, True),
    "fsdp_dp2_accumulate_step": (ParallelDims(), False, "none", True, True, None, "step"),
    "hsdp_dp4": (ParallelDims(), False, "none", True, False, 2),  # 4 processes: shard over 2 x replicate 2
    "hsdp_cp2_dp2_step": (ParallelDims(cp=2), False, "selective", True, False, 2, "step"),  # 4: shard 2 = CP pair
    "cp2_tp2_sp_packed": (ParallelDims(cp=2, tp=2, sequence_parallel=True), True),  # 4 processes
    # pipeline: 1F1B over a micro-batch per row (the first stage runs one ahead, then one forward, one backward)
    "pp2": (ParallelDims(pp=2), False, "none", False, True),
    "pp2_packed": (ParallelDims(pp=2), True, "none", False, True),
    "pp2_tp2_sp_packed": (ParallelDims(tp=2, pp=2, sequence_parallel=True), True, "none", False, True),  # 4 procs
    "pp2_dp2_selective": (ParallelDims(pp=2), False, "selective", False, True),  # 4 processes
    "pp2_cp2_packed": (ParallelDims(cp=2, pp=2), True, "none", False, True),  # 4 processes
    # pipeline stages sharded with FSDP2 over each stage's DP×CP ranks (4 processes, or 8 for TP + SP and HSDP)
    "pp2_fsdp_dp2": (ParallelDims(pp=2), False, "none", True, True),
    "pp2_fsdp_dp2_step": (ParallelDims(pp=2), False, "selective", True, True, None, "step"),
    "pp2_fsdp_cp2_packed": (ParallelDims(cp=2, pp=2), True, "none", True, True),
    "pp2_tp2_sp_fsdp_dp2_packed": (ParallelDims(tp=2, pp=2, sequence_parallel=True), True, "none", True, True),
    "pp2_hsdp_dp4": (ParallelDims(pp=2), False, "none", True, True, 2),  # shard over 2 x replicate 2, per stage
    # expert parallelism (the "moe" config): the experts split over 2 ranks of DP, of CP; over 2 of DP=4, whose
    # experts' gradients are then averaged over 2 ranks
    "ep2": (ParallelDims(ep=2), False),
    "ep2_cp2_packed": (ParallelDims(cp=2, ep=2), True),
    "ep2_dp4": (ParallelDims(ep=2), False),
    # and through pipeline stages (1F1B, a micro-batch per row): the MoE block on the second stage, alone or with its
    # experts over the stage's 2 data-parallel ranks (4 processes)
    "pp2_moe": (ParallelDims(pp=2), False, "none", False, True),
    "ep2_pp2": (ParallelDims(pp=2, ep=2), False, "none", False, True),
    "moe_tp2_sp_packed": (ParallelDims(tp=2, sequence_parallel=True), True),
    "moe_tp2": (ParallelDims(tp=2), False),
    "ep2_tp2_sp": (ParallelDims(tp=2, sequence_parallel=True, ep=2), False),
    # and sharded with FSDP2: the experts over the ranks holding the same ones (2 of DP=4; 1 of DP=2), the rest over DP;
    # HSDP (shard 2 × replicate 2: the experts over their 2 ranks all the same); gathered and reduced once a step
    "ep2_fsdp_dp4": (ParallelDims(ep=2), False, "none", True),
    "ep2_fsdp": (ParallelDims(ep=2), False, "none", True),
    "ep2_hsdp_dp4": (ParallelDims(ep=2), False, "none", True, False, 2),
    "ep2_fsdp_dp4_step": (ParallelDims(ep=2), False, "none", True, True, None, "step"),
    "ep2_fsdp_step": (ParallelDims(ep=2), False, "none", True, True, None, "step"),  # 2 micro-batches a rank
}



def hsdp_checkpoints(folder: Path) -> dict:
    """HSDP (shard 2 x replicate 2) and FSDP over 4 ranks through layout-free checkpoints: HSDP's weights and AdamW
    moments, read back on one process (every rank reads the whole files, no group), are exactly what it held; FSDP
    resumes exactly them, and HSDP resumes them from FSDP's checkpoint. Compared piece by piece on every rank."""
    groups = ParallelDims().initialize()

    def sharded(shard: int | None, seed: int):
        with torch.device("meta"):
            model = build(CFG)
        parallelize(model, groups)
        apply_fsdp(model, groups, "cpu", shard=shard)
        materialize(model, seed, "cpu", groups)
        opt = torch.optim.AdamW(model.parameters())
        dist_checkpoint.init_optimizer_state(opt)
        with torch.no_grad():
            for p in model.parameters():  # moments of their own, unlike the weights
                local(opt.state[p]["exp_avg"]).copy_(local(p) * 2 + seed)
        return model, opt

    def views(model, opt):
        return runs.checkpoint_tensors(*dist_checkpoint.state_tensors(model, None, opt, groups, "cpu"))

    def holds(model, opt) -> bool:  # this rank's pieces are those of HSDP's checkpoint's one-device tensors
        return all(torch.equal(local(p), local_piece(weights[k], p)) and
                   torch.equal(local(opt.state[p]["exp_avg"]), local_piece(optim[f"{k}.exp_avg"], p))
                   for k, p in model.named_parameters())

    hsdp, opt = sharded(2, 5)
    runs.save_tensors(folder / "hsdp", views(hsdp, opt), {"step": 1})
    weights, optim = runs.read_full(folder / "hsdp", runs.MODEL), runs.read_full(folder / "hsdp", runs.OPTIM)
    fsdp, fsdp_opt = sharded(None, 6)  # other weights: all of them must come from the checkpoint
    vacuous = holds(fsdp, fsdp_opt)
    runs.load_tensors(folder / "hsdp", views(fsdp, fsdp_opt))
    runs.save_tensors(folder / "fsdp", views(fsdp, fsdp_opt), {"step": 1})
    back, back_opt = sharded(2, 7)
    runs.load_tensors(folder / "fsdp", views(back, back_opt))
    found = torch.tensor([holds(hsdp, opt), holds(fsdp, fsdp_opt), holds(back, back_opt), not vacuous])
    dist.all_reduce(found, op=dist.ReduceOp.MIN)  # on every rank
    return dict(zip(["hsdp_to_one", "hsdp_to_fsdp", "fsdp_to_hsdp", "not_vacuous"], map(bool, found), strict=True))


def ep_checkpoints(folder: Path) -> dict:
    """A mixture of 4 experts through layout-free checkpoints across EP sizes and FSDP (4 processes): EP2's weights and
    AdamW moments, read back on one process, are the one-device tensors (E, ., .) it held; EP4 resumes exactly them.
    The same from EP2 under FSDP (the experts sharded over the 2 ranks holding them) to EP2 without it."""
    cfg = CONFIGS["moe"]

    def split(ep: int, seed: int, fsdp: bool = False):
        groups = ParallelDims(ep=ep).initialize()
        with torch.device("meta"):
            model = build(cfg)
        parallelize(model, groups)
        if fsdp:
            apply_fsdp(model, groups, "cpu")
        materialize(model, seed, "cpu", groups)
        opt = torch.optim.AdamW(model.parameters())
        dist_checkpoint.init_optimizer_state(opt)
        with torch.no_grad():
            for p in model.parameters():
                local(opt.state[p]["exp_avg"]).copy_(local(p) * 2 + seed)
        views = runs.checkpoint_tensors(*dist_checkpoint.state_tensors(model, None, opt, groups, "cpu"))
        return model, opt, groups, views

    def holds(model, opt, groups, checkpoint: str, elsewhere: bool = True) -> bool:  # on rank 0: its tensors?
        weights, optim = (runs.read_full(folder / checkpoint, kind) for kind in (runs.MODEL, runs.OPTIM))
        full = consolidated_state_dict(model, groups)
        moments = gather_full(model, {k: opt.state[p]["exp_avg"] for k, p in model.named_parameters()}, groups)
        if full is None:  # the other ranks: what the reduction below ignores
            return elsewhere
        return all(torch.equal(full[k], weights[k]) and torch.equal(moments[k], optim[f"{k}.exp_avg"])
                   for k in moments)

    def round_trip(written, name: str, read) -> list:
        """`written` (model, optimizer, groups, views) saved as `name` and loaded into `read`: [the checkpoint holds
        the writer's tensors, it holds all the experts, the reader held other ones before, it holds them after]."""
        runs.save_tensors(folder / name, written[3], {"step": 1})
        experts = runs.read_full(folder / name, runs.MODEL)["blocks.1.mlp.experts.w_in"].shape[0]
        wrote = holds(*written[:3], name)
        vacuous = holds(*read[:3], name, elsewhere=False)
        runs.load_tensors(folder / name, read[3])
        return [wrote, experts == cfg.moe.experts, not vacuous, holds(*read[:3], name)]

    ep2_to_one, full, not_vacuous, one_to_ep4 = round_trip(split(2, 5), "ep2", split(4, 6))
    fsdp_to_one, full_fsdp, not_vacuous_fsdp, one_to_ep2 = round_trip(split(2, 7, fsdp=True), "ep2_fsdp", split(2, 8))
    found = torch.tensor([ep2_to_one, one_to_ep4, not_vacuous, full, fsdp_to_one, one_to_ep2, not_vacuous_fsdp,
                          full_fsdp])
    dist.all_reduce(found, op=dist.ReduceOp.MIN)
    return dict(zip(["ep2_to_one", "one_to_ep4", "not_vacuous", "full_experts", "ep2_fsdp_to_one",
                     "one_to_ep2", "not_vacuous_fsdp", "full_experts_fsdp"], map(bool, found), strict=True))


def main() -> None:
    import fourth_arch  # this script's sibling (a relative import when the tests import this file)

    register(fourth_arch.ARCH)  # the architecture that test_registry.py registers: "reglu:CASE" runs CASE on it
    CONFIGS["reglu"] = preset(fourth_arch.ARCH.tiny, **DATA)
    dist.init_process_group("gloo")
    results = {}
    for name in sys.argv[2:] or CASES:
        arch, _, case = name.rpartition(":")
        if case in ("hsdp_checkpoints", "ep_checkpoints"):
            results[name] = globals()[case](Path(sys.argv[1]).parent)
            continue
        case, bf16, _ = case.partition("@bf16")  # "CASE@bf16": only its traffic, under bf16 autocast
        if bf16:
            results[name] = count_bf16(arch or "dit", *CASES[case])
        else:
            results[name] = run_case(arch or "dit", *CASES[case], heldout=not arch and case in HELDOUT_CASES)
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
