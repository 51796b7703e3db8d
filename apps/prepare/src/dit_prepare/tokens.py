"""How the prepared latents meet the models: tokens per sample at each shipped dit-train config's patch size.

The patch sizes and row lengths are read from dit-train's shipped config files (apps/train/configs/NAME.yaml, found
where the dit_train package is installed, without importing it: apps do not depend on each other), with the
patch a config leaves out taken from its preset (ditcore.models.PRESETS). Nothing here is a copy of those numbers.
"""

from __future__ import annotations

import importlib.util
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import yaml

from ditcore.data.fit import parse_shapes, tokens_of


@dataclass(frozen=True)
class ModelShape:
    name: str  # the config's name (dit-train --config NAME)
    patch: int  # spatial patch p
    patch_t: int  # temporal patch pt
    seq_length: int  # data.seq_length: tokens per packed row


def shipped_configs_dir() -> Path | None:
    """apps/train/configs beside an installed dit_train (as dit_train.config.CONFIGS), or None without it."""
    spec = importlib.util.find_spec("dit_train")
    if spec is None or not spec.origin:
        return None
    folder = Path(spec.origin).resolve().parents[2] / "configs"
    return folder if folder.is_dir() else None


def shipped_model_shapes(folder: Path | None = None) -> list[ModelShape]:
    """Each shipped config's patch sizes and row length; a config this cannot read is left out."""
    from ditcore.models import PRESETS

    folder = folder or shipped_configs_dir()
    shapes = []
    for path in sorted(folder.glob("*.yaml")) if folder else []:
        cfg = yaml.safe_load(path.read_text()) or {}
        model, data = cfg.get("model") or {}, cfg.get("data") or {}
        preset = PRESETS.get(model.get("preset", "DiT-Demo"))  # dit-train's default preset
        if preset is None or "seq_length" not in data:
            continue
        shapes.append(ModelShape(path.stem, int(model.get("patch_size") or preset.patch_size),
                                 int(model.get("patch_size_t") or preset.patch_size_t), int(data["seq_length"])))
    return shapes


def largest_patch(shapes: list[ModelShape]) -> int:
    """The patch that every shipped config can cut a latent into when its sides are multiples of it (all are
    powers of two, so the largest is a multiple of the others); 1 when dit-train's configs are not found."""
    return max((s.patch for s in shapes), default=1)


def token_lines(latent_shapes: Counter | dict, shapes: list[ModelShape]) -> list[str]:
    """The summary's table: per config, tokens per sample (min-max over the dataset's latent shapes), how many
    samples a packed row of data.seq_length holds, and the samples that fit none of its rows (with why)."""
    counts = parse_shapes(dict(latent_shapes))
    if not counts or not shapes:
        return []
    out = ["tokens    per sample at each dit-train config's patch (data.seq_length: samples per packed row)"]
    width = max(len(s.name) for s in shapes)
    for s in shapes:
        tokens, undivisible, too_long = [], 0, 0
        for shape, n in counts.items():
            k = tokens_of(shape, s.patch, s.patch_t)
            if k is None:
                undivisible += n
            elif k > s.seq_length:
                too_long += n
            else:
                tokens.append(k)
        line = f"          {s.name:<{width}}  patch {s.patch_t}x{s.patch}x{s.patch}: "
        if tokens:
            lo, hi = min(tokens), max(tokens)
            few, many = s.seq_length // hi, s.seq_length // lo
            line += (f"{lo}" if lo == hi else f"{lo}-{hi}") + f" tokens ({s.seq_length}: "
            line += (f"{few}" if few == many else f"{few}-{many}") + " per row)"
        else:
            line += "no sample fits"
        if undivisible:
            line += f"; {undivisible} not divisible by the patch"
        if too_long:
            line += f"; {too_long} longer than {s.seq_length} tokens"
        out.append(line)
    return out
