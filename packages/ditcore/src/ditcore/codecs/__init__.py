"""Latent codecs (pixels <-> latents), latent statistics and text encoders (in ditcore.codecs.text)."""

from pathlib import Path

from ditcore.codecs.base import Codec, per_frame, psnr
from ditcore.codecs.hub import HubLoadError
from ditcore.codecs.pca import PatchPCACodec
from ditcore.codecs.pixel import PixelCodec
from ditcore.codecs.stats import LatentStats
from ditcore.codecs.vae import VAE_CLASSES, DiffusersVAECodec

# kind (what a codec's saved config and a dataset's ditcore.json record) → class; each class spells its own kind
CODECS = {codec.kind: codec for codec in (PatchPCACodec, PixelCodec, DiffusersVAECodec)}


def load_codec(config: dict, directory: Path) -> Codec:
    """Rebuild a codec from the dict its `save(directory)` returned."""
    kind = config.get("kind") if isinstance(config, dict) else None
    if kind not in CODECS:
        raise ValueError(f"codec config kind={kind!r} is unknown: expected one of {', '.join(CODECS)}")
    return CODECS[kind].from_config(config, Path(directory))


__all__ = [
    "CODECS", "VAE_CLASSES", "Codec", "DiffusersVAECodec", "HubLoadError", "LatentStats", "PatchPCACodec",
    "PixelCodec", "load_codec", "per_frame", "psnr",
]
