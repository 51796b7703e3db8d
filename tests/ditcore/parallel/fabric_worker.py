"""Training through Fabric + MegatronStrategy at TP=2, with a checkpoint in the middle.

    torchrun --nproc-per-node 2 fabric_worker.py straight OUT    # 4 steps, saving a checkpoint after 2
    python fabric_worker.py resume OUT                           # Fabric's own launcher: load it, 2 more steps

Both write losses, the consolidated final weights and the model's output on a probe batch to OUT (rank 0).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from lightning_fabric import Fabric

from ditcore import runs
from ditcore.diffusion import EDMLoss, EDMPrecond
from ditcore.layout import grid_positions
from ditcore.models import DiT, preset
from ditcore.parallel import ParallelDims, consolidated_state_dict, finalize_grads, load_consolidated, parallelize
from ditcore.parallel.fabric import MegatronStrategy

CFG = preset("DiT-Tiny", in_channels=4, num_classes=5, text_dim=16)
POS = grid_positions((1, 4, 4))
STEPS, SAVE_AT = 4, 2


def batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)  # the data and noise of step k are fixed
    return dict(x=torch.randn(4, 16, CFG.patch_dim, generator=g) * 0.5,
                sigma=torch.exp(torch.randn(4, 1, generator=g) * 1.2 - 1.2),
                noise=torch.randn(4, 16, CFG.patch_dim, generator=g),
                class_labels=torch.randint(0, 6, (4, 1), generator=g), text=torch.randn(4, 5, 16, generator=g))


def train_step(fabric, model, opt, groups, step: int) -> float:
    b = batch(step)
    loss = EDMLoss()(EDMPrecond(model), b["x"], sigma=b["sigma"], noise=b["noise"], pos=POS,
                     class_labels=b["class_labels"], text=b["text"])
    opt.zero_grad()
    fabric.backward(loss)
    finalize_grads(model.module, groups)
    opt.step()
    return loss.item()


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    strategy = MegatronStrategy(ParallelDims(tp=2), shard_file=runs.shard_file)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    groups = strategy.groups

    torch.manual_seed(0)
    model = DiT(CFG)
    full_init = {k: v.clone() for k, v in model.state_dict().items()}  # identical on every rank (seeded)
    parallelize(model, groups)
    load_consolidated(model, full_init, groups)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = fabric.setup(model, opt)

    losses, start = [], 0
    if mode == "resume":
        state = {"model": model, "optimizer": opt, "step": 0}
        fabric.load(out / "checkpoint", state)
        start = state["step"]
    for step in range(start, STEPS):
        losses.append(train_step(fabric, model, opt, groups, step))
        if mode == "straight" and step + 1 == SAVE_AT:
            fabric.save(out / "checkpoint", {"model": model, "optimizer": opt, "step": SAVE_AT})

    final = consolidated_state_dict(model.module, groups)
    b = batch(99)
    with torch.no_grad():
        probe = EDMPrecond(model.module)(b["x"], b["sigma"], pos=POS, class_labels=b["class_labels"], text=b["text"])
    if fabric.global_rank == 0:
        torch.save({"weights": final, "probe_output": probe}, out / f"{mode}.pt")
        (out / f"{mode}.json").write_text(json.dumps({"losses": losses, "start": start,
                                                      "world_size": fabric.world_size}))
    fabric.barrier()


if __name__ == "__main__":
    main()
