"""CUDA_DEVICE_MAX_CONNECTIONS: what each layout needs, decided before CUDA starts.

The host sends kernels to a GPU through CUDA_DEVICE_MAX_CONNECTIONS hardware queues (1 to 32; CUDA's default is
8), and CUDA maps every stream onto one of them. Work in one queue starts in the order it was queued, so with 1 all
streams share a queue: a collective on NCCL's stream waits for the compute kernels queued before it, and compute
queued after a collective waits for it to start.

Megatron-Core's own ColumnParallelLinear / RowParallelLinear rely on that order: in backward they launch the
sequence-parallel all-gather (or the tensor-parallel all-reduce) asynchronously and need it to start before the
weight-gradient matmul queued after it ("Here we rely on CUDA_DEVICE_MAX_CONNECTIONS=1", megatron/core/
tensor_parallel/layers.py; it warns when the variable is not 1, and Megatron-LM's training script asserts it for TP
and CP). The order buys overlap, not correctness. ditcore's tensor-parallel linears
(ditcore.parallel.tensor_parallel) use torch's functional collectives instead, which torch.compile traces and
Inductor schedules itself: nothing in ditcore depends on the queue order.

What ditcore's layouts need is the opposite: collectives that run on their own streams beside the compute —
FSDP2's parameter all-gathers and gradient reduce-scatters, DDP's bucketed gradient all-reduces, tensor and context
parallelism's gathers, the pipeline's sends and receives — overlap it only with more than one queue. With 1,
FSDP2's reduce-scatters serialise with the backward (verl-project/verl-omni#421: CUDA's default 8 restored the
overlap); for FSDP2 with torch's own tensor parallelism torchtitan recommends one queue per stream, 16 or 32
(pytorch/torchtitan#1147). A training process here uses up to about ten streams: compute, FSDP2's copy-in,
all-gather and reduce-scatter streams and one NCCL stream per process group in use; 32, the most CUDA allows, gives
each its own queue, so that no two streams wait on each other through a queue they share.

The variable is read when CUDA creates its context: it has to be in the environment before the first CUDA call of
the process. Processes that Fabric starts inherit the launcher's environment; under torchrun every rank sets it in
its own.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

import torch

from ditcore.parallel.dims import ParallelDims

VARIABLE = "CUDA_DEVICE_MAX_CONNECTIONS"
QUEUES = 32  # one hardware queue per stream (see above); the most CUDA allows


@dataclass(frozen=True)
class Connections:
    """What to do about CUDA_DEVICE_MAX_CONNECTIONS: a value to set (None: leave the environment as it is) and a
    one-line warning (None: nothing to say)."""

    set_to: str | None = None
    warning: str | None = None


def overlapped(dims: ParallelDims, world_size: int, fsdp: bool) -> list[str]:
    """The collectives of this layout that overlap compute on streams of their own, in words (none on one process)."""
    replicas = world_size // (dims.tp * dims.cp * dims.pp)  # data-parallel ranks, which hold the same weights
    what = []
    if dims.tp > 1:
        what.append("tensor parallelism's " + ("all-gathers and reduce-scatters" if dims.sequence_parallel
                                               else "all-reduces"))
    if dims.cp > 1:
        what.append("context parallelism's key/value all-gathers")
    if dims.pp > 1:
        what.append("the pipeline's sends and receives")
    if fsdp and replicas * dims.cp > 1:
        what.append("FSDP2's all-gathers and reduce-scatters")
    elif replicas > 1 and dims.pp == 1:
        what.append("DDP's gradient all-reduces")
    return what


def decide(dims: ParallelDims, world_size: int, fsdp: bool, env: Mapping[str, str]) -> Connections:
    """What a process of this layout should do about CUDA_DEVICE_MAX_CONNECTIONS in `env`: set QUEUES where it is
    unset and the layout communicates; warn where it is 1 and the layout has collectives to overlap; otherwise keep
    what the user chose."""
    what = overlapped(dims, world_size, fsdp)
    if not what:
        return Connections()  # one process: nothing to overlap, any value will do
    value = env.get(VARIABLE)
    if value is None:
        return Connections(set_to=str(QUEUES))
    if value.strip() == "1":
        return Connections(warning=f"warning: {VARIABLE}=1 puts every CUDA stream in one queue, so "
                                   f"{' and '.join(what)} cannot overlap compute — unset it ({QUEUES} is then set) "
                                   "or set it above 1")
    return Connections()


def apply(dims: ParallelDims, world_size: int, fsdp: bool, env: MutableMapping[str, str] = os.environ) -> str | None:
    """Put `decide`'s value in `env` (this process's environment) before CUDA starts; returns its warning, if any."""
    action = decide(dims, world_size, fsdp, env)
    if action.set_to is not None:
        if torch.cuda.is_initialized():  # too late for this process: CUDA read the variable when it started
            return (f"warning: CUDA started before {VARIABLE} could be set to {action.set_to}: set it in the launch "
                    "environment")
        env[VARIABLE] = action.set_to
    return action.warning
