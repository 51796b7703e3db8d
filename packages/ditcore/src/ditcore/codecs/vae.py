"""Pretrained VAEs through diffusers, from the hub or a local folder.

Image VAEs (AutoencoderKL, AutoencoderTiny) encode each frame alone; AutoencoderKLWan is a causal video VAE.
Latents are the posterior mean (deterministic) and are not scaled here: LatentStats normalises every codec's
latents the same way. The config records the class and where the weights are, not the weights.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ditcore.choices import VAE_CLASSES
from ditcore.codecs.base import Codec, per_frame
from ditcore.codecs.hub import from_pretrained

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def vae_factors(vae_class: str, config) -> tuple[int, int, int]:
    """(latent channels, spatial factor, temporal factor) from a diffusers VAE config.

    Computed from the architecture (one 2× downsample between consecutive block levels), not from Wan's
    scale_factor_* fields: those are informational and keep their defaults in smaller builds.
    """
    if vae_class == "AutoencoderKL":
        return config.latent_channels, 2 ** (len(config.block_out_channels) - 1), 1
    if vae_class == "AutoencoderTiny":
        return config.latent_channels, 2 ** (len(config.num_encoder_blocks) - 1), 1
    # AutoencoderKLWan; patch_size is the pixel patchify in front of the encoder (Wan 2.2)
    spatial = 2 ** (len(config.dim_mult) - 1) * (config.patch_size or 1)
    return config.z_dim, spatial, 2 ** sum(config.temperal_downsample)


class DiffusersVAECodec(Codec):
    kind = "diffusers"

    def __init__(self, source: str | Path, vae_class: str = "AutoencoderKL", subfolder: str | None = None,
                 dtype: str = "float32"):
        """source: a hub id (e.g. "stabilityai/sd-vae-ft-mse") or a local folder written by save_pretrained."""
        if vae_class not in VAE_CLASSES:
            raise ValueError(f"vae_class={vae_class!r} is not supported: expected one of {', '.join(VAE_CLASSES)}")
        if dtype not in DTYPES:
            raise ValueError(f"VAE dtype={dtype!r} is invalid: expected one of {', '.join(DTYPES)}")
        import diffusers  # deferred: importing diffusers takes seconds and only this codec needs it

        classes = {
            "AutoencoderKL": diffusers.AutoencoderKL,
            "AutoencoderTiny": diffusers.AutoencoderTiny,
            "AutoencoderKLWan": diffusers.AutoencoderKLWan,
        }
        folder = Path(source).expanduser()
        # a local folder is recorded absolute, so the saved config resolves from any working directory
        self.source = str(folder.resolve()) if folder.is_dir() else str(source)
        self.vae_class, self.subfolder, self.dtype = vae_class, subfolder, dtype
        self.vae = from_pretrained(classes[vae_class], self.source, what="VAE", subfolder=subfolder,
                                   torch_dtype=DTYPES[dtype])
        self.vae.eval().requires_grad_(False)
        self.latent_channels, self.spatial_factor, self.temporal_factor = vae_factors(vae_class, self.vae.config)

    def _encode(self, pixels: torch.Tensor) -> torch.Tensor:
        vae = self.vae.to(pixels.device)
        x = pixels.to(vae.dtype)
        if self.vae_class == "AutoencoderKLWan":
            return vae.encode(x).latent_dist.mode().float()
        if self.vae_class == "AutoencoderKL":
            return per_frame(lambda frames: vae.encode(frames).latent_dist.mode(), x).float()
        return per_frame(lambda frames: vae.encode(frames).latents, x).float()

    def _decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.vae.to(latents.device)
        z = latents.to(vae.dtype)
        if self.vae_class == "AutoencoderKLWan":
            return vae.decode(z).sample.float()
        return per_frame(lambda frames: vae.decode(frames).sample, z).float()

    def save(self, directory: Path) -> dict:
        return {"kind": self.kind, "class": self.vae_class, "source": self.source, "subfolder": self.subfolder,
                "dtype": self.dtype}

    @classmethod
    def from_config(cls, config: dict, directory: Path) -> DiffusersVAECodec:
        return cls(config["source"], config["class"], config.get("subfolder"), config.get("dtype", "float32"))
