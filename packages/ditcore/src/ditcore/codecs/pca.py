"""The patch-PCA codec: a closed-form linear autoencoder, fitted on the dataset itself at prepare time.

Each non-overlapping patch×patch×3 pixel patch (192 values for 8×8) is projected onto the top-K principal
components of the dataset's patches; latent channel k of a cell is the patch's k-th coefficient. For a given
K this is the linear code with the least squared reconstruction error on the fitted data (Eckart–Young), and
it needs no download and no training.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path

import torch

from ditcore import tensorfile
from ditcore.codecs.base import Codec
from ditcore.codecs.pixel import PixelCodec, from_patches, to_patches

PARAMETER_FILE = "codec_pca.safetensors"


class PatchPCACodec(Codec):
    """mean (D,), components (K, D) with orthonormal rows, variance (K,) of each component; D = 3·patch²."""

    kind = "patch_pca"
    temporal_factor = 1

    def __init__(self, mean: torch.Tensor, components: torch.Tensor, variance: torch.Tensor):
        K, D = components.shape
        patch = math.isqrt(D // 3)
        if 3 * patch**2 != D or mean.shape != (D,) or variance.shape != (K,):
            raise ValueError(
                f"PatchPCACodec parameters do not fit together: mean {tuple(mean.shape)}, components "
                f"{tuple(components.shape)}, variance {tuple(variance.shape)} — expected (D,), (K, D), (K,) with "
                "D = 3·patch²"
            )
        self.mean, self.components, self.variance = mean.float(), components.float(), variance.float()
        self.patch = self.spatial_factor = patch
        self.latent_channels = K

    @classmethod
    def fit(cls, pixel_batches: Iterable[torch.Tensor], patch: int = 8, channels: int = 16,
            max_patches: int = 1_000_000) -> PatchPCACodec:
        """Fit on pixel batches (B, 3, T, H, W) in [-1, 1].

        Reading stops after max_patches patches (that bounds the time), so pass batches in shuffled order
        when the dataset holds more than that.
        """
        dim = 3 * patch**2
        if not 1 <= channels <= dim:
            raise ValueError(
                f"PatchPCACodec channels={channels} is invalid: expected 1..{dim} (3·patch² for patch={patch})"
            )
        patcher, count, total, gram = PixelCodec(patch), 0, 0.0, 0.0
        for pixels in pixel_batches:
            x = patcher.encode(pixels).movedim(1, -1).reshape(-1, dim)  # (N, D): one row per patch
            x = x[: max_patches - count].double()  # float64: the covariance is a difference of large sums
            total, gram, count = total + x.sum(0), gram + x.T @ x, count + len(x)
            if count >= max_patches:
                break
        if count == 0:
            raise ValueError("PatchPCACodec.fit got no pixels: pass at least one batch of shape (B, 3, T, H, W)")
        mean = total / count
        covariance = gram / count - torch.outer(mean, mean)  # (D, D)
        eigenvalues, eigenvectors = torch.linalg.eigh(covariance)  # ascending
        variance = eigenvalues.flip(0)[:channels].clamp_min(0)  # rounding can leave tiny negative values
        components = eigenvectors.flip(1)[:, :channels].T  # (K, D)
        # Eigenvectors are defined up to sign: make each one's largest entry positive, so that fitting the
        # same data twice gives the same codec.
        largest = components.gather(1, components.abs().argmax(1, keepdim=True))
        components = components * largest.sign()
        return cls(mean.cpu(), components.cpu(), variance.cpu())

    def _encode(self, pixels: torch.Tensor) -> torch.Tensor:
        patches = to_patches(pixels, self.patch)  # (B, D, T, h, w)
        mean = self.mean.to(patches.device)[:, None, None, None]
        return torch.einsum("kd,bdthw->bkthw", self.components.to(patches.device), patches - mean)

    def _decode(self, latents: torch.Tensor) -> torch.Tensor:
        latents = latents.float()
        mean = self.mean.to(latents.device)[:, None, None, None]
        patches = torch.einsum("kd,bkthw->bdthw", self.components.to(latents.device), latents) + mean
        return from_patches(patches, self.patch)

    def save(self, directory: Path) -> dict:
        tensors = {"mean": self.mean, "components": self.components, "variance": self.variance}
        tensorfile.save(tensors, Path(directory) / PARAMETER_FILE)
        return {"kind": self.kind, "patch": self.patch, "channels": self.latent_channels, "file": PARAMETER_FILE}

    @classmethod
    def from_config(cls, config: dict, directory: Path) -> PatchPCACodec:
        path = Path(directory) / config.get("file", PARAMETER_FILE)
        if not path.is_file():
            raise FileNotFoundError(
                f"patch_pca codec parameters {str(path)!r} not found — they are written next to the codec config by "
                "PatchPCACodec.save; copy the whole dataset (or checkpoint) folder, not only its JSON"
            )
        codec = cls(**tensorfile.load(path, "copy it again from the dataset folder that dit-prepare wrote"))
        if (codec.patch, codec.latent_channels) != (config["patch"], config["channels"]):
            raise ValueError(
                f"{str(path)!r} holds a patch={codec.patch}, channels={codec.latent_channels} codec but its config "
                f"says patch={config['patch']}, channels={config['channels']} — the files come from different runs"
            )
        return codec
