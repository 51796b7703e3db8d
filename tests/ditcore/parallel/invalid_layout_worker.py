"""Start-up of a parallel job with a layout that cannot work: every rank must fail with the same clear
message, before or without any rank waiting in a collective. argv: tp cp num_heads seq_len [sp]."""

import sys

import torch.distributed as dist

from ditcore.errors import ConfigError
from ditcore.models import DiT, preset
from ditcore.parallel import ParallelDims, parallelize

tp, cp, heads, seq = (int(a) for a in sys.argv[1:5])
dist.init_process_group("gloo")
rank = dist.get_rank()
try:
    dims = ParallelDims(tp=tp, cp=cp, sequence_parallel="sp" in sys.argv).resolve(dist.get_world_size())
    dims.check_model(heads, seq)
    parallelize(DiT(preset("DiT-Tiny", hidden_size=24 * heads, num_heads=heads)), dims.initialize())
except ConfigError as e:
    print(f"rank {rank}: {e}", file=sys.stderr, flush=True)
    sys.exit(3)
print(f"rank {rank}: started", flush=True)
dist.destroy_process_group()
