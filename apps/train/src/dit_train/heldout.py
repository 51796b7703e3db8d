"""The held-out loss per noise level (ditcore.eval.heldout) of the EMA and the raw weights, every
validation.heldout.every steps (default: at every validation, validation.every) and at the end: logged through
Fabric's loggers (CSV, TensorBoard, any other) as

    heldout/ema/total            the levels' losses weighted by the training distribution of σ (edm.p_mean/p_std)
    heldout/ema/sigma_00=0.002   the loss at level 0 (σ_min), ... up to sigma_07=80 (σ_max) with 8 levels
    heldout/raw/...              the same for the raw (not averaged) weights

and kept in the run's state (checkpointed, so a resumed run plots its whole curve: RUN_DIR/heldout.png).

The held-out samples (the first validation.heldout.samples of data.val_path, by key) are read, patchified, given
their fixed noise and packed on the host once, at setup; each data-parallel rank holds every dp-th of them. Nothing
here runs between validations.
"""

from __future__ import annotations

from pathlib import Path

from dit_train.config import TrainConfig
from ditcore.data.packing import TokenSample
from ditcore.data.schema import (
    HELDOUT_DIR,
    DatasetError,
    DatasetInfo,
    read_info,
    read_sample,
    shard_keys,
    shard_samples,
)
from ditcore.diffusion import EDMLoss
from ditcore.errors import ConfigError
from ditcore.eval.heldout import bucket_weights, heldout_batches, heldout_totals, sigma_buckets
from ditcore.models import inputs_of
from ditcore.parallel.pipeline import PipelinedModel


def val_path(cfg: TrainConfig) -> tuple[Path, bool]:
    """The held-out dataset's folder, and whether the config names it (else the default, data.path/val)."""
    if cfg.data.val_path:
        return Path(cfg.data.val_path), True
    return Path(cfg.data.path) / HELDOUT_DIR, False


def read_heldout(root: Path, n: int, patch_size: int, patch_size_t: int, seq_length: int) -> list[TokenSample]:
    """The first n samples of the dataset at `root` in key order (its shards read directly: no loader order, shuffle
    or rank split may change which samples these are), patchified. Only their members are read: the tar headers of
    a large set (data.val_path may name any dataset) are walked once, seeking over the payloads."""
    shards = sorted(root.glob("rank*-*.tar"))
    chosen = set(sorted(set().union(*map(shard_keys, shards)))[:n])
    members = {sample["__key__"]: sample for shard in shards for sample in shard_samples(shard, chosen)}
    samples = []
    for key in sorted(members):
        latent, text, meta = read_sample(members[key])
        _, T, H, W = latent.shape
        grid = (T // patch_size_t, H // patch_size, W // patch_size)
        if T % patch_size_t or H % patch_size or W % patch_size or grid[0] * grid[1] * grid[2] > seq_length:
            raise DatasetError(f"held-out sample {key} of '{root}' (latent {T}x{H}x{W}) does not fit patch "
                               f"{patch_size_t}x{patch_size}x{patch_size} and data.seq_length={seq_length} — "
                               "prepare the held-out set with the training set (dit-prepare --val-samples N)")
        samples.append(TokenSample.of(key, latent, text, meta, patch_size, patch_size_t))
    return samples


def check_same_latents(val: DatasetInfo, info: DatasetInfo, root: Path) -> None:
    """A held-out set in other latent units (another codec, statistics or text encoder) would score the model on
    inputs it never saw."""
    for what in ("codec", "latent_stats", "text_encoder"):
        if getattr(val, what) != getattr(info, what):
            raise ConfigError("data.val_path", str(root), f"a held-out set with the training set's {what} (this one "
                                                          "differs): prepare both at once with dit-prepare "
                                                          "--val-samples N")


class HeldOutLoss:
    """The held-out losses of a run (`build` says whether it has any): `due(step)`, `run(...)` → the logged values."""

    def __init__(self, run, batches: list, loss: EDMLoss):
        h = run.cfg.validation.heldout
        self.run, self.batches, self.loss = run, batches, loss
        self.latent_map = run.recipe.latent_map(run.fabric.device)  # dataset units → the network's, if they differ
        self.buckets = sigma_buckets(h.buckets, h.sigma_min, h.sigma_max)
        self.weights = bucket_weights(self.buckets, run.cfg.edm.p_mean, run.cfg.edm.p_std)
        self.names = [f"sigma_{k:02d}={s:.3g}" for k, s in enumerate(self.buckets.tolist())]

    @classmethod
    def build(cls, run) -> HeldOutLoss | None:
        """Read and pack this rank's held-out samples (`run`: dit_train.train.Setup); None when there are none to
        score: validation.heldout.samples 0, or no held-out set where the default looks (said once)."""
        cfg, fabric, groups = run.cfg, run.fabric, run.groups
        h = cfg.validation.heldout
        root, named = val_path(cfg)
        if not h.samples:
            return None
        if not (root / "ditcore.json").is_file() and not named:
            fabric.print(f"note: no held-out set at {root} (dit-prepare --val-samples N writes one; or set "
                         "data.val_path): no held-out loss")
            return None
        try:
            val = read_info(root)
        except DatasetError as e:
            raise ConfigError("data.val_path", str(root), f"a held-out dataset written by dit-prepare ({e})") from None
        check_same_latents(val, run.info, root)
        m = run.model_cfg
        samples = read_heldout(root, h.samples, m.patch_size, m.patch_size_t, cfg.data.seq_length)
        # each data-parallel rank scores its share (TP/CP/PP peers hold the same); under expert parallelism every rank
        # scores them all: EP peers run their forwards in lockstep, the same number of batches of the same shapes
        # (the dispatch's all-to-alls), which shares of the set would not give
        share = groups.dims.dp if groups.dims.ep == 1 else 1
        mine = list(range(len(samples)))[groups.dp_rank % share::share]
        batches = heldout_batches([samples[i] for i in mine], mine, h.seed, cfg.data.seq_length,
                                  cfg.train.micro_batch, text_multiple=128 if run.on_gpu else 1, inputs=inputs_of(m))
        fabric.print(f"held-out loss: {len(samples)} samples of {root} at {h.buckets} noise levels "
                     f"({h.sigma_min:g} to {h.sigma_max:g}), EMA and raw weights")
        e = cfg.edm  # the run's EDM loss; under edm.loss=ddpm too (its levels rounded to the network's under VP)
        return cls(run, batches, EDMLoss(e.p_mean, e.p_std, max_weight=e.max_weight, vp=run.recipe.vp))

    def due(self, step: int) -> bool:
        """Every validation.heldout.every steps, else at every validation (validation.every); the end is `export`'s."""
        cfg = self.run.cfg
        every = cfg.validation.heldout.every or cfg.validation.every
        return bool(every) and step % every == 0 and step != cfg.train.steps

    def run_on(self, models: dict, step: int, state: dict) -> dict[str, float]:
        """Collective: the held-out losses of `models` (name → this rank's module), as logged; also appended to
        state["heldout"] as [step, values]."""
        run = self.run
        values = {}
        for which, model in models.items():
            if run.groups.dims.pp > 1:  # the hidden states go through the stages; every stage gets the output
                model = PipelinedModel(model, run.groups)
            sums, counts = heldout_totals(run.recipe.denoiser(model), self.batches, self.buckets, self.loss,
                                          device=run.fabric.device, cfg=run.model_cfg,
                                          latent_map=self.latent_map,
                                          group=run.groups.dp_group if run.groups.dims.ep == 1 else None,
                                          autocast=run.fabric.autocast)
            losses = (sums / counts).cpu()  # waits for the device: a validation step
            values[f"heldout/{which}/total"] = float((losses * self.weights).sum())
            values |= {f"heldout/{which}/{name}": float(v) for name, v in zip(self.names, losses, strict=True)}
        state.setdefault("heldout", []).append([step, values])
        return values
