"""What a resume may change: every key of the training config, and what dit-train does when it differs from the
checkpoint's (the config.yaml saved in it).

A resumed run is the same run continued, so a change is either applied from the next step on, or refused with one
line naming the key, both values and what to do:

  apply   the new value wins: optimizer hyper-parameters (dit_train.checkpoint keeps them over the checkpoint's),
          the schedule (recomputed from the new config at the restored step), the layout, logging, checkpointing,
          validation, the EDM loss's noise levels and weights, the EMA decay
  loader  applied too, but the data loader's saved position does not fit a loader built with the new value (Energon
          refuses another number of workers or micro-batch size, and its packing and shuffle buffers, sequence
          length and seed decide which samples come next): the loader starts a fresh pass, with a note
  data    the dataset: its fingerprint in the checkpoint decides (the same data → the position is restored; other
          data → a fresh pass; a shard the checkpoint read that is damaged now → refused)
  model   what the weights mean (architecture, shapes, positions, what the network predicts): refused, as loading
          the weights into another model would drop or misread them
  run     what a step is (its batch): refused, as the optimizer state and schedule count such steps
  place   where the run is or where its first weights came from, not what it is (train.run_dir: a copied run
          directory; model.init_from: read only when a run starts, a resume ignores it): not compared

Every key of the schema is in RULES; tests/apps/test_resume_config.py fails when a new key is added without one.

A resume that would train nothing (the checkpoint is at or past train.steps) with any other change is refused as
well (`nothing_to_train`): such a command would not continue the run, only rewrite its samples and export with
settings it never trained with — a command meant for a new run that found an old run's folder (the README's
examples share runs/demo).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from dit_train.config import Section, TrainConfig

APPLY, LOADER, DATA, MODEL, RUN, PLACE = "apply", "loader", "data", "model", "run", "place"

RULES: dict[str, str] = {
    # as saved, resolved (auto → what the run used): the network's output is a velocity under flow, a denoised
    # estimate under EDM, so loading one as the other misreads every weight's purpose
    "objective": MODEL,
    "model.arch": MODEL,
    "model.preset": MODEL,
    "model.patch_size": MODEL,
    "model.patch_size_t": MODEL,
    "model.depth": MODEL,
    "model.pos_embed": MODEL,
    "model.qk_norm": MODEL,
    "model.fps_cond": MODEL,
    # a bound on positions (rope needs no table); where it sizes learned position tables, the weights' shapes
    # differ and the strict load refuses it
    "model.max_grid": APPLY,
    "model.num_heads": MODEL,
    "model.learn_sigma": MODEL,
    "model.freq_shift": MODEL,
    "model.mlp_norm_eps": MODEL,
    "model.block_embedders": MODEL,
    # the experts and their routing are the model; one key for the section, so its coefficients and EP's capacity
    # factor are held with it (a resumed run that wants other ones starts a new run from model.init_from)
    "model.moe": MODEL,
    "model.compile": APPLY,
    "model.activation_checkpointing": APPLY,
    "model.attention": APPLY,
    "model.init_from": PLACE,
    "data.path": DATA,
    "data.seq_length": LOADER,
    "data.num_workers": LOADER,
    "data.shuffle_buffer": LOADER,
    "data.packing_buffer": LOADER,
    "data.max_skipped_in_a_row": APPLY,  # a bound on the loader's skips, not its position
    "parallel.tp": APPLY,  # any layout resumes from any other (the loader's position: by data-parallel size)
    "parallel.cp": APPLY,
    "parallel.pp": APPLY,
    "parallel.ep": APPLY,  # experts are saved whole, (E, ., .), whatever ep wrote them
    "parallel.sequence_parallel": APPLY,
    "parallel.fsdp": APPLY,
    "parallel.reduce_dtype": APPLY,
    "parallel.fsdp_shard": APPLY,  # checkpoints are layout-free: HSDP resumes FSDP's and back
    "parallel.fsdp_sync": APPLY,
    "parallel.devices": APPLY,
    "parallel.accelerator": APPLY,
    "parallel.timeout_s": APPLY,
    "optim.lr": APPLY,
    "optim.weight_decay": APPLY,
    "optim.betas": APPLY,
    "optim.eps": APPLY,
    "optim.schedule": APPLY,
    "optim.warmup_steps": APPLY,
    "optim.min_lr_ratio": APPLY,
    # as saved, resolved (auto → what the run used), so that a resume that would resolve otherwise is refused
    "edm.precond": MODEL,  # the network's input and output mean other quantities
    "edm.loss": APPLY,  # the objective, like its noise levels and weights
    "edm.vp.timesteps": MODEL,  # the levels the network knows
    "edm.vp.beta_start": MODEL,
    "edm.vp.beta_end": MODEL,
    "edm.vp.beta_schedule": MODEL,
    "edm.p_mean": APPLY,
    "edm.p_std": APPLY,
    "edm.prediction": MODEL,  # the network's output is read as another quantity
    "edm.max_weight": APPLY,
    "edm.cfg_dropout": APPLY,
    "edm.ema_decay": APPLY,
    # flow's training t: its distribution and shift, like EDM's noise levels (the export records the shift the run
    # ends with, which sampling uses)
    "flow.prediction": MODEL,  # the network's output is read as another quantity
    "flow.t_dist": APPLY,
    "flow.t_mean": APPLY,
    "flow.t_std": APPLY,
    "flow.shift": APPLY,
    "flow.dynamic_shift": APPLY,
    "flow.base_shift": APPLY,
    "flow.max_shift": APPLY,
    "flow.base_seq_len": APPLY,
    "flow.max_seq_len": APPLY,
    "train.run_dir": PLACE,
    "train.steps": APPLY,  # the cosine schedule stretches to the new length from the restored step
    "train.global_batch": RUN,
    "train.micro_batch": LOADER,  # the same global batch in more or fewer micro-batches per step
    "train.precision": APPLY,
    "train.grad_clip": APPLY,
    "train.seed": LOADER,  # the loader's order; the per-step noise draws follow the new seed too
    "train.stop_at": APPLY,
    "checkpoint.every": APPLY,
    "checkpoint.keep": APPLY,
    "validation.every": APPLY,
    "validation.prompts": APPLY,
    "validation.dataset_prompts": APPLY,
    "validation.steps": APPLY,
    "validation.guidance": APPLY,
    "validation.solver": APPLY,
    "validation.frames": APPLY,
    "validation.clip_frames": APPLY,
    "validation.size": APPLY,
    "validation.fps": APPLY,
    "validation.seed": APPLY,
    "validation.seeds": APPLY,
    # FID figures of a segment with other settings differ by the settings, not the training: the new ones apply
    "validation.fid.num": APPLY,
    "validation.fid.features": APPLY,
    "validation.fid.weights": APPLY,
    # what the held-out loss measures (dit_train.heldout), not what trains: a resumed run's later points use them
    "data.val_path": APPLY,
    "validation.heldout.samples": APPLY,
    "validation.heldout.buckets": APPLY,
    "validation.heldout.sigma_min": APPLY,
    "validation.heldout.sigma_max": APPLY,
    "validation.heldout.seed": APPLY,
    "validation.heldout.every": APPLY,
    "logging.every": APPLY,
    "logging.csv": APPLY,
    "logging.tensorboard": APPLY,
    "logging.wandb.project": APPLY,  # W&B starts (or stops) logging from the resumed step on
    "logging.wandb.entity": APPLY,
    "logging.wandb.mode": APPLY,  # an offline run's steps go online with `wandb sync`
}


def config_keys(section: type[Section] = TrainConfig, prefix: str = "") -> list[str]:
    """Every leaf key of the schema, dotted: model.arch, ..., logging.tensorboard (a list value is one leaf)."""
    keys = []
    for name, field in section.model_fields.items():
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, Section):
            keys += config_keys(kind, f"{prefix}{name}.")
        else:
            keys.append(prefix + name)
    return keys


def flatten(config: dict, prefix: str = "") -> dict[str, object]:
    """{section: {key: value}} → {"section.key": value}."""
    out = {}
    for name, value in config.items():
        if isinstance(value, dict):
            out |= flatten(value, f"{prefix}{name}.")
        else:
            out[prefix + name] = value
    return out


@dataclass(frozen=True)
class Change:
    key: str
    old: object  # the checkpoint's value
    new: object  # this config's

    @property
    def rule(self) -> str:
        return RULES.get(self.key, MODEL)  # a key no rule covers is refused rather than guessed at

    def __str__(self) -> str:
        return f"{self.key} {_show(self.old)} → {_show(self.new)}"


@dataclass(frozen=True)
class Comparison:
    """How this config differs from the one a checkpoint was written with."""

    ckpt: Path
    changes: tuple[Change, ...]

    @property
    def refused(self) -> list[Change]:
        return [c for c in self.changes if c.rule in (MODEL, RUN)]

    @property
    def applied(self) -> list[Change]:
        return [c for c in self.changes if c.rule in (APPLY, LOADER, DATA)]

    @property
    def loader_changes(self) -> list[Change]:
        """The changes after which the loader's saved position does not fit the new loader."""
        return [c for c in self.changes if c.rule == LOADER]

    def refusal(self) -> str | None:
        """One line: the changes that cannot apply to this run, both values, and what to do; None if none."""
        refused = self.refused
        if not refused:
            return None
        was = ", ".join(f"{c.key}={_show(c.old)}" for c in refused)
        now = ", ".join(f"{c.key}={_show(c.new)}" for c in refused)
        if any(c.rule == MODEL for c in refused):
            why = ("the model cannot change within a run: the checkpoint's weights belong to its model; set "
                   f"{was} to continue this run, or train the new model in a new run (another train.run_dir) "
                   f"{init_from_hint(self.ckpt)}")
        else:
            why = ("a step's batch cannot change within a run: the optimizer state and the schedule count steps of "
                   f"the checkpoint's batch; set {was} to continue this run (train.micro_batch may change), or start "
                   "a new run in another train.run_dir")
        return f"checkpoint {self.ckpt} was trained with {was}, this config has {now} — {why}"

    def summary(self) -> str | None:
        """One line naming every change applied on resuming; None if there are none."""
        if not self.applied:
            return None
        return f"resuming {self.ckpt.name} with changed settings (the new values apply): " + ", ".join(
            f"{c}" for c in self.applied)


def nothing_to_train(comparison: Comparison, step: int, saved: dict | None, cfg: TrainConfig) -> str | None:
    """One line refusing to resume a checkpoint of step `step` that this config would train no further (step >=
    train.steps) while it differs from the checkpoint's in anything but train.steps (lowered to stop a run where it
    is: its export is written); None where it may resume. Says how to continue the run and how to start a new one."""
    changes = [c for c in comparison.changes if c.key != "train.steps"]
    if step < cfg.train.steps or not changes:
        return None
    ckpt, planned = comparison.ckpt, flatten(saved or {}).get("train.steps")
    finished = isinstance(planned, int) and step >= planned
    held = (f"a finished run (its checkpoint {ckpt.name}: step {step} of train.steps={planned})" if finished else
            f"a run whose checkpoint {ckpt.name} is at step {step}")
    return (f"train.run_dir {ckpt.parent.parent} holds {held}, which this command would not train further "
            f"(train.steps={cfg.train.steps}) but resume with another config: {', '.join(map(str, changes))} — "
            "continue that run with --resume auto and its own config (raise train.steps to train it longer), or "
            "start a new run with --overwrite (removes the old run's outputs) or in another train.run_dir")


def init_from_hint(ckpt: Path) -> str:
    """How a new run starts from a checkpoint's weights."""
    return (f"with model.init_from={ckpt} to start from its weights (the tensors whose names and shapes fit the new "
            "model; the rest start fresh)")


def compare(saved: dict | None, cfg: TrainConfig, ckpt: Path) -> Comparison:
    """The keys whose value differs between the checkpoint's config (`saved`, as read from its config.yaml) and
    `cfg`. A key the checkpoint does not record (written before the key existed) is not compared; one that this
    dit-train no longer has is ignored."""
    old, new = flatten(saved or {}), flatten(cfg.to_dict())
    changes = tuple(Change(key, old[key], value) for key, value in new.items()
                    if key in old and RULES.get(key) != PLACE and not _same(old[key], value))
    return Comparison(Path(ckpt), changes)


def _same(a, b) -> bool:
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return float(a) == float(b)  # the schema reads 1 and 1.0 alike
    return a == b


def _show(value) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()
