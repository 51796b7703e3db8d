"""Exponential moving average of model weights; samplers use the EMA weights."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor


class EMA(nn.Module):
    """θ_ema ← β θ_ema + (1 − β) θ after each optimizer step.

    `module` is a frozen copy of the model with the same structure (and, for sharded models, the same
    shards), so it can be saved, loaded and sampled like the model itself. Buffers are copied as is.

    A model sharded by FSDP cannot be deep-copied: pass `module`, a second model built and sharded the same way,
    and the EMA starts from a copy of the model's (local) weights in it.
    """

    def __init__(self, model: nn.Module, decay: float = 0.9999, module: nn.Module | None = None):
        super().__init__()
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay={decay} is invalid: expected 0 <= decay < 1 (0 copies the weights)")
        self.decay = decay
        if module is None:
            # A parallelized model holds process-group handles: the copy shares them (they cannot be copied).
            groups = {id(v): v for m in model.modules() for v in vars(m).values() if isinstance(v, ProcessGroup)}
            module = copy.deepcopy(model, memo=groups)
        else:
            with torch.no_grad():
                for e, p in zip(_tensors(module), _tensors(model), strict=True):
                    e.copy_(p)
        self.module = module.requires_grad_(False).eval()

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        ema_p = [_local(p) for p in self.module.parameters()]  # FSDP: this rank's pieces, updated in place
        new_p = [_local(p).detach().to(e.dtype) for p, e in zip(model.parameters(), ema_p, strict=True)]
        torch._foreach_lerp_(ema_p, new_p, 1.0 - self.decay)
        for b_ema, b in zip(self.module.buffers(), model.buffers(), strict=True):
            b_ema.copy_(b)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _tensors(module: nn.Module) -> list[torch.Tensor]:
    return [_local(t) for t in [*module.parameters(), *module.buffers()]]
