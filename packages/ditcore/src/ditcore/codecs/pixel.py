"""The exact pixel codec: each factor×factor×3 patch of a frame becomes one latent cell (pixel_unshuffle).

It loses nothing (decode(encode(x)) == x), which makes it the codec for tests; PatchPCACodec builds on
the same patch layout.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from ditcore.codecs.base import Codec, per_frame


def to_patches(pixels: torch.Tensor, patch: int) -> torch.Tensor:
    """(B, 3, T, H, W) -> (B, 3·patch², T, H/patch, W/patch) float32; channel c·patch² + i·patch + j is pixel (i, j)
    of colour c within the patch."""
    return per_frame(lambda x: F.pixel_unshuffle(x, patch), pixels.float())


def from_patches(patches: torch.Tensor, patch: int) -> torch.Tensor:
    """Inverse of `to_patches`."""
    return per_frame(lambda x: F.pixel_shuffle(x, patch), patches)


class PixelCodec(Codec):
    kind = "pixel"
    temporal_factor = 1

    def __init__(self, factor: int = 1):
        if not isinstance(factor, int) or factor < 1:
            raise ValueError(f"PixelCodec factor={factor!r} is invalid: expected an integer >= 1 (e.g. 8)")
        self.factor = self.spatial_factor = factor
        self.latent_channels = 3 * factor**2

    def _encode(self, pixels: torch.Tensor) -> torch.Tensor:
        return to_patches(pixels, self.factor)

    def _decode(self, latents: torch.Tensor) -> torch.Tensor:
        return from_patches(latents.float(), self.factor)

    def save(self, directory: Path) -> dict:
        return {"kind": self.kind, "factor": self.factor}

    @classmethod
    def from_config(cls, config: dict, directory: Path) -> PixelCodec:
        return cls(config["factor"])
