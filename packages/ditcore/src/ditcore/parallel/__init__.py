"""Parallelism, applied to a one-device model from the outside (as torchtitan's `parallelize_*`).

- dims: topology (`ParallelDims`) and Megatron-Core process groups (`ParallelGroups`)
- the TP plans applied here (how each parameter is laid out over TP ranks) are not here: each architecture's is
  defined beside its model and registered with it (ditcore.models.plan, ditcore.models.registry)
- tensor_parallel / context_parallel: the sharding itself; parallelize: both, in order; build_parallel_model:
  this rank's part of a model, built (meta → sharded → techniques → materialised) as dit-train builds it
- materialize: initial weights for a model built on the meta device, each rank computing only its shards
- grads: completing, measuring and clipping gradients; consolidate: one-device weights and back
- fabric: the Lightning Fabric strategy for these layouts; connections: the CUDA_DEVICE_MAX_CONNECTIONS they need
- watchdog: every group's collective timeout, heartbeats, and the one line that ends a run whose peer is lost

Megatron-Core and Lightning are imported only when a layout is initialised or a strategy is built, so
one-device use of ditcore does not pay for them.
"""

from ditcore.parallel.consolidate import consolidated_state_dict, gather_full, load_consolidated
from ditcore.parallel.dims import ParallelDims, ParallelGroups
from ditcore.parallel.grads import clip_grad_norm_, finalize_grads, grad_norm
from ditcore.parallel.materialize import materialize
from ditcore.parallel.parallelize import build_parallel_model, parallelize

__all__ = [
    "ParallelDims", "ParallelGroups", "build_parallel_model", "clip_grad_norm_", "consolidated_state_dict",
    "finalize_grads", "gather_full", "grad_norm", "load_consolidated", "materialize", "parallelize",
]
