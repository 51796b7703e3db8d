"""What a run trains, decided once from the config, the dataset and model.init_from: the model's architecture, the
network's preconditioning and objective (edm.precond and edm.loss, auto resolved), its DDPM schedule, and the latent
units it works in.

Most runs are ditcore's own: EDM preconditioning and loss, the preset's architecture, the dataset's latents as they
are. A run that starts from one of the field's DDPM-trained DiTs (ditcore.interop: DiT-XL/2, a diffusers DiT) takes
what that network is: its architecture, inferred from its weights (a model key the user set that disagrees is an
error naming it), VP preconditioning on its schedule, DiT's objective, and its latent scale — DiT was trained on
0.18215 z, the dataset stores z normalised by its own statistics, so every batch is mapped to the network's units on
the device (ditcore.training.LatentMap), and the export records the network's statistics, so that sampling decodes
right. A run fine-tuned that way records the same beside its weights, so a run started from it continues alike.
A Wan (a diffusers WanTransformer3DModel or WanPipeline folder) likewise brings its architecture (model.arch=wan),
objective flow with its scheduler's time shift (flow.shift where the config sets none), and the per-channel latent
units of its VAE (latents_mean, latents_std); its text cross-attention is taken where the dataset's text encoder is
its UMT5 (the same width).

Classes: a dataset with the checkpoint's classes (or none: every sample is then trained as the null class, the
unconditional DiT) keeps its class embedding; one with another number of classes gets a fresh one (init_from's line
names it). Text states, if the dataset has them, meet fresh cross-attention layers.
"""

from __future__ import annotations

from dataclasses import dataclass

from dit_train.config import TrainConfig, VPSchedule
from ditcore import init_from
from ditcore.codecs import LatentStats
from ditcore.data.schema import INFO_FILE
from ditcore.diffusion import EDMLoss, EDMPrecond
from ditcore.diffusion.ddpm import DDPMLoss
from ditcore.diffusion.flow import FlowLoss, FlowPrecond
from ditcore.diffusion.vp import DiscreteVP
from ditcore.errors import ConfigError
from ditcore.models import PRESETS, DiTConfig, arch_of, preset
from ditcore.models.moe import MoEConfig
from ditcore.training import LatentMap

# model keys that override one DiTConfig field each (model.max_grid bounds positions only: it may differ)
ARCH_KEYS = ("patch_size", "patch_size_t", "depth", "num_heads", "pos_embed", "qk_norm", "fps_cond", "learn_sigma",
             "freq_shift", "mlp_norm_eps", "block_embedders", "moe")
PRESET_FIELDS = ("hidden_size", "depth", "num_heads", "patch_size", "patch_size_t", "mlp_ratio")


@dataclass(frozen=True)
class Recipe:
    cfg: TrainConfig  # edm.precond, edm.loss and edm.vp resolved: what checkpoints save and a resume compares
    model_cfg: DiTConfig
    vp: DiscreteVP | None  # the DDPM schedule under VP preconditioning; None: EDM's
    data_stats: LatentStats | None  # what the dataset's latents are normalised by (None: it does not say)
    latent_stats: LatentStats | None  # ... and the network's (the same unless it was trained on other units)
    source: init_from.Source | None  # model.init_from, read once (its weights are copied in by dit_train.train)

    @property
    def foreign(self) -> bool:
        return self.source is not None and self.source.cfg is not None

    @property
    def flow(self) -> bool:
        return self.cfg.objective == "flow"

    def denoiser(self, model) -> EDMPrecond | FlowPrecond:
        if self.flow:
            return FlowPrecond(model, self.cfg.flow.prediction)
        return EDMPrecond(model, prediction=self.cfg.edm.prediction, vp=self.vp)

    def loss(self) -> EDMLoss | DDPMLoss | FlowLoss:
        e, f = self.cfg.edm, self.cfg.flow
        if self.flow:
            return FlowLoss(f.t_dist, float(f.t_mean), float(f.t_std), f.time_shift())
        if e.loss == "ddpm":
            return DDPMLoss(self.vp, self.model_cfg.learn_sigma)
        return EDMLoss(e.p_mean, e.p_std, max_weight=e.max_weight, vp=self.vp)

    def foreign_line(self) -> str:
        """What a run started from one of the field's networks takes from it, in one line."""
        m, cfg, src = self.model_cfg, self.cfg, self.source
        line = (f"model.init_from: {src.kind} {src.path} — its architecture (width {m.hidden_size}, depth {m.depth}, "
                f"{m.num_heads} heads, patch {m.patch_size}{', learned Σ' if m.learn_sigma else ''}), ")
        if self.flow:
            f = cfg.flow
            shift = "by length" if f.dynamic_shift else f"{f.shift:g}"
            return line + f"objective=flow (timestep shift {shift}), latents scaled as it was trained"
        return line + (f"edm.precond={cfg.edm.precond} ({self.vp.timesteps} {self.vp.beta_schedule} timesteps), "
                       f"edm.loss={cfg.edm.loss}, latents scaled as it was trained (std "
                       f"{self.latent_stats.std[0]:.4g})")

    @property
    def own_units(self) -> bool:
        """Whether the network works in other latent units than the dataset's."""
        ours, data = self.latent_stats, self.data_stats
        return ours is not data and data is not None and not (ours.mean.equal(data.mean) and ours.std.equal(data.std))

    def latent_map(self, device) -> LatentMap | None:
        """dataset units → the network's, on `device`; None where they are the same."""
        if not self.own_units:
            return None
        m = self.model_cfg
        return LatentMap.between(self.data_stats, self.latent_stats, m.patch_size_t * m.patch_size**2, device)

    def recorded(self) -> dict:
        """What an export's model.json and a checkpoint's values say of the network's objective, preconditioning and
        units."""
        units = self.latent_stats if self.own_units or self.vp is not None else None  # under VP: DiT's, always
        return init_from.recorded(self.vp, units, self.cfg.objective,
                                  self.cfg.flow.time_shift() if self.flow else None)

    def sampling(self) -> dict:
        """What ditcore.sampling.sample needs to know of the network (as ditcore.export.Exported.sampling says it)."""
        prediction = self.cfg.flow.prediction if self.flow else self.cfg.edm.prediction
        return {"objective": self.cfg.objective, "prediction": prediction, "vp": self.vp,
                "shift": self.cfg.flow.time_shift() if self.flow else None}


def resolve(cfg: TrainConfig, info) -> Recipe:
    """The recipe of a run of `cfg` on the dataset `info`; ConfigError in one line for what does not fit."""
    m = cfg.model
    source = init_from.read_source(m.init_from, m.num_heads) if m.init_from else None
    # a dataset records the statistics it normalised by; tests' hand-written ones may not (validation then skips)
    data_stats = LatentStats.from_dict(info.latent_stats) if info.latent_stats else None
    model_cfg = model_config(cfg, info, source)
    objective = _objective(cfg, source)
    if objective == "flow":
        # edm.precond and edm.loss resolved as an EDM run's are (flow refuses vp and ddpm), so that a resume under the
        # other objective is refused for the objective alone
        update = {"objective": objective, "flow": _flow_shift(cfg, source),
                  "edm": cfg.edm.model_copy(update={"precond": "edm", "loss": "edm"})}
        return Recipe(cfg.model_copy(update=update), model_cfg, None, data_stats, _latent_stats(cfg, source,
                                                                                                 data_stats), source)
    e = cfg.edm
    precond = _precond(e, source)
    vp = _vp(cfg, source) if precond == "vp" else None
    loss = e.loss if e.loss != "auto" else ("ddpm" if precond == "vp" else "edm")
    if loss == "ddpm" and precond != "vp":
        raise ConfigError("edm.loss", "ddpm", "auto or edm under edm.precond=edm (auto: model.init_from is no "
                                              "DDPM-trained network): DiT's objective trains a DDPM network on its "
                                              "timesteps (edm.precond=vp)")
    latent_stats = _latent_stats(cfg, source, data_stats)
    edm = e.model_copy(update={"precond": precond, "loss": loss,
                               # the schedule trained on (the export records DDIM's steps through it too: vp)
                               "vp": VPSchedule(**{k: getattr(vp, k) for k in VPSchedule.model_fields})
                               if vp is not None else e.vp})
    return Recipe(cfg.model_copy(update={"edm": edm, "objective": objective}), model_cfg, vp, data_stats,
                  latent_stats, source)


def _objective(cfg: TrainConfig, source: init_from.Source | None) -> str:
    """objective, auto resolved: what model.init_from's network was trained with (flow for a Wan model or a flow run),
    else edm. A DDPM-trained network is not trained with flow (its timesteps and ε-output are VP's)."""
    theirs = source.objective if source is not None else "edm"
    objective = cfg.objective if cfg.objective != "auto" else theirs
    if objective == "flow" and source is not None and source.vp is not None:
        raise ConfigError("objective", "flow", f"auto or edm for {_named(source)}, a DDPM-trained network: it "
                                               "predicts the noise on its own timesteps (edm.precond=vp)")
    if objective == "edm" and cfg.validation.solver == "unipc":
        raise ConfigError("validation.solver", "unipc", "heun or euler under objective=edm: UniPC samples flow "
                                                        "networks (objective=flow)")
    return objective


def _flow_shift(cfg: TrainConfig, source: init_from.Source | None):
    """The flow section, its timestep shift the source network's (Wan 2.1 1.3B's 3) where the config sets none."""
    f = cfg.flow
    if source is None or source.shift is None or {"shift", "dynamic_shift"} & f.model_fields_set:
        return f
    s = source.shift
    return f.model_copy(update={"shift": s.shift, "dynamic_shift": s.dynamic, "base_shift": s.base_shift,
                                "max_shift": s.max_shift, "base_seq_len": s.base_seq_len,
                                "max_seq_len": s.max_seq_len})


def _precond(e, source: init_from.Source | None) -> str:
    """edm.precond, auto resolved: vp for a DDPM-trained source, which EDM's preconditioning cannot drive."""
    src_vp = source.vp if source is not None else None
    precond = e.precond if e.precond != "auto" else ("vp" if src_vp is not None else "edm")
    if precond == "edm" and src_vp is not None:
        raise ConfigError("edm.precond", "edm", f"vp or auto for {_named(source)}, a DDPM-trained network: EDM's "
                                                "preconditioning would feed it inputs and read outputs it was not "
                                                "trained for (edm.loss=edm trains it with EDM's objective under vp)")
    return precond


def _vp(cfg: TrainConfig, source: init_from.Source | None) -> DiscreteVP:
    """The DDPM schedule under VP preconditioning: a DDPM-trained source's own, else edm.vp's."""
    e, src_vp = cfg.edm, source.vp if source is not None else None
    vp = src_vp or e.vp.schedule()
    if src_vp is not None and _set(e, "vp") and e.vp.schedule() != src_vp.trained():
        raise ConfigError("edm.vp", e.vp.model_dump(), f"the schedule {_named(source)} was trained with, "
                                                       f"{src_vp.to_dict()} — leave edm.vp unset")
    if e.prediction == "x":
        raise ConfigError("edm.prediction", "x", "edm with edm.precond=vp (here: auto, for a DDPM-trained "
                                                 f"{cfg.model.init_from}): a DDPM network predicts the noise")
    return vp


def _latent_stats(cfg: TrainConfig, source: init_from.Source | None,
                  data_stats: LatentStats | None) -> LatentStats | None:
    """The units the network works in: those a source records (a DDPM-trained DiT's 0.18215 z, Wan's per-channel
    normalisation of its VAE's latents, or a run fine-tuned from one), else the dataset's."""
    if source is None or source.latent_stats is None:
        return data_stats
    if data_stats is None:
        raise ConfigError("data.path", cfg.data.path, f"a dataset that records its latent statistics (its "
                                                      f"{INFO_FILE} has none), to feed {_named(source)} its "
                                                      "latents in the units it was trained on — prepare it again")
    if len(data_stats.mean) != len(source.latent_stats.mean):
        raise ConfigError("data.path", cfg.data.path, f"latents of {len(source.latent_stats.mean)} channels, as "
                                                      f"{_named(source)} was trained on (this dataset's have "
                                                      f"{len(data_stats.mean)}) — prepare the data with its VAE")
    return source.latent_stats


def model_config(cfg: TrainConfig, info, source: init_from.Source | None = None) -> DiTConfig:
    """The run's architecture: the preset's with the config's overrides, or a foreign source's (`foreign_config`);
    data-dependent fields from the dataset."""
    if source is not None and source.cfg is not None:
        return foreign_config(cfg, info, source)
    m = cfg.model
    changes = dict(in_channels=info.latent_channels, text_dim=info.text_encoder["dim"], num_classes=info.num_classes,
                   pos_embed=m.pos_embed, qk_norm=m.qk_norm, fps_cond=m.fps_cond)
    for key in ("patch_size", "patch_size_t", "depth", "num_heads", "learn_sigma", "freq_shift", "mlp_norm_eps",
                "block_embedders"):
        if getattr(m, key) is not None:
            changes[key] = getattr(m, key)
    if m.max_grid is not None:
        changes["max_grid"] = tuple(m.max_grid)
    try:
        if m.moe is not None:
            changes["moe"] = MoEConfig(**m.moe.model_dump(exclude_none=True))
        return preset(m.preset, **changes)
    except ConfigError as e:  # ditcore names the config's fields: moe.top_k is model.moe.top_k here
        if e.key.startswith("moe"):
            raise ConfigError(f"model.{e.key}", e.value, e.allowed) from None
        raise


def foreign_config(cfg: TrainConfig, info, source: init_from.Source) -> DiTConfig:
    """A foreign checkpoint's architecture; ConfigError naming every model key the user set that disagrees with it,
    and for a dataset of other latent channels."""
    m, theirs = cfg.model, source.cfg
    differ = _disagreements(m, theirs)
    if differ:
        (key, value, ckpt), *rest = differ
        also = "; also " + ", ".join(f"{k}={v} (the checkpoint's: {c})" for k, v, c in rest) if rest else ""
        raise ConfigError(key, value, f"the checkpoint's {ckpt}{also}: model.init_from={m.init_from} sets the "
                                      f"architecture from its weights — leave {', '.join(k for k, _, _ in differ)} "
                                      "unset, or start from fresh weights")
    if info.latent_channels != theirs.in_channels:
        raise ConfigError("data.path", cfg.data.path, f"latents of {theirs.in_channels} channels, as {_named(source)} "
                                                      f"was trained on (this dataset's have {info.latent_channels}) "
                                                      "— prepare the data with the checkpoint's VAE (dit-prepare "
                                                      "--codec vae --vae PATH)")
    # the checkpoint's classes for a dataset of the same or none (trained as the null class); else the dataset's,
    # whose class embedding starts fresh
    classes = theirs.num_classes if info.num_classes in (0, theirs.num_classes) else info.num_classes
    changes = dict(text_dim=info.text_encoder["dim"], num_classes=classes)
    if m.max_grid is not None:
        changes["max_grid"] = tuple(m.max_grid)
    return theirs.replace(**changes)


def _disagreements(m, theirs: DiTConfig) -> list[tuple[str, object, object]]:
    """(key, the user's value, the checkpoint's) for every model key the config set that the checkpoint disagrees
    with; the preset first."""
    differ = []
    # model.arch is the preset's (a config cannot set one without the other): given only where the preset is
    if _set(m, "preset") and m.arch != arch_of(theirs):
        differ.append(("model.arch", m.arch, arch_of(theirs)))
    for key in ARCH_KEYS:
        if _set(m, key) and getattr(m, key) is not None and getattr(m, key) != getattr(theirs, key):
            differ.append((f"model.{key}", getattr(m, key), getattr(theirs, key)))
    if _set(m, "preset"):
        ours = PRESETS[m.preset]
        wrong = [k for k in PRESET_FIELDS  # a key given beside the preset is compared by itself above
                 if getattr(ours, k) != getattr(theirs, k) and not (_set(m, k) and getattr(m, k) is not None)]
        if wrong:
            differ.insert(0, ("model.preset", m.preset, ", ".join(f"{k} {getattr(theirs, k)} (the preset's "
                                                                    f"{getattr(ours, k)})" for k in wrong)))
    return differ


def _set(section, key: str) -> bool:
    """Whether the config gave `key` (in its file or an override) rather than leaving the default."""
    return key in section.model_fields_set


def _named(source: init_from.Source) -> str:
    return f"{source.kind} {source.path}"
