"""What CUDA's kernels keep for backward where the CPU's keep otherwise, for the memory record (ditcore.memory), which
runs a layout for CUDA on the CPU's fake tensors: these make the CPU's ops keep what CUDA's would.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ditcore.models import attention

# What CUDA's kernels keep that the CPU's, which the record runs, keep otherwise (a layout for CUDA records with them):
# - LayerNorm: its mean and rstd in fp32; the CPU's in the input's dtype (CUDA_KEEPS: op → its outputs' dtypes);
# - RMSNorm: the fused kernel keeps its input and rstd (fp32); the CPU decomposes it in fp32 and keeps fp32 copies and
#   the normalised values (_FusedRMSNorm);
# - FlexAttention: block masks, no dense (B, 1, Nq, Nk) mask; q, k, v, its output and logsumexp (fp32) (flex_keeps).
# SDPA's kernels keep the same on both: the output and logsumexp (flash, memory-efficient; the CPU's flash).
CUDA_KEEPS = {torch.ops.aten.native_layer_norm.default: ((1, torch.float32), (2, torch.float32))}


class _FusedRMSNorm(torch.autograd.Function):
    """RMSNorm as CUDA's fused kernel (aten._fused_rms_norm) keeps it: its input and rstd (fp32)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, shape, weight: torch.Tensor | None, eps: float | None) -> torch.Tensor:
        with torch.no_grad():
            out = F.rms_norm(x, shape, weight, eps)
        ctx.save_for_backward(x, x.new_empty((*x.shape[:-len(shape)], *[1] * len(shape)), dtype=torch.float32),
                              weight)
        return out

    @staticmethod
    def backward(ctx, grad):  # never run: the record is a forward
        raise NotImplementedError


class CudaNorms(TorchFunctionMode):
    """F.rms_norm as on CUDA (`_FusedRMSNorm`)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.rms_norm:
            x, shape, weight, eps = [*args, None, None][:4]
            kwargs = kwargs or {}
            return _FusedRMSNorm.apply(x, tuple(shape), kwargs.get("weight", weight), kwargs.get("eps", eps))
        return func(*args, **(kwargs or {}))


class _EagerFlex(torch.autograd.Function):
    """What FlexAttention's autograd keeps: q, k, v, its output and logsumexp (fp32); made by ops that selective
    checkpointing does not keep (an eager block calls a separately compiled kernel, which its policy cannot see)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out, lse = torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):  # never run: the record is a forward
        raise NotImplementedError


@contextlib.contextmanager
def flex_keeps(compiled: bool):
    """FlexAttention as CUDA runs it, for a record on fake CPU tensors (the CPU has no flex backward): its block
    masks made by create_block_mask itself (no dense mask), its kernel one that keeps what flex's keeps. In compiled
    blocks selective checkpointing sees flex and keeps its output: the CPU's flash kernel without a mask, which keeps
    the same and which the policy keeps too; in eager ones it is `_EagerFlex`."""
    create_block_mask, _ = attention._flex()

    # The kernels attend() calls for a device type are ditcore.models.attention's to choose; the record swaps the
    # CPU's while it runs (fake tensors are CPU tensors), and puts them back.
    def flex(q, k, v, block_mask, enable_gqa, score_mod=None):  # a score term keeps nothing more than its inputs
        if compiled:
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=enable_gqa)
        return _EagerFlex.apply(q, k, v)

    before = attention._KERNELS.get("cpu")
    attention._KERNELS["cpu"] = attention._Kernels(create_block_mask, flex)
    try:
        yield
    finally:
        attention._KERNELS.pop("cpu")
        if before is not None:
            attention._KERNELS["cpu"] = before
