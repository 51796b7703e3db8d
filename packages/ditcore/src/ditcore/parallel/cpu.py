"""Megatron-Core on a CPU-only machine (gloo): the shims, all in one place, applied only without CUDA.

What is shimmed here, with the failures it fixes (measured with megatron-core 0.16.1 and torch 2.13 on CPU):
- `torch.cuda.current_device()` is Megatron's allocation device (global memory buffer, sequence-parallel
  all-gathers, parameter allocation, `DotProductAttention`), which fails with "AssertionError: Torch not
  compiled with CUDA enabled": make it "cpu".
- The model-parallel RNG tracker stores CUDA generator states: `model_parallel_cuda_manual_seed` fails with the
  same assertion, then attention's `fork()` with "cuda rng state model-parallel-rng is not added". A tracker
  that swaps the CPU generator's state instead, seeded as Megatron seeds (seed + 2718 + tp_rank).
What is not needed: Megatron's SP-capable norm and its attention modules. ditcore's DiT uses its own norms
(their gradients under SP are reduced by `finalize_grads`) and its own attention (SDPA with a block-diagonal
mask for packed rows; K/V all-gathered over the context-parallel group), which run on CPU and GPU alike.
These shims can go when Megatron-Core takes a device argument for these paths.
"""

from __future__ import annotations

import contextlib

import torch

_APPLIED = False


def apply_cpu_shims() -> None:
    global _APPLIED
    if _APPLIED or torch.cuda.is_available():
        return
    torch.cuda.current_device = lambda: "cpu"
    _install_cpu_rng_tracker()
    _APPLIED = True


def _install_cpu_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """Megatron's tracker with CPU generator states: same names, seeds and fork semantics."""

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)

    mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def seed_model_parallel_rng(seed: int, tp_rank: int) -> None:
    """Megatron's seeding: the data-parallel stream gets `seed`, the model-parallel one seed + 2718 + tp_rank."""
    from megatron.core.tensor_parallel import random as mrandom

    if torch.cuda.is_available():
        mrandom.model_parallel_cuda_manual_seed(seed, tp_rank=tp_rank, ep_rank=0, etp_rank=0, force_reset_rng=True)
        return
    tracker = mrandom.get_cuda_rng_tracker()
    tracker.reset()
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
