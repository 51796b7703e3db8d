"""Run under torchrun (2 or 4 gloo processes): each layout's model, built as dit-train builds it
(ditcore.parallel.build_parallel_model) and compiled with a CPU backend, trains on 20 batches packed differently,
with different text lengths. Rank 0 writes, per case, dynamo's counters (graphs, graph breaks) and the largest
difference between the compiled model's loss and gradients and the same model run eagerly, as JSON to argv[1].

aot_eager is torch.compile's own tracing (dynamo, then AOTAutograd's joint forward/backward graph) without code
generation: graph breaks and recompilations are decided there, so what it counts is what Inductor would get on a GPU.
"""

from __future__ import annotations

import faulthandler
import gc
import json
import sys

import torch
import torch._dynamo
import torch.distributed as dist
from torch._dynamo.utils import counters

from ditcore.diffusion import EDMLoss, EDMPrecond
from ditcore.inputs import Inputs
from ditcore.layout import grid_positions
from ditcore.models import preset
from ditcore.models.moe import MoEConfig
from ditcore.parallel import ParallelDims, build_parallel_model, finalize_grads, gather_full
from ditcore.parallel.pipeline import one_f_one_b, reduce_grads
from ditcore.training import stage_forward

DATA = dict(in_channels=4, num_classes=5, text_dim=16, fps_cond=True)
CONFIGS = {"dit": preset("DiT-Tiny", **DATA), "moviegen": preset("MovieGen-Tiny", **DATA),
           "wan": preset("Wan-Tiny", **DATA),  # QK norms summed over TP ranks, zero-padded text's masks
           # "moe:CASE": the second block a mixture of 4 experts, top-2; under EP no slot overflows (capacity 2 = ep)
           "moe": preset("DiT-Tiny", moe=MoEConfig(experts=4, top_k=2, every=2, capacity_factor=2.0), **DATA)}
ROWS, N, BATCHES = 2, 32, 20  # rows of 32 tokens: divisible by cp·tp = 4

# case → (dims, activation checkpointing, fsdp)
CASES = {
    "tp2": (ParallelDims(tp=2), "none", False),
    "tp2_sp": (ParallelDims(tp=2, sequence_parallel=True), "none", False),
    "tp2_sp_block": (ParallelDims(tp=2, sequence_parallel=True), "block", False),
    "tp2_sp_selective": (ParallelDims(tp=2, sequence_parallel=True), "selective", False),
    "fsdp_tp2_sp": (ParallelDims(tp=2, sequence_parallel=True), "none", True),  # FSDP over dp=1: the 2-D layout
    "fsdp_tp2_sp_block": (ParallelDims(tp=2, sequence_parallel=True), "block", True),
    "fsdp_tp2_sp_selective": (ParallelDims(tp=2, sequence_parallel=True), "selective", True),
    "cp2": (ParallelDims(cp=2), "none", False),
    "cp2_selective": (ParallelDims(cp=2), "selective", False),
    "fsdp_dp2_selective": (ParallelDims(), "selective", True),
    "fsdp_cp2_selective": (ParallelDims(cp=2), "selective", True),  # FSDP over the CP pair: dit-28b-8k, moviegen-30b
    "pp2": (ParallelDims(pp=2), "none", False),
    "ep2_selective": (ParallelDims(ep=2), "selective", False),  # experts over the 2 data-parallel ranks
    # 4 processes
    "fsdp_tp2_sp_dp2_selective": (ParallelDims(tp=2, sequence_parallel=True), "selective", True),
    "cp2_tp2_sp_block": (ParallelDims(cp=2, tp=2, sequence_parallel=True), "block", False),
    "pp2_tp2_sp_selective": (ParallelDims(pp=2, tp=2, sequence_parallel=True), "selective", False),
    "fsdp_pp2_dp2_selective": (ParallelDims(pp=2), "selective", True),  # each stage's one block sharded over dp=2
}


def packed_batch(g: torch.Generator, cfg) -> dict:
    """ROWS rows of N tokens, each packing random image and clip grids (padding after them) with their own text of a
    random length: no two batches alike."""
    pos, seg = torch.zeros(ROWS, N, 3, dtype=torch.long), torch.full((ROWS, N), -1)
    lengths = []
    for r in range(ROWS):
        n, s = 0, 0
        while True:
            t, h, w = (int(v) for v in torch.randint(1, 5, (3,), generator=g))
            grid = (1 + t % 2, h, w)
            k = grid[0] * grid[1] * grid[2]
            if n + k > N or s == 4:
                break
            pos[r, n:n + k], seg[r, n:n + k] = grid_positions(grid), s
            lengths.append((r, s, int(torch.randint(1, 9, (), generator=g))))
            n, s = n + k, s + 1
    S = int(seg.max()) + 1
    L = max(sum(length for row, _, length in lengths if row == r) for r in range(ROWS))
    text_seg = torch.full((ROWS, L), -1)
    for r in range(ROWS):
        t = 0
        for row, s, length in lengths:
            if row == r:
                text_seg[r, t:t + length], t = s, t + length
    return dict(
        x=torch.randn(ROWS, N, cfg.patch_dim, generator=g) * 0.5,
        noise=torch.randn(ROWS, N, cfg.patch_dim, generator=g),
        sigma=torch.exp(torch.randn(ROWS, S, generator=g) * 1.2 - 1.2), seg=seg, mask=seg >= 0,
        cond=dict(pos=pos, class_labels=torch.randint(0, 6, (ROWS, S), generator=g),
                  fps=torch.rand(ROWS, S, generator=g) * 24, text=torch.randn(ROWS, L, 16, generator=g),
                  text_seg=text_seg),
    )


def train_step(model, batch, groups) -> torch.Tensor:
    """Loss and gradients of one EDM step on this rank (its pipeline stage's part, under PP); the loss on every rank."""
    denoiser, loss_fn = EDMPrecond(model), EDMLoss()
    inputs = Inputs(seg=batch["seg"], **batch["cond"])
    kw = dict(mask=batch["mask"], sigma=batch["sigma"], noise=batch["noise"])
    if groups.dims.pp == 1:
        loss = loss_fn(denoiser, batch["x"], inputs, **kw)
        loss.backward()
    else:
        losses, n = [], len(range(N)[model.rows.spans(N)[1]])

        def forward(i, hidden):
            out = stage_forward(loss_fn, denoiser, batch["x"], inputs, last=groups.last_stage, hidden=hidden, **kw)
            if groups.last_stage:
                losses.append(out.detach())
            return out

        one_f_one_b(groups, 1, forward, lambda i: (n, ROWS, model.cfg.hidden_size), torch.float32, torch.device("cpu"))
        reduce_grads(model, groups)
        loss = losses[0] if losses else torch.zeros(())
        dist.broadcast(loss, src=groups.pp_ranks[-1], group=groups.pp_group)
    finalize_grads(model, groups)
    return loss.detach()


def run_case(arch: str, dims: ParallelDims, checkpointing: str, fsdp: bool) -> dict:
    cfg = CONFIGS[arch]
    groups = dims.initialize()
    build = dict(seed=3, checkpointing=checkpointing, fsdp=fsdp, attention="sdpa")
    eager = build_parallel_model(cfg, groups, "cpu", **build)
    torch._dynamo.reset()
    counters.clear()
    compiled = build_parallel_model(cfg, groups, "cpu", compile=True, compile_options={"backend": "aot_eager"}, **build)
    g = torch.Generator().manual_seed(dist.get_rank() // (dims.tp * dims.cp * dims.pp))  # DP ranks: their own data
    worst = {"loss": 0.0, "grad": 0.0}
    for _ in range(BATCHES):
        batch = packed_batch(g, cfg)
        losses, grads = [], []
        for model in (eager, compiled):
            losses.append(train_step(model, batch, groups))
            grads.append(gather_full(model, {k: p.grad for k, p in model.named_parameters()}, groups))
            model.zero_grad(set_to_none=True)
        worst["loss"] = max(worst["loss"], rel(losses[1], losses[0]))
        if grads[0] is not None:
            worst["grad"] = max([worst["grad"]] + [rel(grads[1][k], grads[0][k]) for k in grads[0]])
    held = [b for b in compiled.blocks if next(b.parameters(), None) is not None]
    return {"unique_graphs": counters["stats"]["unique_graphs"], "graph_breaks": dict(counters["graph_break"]),
            "blocks": len(held), "kinds": len({(type(b), getattr(b, "moe", False)) for b in held}), **worst,
            **(device_checks(eager, groups, cfg) if cfg.moe is not None else {})}


def device_checks(model, groups, cfg) -> dict:
    """What a GPU would suffer and a CPU hides, on one bf16 step of the eager model (ditcore.testing): a value read
    back to the host (an all-to-all's split sizes, an expert's token count), or a sum scattered into bf16."""
    from ditcore.models import dit
    from ditcore.testing import HostReads, NoLowPrecisionScatter
    from ditcore.training import routing_of

    batch = packed_batch(torch.Generator().manual_seed(100 + dist.get_rank()), cfg)
    watch = HostReads("cpu")
    found = {"host_read": None, "low_precision_scatter": None}
    check, dit.check_positions = dit.check_positions, watch.unwatched(dit.check_positions)  # CPU positions, by design
    try:
        scatter = NoLowPrecisionScatter()
        with watch, scatter, torch.autocast("cpu", torch.bfloat16):
            inputs = Inputs(seg=batch["seg"], **batch["cond"])
            loss = EDMLoss()(EDMPrecond(model), batch["x"], inputs, mask=batch["mask"], sigma=batch["sigma"],
                             noise=batch["noise"])
            (loss + routing_of(model).aux_loss).backward()
    except RuntimeError as e:
        found["host_read" if "host wait" in str(e) else "low_precision_scatter"] = str(e)
    finally:
        dit.check_positions = check
    model.zero_grad(set_to_none=True)
    return found


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30)).item()


def main() -> None:
    faulthandler.enable()  # a crash in native code names its Python frames in the test's output
    dist.init_process_group("gloo")
    results = {}
    for name in sys.argv[2:]:
        arch, _, case = name.rpartition(":")
        r = run_case(arch or "dit", *CASES[case])
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, r)  # every rank's counters: a rank may compile differently from another
        results[name] = gathered
        # The case's models hold reference cycles (FSDP's hooks, compiled wrappers): collect them now, while their
        # process groups live, not at some allocation inside the next case after dims.initialize() destroyed those
        # groups. The likely cause of a rank's SIGSEGV seen once on CI at the 10th of the 14 slow cases (the case
        # alone passed 8 runs of 8 here); faulthandler names the frames if it comes back
        gc.collect()
        dist.barrier()
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
