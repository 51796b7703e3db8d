"""The training loop: setup → build → resume → fit (train_step: accumulate, clip, step, EMA; log, checkpoint,
validate) → export. `train()` reads as that list."""

from __future__ import annotations

import math
import os
import time
from collections import Counter
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from lightning_fabric import Fabric
from lightning_fabric.loggers import CSVLogger
from lightning_fabric.plugins.environments import (
    ClusterEnvironment,
    LightningEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
)
from tqdm import tqdm

from dit_train import checkpoint, rundir
from dit_train.config import TrainConfig, memory_layout
from dit_train.evaluation import FIDScorer
from dit_train.heldout import HeldOutLoss
from dit_train.media_log import TensorBoard, log_samples
from dit_train.metrics import BlendWindow, Metrics, bar_postfix, drawn_counts
from dit_train.plots import plot_heldout, plot_losses
from dit_train.preemption import Preempted, sample_command
from dit_train.recipe import Recipe, model_config, resolve  # noqa: F401 (model_config: where it was before)
from dit_train.validation import Validator, resolve_validation
from ditcore import durable, init_from, runs
from ditcore.codecs.text import max_text_tokens
from ditcore.data import blend
from ditcore.data.fit import fit_report
from ditcore.data.loader import build_loader, check_samples_fit, next_batch
from ditcore.data.packing import PackedBatch
from ditcore.data.schema import DatasetInfo, read_info
from ditcore.diffusion import EMA, EDMPrecond
from ditcore.errors import ConfigError
from ditcore.export import describe, export_model
from ditcore.flops import batch_flops, gpu_peak_flops, measure_cpu_peak_flops
from ditcore.models import DiTConfig, check_compiled, inputs_of
from ditcore.models.layers import check_positions
from ditcore.models.moe import Routing, routing_metrics
from ditcore.parallel import (
    ParallelDims,
    ParallelGroups,
    build_parallel_model,
    clip_grad_norm_,
    connections,
    finalize_grads,
    fsdp,
    gather_full,
)
from ditcore.parallel.consolidate import without_extra_state
from ditcore.parallel.fabric import MegatronStrategy
from ditcore.parallel.pipeline import one_f_one_b, reduce_grads
from ditcore.parallel.watchdog import Watchdog, raise_on_nccl_timeout
from ditcore.training import (
    LatentMap,
    Loss,
    StepDraw,
    WithLoss,
    aux_loss,
    draw,
    routing_of,
    stage_forward,
    step_generator,
)


class Diverged(RuntimeError):
    """The loss became NaN or infinite: stopping, without a checkpoint of the broken weights."""


def prepare_run_dir(run_dir: Path) -> None:
    """Create RUN_DIR, or say why it cannot be (before any process group or model exists)."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError("train.run_dir", str(run_dir), "a folder path (this is a file)")
    try:
        durable.make_writable_dir(run_dir)
    except OSError as e:
        raise ConfigError("train.run_dir", str(run_dir), f"a folder this user can write ({e.strerror})") from None


def lr_lambda(cfg: TrainConfig):
    o, steps = cfg.optim, cfg.train.steps

    def factor(step: int) -> float:
        if step < o.warmup_steps:
            return (step + 1) / o.warmup_steps
        if o.schedule == "constant":
            return 1.0
        progress = (step - o.warmup_steps) / max(1, steps - o.warmup_steps)
        return o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def cluster_environment() -> ClusterEnvironment:
    """Who started the processes, from the variables the launcher set: torchrun (train.sbatch runs one per node, under
    Slurm too), srun starting every process itself (SLURM_NTASKS, outside an interactive allocation), or nobody
    (Fabric starts parallel.devices). Fabric's own choice (less LSF and MPI, launchers dit-train has no use for),
    without its SLURMEnvironment.detect(), which warns "The `srun` command is available ... prepend your python
    command with srun" on every run started without srun or torchrun where Slurm is installed (a login node, a
    workstation): wrong advice for dit-train, whose Slurm path is train.sbatch's torchrun."""
    if TorchElasticEnvironment.detect():
        return TorchElasticEnvironment()
    if "SLURM_NTASKS" in os.environ and os.environ.get("SLURM_JOB_NAME") not in ("bash", "interactive"):
        return SLURMEnvironment()  # srun was used, so it does not warn
    return LightningEnvironment()


class OneVoiceFabric(Fabric):
    """Fabric whose `print` speaks from global rank 0 only. Fabric's own prints on every node's local rank 0: on
    two nodes each line would appear twice in the job's log."""

    def print(self, *args, **kwargs) -> None:
        if self.is_global_zero:
            print(*args, **kwargs)


@dataclass
class Setup:
    """What the run is: config, dataset, processes and layout. The same on every rank."""

    cfg: TrainConfig  # edm.precond/loss/vp resolved (dit_train.recipe)
    info: DatasetInfo
    fabric: Fabric
    groups: ParallelGroups
    model_cfg: DiTConfig
    accum: int  # micro-batches per optimizer step on each rank
    on_gpu: bool
    bf16: bool
    loggers: list
    recipe: Recipe  # preconditioning, objective and latent units; model.init_from's weights, read once
    fsdp_sync: str = "micro_batch"  # parallel.fsdp_sync, auto resolved (`choose_fsdp_sync`)

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.train.run_dir)


@dataclass
class Trainee:
    """What training changes, and what it reads from: model, optimizer, EMA, data."""

    model: torch.nn.Module  # wrapped by Fabric (DDP over DP×CP); .module is the parallelized DiT
    ema: EMA
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    loader: object
    loss_fn: Loss
    denoiser: EDMPrecond  # the model, preconditioned
    latent_map: LatentMap | None  # dataset units → the network's, on the device; None where they are the same
    state: dict  # what a checkpoint holds: the above, the step and the loss history
    blend_window: BlendWindow | None = None  # the logged figures of a blend's datasets; None for one dataset


def train(cfg: TrainConfig, resume: str = "auto", overwrite: bool = False) -> dict:
    run = setup(cfg, resume, overwrite)
    # from here on a lost peer ends this process in one line, exit code 75 (ditcore.parallel.watchdog)
    with Watchdog(run.cfg.parallel.timeout_s, newest=lambda: runs.newest(run.run_dir), rank=run.fabric.global_rank,
                  world_size=run.fabric.world_size) as watchdog:
        heldout = HeldOutLoss.build(run)  # read and packed once, here; refused before anything is built
        trainee = build(run, checkpoint.blend_order(run.run_dir, resume))
        # compared, and saved with every checkpoint, resolved: a resume whose auto would resolve otherwise is refused
        ckpt = checkpoint.resume(run.fabric, run.run_dir, resume, trainee.state, trainee.loader, run.cfg)  # verified
        if ckpt is not None:
            run.fabric.print(f"resumed from {ckpt} at step {trainee.state['step']}")
            if cfg.model.init_from:
                run.fabric.print(f"note: model.init_from={cfg.model.init_from} is ignored: the run continues from its "
                                 "own checkpoint (init_from gives a new run its first weights)")
        elif cfg.model.init_from:
            start_from(run, trainee)
        if run.recipe.source is not None:
            run.recipe.source.tensors.clear()  # the host copy of model.init_from's weights is not read again
        validator = Validator(run.cfg, run.info, run.model_cfg, run.fabric, run.groups, network=run.recipe.sampling(),
                              stats=run.recipe.latent_stats)
        scorer = FIDScorer(run.cfg, run.info, run.model_cfg, run.fabric, run.groups, network=run.recipe.sampling(),
                           stats=run.recipe.latent_stats)  # the reference statistics: computed here once, or read
        # until the export is written
        preempted = Preempted(run.fabric.world_size, run.on_gpu, run.fabric.global_rank, run.groups.timeout,
                              run.run_dir, partial(sample_command, prompts=run.cfg.validation.prompts,
                                                   num_classes=run.model_cfg.num_classes))
        try:
            result = fit(run, trainee, validator, run.cfg.to_yaml(), preempted, heldout, scorer, watchdog)
            result["rank"] = run.fabric.global_rank
            if not result["stopped"]:
                result["samples"] = export(run, trainee, validator, heldout, scorer)
            return result
        except BaseException as e:
            watchdog.lost(e)  # a lost peer: the process ends here, before the loggers' last writes could delay it
            raise
        finally:
            for logger in run.loggers:  # whatever ended the run, every logged value is on disk
                logger.finalize("success")
            preempted.close()  # after: a signal meanwhile is recorded, not raised in the middle of a logger's writes


def setup(cfg: TrainConfig, resume: str = "auto", overwrite: bool = False) -> Setup:
    """Check the dataset and run directory (and hold it: dit_train.rundir), start the processes and their groups,
    check the layout fits."""
    run_dir = Path(cfg.train.run_dir)
    info = read_info(cfg.data.path)  # fails early, on every rank, if the dataset is missing or unfinished
    recipe = resolve(cfg, info)  # the architecture too, where model.init_from is one of the field's DiTs
    cfg, model_cfg = recipe.cfg, recipe.model_cfg
    # the prompts and size the dataset gives (its captions or classes): what is saved, sampled, scored and exported
    cfg = resolve_validation(cfg, info, model_cfg)
    dims = ParallelDims(cfg.parallel.tp, cfg.parallel.cp, cfg.parallel.pp,
                        sequence_parallel=cfg.parallel.sequence_parallel, ep=cfg.parallel.ep)
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", cfg.parallel.devices))
    # before the first CUDA call, which reads it; the processes Fabric starts inherit it
    queues_warning = connections.apply(dims, int(os.environ.get("WORLD_SIZE", devices)), cfg.parallel.fsdp)
    on_gpu = torch.cuda.is_available() and cfg.parallel.accelerator != "cpu"
    if cfg.model.attention == "flex" and not on_gpu:
        raise ConfigError("model.attention", "flex", "auto or sdpa on a CPU: FlexAttention has no CPU backward "
                                                     "(auto picks flex on a GPU)")
    bf16 = cfg.train.precision == "bf16" or (cfg.train.precision == "auto" and on_gpu)
    prepare_run_dir(run_dir)
    claim = rundir.claim(run_dir, resume, overwrite, cfg)  # the lock, before anything is written into the run dir
    loggers = make_loggers(cfg, run_dir, rundir.csv_version(run_dir), resume)
    if on_gpu:
        raise_on_nccl_timeout()  # so that a lost peer's timed-out collective is reported, not torn down
    strategy = MegatronStrategy(dims, fsdp=cfg.parallel.fsdp, timeout=timedelta(seconds=cfg.parallel.timeout_s),
                                cluster_environment=cluster_environment())
    num_nodes = int(os.environ.get("WORLD_SIZE", devices)) // devices  # torchrun on several nodes
    fabric = OneVoiceFabric(accelerator="cuda" if on_gpu else "cpu", devices=devices, num_nodes=num_nodes,
                            strategy=strategy, precision="bf16-mixed" if bf16 else "32-true", loggers=loggers)
    fabric.launch()
    claim.agree(fabric)  # under torchrun, the other processes learn here whether the first one holds the run dir
    if queues_warning and on_gpu:
        fabric.print(queues_warning)
    groups = strategy.groups
    if recipe.foreign:
        fabric.print(recipe.foreign_line())
    dims.check_model(model_cfg.num_heads, cfg.data.seq_length, model_cfg.depth, model_cfg.kv_heads,
                     moe=model_cfg.moe)
    if cfg.parallel.fsdp:
        groups.dims.check_fsdp_shard(cfg.parallel.fsdp_shard)
    gpu = torch.cuda.get_device_properties(fabric.device).total_memory if on_gpu else None
    text_len = max_text_tokens(info.text_encoder["name"]) if model_cfg.text_dim else 0  # one longest caption a row
    fsdp_sync = choose_fsdp_sync(cfg, model_cfg, fabric, gpu, text_len)
    if on_gpu:
        check_memory_plan(cfg, model_cfg, fabric.world_size, gpu, text_len, fsdp_sync)
    for name, root, data_info in blend.datasets(cfg.data.path, info):  # the dataset, or each one of a blend
        check_samples_fit(data_info, root, patch_size=model_cfg.patch_size, patch_size_t=model_cfg.patch_size_t,
                          seq_length=cfg.data.seq_length)  # refuses a dataset none of whose samples fits
        if name:
            fabric.print(f"blend     {name}: {root}")
        for line in fit_report(data_info, patch_size=model_cfg.patch_size, patch_size_t=model_cfg.patch_size_t,
                               seq_length=cfg.data.seq_length, micro_batch=cfg.train.micro_batch,
                               num_workers=cfg.data.num_workers):
            fabric.print(line)
    accum = cfg.train.global_batch // (cfg.train.micro_batch * groups.dims.dp)
    if accum * cfg.train.micro_batch * groups.dims.dp != cfg.train.global_batch:
        raise ValueError(f"train.global_batch={cfg.train.global_batch} is not a multiple of train.micro_batch="
                         f"{cfg.train.micro_batch} x data-parallel size {groups.dims.dp}")
    return Setup(cfg, info, fabric, groups, model_cfg, accum, on_gpu, bf16, loggers, recipe, fsdp_sync)


def make_loggers(cfg: TrainConfig, run_dir: Path, segment: str, resume: str = "auto") -> list:
    """The metrics loggers of this process's part of the run (`segment`: run-<start time>; a resume starts another);
    `resume` (--resume) says whether it continues a checkpoint, whose W&B run it then continues."""
    loggers = []
    if cfg.logging.csv:
        # written at every log call (Lightning's default buffers 100 calls, so that any stop before train.steps
        # lost them): each window is on disk when it is logged, whatever ends the run afterwards
        loggers.append(CSVLogger(str(run_dir), name=runs.CSV, version=segment, flush_logs_every_n_steps=1))
    if cfg.logging.tensorboard:
        # TensorBoard names a run by its folder under --logdir: RUN_DIR/tensorboard/<run dir's name>/<segment> shows
        # as "demo/run-20260101-120000" (with --logdir RUN_DIR/tensorboard, as `make demo` says), not "."; each
        # resumed segment is a run of its own, so a branch that repeats steps is not drawn over its parent's curve
        name = Path(run_dir).resolve().name or "run"  # train.run_dir=. names the current folder
        loggers.append(TensorBoard(str(run_dir), name=runs.TENSORBOARD, version=f"{name}/{segment}"))
    if cfg.logging.wandb.project:
        from dit_train.wandb_logger import WandBLogger  # imports wandb, when it starts its run

        resuming = bool(checkpoint.resolve_resume(run_dir, resume))
        loggers.append(WandBLogger(cfg.logging.wandb, run_dir, cfg.to_dict(), resuming))
    return loggers


def choose_fsdp_sync(cfg: TrainConfig, model_cfg: DiTConfig, fabric: Fabric, gpu: int | None, text_len: int) -> str:
    """parallel.fsdp_sync, with auto resolved (ditcore.memory.choose_fsdp_sync: once per step where the memory plan
    with it fits the GPU's `gpu` bytes; on a CPU, None, always) and said once. text_len: text tokens a row."""
    from ditcore.memory import GiB
    from ditcore.memory import choose_fsdp_sync as choose

    if not cfg.parallel.fsdp or cfg.parallel.fsdp_sync != "auto":
        return "micro_batch" if cfg.parallel.fsdp_sync == "auto" else cfg.parallel.fsdp_sync
    layout = memory_layout(cfg, fabric.world_size, text_len)
    sync = choose(model_cfg, layout, gpu).fsdp_sync
    why = (f"the memory plan with step sync {'fits' if sync == 'step' else 'does not fit'} {gpu / GiB:.1f} GiB"
           if gpu is not None else "on a CPU")
    fabric.print(f"parallel.fsdp_sync=auto: {sync} ({why}): FSDP gathers the parameters and reduces the gradients "
                 + ("once per optimizer step" if sync == "step" else "every micro-batch"))
    return sync


def check_memory_plan(cfg: TrainConfig, model_cfg: DiTConfig, world_size: int, gpu: int, text_len: int,
                      fsdp_sync: str | None = None) -> None:
    """Refuse, before any weight is allocated, a layout whose memory plan (ditcore.memory) exceeds a GPU of `gpu` bytes
    after the headroom that `dit-train --plan` keeps (ditcore.memory.HEADROOM)."""
    from ditcore.memory import HEADROOM, GiB, plan_from

    layout = memory_layout(cfg, world_size, text_len, fsdp_sync)
    plan = plan_from(model_cfg, layout)
    if not plan.fits(gpu, HEADROOM):
        raise ConfigError("parallel", layout.describe(),
                          f"a layout that fits {gpu / GiB:.1f} GiB per GPU: this one needs {plan.total / GiB:.1f} GiB, "
                          f"more than the {HEADROOM.usable(gpu) / GiB:.1f} GiB usable after {HEADROOM} — run "
                          f"dit-train --plan --world-size {world_size} --gpu-memory {gpu / GiB:.1f} with the same "
                          "config to see where it goes and what to change")


def build(run: Setup, first: tuple[str, ...] = ()) -> Trainee:
    """The model (same seed on every rank, then sharded), EMA, optimizer, schedule and data loader. first: the
    datasets of a blend the checkpoint to resume read, in its loader's order (checkpoint.blend_order)."""
    cfg, fabric, groups, model_cfg = run.cfg, run.fabric, run.groups, run.model_cfg
    torch.manual_seed(cfg.train.seed)
    model = build_model(run, training=True)
    # FSDP's model cannot be deep-copied: the EMA gets a second one, sharded the same way
    ema = EMA(model, cfg.edm.ema_decay, module=build_model(run, training=False) if cfg.parallel.fsdp else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=tuple(cfg.optim.betas),
                                  eps=cfg.optim.eps, weight_decay=cfg.optim.weight_decay,
                                  fused=run.on_gpu or None)  # one kernel for all parameters on a GPU
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    # A sharded model is on its device already; moving it would swap its parameters (and drop their TP tags)
    model, optimizer = fabric.setup(model, optimizer, move_to_device=not cfg.parallel.fsdp)
    if not cfg.parallel.fsdp:
        ema.module.to(fabric.device)
    loader = build_loader(cfg.data.path, patch_size=model_cfg.patch_size, patch_size_t=model_cfg.patch_size_t,
                          seq_length=cfg.data.seq_length, batch_size=cfg.train.micro_batch,
                          num_workers=cfg.data.num_workers, dp_rank=groups.dp_rank, dp_size=groups.dims.dp,
                          dp_group=groups.dp_group, shuffle_buffer_size=cfg.data.shuffle_buffer,
                          packing_buffer_size=cfg.data.packing_buffer, seed=cfg.train.seed,
                          text_multiple=128 if run.on_gpu else 1,  # 128: FlexAttention's key block
                          max_skipped_in_a_row=cfg.data.max_skipped_in_a_row, inputs=inputs_of(model_cfg),
                          first=first)
    state = {runs.MODEL: model, "optimizer": optimizer, runs.EMA: ema.module, "scheduler": scheduler, "step": 0,
             "history": [],  # [step, loss] of every step
             # samples this rank's loader passed over, by reason; the shards left out at the start, counted once
             "skipped": Counter(loader.skipped_at_start if groups.dp_rank == 0 else {}),
             "drawn": Counter(),  # samples and tokens this rank drew from each dataset of a blend (drawn_counts)
             # the network's preconditioning and units, as a run started from this one reads them (ditcore.init_from)
             "network": run.recipe.recorded()}
    # The denoiser calls what Fabric wrapped (DDP, or the model itself) under fabric.autocast(), not Fabric's wrapper:
    # under bf16-mixed that casts every float input to bf16 (the noise level before its sinusoidal embedding too),
    # and a pipeline stage's backward of its hidden states cannot go through fabric.backward.
    denoiser = run.recipe.denoiser(model._forward_module)
    return Trainee(model, ema, optimizer, scheduler, loader, run.recipe.loss(), denoiser,
                   run.recipe.latent_map(fabric.device), state,
                   BlendWindow([m.name for m in loader.blend]) if loader.blend else None)


def start_from(run: Setup, t: Trainee) -> None:
    """A new run's first weights from model.init_from, copied into the model and the EMA alike (each rank its pieces:
    ditcore.init_from); the optimizer state, step and schedule stay fresh. One line says what was taken."""
    run.fabric.print(init_from.start_from(run.cfg.model.init_from, run.model_cfg, [t.model.module, t.ema.module],
                                          run.groups, run.recipe.source))


def build_model(run: Setup, training: bool) -> torch.nn.Module:
    """This rank's part of the model (ditcore.parallel.build_parallel_model); for the EMA copy (training False):
    neither checkpointed nor compiled."""
    cfg = run.cfg
    return build_parallel_model(
        run.model_cfg, run.groups, run.fabric.device, seed=cfg.train.seed, attention=cfg.model.attention,
        checkpointing=cfg.model.activation_checkpointing if training else "none", fsdp=cfg.parallel.fsdp,
        param_dtype=torch.bfloat16 if run.bf16 else None, reduce_dtype=fsdp.DTYPES[cfg.parallel.reduce_dtype],
        fsdp_shard=cfg.parallel.fsdp_shard, fsdp_sync=run.fsdp_sync if training else "micro_batch",
        compile=training and cfg.model.compile)


def fit(run: Setup, t: Trainee, validator: Validator, config_yaml: str, preempted: Preempted,
        heldout: HeldOutLoss | None, scorer: FIDScorer, watchdog: Watchdog) -> dict:
    """Steps until train.steps (or a stop): log, checkpoint and validate on schedule. The state is updated in place.
    Each step, up to the ranks' agreement on a stop, is under the watchdog's deadline (the checkpoints, validation and
    scoring between steps are bounded by the collective timeout alone).

    Steps are queued on the device without waiting for it: their losses and other recorded values (dit_train.metrics)
    stay on the device until a step that logs, checkpoints or validates reads them back, all at once. That is where a
    non-finite loss is found, before any checkpoint could keep the weights it broke.
    """
    cfg, fabric = run.cfg, run.fabric
    peak = (gpu_peak_flops(torch.cuda.get_device_name()) if run.on_gpu else measure_cpu_peak_flops()) or float("nan")
    step = first = t.state["step"]
    bar = tqdm(total=cfg.train.steps, initial=step, desc="train", unit="step", disable=fabric.global_rank != 0,
               dynamic_ncols=True)
    it = iter(t.loader)
    metrics = Metrics()
    if t.blend_window is not None:  # its first window starts here (after a resume: at the checkpoint's totals)
        t.blend_window.last = checkpoint.dp_total(fabric, t.state["drawn"])
    while step < cfg.train.steps:
        watchdog.stepping(step + 1)
        t0 = time.perf_counter()
        micro = train_step(run, t, it, step, metrics)
        step += 1
        t.state["step"] = step
        metrics.end_step(step, time.perf_counter() - t0, micro.tokens, micro.flops, micro.skipped.total())
        t.state["skipped"].update(micro.skipped)
        t.state["drawn"].update(micro.drawn)
        bar.update()
        if cfg.model.compile and step == first + 1:  # the blocks were compiled in this process's first step
            for reason in check_compiled(t.model.module):
                fabric.print(f"warning: a compiled block has a graph break (slower, still right): {reason}")

        now = Due.at(cfg, step, preempted.signalled(), heldout)
        watchdog.stepped(step)
        if not (now.log or now.save or now.validate or now.score):
            continue
        read = metrics.read_back()  # waits for the device
        check_finite(read, preempted, bar, cfg.optim.lr, data=cfg.data.path)  # may raise Diverged
        t.state["history"] += [[s, values["loss"]] for s, values in read]
        figures = step_figures(run, t, now, step, metrics, peak, heldout, scorer)
        if now.log:
            bar.set_postfix(**bar_postfix(figures))
        if figures:
            fabric.log_dict(figures, step=step)
        if now.save:
            saved = checkpoint.save(fabric, run.run_dir, step, t.state, t.loader, config_yaml, cfg.checkpoint.keep,
                                    describe=partial(describe, **description(run, step)))
        if now.validate:
            log_samples(run.loggers, validator.run(t.ema.module, step))
        if now.stop:
            bar.close()
            report_skipped(run, t)
            why = "by signal" if step != cfg.train.stop_at else "at train.stop_at"
            fabric.print(f"stopped {why} at step {step}; checkpoint saved — continue with --resume auto, or sample "
                         f"it: {sample_command(saved, cfg.validation.prompts, run.model_cfg.num_classes)}")
            return {"step": step, "stopped": True, "history": t.state["history"]}
    bar.close()
    skipped = report_skipped(run, t)
    return {"step": step, "stopped": False, "history": t.state["history"], "skipped": skipped}


@dataclass(frozen=True)
class Due:
    """What a step does besides training, by the config's schedules."""

    stop: bool  # a signal, or train.stop_at
    log: bool
    save: bool
    validate: bool  # sample the prompts and score FID (the last step's are the export's)
    score: bool  # the held-out loss

    @classmethod
    def at(cls, cfg: TrainConfig, step: int, signalled: bool, heldout: HeldOutLoss | None) -> Due:
        stop = signalled or step == cfg.train.stop_at
        last = step == cfg.train.steps
        return cls(stop=stop, log=step % cfg.logging.every == 0 or last,
                   save=step % cfg.checkpoint.every == 0 or last or stop,
                   validate=bool(cfg.validation.every) and step % cfg.validation.every == 0 and not last,
                   score=heldout is not None and heldout.due(step))


def step_figures(run: Setup, t: Trainee, now: Due, step: int, metrics: Metrics, peak: float,
                 heldout: HeldOutLoss | None, scorer: FIDScorer) -> dict:
    """The step's figures, logged together: one row of the CSV."""
    figures = {}
    if now.log:
        figures = metrics.close_window(peak, run.groups.dims) | {"lr": t.scheduler.get_last_lr()[0]}
        if t.loader.blend:
            figures |= t.blend_window.figures(checkpoint.dp_total(run.fabric, t.state["drawn"]))
    if now.score:  # before the save: a run resumed from this step has this point of the curve too
        figures |= heldout.run_on(scored(t), step, t.state)
    if now.validate:
        figures |= scorer.run(t.ema.module, step)
    return figures


def report_skipped(run: Setup, t: Trainee) -> dict:
    """Collective: the samples every data-parallel rank's loader skipped since the run began (by reason, over all
    resumes), printed in one line; each data-parallel rank counts once (its TP/CP/PP peers saw the same samples)."""
    total = checkpoint.dp_total(run.fabric, t.state["skipped"])
    if total:
        reasons = ", ".join(f"{n} {reason.replace('_', ' ')}" for reason, n in sorted(total.items()))
        run.fabric.print(f"skipped {total.total()} samples of {run.cfg.data.path} while training ({reasons}); "
                         "the counts per logging window are in the metrics' skipped column")
    return total


EARLY_STEPS = 10  # a loss that is not finite this early may come from the data rather than the learning rate
FINITE = {"loss": "loss", "grad_norm": "gradient norm"}  # finite loss, inf gradients (a bf16 overflow) diverge too


def check_finite(read: list[tuple[int, dict[str, float]]], preempted: Preempted, bar, lr: float,
                 data: str | None = None) -> None:
    """Steps' values as read back (Metrics.read_back): a non-finite loss or gradient norm on any rank stops every rank
    with Diverged (on the first EARLY_STEPS steps, its message names the dataset `data` as a suspect too)."""
    bad = next(((step, what, values[name]) for step, values in read for name, what in FINITE.items()
                if not math.isfinite(values[name])), None)
    if preempted.any_rank(bad is not None):
        bar.close()
        step, what, value = bad or (None, "loss", None)
        where = f"at step {step} (this rank: {value})" if bad else "on another rank"
        early = (f"; this early it may also be the data: check dataset {data} for extreme latents or text states"
                 if data is not None and read[0][0] <= EARLY_STEPS else "")
        raise Diverged(f"the {what} is not finite {where}: training diverged — lower optim.lr (now {lr:g}) or raise "
                       f"optim.warmup_steps{early}; no checkpoint was written for it, the newest one is kept for "
                       "--resume auto")


def train_step(run: Setup, t: Trainee, it, step: int, metrics: Metrics) -> MicroBatches:
    """One optimizer step over `accum` micro-batches; records its mean loss and gradient norm (device values) in
    `metrics` and returns the micro-batches taken (their real tokens, FLOPs and skipped samples on this rank).
    Nothing here waits for the device."""
    cfg, fabric, groups = run.cfg, run.fabric, run.groups
    micro = MicroBatches(run, t, it, step)
    if groups.dims.pp == 1:
        loss_sum = torch.zeros((), device=fabric.device)
        routed = []  # each micro-batch's routing statistics (MoE blocks)
        for i in range(run.accum):
            m = micro.take(i)
            # around the backward too: FSDP2 reads it there (fsdp_sync=step: ditcore.parallel.fsdp.accumulating)
            with fabric.no_backward_sync(t.model, enabled=i < run.accum - 1):
                with fabric.autocast():
                    loss = t.loss_fn(t.denoiser, m.batch.x, m.draw.inputs, mask=m.batch.mask, sigma=m.draw.sigma,
                                     noise=m.draw.noise)
                # the diffusion loss is what is logged and compared; the MoE blocks' aux loss is trained on besides
                routing = routing_of(t.denoiser.model)
                fabric.backward((loss if routing is None else loss + aux_loss(routing, groups.dims)) / run.accum)
            loss_sum += loss.detach()
            if routing is not None:
                routed.append(routing.stats.detach())
            del m, loss, routing  # this micro-batch's tensors go before the next one is loaded
        if routed:
            for name, value in Routing(torch.stack(routed).mean(0), run.model_cfg.moe).metrics().items():
                metrics.record(name, value)
    else:
        loss_sum = pipeline_step(run, t, micro, metrics)
    finalize_grads(t.model.module, groups)
    grad_norm = clip_grad_norm_(t.model.module, cfg.train.grad_clip or float("inf"), groups)
    t.optimizer.step()
    t.optimizer.zero_grad(set_to_none=True)
    t.scheduler.step()
    t.ema.update(t.model.module)
    metrics.record("loss", loss_sum / run.accum)
    metrics.record("grad_norm", grad_norm)
    return micro


def pipeline_step(run: Setup, t: Trainee, micro: MicroBatches, metrics: Metrics) -> torch.Tensor:
    """The step's micro-batches through the pipeline stages (1F1B), gradients completed; returns the sum of their
    losses, which the last stage computes and every stage gets (a broadcast on the device, no host sync). Each
    stage's MoE blocks' aux loss rides on its own backward (`WithLoss`); their statistics are pooled over the stages
    for the metrics."""
    fabric, groups, moe = run.fabric, run.groups, run.model_cfg.moe
    loss_sum = torch.zeros((), device=fabric.device)
    local = run.model_cfg.hidden_size, t.model.module.rows.spans(run.cfg.data.seq_length)[1]
    routed = torch.zeros(0 if moe is None else moe.experts + 4, device=fabric.device)  # stats summed, then blocks

    def forward(i: int, hidden: torch.Tensor | None) -> torch.Tensor:
        nonlocal loss_sum, routed
        m = micro.take(i)  # afterwards autograd keeps what backward needs of it, and nothing else stays
        with fabric.autocast():
            out = stage_forward(t.loss_fn, t.denoiser, m.batch.x, m.draw.inputs, last=groups.last_stage, hidden=hidden,
                                mask=m.batch.mask, sigma=m.draw.sigma, noise=m.draw.noise)
        routing = routing_of(t.denoiser.model)  # this stage's MoE blocks, if it holds any
        if routing is not None:
            stats = routing.stats.detach()
            routed = routed + torch.cat([stats.sum(0), stats.new_tensor([len(stats)])]) / run.accum
        if not groups.last_stage:
            return out if routing is None else WithLoss.apply(out, aux_loss(routing, groups.dims), 1 / run.accum)
        loss_sum = loss_sum + out.detach()
        return (out if routing is None else out + aux_loss(routing, groups.dims)) / run.accum

    def shape(i: int) -> tuple[int, int, int]:  # this rank's tokens of the rows, the rows, the width
        rows, tokens = micro.shape(i)
        return len(range(tokens)[local[1]]), rows, local[0]

    # FSDP's backward-sync control (fsdp_sync=step: ditcore.parallel.fsdp.accumulating) on all backwards but the last
    no_sync = lambda enabled: fabric.no_backward_sync(t.model, enabled=enabled)
    wire = torch.bfloat16 if run.bf16 else torch.float32
    one_f_one_b(groups, run.accum, forward, shape, wire, fabric.device, no_sync)
    reduce_grads(t.model.module, groups)
    dist.broadcast(loss_sum, src=groups.pp_ranks[-1], group=groups.pp_group)
    if moe is not None:  # every stage's blocks: their statistics' sums and counts added up over the stages
        dist.all_reduce(routed, group=groups.pp_group)
        for name, value in routing_metrics(routed[:-1], routed[-1], moe).items():
            metrics.record(name, value)
    return loss_sum


class MicroBatches:
    """One step's micro-batches, loaded in order when first needed (on the device, with their random draws) and
    handed over once (`take`), so that none stays on the device after its forward; their row shapes, and the real
    tokens, FLOPs and skipped samples (by reason) of those loaded so far."""

    def __init__(self, run: Setup, t: Trainee, it, step: int):
        self.run, self.t, self.it, self.step = run, t, it, step
        self.waiting: dict[int, MicroBatch] = {}  # loaded, not taken yet
        self.shapes: list[tuple[int, int]] = []  # (rows, tokens per row) of every one loaded
        self.tokens, self.flops = 0, 0.0
        self.skipped: Counter = Counter()
        self.drawn: Counter = Counter()  # samples and tokens of each dataset of a blend (drawn_counts)

    def take(self, i: int) -> MicroBatch:
        self._load_until(i)
        return self.waiting.pop(i)

    def shape(self, i: int) -> tuple[int, int]:
        self._load_until(i)
        return self.shapes[i]

    def _load_until(self, i: int) -> None:
        while len(self.shapes) <= i:
            m = self._load(len(self.shapes))
            self.waiting[len(self.shapes)] = m
            self.shapes.append(tuple(m.batch.x.shape[:2]))

    def _load(self, i: int) -> MicroBatch:
        run, model_cfg, device = self.run, self.run.model_cfg, self.run.fabric.device
        batch = self._next_on_host()
        batch = batch.to(device, non_blocking=True)  # from pinned memory on a GPU: an asynchronous copy
        if self.t.latent_map is not None:  # into the units the network was trained on, on the device
            batch.x = self.t.latent_map(batch.x, batch.mask)
        g = step_generator(run.cfg.train.seed, self.step, i, run.groups.dp_rank, device)  # TP/CP/PP peers alike
        return MicroBatch(batch, draw(batch, g, self.t.loss_fn, run.cfg.edm.cfg_dropout, model_cfg))

    def _next_on_host(self) -> PackedBatch:
        """The loader's next batch, still on the host, counted and checked. Every read of a value in a step is here,
        before the copy to the device, so that nothing after it waits for the device."""
        batch = next_batch(self.it, self.t.loader)  # its failures as one DatasetError
        self.skipped.update(batch.skipped)  # what the loader passed over to fill this batch
        if self.t.loader.blend:
            self.drawn.update(drawn_counts(batch))
        self.tokens += int(batch.mask.sum())
        check_positions(batch.pos, self.run.model_cfg.max_grid)  # here, not in the model's forward, where it would sync
        self.flops += batch_flops(self.run.model_cfg, batch)
        return batch


@dataclass
class MicroBatch:
    batch: PackedBatch
    draw: StepDraw  # its noise levels, noise and the model's inputs after CFG dropout


def description(run: Setup, step: int) -> dict:
    """What the export records beside the EMA weights, and every checkpoint beside its own (ditcore.export.describe,
    so that dit-sample samples a run before it is exported): the model config, the dataset's codec and latent
    statistics, and model.json's fields."""
    recipe = run.recipe
    # its own latent statistics, where the network works in other units than the dataset's
    return dict(cfg=run.model_cfg, dataset=run.cfg.data.path, latent_stats=recipe.latent_stats if recipe.own_units
                else None,
                extra={"step": step, "prediction": recipe.sampling()["prediction"],
                       # under VP: precond vp and its schedule (ditcore.export.Exported.vp)
                       **{k: v for k, v in recipe.recorded().items() if k != "latent_stats"},
                       # dit-sample's defaults and examples for this model: the guidance, solver, prompts and size it
                       # validated with
                       "guidance": run.cfg.validation.guidance, "solver": run.cfg.validation.solver,
                       "prompts": list(run.cfg.validation.prompts), "size": run.cfg.validation.size})


def scored(t: Trainee) -> dict[str, torch.nn.Module]:
    """The weights the held-out loss is computed for (dit_train.heldout), by the name it is logged under."""
    return {"ema": t.ema.module, "raw": t.model.module}


def export(run: Setup, t: Trainee, validator: Validator, heldout: HeldOutLoss | None, scorer: FIDScorer
           ) -> list[Path]:
    """Final validation samples, held-out losses and FID, the consolidated EMA export and the loss curves; returns
    the samples written."""
    fabric, step = run.fabric, t.state["step"]
    figures = heldout.run_on(scored(t), step, t.state) if heldout is not None else {}
    if figures := figures | scorer.run(t.ema.module, step):
        fabric.log_dict(figures, step=step)
    samples = validator.run(t.ema.module, step)
    log_samples(run.loggers, samples)
    full = gather_full(t.model.module, without_extra_state(t.ema.module.state_dict()), run.groups)
    if fabric.global_rank == 0:
        export_model(runs.export_dir(run.run_dir), full, **description(run, step))
        plot_losses(t.state["history"], run.run_dir / runs.LOSS_PLOT)
        if t.state.get("heldout"):
            plot_heldout(t.state["heldout"], run.run_dir / runs.HELDOUT_PLOT)
    fabric.barrier()
    return samples.paths
