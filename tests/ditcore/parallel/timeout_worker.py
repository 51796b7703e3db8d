"""Every process group of a run waits at most its collective timeout for a frozen peer.

    torchrun --nproc-per-node 2 timeout_worker.py SECONDS OUT

Fabric + MegatronStrategy(timeout=SECONDS) start the run (the default group), its Megatron-Core groups (DP×CP, with
ep=2 the experts' group, the data-parallel gloo group) and an HSDP mesh (its replicate group) are made, and one
collective runs once on each, so that every group is connected. Then rank 1 freezes: it sleeps, its sockets open, as
a stopped node's. Rank 0 starts an all-reduce on every group at once and records, for each, the seconds until it
raised (and the first line of the error) in OUT.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from lightning_fabric import Fabric
from megatron.core import parallel_state as ps

from ditcore.parallel import ParallelDims
from ditcore.parallel.fabric import MegatronStrategy
from ditcore.parallel.fsdp import fsdp_mesh

seconds, out = float(sys.argv[1]), sys.argv[2]
strategy = MegatronStrategy(ParallelDims(ep=2), timeout=timedelta(seconds=seconds))
fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
fabric.launch()
groups = strategy.groups
hsdp = fsdp_mesh(groups, "cpu", shard=1)  # dp 2, shards of 1: each rank's replicate group holds both ranks
under_test = {"default": dist.group.WORLD, "dp_cp": groups.dp_cp_group, "ep": groups.ep_group,
              "dp_gloo": ps.get_data_parallel_group_gloo(), "hsdp_replicate": hsdp.get_group("replicate")}
for group in under_test.values():
    dist.all_reduce(torch.ones(1), group=group)  # every pair connected, as in a run's first step
dist.barrier()

if dist.get_rank() == 1:
    deadline = time.monotonic() + seconds * 3 + 60
    while not Path(out).exists() and time.monotonic() < deadline:  # frozen: no collective, its sockets open
        time.sleep(0.1)
    os._exit(0)  # not through the process groups' teardown, which would wait for rank 0

started = time.monotonic()
work = {name: dist.all_reduce(torch.ones(1), group=group, async_op=True) for name, group in under_test.items()}
raised = {}
for name, w in work.items():
    try:
        w.wait()
        raised[name] = None
    except RuntimeError as e:
        raised[name] = (time.monotonic() - started, str(e).splitlines()[0][:200])
Path(out + ".tmp").write_text(json.dumps(raised))
os.replace(out + ".tmp", out)  # whole, when rank 1 sees it
os._exit(0)  # as rank 1: its groups' teardown would wait on the collectives that timed out
