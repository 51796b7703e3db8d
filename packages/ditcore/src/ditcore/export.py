"""The consolidated export: what dit-sample (or anyone) needs to sample a trained model on one device.

    EXPORT_DIR/model.safetensors   one-device (consolidated) EMA weights
    EXPORT_DIR/model.json          the DiTConfig (architecture + data-dependent fields) and training info
    EXPORT_DIR/ditcore.json        the dataset's codec, latent statistics and text encoder
    EXPORT_DIR/codec_*             codec parameter files the dataset had (e.g. the patch-PCA components)

Written to a temporary folder and renamed into place, so an export is complete or absent.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ditcore import durable
from ditcore.codecs import Codec, LatentStats, load_codec
from ditcore.data.schema import INFO_FILE, DatasetInfo, parse_info
from ditcore.diffusion.edm import PREDICTIONS
from ditcore.models import ARCHS, DiT, DiTConfig, arch_of, build

WEIGHTS, CONFIG = "model.safetensors", "model.json"


DEFAULT_GUIDANCE = 4.0  # for exports that do not record the guidance their run validated with


def export_model(out: str | Path, state_dict: dict[str, torch.Tensor], cfg: DiTConfig, dataset: str | Path,
                 extra: dict | None = None) -> Path:
    out, dataset = Path(out), Path(dataset)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in state_dict.items()}, str(tmp / WEIGHTS))
    meta = {"model": dataclasses.asdict(cfg), "arch": arch_of(cfg), **(extra or {})}
    (tmp / CONFIG).write_text(json.dumps(meta, indent=1))
    shutil.copy2(dataset / INFO_FILE, tmp / INFO_FILE)
    for codec_file in dataset.glob("codec_*"):
        shutil.copy2(codec_file, tmp / codec_file.name)
    for f in tmp.iterdir():
        durable.fsync_file(f)
    durable.publish_dir(tmp, out)
    return out


@dataclass
class Exported:
    model: DiT
    codec: Codec
    stats: LatentStats
    info: DatasetInfo
    extra: dict

    @property
    def prediction(self) -> str:
        """What the network outputs (ditcore.diffusion.edm.PREDICTIONS); exports from before it was recorded: edm."""
        return self.extra.get("prediction", "edm")

    @property
    def guidance(self) -> float:
        """The guidance weight the run validated with, dit-sample's default for it; older exports: 4.0."""
        return float(self.extra.get("guidance", DEFAULT_GUIDANCE))


def exported_config(path: str | Path) -> DiTConfig:
    """The model config (of its architecture) that an export folder's CONFIG file records."""
    meta = json.loads((Path(path) / CONFIG).read_text())
    arch = meta.get("arch", "dit")  # exports from before other architectures: the DiT
    if arch not in ARCHS:
        raise ValueError(f"'{Path(path) / CONFIG}' says arch={arch!r}: this ditcore knows {', '.join(ARCHS)} — sample "
                         "it with the ditcore version that trained it")
    config_class = ARCHS[arch][0]
    fields = {f.name for f in dataclasses.fields(config_class)}
    model_cfg = meta.get("model", {})
    if not isinstance(model_cfg, dict) or not {"hidden_size", "depth", "num_heads"} <= model_cfg.keys():
        raise ValueError(f"'{Path(path) / CONFIG}' does not describe a DiT (no hidden_size/depth/num_heads)")
    return config_class(**{k: (tuple(v) if k == "max_grid" else v) for k, v in model_cfg.items() if k in fields})


def load_export(path: str | Path, device: str | torch.device = "cpu") -> Exported:
    """Load an export folder; errors say what is missing or which architecture does not fit."""
    path = Path(path)
    if not (path / WEIGHTS).is_file() or not (path / CONFIG).is_file():
        raise FileNotFoundError(f"'{path}' is not a ditcore export: it needs {WEIGHTS} and {CONFIG} "
                                "(dit-train writes them to RUN_DIR/export/)")
    meta = json.loads((path / CONFIG).read_text())
    model = build(exported_config(path))
    state = model.upgrade_state_dict(load_file(str(path / WEIGHTS)))
    missing, unexpected = model.state_dict().keys() - state.keys(), state.keys() - model.state_dict().keys()
    if missing or unexpected:
        raise ValueError(f"'{path}' holds weights of another architecture: missing {sorted(missing)[:3]}, "
                         f"unexpected {sorted(unexpected)[:3]}")
    model.load_state_dict(state)
    if not (path / INFO_FILE).is_file():
        raise FileNotFoundError(f"'{path}' has no {INFO_FILE}: the export is incomplete")
    info = parse_info(path / INFO_FILE, "export", "export the run again (dit-train writes RUN_DIR/export/)")
    if meta.get("prediction", "edm") not in PREDICTIONS:
        raise ValueError(f"'{path / CONFIG}' says prediction={meta['prediction']!r}: this ditcore knows "
                         f"{', '.join(PREDICTIONS)} — sample it with the ditcore version that trained it")
    return Exported(model.to(device).eval(), load_codec(info.codec, path), LatentStats.from_dict(info.latent_stats),
                    info, {k: v for k, v in meta.items() if k != "model"})


__all__ = ["CONFIG", "DEFAULT_GUIDANCE", "WEIGHTS", "Exported", "export_model", "load_export"]
