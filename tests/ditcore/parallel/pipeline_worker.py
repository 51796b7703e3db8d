"""Run under `torchrun --nproc-per-node P`: the 1F1B schedule of P stages, one linear layer each, against one process
running the same micro-batches, for several numbers of micro-batches (fewer than, as many as and more than P).
Rank 0 writes {micro-batches: largest relative gradient difference of any stage} as JSON to argv[1]."""

from __future__ import annotations

import copy
import json
import sys

import torch
import torch.distributed as dist
from torch import nn

from ditcore.parallel import ParallelDims
from ditcore.parallel.pipeline import one_f_one_b

WIDTH, ROWS = 8, 3


def stage_forward(layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return torch.tanh(layer(h))


def run(groups, micro: int) -> float:
    pp, stage = groups.dims.pp, groups.pp_rank
    g = torch.Generator().manual_seed(micro)
    layers = [nn.Linear(WIDTH, WIDTH) for _ in range(pp)]
    for layer in layers:
        with torch.no_grad():
            for p in layer.parameters():
                p.copy_(torch.randn(p.shape, generator=g))
    xs = [torch.randn(ROWS + i, WIDTH, generator=g) for i in range(micro)]  # micro-batches of different shapes
    mine = copy.deepcopy(layers[stage])

    for x in xs:  # the reference: every stage in one process, gradients accumulated
        h = x
        for layer in layers:
            h = stage_forward(layer, h)
        (h.square().mean() / micro).backward()

    def forward(i, hidden):
        out = stage_forward(mine, xs[i] if hidden is None else hidden)
        return out.square().mean() / micro if groups.last_stage else out

    one_f_one_b(groups, micro, forward, lambda i: (ROWS + i, WIDTH), torch.float32, torch.device("cpu"))
    return max(((p.grad - q.grad).abs().max() / q.grad.abs().max()).item()
               for p, q in zip(mine.parameters(), layers[stage].parameters(), strict=True))


def main() -> None:
    dist.init_process_group("gloo")
    groups = ParallelDims(pp=dist.get_world_size()).initialize()
    results = {}
    for micro in (1, 2, dist.get_world_size(), 2 * dist.get_world_size() + 1):
        diffs = [None] * dist.get_world_size()
        dist.all_gather_object(diffs, run(groups, micro))
        results[micro] = max(diffs)
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
