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
from ditcore.models.techniques import apply_compile

__all__ = ["PRESETS", "DiT", "DiTConfig", "apply_compile", "grid_positions", "patchify", "preset", "unpatchify"]
