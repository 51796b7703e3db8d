"""Per-channel latent statistics: every codec's latents are stored normalised to std SIGMA_DATA.

EDM's preconditioning assumes data with std σ_data (Karras et al. 2022, Table 1), so the dataset stores
(z − mean) / std · σ_data and sampling decodes denormalize(x). The channel axis is 1 for a batch
(B, C, T, H, W) and 0 for a single sample (C, T, H, W).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ditcore.layout import SIGMA_DATA

MIN_STD = 1e-6  # a constant channel carries nothing; the floor keeps its normalised value finite (zero)


def channel_axis(z: torch.Tensor) -> int:
    if z.ndim == 5:
        return 1
    if z.ndim == 4:
        return 0
    raise ValueError(
        f"latents of shape {tuple(z.shape)}: expected a batch (B, C, T, H, W) or one sample (C, T, H, W)"
    )


@dataclass(frozen=True)
class LatentStats:
    mean: torch.Tensor  # (C,) float32
    std: torch.Tensor  # (C,) float32

    @classmethod
    def measure(cls, latents: Iterable[torch.Tensor]) -> LatentStats:
        """Mean and (population) std per channel over every position of every tensor given."""
        count, total, squares = 0, None, None
        for z in latents:
            axis = channel_axis(z)
            x = z.detach().movedim(axis, 0).reshape(z.shape[axis], -1).double()  # (C, N); float64 running sums
            if total is None:
                total, squares = torch.zeros_like(x[:, 0]), torch.zeros_like(x[:, 0])
            elif len(x) != len(total):
                raise ValueError(f"latents with {len(x)} channels after ones with {len(total)}: mixed codecs?")
            count, total, squares = count + x.shape[1], total + x.sum(1), squares + x.pow(2).sum(1)
        if not count:
            raise ValueError("LatentStats.measure got no latents: pass at least one non-empty tensor")
        mean = total / count
        std = (squares / count - mean**2).clamp_min(0).sqrt().clamp_min(MIN_STD)
        return cls(mean.float().cpu(), std.float().cpu())

    @classmethod
    def of_vae(cls, channels: int, scaling_factor: float, shift_factor: float = 0.0) -> LatentStats:
        """The statistics that normalise a VAE's latents z as diffusers' pipelines do, (z − shift)·scaling_factor
        (DiT: 0.18215·z): (z − mean)/std·σ_d is that for mean = shift, std = σ_d/scaling_factor."""
        return cls(torch.full((channels,), float(shift_factor)), torch.full((channels,), SIGMA_DATA / scaling_factor))

    def pooled(self) -> LatentStats:
        """The same means, one std for every channel (the root mean square of theirs): the latents keep their
        channels' relative scales, as a VAE's single scaling factor does. For codecs whose channels differ in
        importance (PCA: the first component carries most of the picture), per-channel scaling would give a
        channel of fine detail as much noise, and as much weight in the loss, as the one of the coarse shape."""
        rms = self.std.double().pow(2).mean().sqrt().float()
        return LatentStats(self.mean.clone(), torch.full_like(self.std, rms.item()))

    def normalize(self, z: torch.Tensor) -> torch.Tensor:
        """(z − mean) / std · SIGMA_DATA, computed in float32, returned in z's dtype."""
        mean, std = self._shaped(z)
        return ((z.float() - mean) / std * SIGMA_DATA).to(z.dtype)

    def denormalize(self, z: torch.Tensor) -> torch.Tensor:
        """Inverse of `normalize`: what the codec decodes."""
        mean, std = self._shaped(z)
        return (z.float() / SIGMA_DATA * std + mean).to(z.dtype)

    def _shaped(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        axis, C = channel_axis(z), len(self.mean)
        if z.shape[axis] != C:
            raise ValueError(
                f"latents of shape {tuple(z.shape)} have {z.shape[axis]} channels on axis {axis}: these "
                f"statistics are for {C} channels — were they measured with a different codec?"
            )
        shape = [1] * z.ndim
        shape[axis] = C
        return self.mean.to(z.device).view(shape), self.std.to(z.device).view(shape)

    def to_dict(self) -> dict:
        return {"mean": self.mean.tolist(), "std": self.std.tolist()}

    @classmethod
    def from_dict(cls, data: dict) -> LatentStats:
        mean, std = data.get("mean"), data.get("std")
        if not isinstance(mean, list) or not isinstance(std, list) or len(mean) != len(std) or not mean:
            raise ValueError(
                f"latent stats {data!r} are invalid: expected {{'mean': [...], 'std': [...]}}, two lists of one "
                "float per channel"
            )
        if min(std) <= 0:
            raise ValueError(f"latent stats std={std} is invalid: every channel's std must be > 0")
        return cls(torch.tensor(mean, dtype=torch.float32), torch.tensor(std, dtype=torch.float32))
