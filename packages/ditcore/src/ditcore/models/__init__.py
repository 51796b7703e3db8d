"""DiT architectures and their size presets."""

from ditcore.models.dit import (
    PRESETS,
    DiT,
    DiTConfig,
    grid_positions,
    patchify,
    preset,
    unpatchify,
)

__all__ = ["PRESETS", "DiT", "DiTConfig", "grid_positions", "patchify", "preset", "unpatchify"]
