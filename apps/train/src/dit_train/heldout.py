"""The held-out loss per noise level (ditcore.eval.heldout) of the EMA and the raw weights, every
validation.heldout.every steps (default: at every validation, validation.every) and at the end: logged through
Fabric's loggers (CSV, TensorBoard, any other) as

    heldout/ema/total            the levels' losses weighted by the training distribution of σ (edm.p_mean/p_std)
    heldout/ema/sigma_00=0.002   the loss at level 0 (σ_min), ... up to sigma_07=80 (σ_max) with 8 levels
    heldout/raw/...              the same for the raw (not averaged) weights

A flow run (objective: flow) is scored alike at fixed times t instead (ditcore.eval.heldout.t_buckets: heldout/ema/
t_00=0.05 ... t_07=0.95), its velocity loss weighted by the training distribution of t (flow.t_dist and its shift).
The two objectives' per-level losses measure different quantities and are not compared with each other.

and kept in the run's state (checkpointed, so a resumed run plots its whole curve: RUN_DIR/heldout.png).

The held-out samples (the first validation.heldout.samples of data.val_path, by key) are read, patchified, given
their fixed noise and packed on the host once, at setup; each data-parallel rank holds every dp-th of them. Nothing
here runs between validations.

A blend (ditcore.data.blend) without data.val_path scores each of its datasets that has a held-out split (DATASET/val)
on its own: the first validation.heldout.samples of each, mapped into the blend's latent units as training maps them
(`Member.latent_map`), each with the noise it has when its dataset is trained alone. Logged besides the above as

    heldout/<dataset>/ema/total, heldout/<dataset>/ema/sigma_00=0.002, ..., heldout/<dataset>/raw/...

while heldout/ema/... and heldout/raw/... stay the loss of all held-out samples together: per level, the datasets'
(sum, count) pairs added up, so each real token's features count the same whichever dataset holds them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from dit_train.config import TrainConfig
from ditcore.data.blend import members, to_blend_units
from ditcore.data.packing import TokenSample
from ditcore.data.schema import (
    HELDOUT_DIR,
    INFO_FILE,
    DatasetError,
    DatasetInfo,
    read_info,
    read_sample,
    shard_keys,
    shard_samples,
)
from ditcore.diffusion import EDMLoss
from ditcore.errors import ConfigError
from ditcore.eval.heldout import (
    bucket_weights,
    heldout_batches,
    heldout_totals,
    sigma_buckets,
    t_bucket_weights,
    t_buckets,
)
from ditcore.models import inputs_of
from ditcore.parallel.pipeline import PipelinedModel


def val_path(cfg: TrainConfig) -> tuple[Path, bool]:
    """The held-out dataset's folder, and whether the config names it (else the default, data.path/val)."""
    if cfg.data.val_path:
        return Path(cfg.data.val_path), True
    return Path(cfg.data.path) / HELDOUT_DIR, False


def read_heldout(root: Path, n: int, patch_size: int, patch_size_t: int, seq_length: int,
                 latent_map: tuple[torch.Tensor, torch.Tensor] | None = None) -> list[TokenSample]:
    """The first n samples of the dataset at `root` in key order (its shards read directly: no loader order, shuffle
    or rank split may change which samples these are), patchified. Only their members are read: the tar headers of
    a large set (data.val_path may name any dataset) are walked once, seeking over the payloads. latent_map:
    (scale, shift) per channel into the training set's units (a blend's dataset: Member.latent_map), None: as
    stored."""
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
        latent = to_blend_units(latent, latent_map)
        samples.append(TokenSample.of(key, latent, text, meta, patch_size, patch_size_t))
    return samples


def check_same_latents(val: DatasetInfo, info: DatasetInfo, root: Path, key: str = "data.val_path") -> None:
    """A held-out set in other latent units (another codec, statistics or text encoder) would score the model on
    inputs it never saw."""
    for what in ("codec", "latent_stats", "text_encoder"):
        if getattr(val, what) != getattr(info, what):
            raise ConfigError(key, str(root), f"a held-out set with the training set's {what} (this one differs): "
                                              "prepare both at once with dit-prepare --val-samples N")


@dataclass
class HeldOutSet:
    """One held-out set a run scores: its own (name None), or a blend's dataset's (by the dataset's name)."""

    name: str | None
    root: Path
    latent_map: tuple[torch.Tensor, torch.Tensor] | None = None  # into the training set's units (read_heldout)


def heldout_sets(cfg: TrainConfig, info: DatasetInfo, say) -> list[HeldOutSet]:
    """The held-out sets of a run on the dataset `info` (data.path's), each checked to hold the latents it trains on;
    [] where the default finds none (said once with `say`). data.val_path names one set, for a blend too."""
    root, named = val_path(cfg)
    if info.blend and not named:
        return blend_sets(cfg, info, say)
    if not (root / INFO_FILE).is_file() and not named:
        say(f"note: no held-out set at {root} (dit-prepare --val-samples N writes one; or set data.val_path): no "
            "held-out loss")
        return []
    check_same_latents(_read_val(root, "data.val_path"), info, root)
    return [HeldOutSet(None, root)]


def blend_sets(cfg: TrainConfig, info: DatasetInfo, say) -> list[HeldOutSet]:
    """The held-out split of each dataset of the blend that has one, in the blend's order; checked against that
    dataset's own info (its latent statistics may differ from the blend's: mapped as read)."""
    path, sets, without = Path(cfg.data.path), [], []
    for member in members(path, info):
        root = member.root / HELDOUT_DIR
        if not (root / INFO_FILE).is_file():
            without.append(member.name)
            continue
        check_same_latents(_read_val(root, "data.path"), read_info(member.root), root, "data.path")
        sets.append(HeldOutSet(member.name, root, member.latent_map(info.latent_stats)))
    if not sets:
        say(f"note: no dataset of blend {path} has a held-out set (dit-prepare --val-samples N writes one; or set "
            "data.val_path): no held-out loss")
    elif without:
        say(f"note: dataset{'s' if len(without) > 1 else ''} {', '.join(without)} of blend {path} "
            f"{'have' if len(without) > 1 else 'has'} no held-out set (dit-prepare --val-samples N writes one): "
            "not scored")
    return sets


def _read_val(root: Path, key: str) -> DatasetInfo:
    try:
        return read_info(root)
    except DatasetError as e:
        raise ConfigError(key, str(root), f"a held-out dataset written by dit-prepare ({e})") from None


def heldout_loss(recipe):
    """The loss the held-out sets are scored with: the run's flow loss, or its EDM loss (under edm.loss=ddpm too, its
    levels rounded to the network's under VP)."""
    if recipe.flow:
        return recipe.loss()
    e = recipe.cfg.edm
    return EDMLoss(e.p_mean, e.p_std, max_weight=e.max_weight, vp=recipe.vp)


def levels(recipe, loss) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """(the fixed levels, their weights in the total, their logged names): σ for EDM, t for flow."""
    h = recipe.cfg.validation.heldout
    if recipe.flow:
        buckets = t_buckets(h.buckets)
        return buckets, t_bucket_weights(buckets, loss), [f"t_{k:02d}={t:.3g}" for k, t in enumerate(buckets.tolist())]
    buckets = sigma_buckets(h.buckets, h.sigma_min, h.sigma_max)
    weights = bucket_weights(buckets, recipe.cfg.edm.p_mean, recipe.cfg.edm.p_std)
    return buckets, weights, [f"sigma_{k:02d}={s:.3g}" for k, s in enumerate(buckets.tolist())]


class HeldOutLoss:
    """The held-out losses of a run (`build` says whether it has any): `due(step)`, `run(...)` → the logged values."""

    def __init__(self, run, sets: dict[str | None, list], loss: EDMLoss):
        """sets: each held-out set's batches on this rank, by its name (HeldOutSet.name)."""
        self.run, self.sets, self.loss = run, sets, loss
        self.latent_map = run.recipe.latent_map(run.fabric.device)  # dataset units → the network's, if they differ
        self.buckets, self.weights, self.names = levels(run.recipe, loss)

    @classmethod
    def build(cls, run) -> HeldOutLoss | None:
        """Read and pack this rank's held-out samples (`run`: dit_train.train.Setup); None when there are none to
        score: validation.heldout.samples 0, or no held-out set where the default looks (said once)."""
        cfg, fabric, groups = run.cfg, run.fabric, run.groups
        h = cfg.validation.heldout
        if not h.samples:
            return None
        sets = heldout_sets(cfg, run.info, fabric.print)
        if not sets:
            return None
        m = run.model_cfg
        # each data-parallel rank scores its share (TP/CP/PP peers hold the same); under expert parallelism every rank
        # scores them all: EP peers run their forwards in lockstep, the same number of batches of the same shapes
        # (the dispatch's all-to-alls), which shares of the set would not give
        share = groups.dims.dp if groups.dims.ep == 1 else 1
        batches, counts = {}, []
        for s in sets:  # a blend's: each set shared alike, its samples' noise by their index in it
            samples = read_heldout(s.root, h.samples, m.patch_size, m.patch_size_t, cfg.data.seq_length, s.latent_map)
            mine = list(range(len(samples)))[groups.dp_rank % share::share]
            batches[s.name] = heldout_batches([samples[i] for i in mine], mine, h.seed, cfg.data.seq_length,
                                              cfg.train.micro_batch, text_multiple=128 if run.on_gpu else 1,
                                              inputs=inputs_of(m))
            counts.append(f"{len(samples)} samples of {s.root}" if s.name is None else
                          f"{len(samples)} samples of dataset {s.name}")
        loss = heldout_loss(run.recipe)
        buckets = levels(run.recipe, loss)[0].tolist()
        what = "times t" if run.recipe.flow else "noise levels"
        fabric.print(f"held-out loss: {', '.join(counts)} at {h.buckets} {what} ({buckets[0]:.3g} to "
                     f"{buckets[-1]:.3g}), EMA and raw weights")
        return cls(run, batches, loss)

    def due(self, step: int) -> bool:
        """Every validation.heldout.every steps, else at every validation (validation.every); the end is `export`'s."""
        cfg = self.run.cfg
        every = cfg.validation.heldout.every or cfg.validation.every
        return bool(every) and step % every == 0 and step != cfg.train.steps

    def run_on(self, models: dict, step: int, state: dict) -> dict[str, float]:
        """Collective: the held-out losses of `models` (name → this rank's module), as logged; also appended to
        state["heldout"] as [step, values]."""
        run = self.run
        values, by_set = {}, {}
        for which, model in models.items():
            if run.groups.dims.pp > 1:  # the hidden states go through the stages; every stage gets the output
                model = PipelinedModel(model, run.groups)
            denoiser = run.recipe.denoiser(model)
            by_set[which] = {name: heldout_totals(denoiser, batches, self.buckets, self.loss,
                                                  device=run.fabric.device, cfg=run.model_cfg,
                                                  latent_map=self.latent_map,
                                                  group=run.groups.dp_group if run.groups.dims.ep == 1 else None,
                                                  autocast=run.fabric.autocast)
                             for name, batches in self.sets.items()}  # on every rank in one order: collectives
            # all held-out samples together: one set's pairs as they are, a blend's datasets' added up
            sums, counts = (torch.stack(p).sum(0) for p in zip(*by_set[which].values(), strict=True))
            values |= self._logged(f"heldout/{which}", sums, counts)
        for name in [name for name in self.sets if name is not None]:  # a blend's datasets, in its order
            for which, pairs in by_set.items():
                values |= self._logged(f"heldout/{name}/{which}", *pairs[name])
        state.setdefault("heldout", []).append([step, values])
        return values

    def _logged(self, prefix: str, sums: torch.Tensor, counts: torch.Tensor) -> dict[str, float]:
        losses = (sums / counts).cpu()  # waits for the device: a validation step
        return {f"{prefix}/total": float((losses * self.weights).sum())} | {
            f"{prefix}/{name}": float(v) for name, v in zip(self.names, losses, strict=True)}
