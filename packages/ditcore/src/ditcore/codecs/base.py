"""The latent codec interface: pixels (B, 3, T, H, W) in [-1, 1] <-> latents (B, C, T', H', W').

A codec is fixed once data is prepared: its config (from `save`) is recorded in the dataset and the
checkpoint, so training and sampling always decode with the codec the latents were made with.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable
from pathlib import Path

import torch


class Codec(abc.ABC):
    """Subclasses set the four attributes and implement `_encode`, `_decode` and `save`.

    temporal_factor is 1 for image codecs, which encode each frame alone. Video codecs are causal, as in
    Wan and CogVideoX: the first frame is encoded alone and every later `temporal_factor` frames make one
    latent frame, so T must be 1 + k·temporal_factor and T' = 1 + k.
    """

    kind: str
    latent_channels: int
    spatial_factor: int
    temporal_factor: int

    @torch.no_grad()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """(B, 3, T, H, W) float in [-1, 1] -> (B, C, T', H', W') float32 on the same device."""
        self._check_pixels(pixels)
        return self._encode(pixels)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """(B, C, T', H', W') -> pixels (B, 3, T, H, W) float32, clamped to [-1, 1]."""
        if latents.ndim != 5 or latents.shape[1] != self.latent_channels:
            raise ValueError(
                f"{self.kind} codec got latents of shape {tuple(latents.shape)}: expected (B, "
                f"{self.latent_channels}, T, H, W) — were they made by a different codec?"
            )
        return self._decode(latents).clamp(-1, 1)

    def latent_size(self, frames: int, height: int, width: int) -> tuple[int, int, int]:
        """(T', H', W') that `encode` gives for pixels of this size; raises ValueError where it cannot encode them."""
        self._check_size(frames, height, width)
        return 1 + (frames - 1) // self.temporal_factor, height // self.spatial_factor, width // self.spatial_factor

    @abc.abstractmethod
    def save(self, directory: Path) -> dict:
        """Write parameter files (if any) into `directory`; return the JSON config `load_codec` rebuilds it from."""

    @abc.abstractmethod
    def _encode(self, pixels: torch.Tensor) -> torch.Tensor: ...

    @abc.abstractmethod
    def _decode(self, latents: torch.Tensor) -> torch.Tensor: ...

    def _check_pixels(self, pixels: torch.Tensor) -> None:
        if pixels.ndim != 5 or pixels.shape[1] != 3:
            raise ValueError(
                f"{self.kind} codec got pixels of shape {tuple(pixels.shape)}: expected (B, 3, T, H, W); "
                "add a frame axis to images with pixels.unsqueeze(2)"
            )
        self._check_size(*pixels.shape[2:])

    def _check_size(self, frames: int, height: int, width: int) -> None:
        f = self.spatial_factor
        if height % f or width % f:
            raise ValueError(
                f"{self.kind} codec got pixels of size {height}x{width}: height and width must be multiples of "
                f"{f} — crop or resize to {height // f * f}x{width // f * f} or {-(-height // f) * f}x"
                f"{-(-width // f) * f}"
            )
        t = self.temporal_factor
        if frames < 1 or (frames - 1) % t:
            usable = 1 + max(frames - 1, 0) // t * t
            raise ValueError(
                f"{self.kind} codec got {frames} frames: expected 1 + k·{t} frames (the first frame is encoded "
                f"alone) — e.g. keep the first {usable}"
            )


def per_frame(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Apply an image function fn: (N, C, H, W) -> (N, C', H', W') to every frame of x (B, C, T, H, W)."""
    B, C, T, H, W = x.shape
    y = fn(x.transpose(1, 2).reshape(B * T, C, H, W))  # (B·T, C', H', W')
    # contiguous: callers store single samples, and saving a view writes its whole batch storage
    return y.reshape(B, T, *y.shape[1:]).transpose(1, 2).contiguous()  # (B, C', T, H', W')


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """Peak signal-to-noise ratio in dB of two images in [-1, 1] (peak-to-peak 2.0), over all elements."""
    if a.shape != b.shape:
        raise ValueError(f"psnr needs tensors of one shape, got {tuple(a.shape)} and {tuple(b.shape)}")
    mse = (a.double() - b.double()).pow(2).mean().item()
    return math.inf if mse == 0 else 10 * math.log10(2.0**2 / mse)
