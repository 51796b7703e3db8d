"""The training config: one typed value, read from YAML with dotted overrides (defaults < file < overrides).

Every error names the key, the value seen and what is allowed. The resolved config is saved next to every
checkpoint and printed by `dit-train --print-config`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml

from ditcore.errors import ConfigError
from ditcore.models import PRESETS

SHIPPED_NAMES = ("demo", "butterfly", "dit-xl", "dit-7b-8k", "mock")  # apps/train/configs/NAME.yaml


@dataclass
class Model:
    preset: str = "DiT-Demo"  # a name from ditcore.models.PRESETS; data-dependent fields come from the dataset
    patch_size: int | None = None  # override the preset's spatial patch
    patch_size_t: int | None = None  # override the preset's temporal patch
    pos_embed: Literal["rope", "sincos"] = "rope"
    qk_norm: bool = True
    fps_cond: bool = False
    max_grid: list[int] | None = None  # largest (T, H, W) token grid; default: the preset's
    compile: bool = False  # torch.compile each block


@dataclass
class Data:
    path: str = "data/butterflies"  # a dataset written by dit-prepare
    seq_length: int = 256  # tokens per packed row
    num_workers: int = 2
    shuffle_buffer: int = 100
    packing_buffer: int | None = None  # samples considered together for packing; default 4 × micro_batch


@dataclass
class Parallel:
    tp: int = 1
    cp: int = 1
    pp: int = 1
    sequence_parallel: bool = False
    devices: int = 1  # processes per node when not launched by torchrun (Fabric starts them)
    accelerator: Literal["auto", "cpu", "gpu"] = "auto"


@dataclass
class Optim:
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    schedule: Literal["cosine", "constant"] = "cosine"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1  # cosine decays to lr × this


@dataclass
class EDM:
    p_mean: float = -1.2
    p_std: float = 1.2
    cfg_dropout: float = 0.1  # per sample: drop the text (or class) so the model also learns the unconditional
    ema_decay: float = 0.999


@dataclass
class Train:
    run_dir: str = "runs/demo"
    steps: int = 1000
    global_batch: int = 8  # packed rows per optimizer step, over all data-parallel ranks
    micro_batch: int = 8  # packed rows per forward pass on one rank
    precision: Literal["auto", "fp32", "bf16"] = "auto"  # auto: bf16 autocast on GPU, fp32 on CPU
    grad_clip: float = 1.0  # 0 disables
    seed: int = 0
    stop_at: int | None = None  # stop with a checkpoint after this step, as a preemption would (time-boxed jobs)


@dataclass
class Checkpoint:
    every: int = 500  # steps; a checkpoint is also written at the end and on SIGTERM/SIGUSR1
    keep: int = 3  # newest complete checkpoints kept


@dataclass
class Validation:
    every: int = 0  # steps between sampling the prompts with the EMA weights; 0: only at the end
    prompts: list[str] = field(default_factory=lambda: ["a red butterfly", "a blue butterfly"])
    steps: int = 18
    guidance: float = 4.0
    solver: Literal["heun", "euler"] = "heun"
    frames: int = 1  # pixel frames of each sample (1: an image)
    clip_frames: int = 0  # > 0: also sample every prompt as a clip of this many frames (mp4)
    size: int = 64  # pixel height and width
    fps: float = 8.0
    seed: int = 0


@dataclass
class Logging:
    every: int = 10
    csv: bool = True
    tensorboard: bool = True
    wandb_project: str | None = None


@dataclass
class TrainConfig:
    model: Model = field(default_factory=Model)
    data: Data = field(default_factory=Data)
    parallel: Parallel = field(default_factory=Parallel)
    optim: Optim = field(default_factory=Optim)
    edm: EDM = field(default_factory=EDM)
    train: Train = field(default_factory=Train)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    validation: Validation = field(default_factory=Validation)
    logging: Logging = field(default_factory=Logging)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# --------------------------------------------------------------------------------------------------
# Reading


def load_config(path: str | Path | None, overrides: list[str] = ()) -> TrainConfig:
    data = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError("--config", str(path), "an existing YAML file (see apps/train/configs/)")
        try:
            data = yaml.safe_load(path.read_text())
        except UnicodeDecodeError:
            raise ConfigError("--config", str(path), "a UTF-8 text file of YAML (this one is binary)") from None
        except yaml.YAMLError as e:
            raise ConfigError("--config", str(path), f"valid YAML ({str(e).splitlines()[0]})") from None
        if data is None:
            raise ConfigError("--config", str(path), "a YAML mapping of sections (the file is empty); start from "
                                                     "a shipped config, e.g. --config demo")
        if not isinstance(data, dict):
            raise ConfigError("--config", str(path), "a YAML mapping of sections (model, data, train, ...)")
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError("override", item, "key.sub=value, e.g. train.steps=200")
        node = data
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(key, raw, f"a key inside a section, but '{p}' is not a section")
        node[leaf] = yaml.safe_load(raw) if raw != "" else None
    cfg = _build(TrainConfig, data, "")
    validate(cfg)
    return cfg


def _build(cls, data, prefix: str):
    if not isinstance(data, dict):
        raise ConfigError(prefix.rstrip(".") or "config", data, "a mapping of keys")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(data) - set(fields)
    if unknown:
        key = sorted(unknown)[0]
        raise ConfigError(f"{prefix}{key}", data[key], "one of the known keys: " + ", ".join(fields))
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in data.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value, f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(value, hint, f"{prefix}{name}")
    return cls(**kwargs)


def _coerce(value, hint, key: str):
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(value, inner, key)
    if origin is Literal:
        if value not in args:
            raise ConfigError(key, value, "one of " + ", ".join(map(repr, args)))
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(key, value, f"a list of {args[0].__name__}")
        return [_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)]
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(key, value, "true or false")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, value, "an integer")
        return value
    if hint is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            with contextlib.suppress(ValueError):
                value = float(value)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ConfigError(key, value, "a finite number")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(key, value, "a string")
        return value
    raise TypeError(f"config field {key} has an unsupported type {hint}")


def validate(cfg: TrainConfig) -> None:
    """Ranges and relations that one field's type cannot express. The world size is checked at launch."""

    def need(ok: bool, key: str, value, allowed: str) -> None:
        if not ok:
            raise ConfigError(key, value, allowed)

    need(cfg.model.preset in PRESETS, "model.preset", cfg.model.preset, "one of " + ", ".join(PRESETS))
    for key, value in (("model.patch_size", cfg.model.patch_size), ("model.patch_size_t", cfg.model.patch_size_t)):
        need(value is None or value >= 1, key, value, "an integer >= 1 (or unset for the preset's)")
    need(cfg.model.max_grid is None or (len(cfg.model.max_grid) == 3 and min(cfg.model.max_grid) >= 1),
         "model.max_grid", cfg.model.max_grid, "three integers >= 1: T, H, W in tokens")
    need(cfg.data.seq_length >= 1, "data.seq_length", cfg.data.seq_length, "an integer >= 1")
    need(cfg.data.num_workers >= 0, "data.num_workers", cfg.data.num_workers, "an integer >= 0")
    for key in ("tp", "cp", "pp", "devices"):
        value = getattr(cfg.parallel, key)
        need(value >= 1, f"parallel.{key}", value, "an integer >= 1")
    need(cfg.parallel.pp == 1, "parallel.pp", cfg.parallel.pp, "1: pipeline parallelism is not available yet")
    need(cfg.optim.lr > 0, "optim.lr", cfg.optim.lr, "a learning rate > 0")
    need(len(cfg.optim.betas) == 2 and all(0 <= b < 1 for b in cfg.optim.betas), "optim.betas", cfg.optim.betas,
         "two numbers in [0, 1)")
    need(0 <= cfg.optim.min_lr_ratio <= 1, "optim.min_lr_ratio", cfg.optim.min_lr_ratio, "a number in [0, 1]")
    need(cfg.optim.warmup_steps >= 0, "optim.warmup_steps", cfg.optim.warmup_steps, "an integer >= 0")
    need(cfg.edm.p_std > 0, "edm.p_std", cfg.edm.p_std, "a number > 0")
    need(0 <= cfg.edm.cfg_dropout < 1, "edm.cfg_dropout", cfg.edm.cfg_dropout, "a probability in [0, 1)")
    need(0 <= cfg.edm.ema_decay < 1, "edm.ema_decay", cfg.edm.ema_decay, "a number in [0, 1)")
    need(cfg.train.steps >= 1, "train.steps", cfg.train.steps, "an integer >= 1")
    need(cfg.train.micro_batch >= 1, "train.micro_batch", cfg.train.micro_batch, "an integer >= 1")
    need(cfg.train.global_batch >= 1 and cfg.train.global_batch % cfg.train.micro_batch == 0, "train.global_batch",
         cfg.train.global_batch, f"a multiple of train.micro_batch={cfg.train.micro_batch}")
    need(cfg.train.grad_clip >= 0, "train.grad_clip", cfg.train.grad_clip, "a number >= 0 (0 disables clipping)")
    need(cfg.checkpoint.every >= 1, "checkpoint.every", cfg.checkpoint.every, "an integer >= 1")
    need(cfg.checkpoint.keep >= 1, "checkpoint.keep", cfg.checkpoint.keep, "an integer >= 1")
    need(cfg.train.stop_at is None or cfg.train.stop_at >= 1, "train.stop_at", cfg.train.stop_at,
         "an integer >= 1, or null (run to train.steps)")
    need(bool(cfg.validation.prompts) and all(p.strip() for p in cfg.validation.prompts), "validation.prompts",
         cfg.validation.prompts, "a non-empty list of non-empty prompts")
    need(cfg.validation.every >= 0, "validation.every", cfg.validation.every, "an integer >= 0 (0: only at the end)")
    need(cfg.validation.steps >= 1, "validation.steps", cfg.validation.steps, "an integer >= 1")
    need(cfg.validation.frames >= 1, "validation.frames", cfg.validation.frames, "an integer >= 1")
    need(cfg.validation.clip_frames >= 0, "validation.clip_frames", cfg.validation.clip_frames,
         "an integer >= 0 (0: no clips)")
    need(cfg.validation.size >= 8, "validation.size", cfg.validation.size, "pixels >= 8")
    need(cfg.logging.every >= 1, "logging.every", cfg.logging.every, "an integer >= 1")
