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
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ditcore import disk, durable, tensorfile
from ditcore.choices import FLOW_PREDICTIONS, OBJECTIVES, PRECONDS, PREDICTIONS
from ditcore.codecs import Codec, LatentStats, load_codec
from ditcore.data.schema import INFO_FILE, DatasetInfo, parse_info
from ditcore.diffusion.vp import DiscreteVP
from ditcore.models import ARCHS, DiT, DiTConfig, arch_of, build

WEIGHTS, CONFIG = "model.safetensors", "model.json"
# What to do about a damaged export: dit-train, run again on a finished run, resumes its last checkpoint and exports
REDO = "export the run again (its dit-train command, run again, resumes the last checkpoint and writes export/)"


DEFAULT_GUIDANCE = 4.0  # for exports that do not record the guidance their run validated with


def export_model(out: str | Path, state_dict: dict[str, torch.Tensor], cfg: DiTConfig, dataset: str | Path,
                 extra: dict | None = None, latent_stats: LatentStats | None = None) -> Path:
    """`latent_stats`: what the network's latents are normalised by, where not the dataset's (a network imported
    from the field works in its own units): the export's INFO_FILE records them, so that sampling decodes right."""
    out, dataset = Path(out), Path(dataset)
    tmp = out.with_name(f".{out.name}.tmp")
    codec_files = list(dataset.glob("codec_*"))
    what = f"could not write the export {out}"
    # Refused before the first byte when it cannot fit (the old export stays until the new one is complete)
    disk.check_space(what, tmp, sum(t.numel() * t.element_size() for t in state_dict.values()) +
                     sum(f.stat().st_size for f in [dataset / INFO_FILE, *codec_files]))
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        tensorfile.save(state_dict, tmp / WEIGHTS)
        describe(tmp, cfg, dataset, extra, latent_stats)
        for f in tmp.iterdir():
            durable.fsync_file(f)
        durable.publish_dir(tmp, out)
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)  # a partial export must not stay behind holding the space it took
        if disk.is_disk_full(e):  # e.g. another writer filled the disk after the check
            raise disk.disk_full(what, tmp) from None
        raise
    return out


def describe(folder: str | Path, cfg: DiTConfig, dataset: str | Path, extra: dict | None = None,
             latent_stats: LatentStats | None = None) -> list[str]:
    """Write what an export holds besides its weights into `folder` — CONFIG (the model config and `extra`), the
    dataset's INFO_FILE and codec files — and return their names. A training checkpoint holds them too, so that its
    EMA weights sample alone (`load_export(ckpt, weights=...)`), before the run has an export."""
    folder, dataset = Path(folder), Path(dataset)
    meta = {"model": dataclasses.asdict(cfg), "arch": arch_of(cfg), **(extra or {})}
    (folder / CONFIG).write_text(json.dumps(meta, indent=1))
    # contents only: the copies' modes come from the umask (a codec an older dit-prepare wrote 0600 included)
    shutil.copyfile(dataset / INFO_FILE, folder / INFO_FILE)
    info = json.loads((folder / INFO_FILE).read_text())
    # a blend's list of datasets names folders relative to the blend's: the export keeps only what its latents are
    if latent_stats is not None or "blend" in info:
        info |= {"latent_stats": latent_stats.to_dict()} if latent_stats is not None else {}
        info.pop("blend", None)
        (folder / INFO_FILE).write_text(json.dumps(info, indent=1))
    codec_files = sorted(dataset.glob("codec_*"))
    for codec_file in codec_files:
        shutil.copyfile(codec_file, folder / codec_file.name)
    return [CONFIG, INFO_FILE, *(f.name for f in codec_files)]


@dataclass
class Exported:
    model: DiT
    codec: Codec
    stats: LatentStats
    info: DatasetInfo
    extra: dict
    load_seconds: dict[str, float] = field(default_factory=dict)  # model, codec: what dit-sample reports as loading

    @property
    def prediction(self) -> str:
        """What the network outputs (ditcore.diffusion.edm.PREDICTIONS); exports from before it was recorded: edm."""
        return self.extra.get("prediction", "edm")

    @property
    def vp(self) -> DiscreteVP | None:
        """The DDPM schedule of a network sampled under VP preconditioning (extra "precond": "vp", its "vp" the
        schedule's fields: ditcore.diffusion.vp.DiscreteVP); None for EDM's, and for exports from before."""
        return vp_of(self.extra)

    @property
    def objective(self) -> str:
        """What the network was trained with (ditcore.choices.OBJECTIVES); exports from before it was recorded: edm."""
        return self.extra.get("objective", "edm")

    @property
    def shift(self):
        """A flow network's timestep shift (ditcore.diffusion.flow.TimeShift), sampled as it was trained; None under
        EDM."""
        return shift_of(self.extra)

    def sampling(self) -> dict:
        """What ditcore.sampling.sample needs to know of the network: its objective and what goes with it."""
        return {"objective": self.objective, "prediction": self.prediction, "vp": self.vp, "shift": self.shift}

    @property
    def solver(self) -> str:
        """The solver the run validated with (or an imported pipeline's scheduler's), dit-sample's default for it;
        older exports: heun."""
        return self.extra.get("solver", "heun")

    @property
    def negative_prompt(self) -> str | None:
        """The caption whose text states are the unconditional side of guidance when no negative prompt is given:
        None (no text at all, the null text ditcore's runs drop captions to), or "" for an imported Wan (WanPipeline
        encodes the empty caption, the unconditional text its network was trained with)."""
        return self.extra.get("negative_prompt")

    @property
    def guidance(self) -> float:
        """The guidance weight the run validated with, dit-sample's default for it; older exports: 4.0."""
        return float(self.extra.get("guidance", DEFAULT_GUIDANCE))


def exported_config(path: str | Path) -> DiTConfig:
    """The model config (of its architecture) that an export folder's CONFIG file records."""
    meta = _meta(path)
    arch = meta.get("arch", "dit")  # exports from before other architectures: the DiT
    if arch not in ARCHS:
        raise ValueError(f"'{Path(path) / CONFIG}' says arch={arch!r}: this ditcore knows {', '.join(ARCHS)} — sample "
                         "it with the ditcore version that trained it")
    config_class = ARCHS[arch].config
    fields = {f.name for f in dataclasses.fields(config_class)}
    model_cfg = meta.get("model", {})
    if not isinstance(model_cfg, dict) or not {"hidden_size", "depth", "num_heads"} <= model_cfg.keys():
        raise ValueError(f"'{Path(path) / CONFIG}' does not describe a DiT (no hidden_size/depth/num_heads)")
    try:
        return config_class(**{k: (tuple(v) if k == "max_grid" else v) for k, v in model_cfg.items() if k in fields})
    except TypeError as e:  # e.g. a number where a list belongs (ConfigError, a ValueError, names the key itself)
        raise ValueError(f"'{Path(path) / CONFIG}' does not describe a DiT: {e}") from None


def _meta(path: str | Path) -> dict:
    """The export's CONFIG file as a dict; ValueError naming the file when it is not one."""
    try:
        meta = json.loads((Path(path) / CONFIG).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"'{Path(path) / CONFIG}' is truncated or damaged ({e}) — {REDO}") from None
    if not isinstance(meta, dict):
        raise ValueError(f"'{Path(path) / CONFIG}' is damaged (not a JSON object) — {REDO}")
    return meta


def check_weights_fit(path: Path, cfg: DiTConfig, stored: dict[str, torch.Tensor] | None = None) -> None:
    """ValueError naming the first tensor whose name or shape in WEIGHTS (or `stored`, weights read elsewhere)
    differs from the model that `cfg` builds.

    Reads the file's header only and builds the model on the meta device, so nothing is allocated: a model.json
    edited to a width of 10^6 is refused here, not after asking for terabytes."""
    stored = tensorfile.header(path / WEIGHTS, REDO) if stored is None else stored
    if cfg.depth > len(stored):  # every layer holds weights; also keeps a depth of 10^6 from building for minutes
        raise ValueError(f"'{path / CONFIG}' says depth={cfg.depth}, but {WEIGHTS} holds only {len(stored)} tensors "
                         f"— model.json and the weights come from different models; {REDO}")
    with torch.device("meta"):
        model = build(cfg)
    stored, expected = model.upgrade_state_dict(stored), model.state_dict()
    missing, unexpected = expected.keys() - stored.keys(), stored.keys() - expected.keys()
    if missing or unexpected:
        raise ValueError(f"'{path}' holds weights of another architecture: missing {sorted(missing)[:3]}, "
                         f"unexpected {sorted(unexpected)[:3]}")
    for name, t in expected.items():
        if stored[name].shape != t.shape:
            raise ValueError(f"'{path}' does not fit its {CONFIG}: {name} is {tuple(stored[name].shape)} in "
                             f"{WEIGHTS}, the model it describes needs {tuple(t.shape)} — the files come from "
                             f"different models; {REDO}")


def check_finite(path: Path, state: dict[str, torch.Tensor]) -> None:
    """ValueError when weights hold NaN/Inf: they would sample an all-black picture."""
    bad = tensorfile.non_finite(state)
    if bad:
        raise ValueError(f"export '{path}' holds non-finite weights in {len(bad)} tensors, e.g. {bad[0]}: the run "
                         "diverged before it was exported — sample an earlier checkpoint (dit-sample serve "
                         "--checkpoint RUN_DIR offers them) or resume from one with a lower optim.lr")


def vp_of(meta: dict) -> DiscreteVP | None:
    """The DDPM schedule an export's CONFIG fields give (Exported.vp), or None for an EDM-preconditioned network."""
    if meta.get("precond", "edm") != "vp":
        return None
    return DiscreteVP(**meta.get("vp", {}))


def shift_of(meta: dict):
    """The timestep shift an export's CONFIG fields (or a checkpoint's values) record for a flow network ("objective":
    "flow", "shift": TimeShift's fields), or None for an EDM network."""
    if meta.get("objective", "edm") != "flow":
        return None
    from ditcore.diffusion.flow import TimeShift

    return TimeShift.from_dict(meta.get("shift", {}))


def recorded_objective(objective: str, shift) -> dict:
    """What model.json and a checkpoint's values record of a flow network ({} for EDM's, which exports from before
    the objective was recorded also mean): read back by `shift_of` and Exported.objective."""
    return {} if objective == "edm" else {"objective": objective, "shift": shift.to_dict()}


def load_network(path: str | Path, weights: dict[str, torch.Tensor] | None = None
                 ) -> tuple[DiTConfig, dict[str, torch.Tensor], dict]:
    """An export's model config, its one-device weights (checked to fit the config and finite) and its CONFIG file's
    other fields — without its codec, which may be a VAE from the hub (dit-sample export needs none). `weights`: a
    training checkpoint's (ditcore.runs.load_weights), for the checkpoint folder that records CONFIG beside them
    (`describe`) in place of WEIGHTS."""
    path = Path(path)
    if (weights is None and not (path / WEIGHTS).is_file()) or not (path / CONFIG).is_file():
        raise FileNotFoundError(f"'{path}' is not a ditcore export: it needs {WEIGHTS} and {CONFIG} "
                                "(dit-train writes them to RUN_DIR/export/)")
    meta = _meta(path)
    cfg = exported_config(path)
    check_weights_fit(path, cfg, weights)  # before the model is built: model.json may promise any size
    with torch.device("meta"):
        upgrade = build(cfg).upgrade_state_dict
    state = upgrade(tensorfile.load(path / WEIGHTS, REDO) if weights is None else weights)
    check_finite(path, state)
    if meta.get("precond", "edm") not in PRECONDS:
        raise ValueError(f"'{path / CONFIG}' says precond={meta['precond']!r}: this ditcore knows "
                         f"{', '.join(PRECONDS)} — sample it with the ditcore version that trained it")
    if meta.get("objective", "edm") not in OBJECTIVES:
        raise ValueError(f"'{path / CONFIG}' says objective={meta['objective']!r}: this ditcore knows "
                         f"{', '.join(OBJECTIVES)} — sample it with the ditcore version that trained it")
    known = PREDICTIONS if meta.get("objective", "edm") == "edm" else ("edm", *FLOW_PREDICTIONS)
    if meta.get("prediction", "edm") not in known:
        raise ValueError(f"'{path / CONFIG}' says prediction={meta['prediction']!r}: this ditcore knows "
                         f"{', '.join(known)} — sample it with the ditcore version that trained it")
    return cfg, state, {k: v for k, v in meta.items() if k != "model"}


def load_export(path: str | Path, device: str | torch.device = "cpu",
                weights: dict[str, torch.Tensor] | None = None) -> Exported:
    """Load an export folder (or a training checkpoint's `weights` with the folder that describes them: see
    load_network); errors say what is missing or which architecture does not fit."""
    path = Path(path)
    t0 = time.perf_counter()
    cfg, state, meta = load_network(path, weights)
    model = build(cfg)
    model.load_state_dict(state)
    if not (path / INFO_FILE).is_file():
        raise FileNotFoundError(f"'{path}' has no {INFO_FILE}: the export is incomplete")
    info = parse_info(path / INFO_FILE, "export", "export the run again (dit-train writes RUN_DIR/export/)")
    model = model.to(device).eval()
    t1 = time.perf_counter()
    codec = load_codec(info.codec, path)  # a pretrained VAE loads here: seconds, as long as the model or longer
    return Exported(model, codec, LatentStats.from_dict(info.latent_stats), info, meta,
                    {"model": t1 - t0, "codec": time.perf_counter() - t1})


__all__ = ["CONFIG", "DEFAULT_GUIDANCE", "WEIGHTS", "Exported", "describe", "export_model", "load_export",
           "load_network", "recorded_objective", "shift_of", "vp_of"]
