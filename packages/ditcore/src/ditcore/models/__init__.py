"""DiT architectures and their size presets (token layout helpers: ditcore.layout)."""

from ditcore.models.dit import PRESETS, DiT, DiTConfig, preset
from ditcore.models.techniques import apply_activation_checkpointing, apply_compile

__all__ = ["PRESETS", "DiT", "DiTConfig", "apply_activation_checkpointing", "apply_compile", "preset"]
