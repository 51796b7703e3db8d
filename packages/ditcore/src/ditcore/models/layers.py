"""The layers the architectures share, each depending only on its arguments: token positions (3D RoPE, fixed sin-cos
tables and their range check), the sinusoidal scalar embedder (noise levels, fps and any per-sample number an
architecture conditions on) and norms that run in the activations' dtype. The DiT (ditcore.models.dit) and every
architecture built on it compose them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

# --------------------------------------------------------------------------------------------------
# Positions


def check_positions(pos: torch.Tensor, max_grid: tuple[int, int, int]) -> None:
    """Refuse positions outside max_grid. Reading the answer waits for the device: call it on host tensors (the
    model does so for CPU inputs; dit-train checks each batch before copying it to the GPU)."""
    limit = torch.tensor(max_grid, device=pos.device)
    bad = (pos < 0) | (pos >= limit)
    if bad.any():
        axis = int(bad.reshape(-1, 3).any(0).nonzero()[0])
        name = "THW"[axis]
        raise ValueError(
            f"token position {name}={int(pos[..., axis].max())} is outside the model's range "
            f"0..{max_grid[axis] - 1} (max_grid={tuple(max_grid)} tokens); sample a smaller "
            f"{['number of frames', 'height', 'width'][axis]} or build the model with a larger max_grid"
        )


def rope_split(head_dim: int) -> tuple[int, int, int]:
    """Rotation pairs given to the (t, h, w) axes: a quarter to time, the rest shared by height and width."""
    pairs = head_dim // 2
    t = pairs // 4
    h = (pairs - t) // 2
    return t, h, pairs - t - h


def rope_angles(pos: torch.Tensor, head_dim: int, theta: float) -> torch.Tensor:
    """3D RoPE rotation angles (..., head_dim/2), float32, for integer (t, h, w) positions (..., 3)."""
    angles = []
    for axis, n in enumerate(rope_split(head_dim)):
        inv_freq = theta ** (-torch.arange(n, device=pos.device, dtype=torch.float32) / n)
        angles.append(pos[..., axis, None].float() * inv_freq)
    return torch.cat(angles, dim=-1)


def apply_rope(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate consecutive pairs (x₁, x₂) of x (B, H, N, hd) by the angles whose (cos, sin) are given, each
    (B or 1, 1, N, hd/2) in x's dtype: real arithmetic in the compute dtype, which a compiler fuses into one pass."""
    cos, sin = rope
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


def sincos_2d(pos: torch.Tensor, dim: int) -> torch.Tensor:
    """DiT's fixed 2-D sin-cos embedding (..., dim) of (t, h, w) positions, t ignored: the first half of the channels
    encodes the column w, the second the row h (DiT builds its grid with w first), each as [sin, cos] of dim/4
    frequencies 10000^(-k/(dim/4)). Computed in float64, as DiT's NumPy table is, then rounded to float32."""
    omega = 10000.0 ** (-torch.arange(dim // 4, device=pos.device, dtype=torch.float64) / (dim // 4))
    parts = []
    for axis in (2, 1):
        a = pos[..., axis, None].double() * omega
        parts += [a.sin(), a.cos()]
    return torch.cat(parts, dim=-1).float()


def sincos_3d(pos: torch.Tensor, dim: int) -> torch.Tensor:
    """Fixed sin-cos embedding (..., dim) of (t, h, w) positions, channels split across axes as for RoPE."""
    parts = []
    for axis, n in enumerate(rope_split(dim)):
        omega = 10000.0 ** (-torch.arange(n, device=pos.device, dtype=torch.float32) / n)
        a = pos[..., axis, None].float() * omega
        parts += [a.sin(), a.cos()]
    return torch.cat(parts, dim=-1)


# --------------------------------------------------------------------------------------------------
# Scalar embedders (one vector per sample)


def sinusoidal(t: torch.Tensor, dim: int, max_period: float = 10000.0, shift: int = 0) -> torch.Tensor:
    """[cos, sin] of t times dim/2 frequencies max_period^(-k/(dim/2 - shift)) (shift 1: diffusers' DiT port)."""
    half = dim // 2
    exponent = -math.log(max_period) * torch.arange(half, device=t.device, dtype=torch.float32)
    freqs = torch.exp(exponent / (half - shift))
    args = t.float()[..., None] * freqs
    return torch.cat([args.cos(), args.sin()], dim=-1)


class ScalarEmbedder(nn.Module):
    """Scalar (noise level, fps) → vector: sinusoidal features then a 2-layer MLP, as DiT's t_embedder.

    The noise level comes in the network's own units, which the preconditioning sets (ditcore.diffusion): EDM's
    1000·ln(σ)/4, or a DDPM network's timestep index in [0, 1000)."""

    def __init__(self, hidden_size: int, freq_dim: int = 256, shift: int = 0):
        super().__init__()
        self.freq_dim, self.shift = freq_dim, shift
        self.mlp = nn.Sequential(nn.Linear(freq_dim, hidden_size), nn.SiLU(), nn.Linear(hidden_size, hidden_size))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.mlp(sinusoidal(t, self.freq_dim, shift=self.shift).to(self.mlp[0].weight.dtype))


# --------------------------------------------------------------------------------------------------
# Norms that run in the activations' dtype. Under autocast, layer_norm is autocast to float32 and an rms_norm
# of a bf16 input with a float32 weight leaves the fused kernel; both kernels accumulate in float32 anyway.


class LayerNorm(nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = (None if t is None else t.to(x.dtype) for t in (self.weight, self.bias))
        with torch.autocast(x.device.type, enabled=False):
            return F.layer_norm(x, self.normalized_shape, w, b, self.eps)


class RMSNorm(nn.RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = None if self.weight is None else self.weight.to(x.dtype)
        with torch.autocast(x.device.type, enabled=False):
            return F.rms_norm(x, self.normalized_shape, w, self.eps)
