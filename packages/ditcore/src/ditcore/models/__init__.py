"""Diffusion transformer architectures and their size presets (token layout helpers: ditcore.layout).

Each architecture is one file that ends by registering it (ditcore.models.registry): `dit` (the original DiT,
ditcore.models.dit), `stdit` (the spatio-temporal DiT with factorised attention, ditcore.models.stdit),
`moviegen` (MovieGen's Llama-style DiT, ditcore.models.moviegen) and `wan` (Wan 2.1's video DiT, ditcore.models.wan).
A config's type says which one it is; `build` makes the model of a config, `plan_for` gives a model's tensor-parallel
plan, `inputs_of` the inputs type its model takes (ditcore.inputs). The DiT's, MovieGen's and Wan's blocks take a
mixture-of-experts feed-forward (ditcore.models.moe) where their config's `moe` is set.
"""

# Imported in this order so that they register in it: the order of presets in dit-train's messages.
from ditcore.models import dit  # isort: skip
from ditcore.models import stdit  # isort: skip
from ditcore.models import moviegen  # isort: skip
from ditcore.models import wan  # isort: skip
from ditcore.models.dit import DiT, DiTConfig
from ditcore.models.moe import MoEConfig
from ditcore.models.moviegen import MovieGen, MovieGenConfig
from ditcore.models.registry import ARCHS, PRESETS, Architecture, arch_of, build, inputs_of, plan_for, preset, register
from ditcore.models.stdit import STDiT, STDiTConfig
from ditcore.models.techniques import NotCompiled, apply_activation_checkpointing, apply_compile, check_compiled
from ditcore.models.wan import Wan, WanConfig

__all__ = ["ARCHS", "PRESETS", "Architecture", "DiT", "DiTConfig", "MoEConfig", "MovieGen", "MovieGenConfig",
           "NotCompiled", "STDiT", "STDiTConfig", "Wan", "WanConfig", "apply_activation_checkpointing", "apply_compile",
           "arch_of", "build", "check_compiled", "dit", "inputs_of", "moviegen", "plan_for", "preset", "register",
           "stdit", "wan"]
