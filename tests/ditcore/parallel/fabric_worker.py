"""Training through Fabric + MegatronStrategy, checkpointing with one layout and resuming with another.

    torchrun --nproc-per-node 2 fabric_worker.py straight tp2 OUT    # 4 steps at TP=2, a checkpoint after 2
    python fabric_worker.py resume tp2 OUT                           # Fabric's own launcher: load it, 2 more steps
    torchrun --nproc-per-node 2 fabric_worker.py resume fsdp OUT     # the same from FSDP over DP=2; saves at 4
    torchrun --nproc-per-node 2 fabric_worker.py resume tp2_fsdp OUT # the same with TP=2 + SP and FSDP
    python fabric_worker.py load one OUT                             # one process: load FSDP's step-4 checkpoint

Each writes its losses, the consolidated final weights and the model's output on a probe batch to OUT (rank 0).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from lightning_fabric import Fabric

from ditcore import runs
from ditcore.diffusion import EMA, EDMLoss, EDMPrecond
from ditcore.inputs import Inputs
from ditcore.layout import grid_positions
from ditcore.memory import measured_state_bytes
from ditcore.models import DiT, preset
from ditcore.parallel import ParallelDims, consolidated_state_dict, finalize_grads, materialize, parallelize
from ditcore.parallel import dist_checkpoint as dcp
from ditcore.parallel.consolidate import gather_full, without_extra_state
from ditcore.parallel.fabric import MegatronStrategy
from ditcore.parallel.fsdp import apply_fsdp

CFG = preset("DiT-Tiny", in_channels=4, num_classes=4, text_dim=16)  # 5 class rows: uneven over 2 FSDP ranks
POS = grid_positions((1, 4, 4))
STEPS, SAVE_AT, ROWS = 4, 2, 4
LAYOUTS = {"tp2": (ParallelDims(tp=2), False, 2), "fsdp": (ParallelDims(), True, 2), "one": (ParallelDims(), False, 1),
           "tp2_fsdp": (ParallelDims(tp=2, sequence_parallel=True), True, 2)}  # FSDP over dp=1: TP tags must survive


def batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)  # the data and noise of step k are fixed
    return dict(x=torch.randn(ROWS, 16, CFG.patch_dim, generator=g) * 0.5,
                sigma=torch.exp(torch.randn(ROWS, 1, generator=g) * 1.2 - 1.2),
                noise=torch.randn(ROWS, 16, CFG.patch_dim, generator=g),
                class_labels=torch.randint(0, 5, (ROWS, 1), generator=g), text=torch.randn(ROWS, 5, 16, generator=g))


def build(groups, fsdp: bool):
    with torch.device("meta"):
        model = DiT(CFG)
    parallelize(model, groups)
    if fsdp:
        apply_fsdp(model, groups, "cpu")
    return materialize(model, 0, "cpu", groups)


def train_step(fabric, model, opt, ema, groups, step: int) -> float:
    """One AdamW step on this rank's rows of the step's batch; returns the loss of the whole batch."""
    per = ROWS // groups.dims.dp
    b = {k: v[groups.dp_rank * per:(groups.dp_rank + 1) * per] for k, v in batch(step).items()}
    loss = EDMLoss()(EDMPrecond(model), b["x"], Inputs(POS, class_labels=b["class_labels"], text=b["text"]),
                     sigma=b["sigma"], noise=b["noise"])
    opt.zero_grad()
    fabric.backward(loss)
    finalize_grads(model.module, groups)
    opt.step()
    ema.update(model.module)
    return fabric.all_reduce(loss.detach(), group=groups.dp_group, reduce_op="mean").item()


hyper = runs.optimizer_hyperparameters


def main() -> None:
    mode, layout, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    dims, fsdp, devices = LAYOUTS[layout]
    strategy = MegatronStrategy(dims, fsdp=fsdp)
    fabric = Fabric(accelerator="cpu", devices=devices, strategy=strategy)
    fabric.launch()
    groups = strategy.groups

    model = build(groups, fsdp)
    ema = EMA(model, 0.5, module=build(groups, fsdp)) if fsdp else EMA(model, 0.5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = fabric.setup(model, opt, move_to_device=not fsdp)  # as dit-train: a sharded model is not moved

    def tensors():
        return runs.checkpoint_tensors(*dcp.state_tensors(model.module, ema.module, opt, groups, "cpu"))

    losses, start = [], 0
    if mode in ("resume", "load"):
        values = runs.load_tensors(out / ("checkpoint" if mode == "resume" else "checkpoint-fsdp"), tensors())
        runs.load_optimizer_hyperparameters(opt, values["optim_groups"])
        start = values["step"]
    for step in range(start, STEPS):
        losses.append(train_step(fabric, model, opt, ema, groups, step))
        if mode == "straight" and step + 1 == SAVE_AT:
            runs.save_tensors(out / "checkpoint", tensors(), {"step": SAVE_AT, "optim_groups": hyper(opt)})
    if mode == "resume" and layout == "fsdp":
        runs.save_tensors(out / "checkpoint-fsdp", tensors(), {"step": STEPS, "optim_groups": hyper(opt)})

    held = measured_state_bytes(model.module, opt, ema.module)  # this rank's real tensors, gradients still there
    most = fabric.all_gather(torch.tensor(list(held.values()))).reshape(-1, len(held)).amax(0)  # the largest rank's
    held = dict(zip(held, most.tolist(), strict=True))
    final = consolidated_state_dict(model.module, groups)
    final_ema = gather_full(model.module, without_extra_state(ema.module.state_dict()), groups)
    b = batch(99)
    with torch.no_grad():
        inputs = Inputs(POS, class_labels=b["class_labels"], text=b["text"])
        probe = EDMPrecond(model.module)(b["x"], b["sigma"], inputs)
    if fabric.global_rank == 0:
        name = f"{mode}-{layout}"
        torch.save({"weights": final, "ema": final_ema, "probe_output": probe}, out / f"{name}.pt")
        (out / f"{name}.json").write_text(json.dumps({"losses": losses, "start": start,
                                                      "world_size": fabric.world_size,
                                                      "state_bytes": {k: int(v) for k, v in held.items()}}))
    fabric.barrier()


if __name__ == "__main__":
    main()
