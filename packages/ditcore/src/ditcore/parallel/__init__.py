"""Parallelism: topology and process groups, TP/SP/CP for the DiT, gradients, consolidated weights.

Megatron-Core and Lightning are imported only when a layout is initialised or a strategy is built, so
one-device use of ditcore does not pay for them.
"""

from ditcore.parallel.dims import ParallelDims, ParallelGroups
from ditcore.parallel.tensor_parallel import (
    clip_grad_norm_,
    consolidated_state_dict,
    finalize_grads,
    gather_full,
    grad_norm,
    load_consolidated,
    parallelize,
)

__all__ = [
    "ParallelDims", "ParallelGroups", "clip_grad_norm_", "consolidated_state_dict", "finalize_grads", "gather_full",
    "grad_norm", "load_consolidated", "parallelize",
]
