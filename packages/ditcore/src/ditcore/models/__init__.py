"""Diffusion transformer architectures and their size presets (token layout helpers: ditcore.layout).

Each architecture is one file: `dit` (the original DiT, ditcore.models.dit), `stdit` (the spatio-temporal DiT with
factorised attention, ditcore.models.stdit) and `moviegen` (MovieGen's Llama-style DiT, ditcore.models.moviegen).
A config's type says which one it is; `build` makes the model of a config.
"""

from ditcore.errors import ConfigError
from ditcore.models import dit, moviegen, stdit
from ditcore.models.dit import DiT, DiTConfig
from ditcore.models.moviegen import MovieGen, MovieGenConfig
from ditcore.models.stdit import STDiT, STDiTConfig
from ditcore.models.techniques import NotCompiled, apply_activation_checkpointing, apply_compile, check_compiled

ARCHS: dict[str, tuple[type[DiTConfig], type[DiT]]] = {
    "dit": (DiTConfig, DiT),
    "stdit": (STDiTConfig, STDiT),
    "moviegen": (MovieGenConfig, MovieGen),
}
PRESETS: dict[str, DiTConfig] = dit.PRESETS | stdit.PRESETS | moviegen.PRESETS


def arch_of(cfg: DiTConfig) -> str:
    """The architecture name of a config ("dit", "stdit", "moviegen")."""
    return next(name for name, (config, _) in ARCHS.items() if type(cfg) is config)


def preset(name: str, **changes) -> DiTConfig:
    """A preset's config with data-dependent fields filled in, e.g. preset("DiT-XL/2", num_classes=1000)."""
    if name not in PRESETS:
        raise ConfigError("model.preset", name, "one of " + ", ".join(PRESETS))
    return PRESETS[name].replace(**changes)


def build(cfg: DiTConfig, attention: str = "auto") -> DiT:
    """The model of a config, of its architecture."""
    return ARCHS[arch_of(cfg)][1](cfg, attention=attention)


__all__ = ["ARCHS", "PRESETS", "DiT", "DiTConfig", "MovieGen", "MovieGenConfig", "NotCompiled", "STDiT", "STDiTConfig",
           "apply_activation_checkpointing", "apply_compile", "arch_of", "build", "check_compiled", "preset"]
