"""Exponential moving average of model weights; samplers use the EMA weights."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed import ProcessGroup


class EMA(nn.Module):
    """θ_ema ← β θ_ema + (1 − β) θ after each optimizer step.

    `module` is a frozen copy of the model with the same structure (and, for sharded models, the same
    shards), so it can be saved, loaded and sampled like the model itself. Buffers are copied as is.
    """

    def __init__(self, model: nn.Module, decay: float = 0.9999):
        super().__init__()
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay={decay} is invalid: expected 0 <= decay < 1 (0 copies the weights)")
        self.decay = decay
        # A parallelized model holds process-group handles: the copy shares them (they cannot be copied).
        groups = {id(v): v for m in model.modules() for v in vars(m).values() if isinstance(v, ProcessGroup)}
        self.module = copy.deepcopy(model, memo=groups).requires_grad_(False).eval()

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        ema_p = [p for p in self.module.parameters()]
        new_p = [p.detach().to(e.dtype) for p, e in zip(model.parameters(), ema_p, strict=True)]
        torch._foreach_lerp_(ema_p, new_p, 1.0 - self.decay)
        for b_ema, b in zip(self.module.buffers(), model.buffers(), strict=True):
            b_ema.copy_(b)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)
