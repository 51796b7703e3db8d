"""The training config: one typed value, read from YAML with dotted overrides (defaults < file < overrides).

Each section is a strict pydantic model (no bool is read as a number, no number as a bool or string; numbers
may be written as YAML strings, as YAML 1.1 reads `1e-3`) with its bounds as
Field constraints. The first thing wrong becomes one ConfigError that names the dotted key, the value seen and
what is allowed. The resolved config is saved next to every checkpoint and printed by `dit-train --print-config`.
"""

from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo

from ditcore.choices import (
    BETA_SCHEDULES,
    FEATURES,
    FLOW_PREDICTIONS,
    LAYOUT_CHOICES,
    LOSSES,
    OBJECTIVES,
    PRECONDS,
    PREDICTIONS,
    SAMPLE_SOLVERS,
    T_DISTRIBUTIONS,
)
from ditcore.errors import ConfigError

CONFIGS = Path(__file__).resolve().parents[2] / "configs"  # apps/train/configs, beside the package source


def shipped_configs() -> dict[str, Path]:
    """The configs that come with dit-train, by name: apps/train/configs/NAME.yaml."""
    return {path.stem: path for path in sorted(CONFIGS.glob("*.yaml"))}


SHIPPED_NAMES = tuple(shipped_configs())


# --------------------------------------------------------------------------------------------------
# Field types


@dataclass(frozen=True)
class Expect:
    """What a field allows, in words, for its range errors where its type and bounds alone would say too little."""

    text: str


def _yaml_number(value):
    """YAML 1.1 reads 1e-3 (no dot) as a string and 1 as an int: both are numbers here. A bool is not."""
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            return float(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


# A finite float. allow_inf_nan stands before the conversion so that it is checked first and on the number read:
# optim.lr=.nan is reported as not finite (rather than as not > 0), and errors show inf or -1.0, not the text.
Number = Annotated[float, Field(allow_inf_nan=False), BeforeValidator(_yaml_number)]
Prompt = Annotated[str, Field(pattern=r"\S"), Expect("a non-empty prompt")]
FROM_DATASET = "from_dataset"  # validation.prompts: the dataset's captions or classes (dit_train.validation)


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# --------------------------------------------------------------------------------------------------
# The sections


class MoE(Section):
    """model.moe: a mixture-of-experts feed-forward (ditcore.models.moe.MoEConfig); a key left unset takes
    MoEConfig's default, written beside each."""

    experts: int | None = Field(None, ge=2, description="routed experts per MoE block (default 8)")
    top_k: int | None = Field(None, ge=1, description="experts each token goes to, at most `experts` (default 2)")
    every: int | None = Field(None, ge=1, description="blocks i with (i+1) % every == 0 are MoE: 1 all, 2 every other; "
                                                      "a divisor of the depth (default 1)")
    expert_hidden: int | None = Field(None, ge=0, description="an expert's hidden width; 0: the dense MLP's "
                                                              "(default 0)")
    shared_experts: int | None = Field(None, ge=0, description="always-on experts of that width (default 0)")
    balance_loss: Number | None = Field(None, ge=0, description="coefficient of the load-balancing loss (default "
                                                                "0.01)")
    z_loss: Number | None = Field(None, ge=0, description="coefficient of the router z-loss (default 0.001)")
    normalize: bool | None = Field(None, description="renormalise a token's top_k weights to sum to 1 (default "
                                                     "false)")
    capacity_factor: Number | None = Field(None, gt=0, description="under parallel.ep > 1: slots a rank sends each "
                                                                  "expert-parallel peer, x its even share of the "
                                                                  "rows; the rest dropped, >= ep drops none "
                                                                  "(default 1.25)")


class Model(Section):
    arch: str | None = Field(None, description="a name from ditcore.models.ARCHS; default: the preset's "
                                                "architecture")
    preset: str = Field("DiT-Demo", description="a name from ditcore.models.PRESETS; data-dependent fields come "
                                                "from the dataset")
    patch_size: int | None = Field(None, ge=1, description="overrides the preset's spatial patch")
    patch_size_t: int | None = Field(None, ge=1, description="overrides the preset's temporal patch")
    depth: int | None = Field(None, ge=1, description="overrides the preset's number of blocks")
    pos_embed: Literal["rope", "sincos", "sincos_2d"] = "rope"
    qk_norm: bool = True
    fps_cond: bool = False
    max_grid: Annotated[list[Annotated[int, Field(ge=1)]] | None, Expect("three integers >= 1: T, H, W in tokens")] = (
        Field(None, min_length=3, max_length=3, description="the largest token grid; default: the preset's"))
    num_heads: int | None = Field(None, ge=1, description="overrides the preset's attention heads (an original DiT "
                                                          "checkpoint of a width the paper has no size for needs it)")
    learn_sigma: bool | None = Field(None, description="a learned-Σ head (DiT's: the output doubled, its variance "
                                                       "values trained by edm.loss=ddpm); default: the preset's")
    freq_shift: Literal[0, 1] | None = Field(None, description="the timestep sinusoid: 0 DiT's, 1 diffusers' port; "
                                                               "default: the preset's")
    mlp_norm_eps: Number | None = Field(None, gt=0, lt=1, description="eps of the LayerNorm before each MLP (1e-6 "
                                                                      "DiT's, 1e-5 diffusers' port); default: the "
                                                                      "preset's")
    block_embedders: bool | None = Field(None, description="every block after the first with its own timestep/class/"
                                                           "fps embedders, as diffusers' DiTTransformer2DModel "
                                                           "(off: one set shared, DiT's); default: the preset's")
    moe: MoE | None = Field(None, description="a mixture-of-experts feed-forward on some blocks (model.moe.*); "
                                              "default: dense MLPs")
    compile: bool = Field(False, description="torch.compile each block")
    activation_checkpointing: Literal[LAYOUT_CHOICES["activation_checkpointing"]] = Field(
        "none", description="recompute in backward, for memory: block: each block's whole forward; selective: all "
                            "but its matmuls and attention")
    attention: Literal[("auto", *LAYOUT_CHOICES["attention"])] = Field(
        "auto", description="attention kernels: flex (FlexAttention, block-diagonal masks of packed rows; GPU only "
                            "for training), sdpa (dense masks; unmasked rows use flash), auto: flex on a GPU")
    init_from: str | None = Field(
        None, description="a new run's first weights: a training checkpoint (RUN_DIR/checkpoints/step-XXXXXXX, its "
                          "EMA weights), a run directory (its newest checkpoint, else its export/) or an export "
                          "folder; every tensor whose name and shape match is copied, the others start fresh. "
                          "Or one of the field's DDPM-trained DiTs: an original DiT checkpoint file (.pt, "
                          ".safetensors), a diffusers DiTTransformer2DModel or DiT pipeline folder; the architecture "
                          "is then the "
                          "checkpoint's (a model key set otherwise is an error), and edm.precond/loss auto become "
                          "vp/ddpm. Optimizer, step and schedule start fresh. A resumed run reads it for the "
                          "architecture only")

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, name: str) -> str:
        from ditcore.models import PRESETS  # deferred: it imports torch, and `dit-train --help` imports this module

        if name not in PRESETS:
            raise ConfigError("model.preset", name, "one of " + ", ".join(PRESETS))
        return name

    @field_validator("arch")
    @classmethod
    def _known_arch(cls, name: str | None) -> str | None:
        from ditcore.models import ARCHS  # deferred, as for the preset

        if name is not None and name not in ARCHS:
            kinds = "; ".join(f"{arch.name}: {arch.summary}" for arch in ARCHS.values())
            raise ConfigError("model.arch", name, "one of " + ", ".join(map(repr, ARCHS)) +
                              f" ({kinds}). The preset is one of its sizes; default: the preset's architecture")
        return name

    @model_validator(mode="after")
    def _preset_of_arch(self) -> Model:
        from ditcore.models import ARCHS, PRESETS, arch_of

        if self.arch is None:  # the preset names its architecture
            self.arch = arch_of(PRESETS[self.preset])
        elif arch_of(PRESETS[self.preset]) != self.arch:
            raise ConfigError("model.preset", self.preset,
                              f"a size of model.arch={self.arch}: one of {', '.join(ARCHS[self.arch].presets)}")
        return self


class Data(Section):
    path: str = Field("data/butterflies", description="a dataset written by dit-prepare")
    seq_length: int = Field(256, ge=1, description="tokens per packed row")
    num_workers: int = Field(2, ge=0)
    shuffle_buffer: int = 100
    packing_buffer: int | None = Field(None, description="samples considered together for packing; "
                                                         "default 4 × micro_batch")
    max_skipped_in_a_row: int = Field(1000, ge=1, description="samples the loader may skip in a row (bad, or too "
                                                              "long for seq_length) before the run stops: a dataset "
                                                              "with no usable sample is not read forever")
    val_path: str | None = Field(None, description="the held-out dataset of validation.heldout; default: "
                                                   "data.path/val, which dit-prepare --val-samples N writes (for a "
                                                   "blend: each of its datasets' val/, scored per dataset)")


class Parallel(Section):
    tp: int = Field(1, ge=1)
    cp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1, description="pipeline stages: the blocks split over pp ranks, 1F1B over a step's "
                                         "micro-batches (use global_batch >= pp x micro_batch x dp)")
    sequence_parallel: bool = False
    ep: int = Field(1, ge=1, description="expert parallel: each mixture-of-experts block's experts split over ep "
                                         "consecutive dp x cp ranks (a divisor of dp x cp and of model.moe.experts); "
                                         "tokens beyond model.moe.capacity_factor x an even share are dropped")
    fsdp: bool = Field(False, description="shard parameters, gradients, optimizer state and EMA over the data-parallel "
                                         "x context-parallel ranks (FSDP2), on top of tp/cp")
    reduce_dtype: Literal[LAYOUT_CHOICES["reduce_dtype"]] = Field(
        "fp32", description="with fsdp: the dtype gradients are reduce-scattered in")
    fsdp_shard: int | None = Field(None, ge=1, description="with fsdp: ranks each parameter is sharded over, a divisor "
                                                            "of dp x cp; the groups of that many ranks replicate "
                                                            "each other (HSDP: shard within a node, replicate "
                                                            "across nodes). A group is tp x fsdp_shard consecutive "
                                                            "ranks (Megatron's order tp-cp-dp-pp): one node when "
                                                            "that divides the GPUs per node; null: all dp x cp ranks")
    fsdp_sync: Literal[("auto", *LAYOUT_CHOICES["fsdp_sync"])] = Field(
        "auto", description="with fsdp: gather the parameters and reduce the gradients every micro-batch, or once per "
                            "optimizer step (keeps the unsharded parameters and gradients between micro-batches); "
                            "auto: once per step when the memory plan says it fits")
    devices: int = Field(1, ge=1, description="processes per node when not launched by torchrun (Fabric starts "
                                              "them)")
    accelerator: Literal["auto", "cpu", "gpu"] = "auto"
    timeout_s: Annotated[Number, Expect("seconds > 0")] = Field(
        600.0, gt=0, description="every process group's collective timeout (NCCL's and Megatron's usual 10 "
                                 "min); a lost peer ends the run in one line, exit code 75: relaunch with --resume "
                                 "auto")

    @model_validator(mode="after")
    def _shard_with_fsdp(self) -> Parallel:
        if self.fsdp_shard is not None and not self.fsdp:
            raise ConfigError("parallel.fsdp_shard", self.fsdp_shard, "null without parallel.fsdp=true (it says how "
                                                                      "FSDP shards)")
        return self


class Optim(Section):
    lr: Annotated[Number, Expect("a learning rate > 0")] = Field(1e-4, gt=0)
    weight_decay: Number = Field(0.0, ge=0)
    betas: Annotated[list[Annotated[Number, Field(ge=0, lt=1)]], Expect("two numbers in [0, 1)")] = (
        Field([0.9, 0.999], min_length=2, max_length=2))
    eps: Number = Field(1e-8, gt=0)
    schedule: Literal["cosine", "constant"] = "cosine"
    warmup_steps: int = Field(0, ge=0)
    min_lr_ratio: Number = Field(0.1, ge=0, le=1, description="cosine decays to lr × this")


class VPSchedule(Section):
    """The DDPM schedule of a network under VP preconditioning (ditcore.diffusion.vp.DiscreteVP); DiT's by default.
    A foreign model.init_from brings its own."""

    timesteps: int = Field(1000, ge=2)
    beta_start: Number = Field(1e-4, gt=0, lt=1)
    beta_end: Number = Field(0.02, gt=0, lt=1)
    beta_schedule: Literal[BETA_SCHEDULES] = "linear"

    def schedule(self):
        from ditcore.diffusion.vp import DiscreteVP  # deferred: it imports torch

        return DiscreteVP(self.timesteps, self.beta_start, self.beta_end, self.beta_schedule)


class EDM(Section):
    precond: Literal[("auto", *PRECONDS)] = Field(
        "auto", description="the network's preconditioning: edm (Karras et al.), or vp (a DDPM ε-network on its "
                            "discrete timesteps, edm.vp); auto: vp when model.init_from is a DDPM-trained network "
                            "(the field's DiTs, or a run fine-tuned from one), else edm")
    loss: Literal[("auto", *LOSSES)] = Field(
        "auto", description="edm (log-normal σ, weight λ(σ); under vp, σ rounded to the network's levels) or ddpm "
                            "(DiT's: uniform timesteps, ε-MSE, plus the variational bound for learned Σ); auto: "
                            "ddpm under precond vp, else edm")
    vp: VPSchedule = VPSchedule()
    p_mean: Number = Field(-1.2, description="training noise levels: ln σ ~ N(p_mean, p_std²)")
    p_std: Number = Field(1.2, gt=0)
    prediction: Literal[PREDICTIONS] = Field("edm", description="what the network outputs: edm (EDM's mix of "
                                                                "noise and data; under precond vp the noise) or x "
                                                                "(the clean latents; not with vp)")
    max_weight: Number | None = Field(None, gt=0, description="cap on the loss weight λ(σ) = (σ² + σ_d²)/(σ σ_d)²; "
                                                              "use with prediction x (e.g. 30)")
    cfg_dropout: Annotated[Number, Expect("a probability in [0, 1)")] = (
        Field(0.1, ge=0, lt=1, description="per sample: drop the text or class so the model also learns the "
                                           "unconditional"))
    ema_decay: Number = Field(0.999, ge=0, lt=1)


class Flow(Section):
    """Rectified flow (objective: flow): x_t = (1 − t) x₀ + t ε, the network predicts the velocity ε − x₀ and is
    trained on its plain mean squared error (ditcore.diffusion.flow). edm.cfg_dropout and edm.ema_decay apply to it
    as to EDM."""

    prediction: Literal[FLOW_PREDICTIONS] = Field("velocity", description="what the network outputs: velocity "
                                                                      "(ε − x₀, SD3's and Wan's) or x (the clean "
                                                                      "latents, v = (x_t − x̂₀)/max(t, 0.05): Li & "
                                                                      "He's, for pixels or small latents)")
    t_dist: Literal[T_DISTRIBUTIONS] = Field("logit_normal", description="training t per sample: logit_normal (SD3: "
                                                                  "t = sigmoid(N(t_mean, t_std²))) or uniform")
    t_mean: Number = Field(0.0, description="logit_normal's mean")
    t_std: Number = Field(1.0, gt=0, description="logit_normal's std")
    shift: Number = Field(1.0, gt=0, description="constant timestep shift s, t' = s t/(1 + (s − 1) t), in training "
                                                 "and sampling alike (Wan 2.1: 5 at 720p, 3 at 480p; SD3: 3); 1: none")
    dynamic_shift: bool = Field(False, description="shift by each sample's token count instead (Flux): mu from "
                                                   "base_shift at base_seq_len to max_shift at max_seq_len tokens, "
                                                   "t' = e^mu/(e^mu + 1/t − 1)")
    base_shift: Number = 0.5
    max_shift: Number = 1.15
    base_seq_len: int = Field(256, ge=1)
    max_seq_len: int = Field(4096, ge=2)

    @model_validator(mode="after")
    def _lengths_in_order(self) -> Flow:
        if self.dynamic_shift and self.shift != 1:
            raise ConfigError("flow.shift", self.shift, "1 (unset) with flow.dynamic_shift=true: the shift is then "
                                                        "each sample's, from its token count (diffusers ignores a "
                                                        "constant shift beside it)")
        if self.base_seq_len >= self.max_seq_len:
            raise ConfigError("flow.base_seq_len", self.base_seq_len,
                              f"less than flow.max_seq_len={self.max_seq_len}")
        return self

    def time_shift(self):
        """The ditcore.diffusion.flow.TimeShift these keys describe."""
        from ditcore.diffusion.flow import TimeShift  # deferred: it imports torch, and --help imports this module

        return TimeShift(shift=float(self.shift), dynamic=self.dynamic_shift, base_shift=float(self.base_shift),
                         max_shift=float(self.max_shift), base_seq_len=self.base_seq_len,
                         max_seq_len=self.max_seq_len)


class Train(Section):
    run_dir: str = "runs/demo"
    steps: int = Field(1000, ge=1)
    global_batch: int = Field(8, ge=1, description="packed rows per optimizer step, over all data-parallel ranks")
    micro_batch: int = Field(8, ge=1, description="packed rows per forward pass on one rank")
    precision: Literal[("auto", *LAYOUT_CHOICES["precision"])] = Field(
        "auto", description="auto: bf16 autocast on GPU, fp32 on CPU")
    grad_clip: Number = Field(1.0, ge=0, description="0 disables clipping")
    seed: int = 0
    stop_at: int | None = Field(None, ge=1, description="stop with a checkpoint after this step, as a preemption "
                                                        "would; unset: run to train.steps")


class Checkpoint(Section):
    every: int = Field(500, ge=1, description="steps; a checkpoint is also written at the end and on "
                                              "SIGTERM/SIGUSR1")
    keep: int = Field(3, ge=1, description="newest complete checkpoints kept")


class HeldOut(Section):
    """The EDM loss of held-out samples at fixed noise levels, at every validation: a curve comparable between
    windows, runs and resumes (the training loss mixes σ drawn at random)."""

    samples: int = Field(64, ge=0, description="held-out samples (the first of data.val_path) scored at every "
                                               "validation; 0: no held-out loss")
    buckets: int = Field(8, ge=1, le=64, description="noise levels, log-spaced from sigma_min to sigma_max (flow: "
                                                     "times t, evenly spaced, ditcore.eval.heldout.t_buckets)")
    sigma_min: Number = Field(0.002, gt=0)
    sigma_max: Number = Field(80.0, gt=0)
    seed: int = Field(0, description="the held-out noise: the same at every validation and across resumes")
    every: int = Field(0, ge=0, description="steps between held-out losses (a few forward passes, far cheaper than "
                                            "sampling); 0: at every validation (validation.every and the end)")

    @model_validator(mode="after")
    def _levels_in_order(self) -> HeldOut:
        if self.sigma_min >= self.sigma_max:
            raise ConfigError("validation.heldout.sigma_min", self.sigma_min,
                              f"less than validation.heldout.sigma_max={self.sigma_max}")
        return self


class FID(Section):
    """FID (Inception features) or FD (DINOv2 features) of samples of the EMA weights against the dataset, at every
    validation (ditcore.eval)."""

    num: int = Field(0, ge=0, description="samples scored at every validation, over all ranks; 0: no FID")
    features: Literal[FEATURES] = Field("inception", description="inception: FID as the DiT papers "
                                                                              "report it; dinov2: FD_DINOv2")
    weights: str | None = Field(None, description="inception: a local copy of torch-fidelity's pt_inception weights "
                                                  "(default: downloaded once); dinov2: a hub id or save_pretrained "
                                                  "folder (default facebook/dinov2-large)")


class Validation(Section):
    every: int = Field(0, ge=0, description="steps between sampling the prompts with the EMA weights; 0: only at "
                                            "the end")
    prompts: list[Prompt] | Literal[FROM_DATASET] = (  # checked by _prompts_or_from_dataset
        Field(["a red butterfly", "a blue butterfly"], description=(
            "what to sample: a list of prompts, or from_dataset: dataset_prompts distinct captions of data.path, "
            "drawn with validation.seed from its first 2000 samples (shards in name order). A class-conditional "
            "model samples classes instead, each named by the dataset's class name: the classes the prompts name, "
            "else (and with from_dataset) classes 0, 1, ... up to 16. dit-train warns when the prompts share no word "
            "with the dataset's captions")))
    dataset_prompts: int = Field(8, ge=1, le=64, description="with prompts: from_dataset, the captions drawn (fewer "
                                                             "when the dataset has fewer distinct ones)")
    steps: int = Field(18, ge=1)
    guidance: Number = 4.0
    solver: Literal[SAMPLE_SOLVERS] = Field("heun", description="heun or euler; unipc (flow only: diffusers' UniPC "
                                                                "multistep scheduler, as Wan samples)")
    frames: int = Field(1, ge=1, description="pixel frames of each sample; 1: an image")
    clip_frames: int = Field(0, ge=0, description="> 0: also sample every prompt as a clip of this many frames "
                                                  "(mp4); 0: no clips")
    size: int | None = Field(64, ge=8, description="pixel height and width; null: the dataset's, the shorter "
                                                    "side of its most common image shape")
    fps: Number = Field(8.0, gt=0)
    seed: int = 0
    seeds: int = Field(1, ge=1, le=64, description="samples of every prompt, with seeds seed, seed + 1, ...: the "
                                                   "contact sheet samples/grid.png shows prompts x seeds")
    heldout: HeldOut = HeldOut()
    fid: FID = FID()

    @field_validator("prompts", mode="before")
    @classmethod
    def _prompts_or_from_dataset(cls, value):
        """The list, or the word from_dataset, checked here whole: pydantic's errors for a union of the two name
        neither the item nor what is allowed."""
        if value == FROM_DATASET:
            return value
        if isinstance(value, str):
            raise ConfigError("validation.prompts", value, f"a list of str ([{value}] for one prompt), or "
                                                           f"{FROM_DATASET}: captions of the dataset")
        if not isinstance(value, list) or not value:
            raise ConfigError("validation.prompts", value, f"a non-empty list of non-empty prompts, or {FROM_DATASET}")
        for i, prompt in enumerate(value):
            if not isinstance(prompt, str):
                raise ConfigError(f"validation.prompts[{i}]", prompt, "a string")
            if not prompt.strip():
                raise ConfigError(f"validation.prompts[{i}]", prompt, "a non-empty prompt")
        return value


class WandB(Section):
    """Weights & Biases: the same figures as the CSV and TensorBoard logs, the contact sheet and the config."""

    project: str | None = Field(None, description="a W&B project; unset: no W&B (wandb is not imported)")
    entity: str | None = Field(None, description="the W&B team or user; unset: the login's default")
    mode: Literal["online", "offline"] = Field("online", description="offline: run files under RUN_DIR/wandb only, "
                                                                     "for `wandb sync` later")


class Logging(Section):
    every: int = Field(10, ge=1)
    csv: bool = True
    tensorboard: bool = True
    wandb: WandB = WandB()


class TrainConfig(Section):
    objective: Literal[("auto", *OBJECTIVES)] = Field(
        "auto", description="edm (Karras et al.: the edm section) or flow (rectified flow: the flow section); auto: "
                            "the objective model.init_from's network was trained with (flow for a Wan model), else "
                            "edm")
    model: Model = Model()
    data: Data = Data()
    parallel: Parallel = Parallel()
    optim: Optim = Optim()
    edm: EDM = EDM()
    flow: Flow = Flow()
    train: Train = Train()
    checkpoint: Checkpoint = Checkpoint()
    validation: Validation = Validation()
    logging: Logging = Logging()

    @model_validator(mode="after")
    def _whole_micro_batches(self) -> TrainConfig:
        """Relations between fields; the world size is checked at launch."""
        if self.train.global_batch % self.train.micro_batch:
            raise ConfigError("train.global_batch", self.train.global_batch,
                              f"a multiple of train.micro_batch={self.train.micro_batch}")
        if self.edm.precond == "vp" and self.edm.prediction == "x":
            raise ConfigError("edm.prediction", "x", "edm with edm.precond=vp: a DDPM network predicts the noise")
        if self.objective == "flow":
            self._flow_alone()
        if self.edm.precond == "edm" and self.edm.loss == "ddpm":
            raise ConfigError("edm.loss", "ddpm", "auto or edm with edm.precond=edm: DiT's objective trains a DDPM "
                                                  "network on its timesteps (edm.precond=vp)")
        return self

    def _flow_alone(self) -> None:
        """objective flow with an EDM-only choice set: one line naming it (flow has no preconditioning or
        prediction choices of its own: the network predicts the velocity)."""
        for key, value, edm_only in (("precond", self.edm.precond, "vp"), ("loss", self.edm.loss, "ddpm"),
                                     ("prediction", self.edm.prediction, "x")):
            if value == edm_only:
                raise ConfigError(f"edm.{key}", value, "unset with objective=flow: a flow network predicts the "
                                                       "velocity ε − x₀ under its own loss (the flow section)")

    def to_dict(self) -> dict:
        return self.model_dump()

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# --------------------------------------------------------------------------------------------------
# Reading


def load_config(path: str | Path | None, overrides: list[str] = ()) -> TrainConfig:
    data = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError("--config", str(path), "an existing YAML file, or a shipped config name: "
                                                     + ", ".join(SHIPPED_NAMES))
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
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as e:
        raise _config_error(e) from None


# --------------------------------------------------------------------------------------------------
# Pydantic's errors in the words of ConfigError

_RANGE_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal", "too_short", "too_long",
                 "string_pattern_mismatch"}
_SYMBOLS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
_TYPE_WORDS = {int: "an integer", float: "a finite number", bool: "true or false", str: "a string"}


def _config_error(error: ValidationError) -> ConfigError:
    """The first of pydantic's errors as a ConfigError: its location as a dotted key (list items as key[i]), the
    value read, and what the field allows."""
    first = error.errors()[0]
    kind, loc, value, ctx = first["type"], first["loc"], first["input"], first.get("ctx", {})
    if isinstance(ctx.get("error"), ConfigError):  # a rule that Field cannot express names its key itself
        return ctx["error"]
    key = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".")
    section, field = _locate(loc)
    if kind == "extra_forbidden":
        return ConfigError(key, value, "one of the known keys: " + ", ".join(section.model_fields))
    if kind == "model_type":
        return ConfigError(key, value, "a mapping of keys")
    return ConfigError(key, value, _allowed(field, kind))


def _locate(loc: tuple) -> tuple[type[Section], FieldInfo | None]:
    """The section that holds what loc points to, and its field (a list item as a FieldInfo; None if unknown)."""
    section, field = TrainConfig, None
    for part in loc:
        if field is not None and isinstance(field.annotation, type) and issubclass(field.annotation, Section):
            section = field.annotation
        if isinstance(part, int):
            items, _ = _without_none(field.annotation)
            field = FieldInfo.from_annotation(get_args(items)[0])
        else:
            field = section.model_fields.get(part)
    return section, field


def _allowed(field: FieldInfo, kind: str) -> str:
    """What the field allows, in words: its type, or for a range error its Expect or its bounds."""
    annotation, nullable = _without_none(field.annotation)
    expect = next((m.text for m in field.metadata if isinstance(m, Expect)), None)
    if kind in _RANGE_ERRORS:
        text = expect or f"{'an integer' if annotation is int else 'a number'} {_bounds(field.metadata)}"
    elif get_origin(annotation) is Literal:
        text = "one of " + ", ".join(map(repr, get_args(annotation)))
    elif get_origin(annotation) is list:
        items = FieldInfo.from_annotation(get_args(annotation)[0]).annotation
        text = f"a list of {items.__name__}"
    else:
        text = _TYPE_WORDS[annotation]
    if nullable:
        text += ", or null"
    return f"{text} ({field.description})" if field.description else text


def _bounds(metadata: list) -> str:
    """'>= 1', '> 0' or 'in [0, 1)' from a field's Field(ge=, gt=, le=, lt=)."""
    limits = {name: getattr(m, name) for m in metadata for name in _SYMBOLS if hasattr(m, name)}
    if len(limits) == 1:
        ((name, limit),) = limits.items()
        return f"{_SYMBOLS[name]} {limit}"
    low, high = limits.get("ge", limits.get("gt")), limits.get("le", limits.get("lt"))
    return f"in {'[' if 'ge' in limits else '('}{low}, {high}{']' if 'le' in limits else ')'}"


def _without_none(annotation) -> tuple:
    """(T, True) for `T | None`, else (annotation, False)."""
    args = get_args(annotation)
    if get_origin(annotation) in (Union, types.UnionType) and type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        return inner, True
    return annotation, False


# --------------------------------------------------------------------------------------------------
# The job's layout (ditcore.job.Layout): which key sets each of its fields. Read both ways: a config's Layout
# (`memory_layout`), a Layout's changes as overrides (`overrides`), and the key of a field ditcore's errors name
# (`in_config_keys`).

LAYOUT_KEYS = {"tp": "parallel.tp", "cp": "parallel.cp", "pp": "parallel.pp",
               "sequence_parallel": "parallel.sequence_parallel", "ep": "parallel.ep", "fsdp": "parallel.fsdp",
               "reduce_dtype": "parallel.reduce_dtype", "fsdp_shard": "parallel.fsdp_shard",
               "fsdp_sync": "parallel.fsdp_sync", "micro_batch": "train.micro_batch", "seq_length": "data.seq_length",
               "precision": "train.precision", "activation_checkpointing": "model.activation_checkpointing",
               "attention": "model.attention", "compile": "model.compile"}
# What a config sets but not one key: tp*cp*pp, the parallel section as a whole (ditcore.parallel.dims).
ERROR_KEYS = LAYOUT_KEYS | {"model_parallel": "parallel"}


def in_config_keys(error: ConfigError) -> ConfigError:
    """A ConfigError of ditcore's, which names a Layout field, as one that names the config key setting it."""
    return ConfigError(ERROR_KEYS.get(error.key, error.key), error.value, error.allowed)


def overrides(changes: dict) -> list[str]:
    """Layout fields' values as the overrides that set them: {"fsdp": True} → ["parallel.fsdp=true"]."""
    text = lambda v: "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)
    return [f"{LAYOUT_KEYS[field]}={text(value)}" for field, value in changes.items()]


def _key(cfg: TrainConfig, key: str):
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def memory_layout(cfg: TrainConfig, world_size: int, text_len: int, fsdp_sync: str | None = None):
    """The ditcore.job.Layout of a training config on world_size GPUs (bf16 unless train.precision=fp32), its errors
    naming the config's keys. fsdp_sync: what parallel.fsdp_sync=auto was resolved to (ditcore.memory.choose_fsdp_sync);
    unresolved, auto is planned as micro_batch."""
    from ditcore.job import Layout

    given = {field: _key(cfg, key) for field, key in LAYOUT_KEYS.items()}
    # what dit-train decides when a key says auto: the GPU's kernels and precision, the sync the plan chooses
    given["fsdp_sync"] = fsdp_sync or (given["fsdp_sync"] if given["fsdp_sync"] != "auto" else "micro_batch")
    given["precision"] = "fp32" if given["precision"] == "fp32" else "bf16"
    given["attention"] = "sdpa" if given["attention"] == "sdpa" else "flex"
    p = cfg.parallel
    dp = max(1, world_size // (p.tp * p.cp * p.pp))  # a world size that does not fit is refused by Layout
    try:
        return Layout(world_size=world_size, text_len=text_len,
                      micro_batches=max(1, cfg.train.global_batch // (cfg.train.micro_batch * dp)), **given)
    except ConfigError as e:
        raise in_config_keys(e) from None
