"""Run under `torchrun --nproc-per-node 2`: model.init_from into every layout dit-train builds.

    torchrun --nproc-per-node 2 init_from_worker.py SOURCE OUT

SOURCE is an export folder of a 2-block DiT-Tiny (model.safetensors). For each layout (TP=2 with sequence
parallelism, FSDP over DP=2, TP=2 + FSDP, two pipeline stages) both ranks build a 3-block model the way dit-train
does (build_parallel_model: meta, sharded, materialised with seed FRESH_SEED), copy the source in
(ditcore.init_from.start_from), and consolidate it; rank 0 writes {layout: {line, weights file}} as JSON to OUT.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ditcore.init_from import start_from
from ditcore.models import preset
from ditcore.parallel import ParallelDims, build_parallel_model, consolidated_state_dict

TARGET = preset("DiT-Tiny", in_channels=4, text_dim=16, depth=3)
FRESH_SEED = 5
LAYOUTS = {"tp2_sp": (ParallelDims(tp=2, sequence_parallel=True), False), "fsdp": (ParallelDims(), True),
           "tp2_fsdp": (ParallelDims(tp=2), True), "pp2": (ParallelDims(pp=2), False)}


def main() -> None:
    source, out = Path(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo")
    results = {}
    for name, (dims, fsdp) in LAYOUTS.items():
        groups = dims.initialize()
        model = build_parallel_model(TARGET, groups, "cpu", seed=FRESH_SEED, fsdp=fsdp)
        line = start_from(source, TARGET, [model], groups)
        full = consolidated_state_dict(model, groups)
        if dist.get_rank() == 0:
            torch.save(full, out / f"{name}.pt")
            results[name] = line
    if dist.get_rank() == 0:
        (out / "lines.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
