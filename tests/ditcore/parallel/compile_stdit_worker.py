"""Run under `torchrun --nproc-per-node 2`: ST-DiT with CP=2 built as dit-train builds it, blocks compiled with the
aot_eager backend, trained on 20 batches packed differently, with different text lengths; dynamo's counters.

argv: OUT.json CHECKPOINTING. Rank 0 writes, per rank: the graphs dynamo compiled, its graph breaks, the all-to-alls
run, the batches whose slices keep every frame and line whole (`cuts`, computed here from the grids: those move by
all-to-all, the others are gathered) and the losses; and before compiling, the first host read of an eager training
step (ditcore.testing.HostReads, with the CPU as the device), if any.
"""

from __future__ import annotations

import json
import random
import sys

import torch
import torch._dynamo
import torch.distributed as dist
from torch._dynamo.utils import counters

from ditcore.diffusion import EDMLoss, EDMPrecond
from ditcore.inputs import Inputs
from ditcore.layout import grid_rows
from ditcore.models import apply_compile, dit, preset, stdit
from ditcore.parallel import ParallelDims, build_parallel_model, context_parallel
from ditcore.testing import HostReads

CFG = preset("ST-DiT-Tiny", in_channels=4, num_classes=5, text_dim=16, fps_cond=True)
N, CP = 32, 2  # tokens per row; each rank's slice is 16
SHAPES = [(1, 2, 2), (1, 2, 4), (1, 3, 3), (2, 2, 2), (2, 2, 4), (4, 1, 2), (2, 1, 3)]


def cuts(row: list[tuple[int, int, int]]) -> bool:
    """Does a slice boundary (every N/CP tokens) fall inside a frame or a time-line of a sample of the row?"""
    start = 0
    for T, H, W in row:
        for boundary in range(N // CP, N, N // CP):
            inside = start < boundary < start + T * H * W
            if inside and ((boundary - start) % (H * W) or (boundary - start) % T):  # frames order; lines order
                return True
        start += T * H * W
    return False


def packing(rng: random.Random, whole: bool) -> list[tuple[int, int, int]]:
    """A row of random samples (then padding); whole: one whose slices are whole frames and, in lines order, whole
    lines. Samples may straddle the slice boundary (their tokens then change rank)."""
    while True:
        row, used = [], 0
        for _ in range(rng.randint(1, 4)):
            grid = rng.choice(SHAPES)
            if used + grid[0] * grid[1] * grid[2] <= N:
                row.append(grid)
                used += grid[0] * grid[1] * grid[2]
        if not (whole and cuts(row)):
            return row


def batch(grids: list[list[tuple[int, int, int]]], L: int, g: torch.Generator) -> dict:
    """Rows packing samples of these grids; L text tokens, shared among each row's samples."""
    seg, pos = grid_rows(grids, N)
    S = max(len(r) for r in grids)
    B = len(grids)
    text_seg = torch.stack([torch.arange(L) * len(r) // L for r in grids])
    return dict(x=torch.randn(B, N, CFG.patch_dim, generator=g), noise=torch.randn(B, N, CFG.patch_dim, generator=g),
                sigma=torch.exp(torch.randn(B, S, generator=g) * 1.2 - 1.2), seg=seg, mask=seg >= 0,
                cond=dict(pos=pos, class_labels=torch.randint(0, 6, (B, S), generator=g),
                          fps=torch.rand(B, S, generator=g) * 24, text=torch.randn(B, L, 16, generator=g),
                          text_seg=text_seg, grids=grids))


def loss_of(model, b: dict) -> torch.Tensor:
    return EDMLoss()(EDMPrecond(model), b["x"], Inputs(seg=b["seg"], **b["cond"]), mask=b["mask"], sigma=b["sigma"],
                     noise=b["noise"])


def first_host_read(model) -> str | None:
    """Training steps, eager, on rows the all-to-all moves and on rows whose slices cut a frame (gathered), with the
    CPU as the device: the first read of a value back, or None. The checks of CPU inputs read them by design (on a
    GPU dit-train checks positions before the copy, and grids are not checked against device tensors)."""
    watch = HostReads("cpu")
    checks = dit.check_positions, stdit.check_grids
    dit.check_positions, stdit.check_grids = map(watch.unwatched, checks)
    g = torch.Generator().manual_seed(1)
    try:
        for grids in ([[(1, 2, 4), (2, 2, 4)], [(2, 2, 4), (1, 2, 2)]],  # whole frames and lines on each rank
                      [[(1, 3, 3), (2, 2, 4)], [(4, 2, 4)]]):  # rank 0's slice ends inside a frame of the clip
            b = batch(grids, 5, g)
            with watch:
                loss_of(model, b).backward()
    except RuntimeError as e:
        return str(e)
    finally:
        dit.check_positions, stdit.check_grids = checks
        model.zero_grad()
    return None


MOVES = [0]  # all-to-alls run by this rank


def counting_all_to_all(*args):
    MOVES[0] += 1
    return all_to_all(*args)


all_to_all, context_parallel.all_to_all = context_parallel.all_to_all, counting_all_to_all


def main() -> None:
    dist.init_process_group("gloo")
    checkpointing = sys.argv[2]
    groups = ParallelDims(cp=CP).initialize()
    # as dit-train builds it (meta device -> parallelize -> activation checkpointing -> materialize), compiled after
    # the eager steps that look for host reads
    model = build_parallel_model(CFG, groups, "cpu", seed=0, attention="sdpa", checkpointing=checkpointing)
    host_read = first_host_read(model)
    apply_compile(model, backend="aot_eager")

    torch._dynamo.reset()
    counters.clear()
    MOVES[0] = 0
    rng, g = random.Random(0), torch.Generator().manual_seed(0)
    losses, local = [], 0
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):  # the limit raises, never falls back
        for i in range(20):  # whole (moved by all-to-all) in every even batch; 2 + i text tokens
            b = batch([packing(rng, whole=i % 2 == 0), packing(rng, whole=i % 2 == 0)], 2 + i, g)
            loss = loss_of(model, b)
            loss.backward()
            losses.append(loss.item())
            local += not any(cuts(row) for row in b["cond"]["grids"])
    mine = {"unique_graphs": counters["stats"]["unique_graphs"], "graph_breaks": dict(counters["graph_break"]),
            "all_to_alls": MOVES[0], "local_batches": local, "losses": losses, "host_read": host_read}
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(ranks, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
