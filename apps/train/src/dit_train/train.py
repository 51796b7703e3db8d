"""The training loop: setup → build → resume → fit (accumulate, clip, step, EMA, log, checkpoint, validate) → export."""

from __future__ import annotations

import math
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from lightning.fabric.loggers import CSVLogger, TensorBoardLogger
from tqdm import tqdm

from dit_train import checkpoint
from dit_train.config import TrainConfig
from ditcore import durable
from ditcore.codecs import LatentStats, load_codec
from ditcore.codecs.text import load_text_encoder
from ditcore.data.loader import build_loader, check_samples_fit
from ditcore.data.schema import read_info
from ditcore.diffusion import EMA, EDMLoss, EDMPrecond
from ditcore.errors import ConfigError
from ditcore.export import export_model
from ditcore.flops import gpu_peak_flops, measure_cpu_peak_flops, training_flops_per_token
from ditcore.media import write_sample
from ditcore.models import DiT, apply_compile, preset
from ditcore.parallel import ParallelDims, clip_grad_norm_, finalize_grads, gather_full, load_consolidated, parallelize
from ditcore.parallel.fabric import MegatronStrategy
from ditcore.sampling import sample


class Preempted:
    """SIGTERM / SIGUSR1 (Slurm preemption or time limit) → finish the step, checkpoint, exit 0."""

    def __init__(self):
        self.flag = False
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.flag = True

    def agreed(self, world_size: int) -> bool:
        """Every rank must stop at the same step: take the flag from any rank."""
        if world_size == 1:
            return self.flag
        t = torch.tensor([float(self.flag)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())


def prepare_run_dir(run_dir: Path) -> None:
    """Create RUN_DIR, or say why it cannot be (before any process group or model exists)."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError("train.run_dir", str(run_dir), "a folder path (this is a file)")
    try:
        durable.make_writable_dir(run_dir)
    except OSError as e:
        raise ConfigError("train.run_dir", str(run_dir), f"a folder this user can write ({e.strerror})") from None


def model_config(cfg: TrainConfig, info):
    m = cfg.model
    changes = dict(in_channels=info.latent_channels, text_dim=info.text_encoder["dim"], num_classes=info.num_classes,
                   pos_embed=m.pos_embed, qk_norm=m.qk_norm, fps_cond=m.fps_cond)
    for key in ("patch_size", "patch_size_t"):
        if getattr(m, key) is not None:
            changes[key] = getattr(m, key)
    if m.max_grid is not None:
        changes["max_grid"] = tuple(m.max_grid)
    return preset(m.preset, **changes)


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


def batch_flops(model_cfg, batch) -> float:
    """Training FLOPs of a packed batch: every sample's tokens at its own sequence and text length."""
    B, S = batch.class_labels.shape
    real = batch.text_seg >= 0
    sample_of_text = (torch.arange(B)[:, None] * S + batch.text_seg)[real]  # flat (row, sample) per text token
    text_len = torch.bincount(sample_of_text, minlength=B * S).view(B, S).tolist()
    total = 0.0
    for r, grids in enumerate(batch.grids):  # token counts are known from each sample's grid
        for s, (t, h, w) in enumerate(grids):
            total += training_flops_per_token(model_cfg, t * h * w, text_len[r][s]) * t * h * w
    return total


def drop_conditions(batch, p: float, null_class: int, g: torch.Generator):
    """CFG dropout per sample: its text becomes empty (all text tokens masked) and its class the null class."""
    B, S = batch.class_labels.shape
    drop = torch.rand(B, S, generator=g) < p
    text_seg = batch.text_seg
    if text_seg.numel():
        dropped = drop.gather(1, text_seg.clamp(min=0)) & (text_seg >= 0)
        text_seg = torch.where(dropped, -1, text_seg)
    labels = torch.where(drop | (batch.class_labels < 0), null_class, batch.class_labels)
    return text_seg, labels


def train(cfg: TrainConfig, resume: str = "auto", config_yaml: str | None = None) -> dict:
    # ---------------------------------------------------------------- setup
    run_dir = Path(cfg.train.run_dir)
    info = read_info(cfg.data.path)  # fails early, on every rank, if the dataset is missing or unfinished
    on_gpu = torch.cuda.is_available() and cfg.parallel.accelerator != "cpu"
    dims = ParallelDims(cfg.parallel.tp, cfg.parallel.cp, cfg.parallel.pp,
                        sequence_parallel=cfg.parallel.sequence_parallel)
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", cfg.parallel.devices))
    bf16 = cfg.train.precision == "bf16" or (cfg.train.precision == "auto" and on_gpu)
    prepare_run_dir(run_dir)
    loggers = []
    if cfg.logging.csv:
        loggers.append(CSVLogger(str(run_dir), name="csv", version=f"run-{time.strftime('%Y%m%d-%H%M%S')}"))
    if cfg.logging.tensorboard:
        loggers.append(TensorBoardLogger(str(run_dir), name="tensorboard", version=""))
    strategy = MegatronStrategy(dims)
    num_nodes = int(os.environ.get("WORLD_SIZE", devices)) // devices  # torchrun on several nodes
    fabric = Fabric(accelerator="cuda" if on_gpu else "cpu", devices=devices, num_nodes=num_nodes, strategy=strategy,
                    precision="bf16-mixed" if bf16 else "32-true", loggers=loggers)
    fabric.launch()
    groups = strategy.groups
    model_cfg = model_config(cfg, info)
    dims.check_model(model_cfg.num_heads, cfg.data.seq_length)
    too_long = check_samples_fit(info, cfg.data.path, patch_size=model_cfg.patch_size,
                                 patch_size_t=model_cfg.patch_size_t, seq_length=cfg.data.seq_length)
    if too_long:
        fabric.print(f"warning: {too_long} of {info.counts['samples']} samples do not fit data.seq_length="
                     f"{cfg.data.seq_length} tokens (or the patch sizes) and will be skipped")
    accum = cfg.train.global_batch // (cfg.train.micro_batch * groups.dims.dp)
    if accum * cfg.train.micro_batch * groups.dims.dp != cfg.train.global_batch:
        raise ValueError(f"train.global_batch={cfg.train.global_batch} is not a multiple of train.micro_batch="
                         f"{cfg.train.micro_batch} x data-parallel size {groups.dims.dp}")

    # ---------------------------------------------------------------- build
    torch.manual_seed(cfg.train.seed)
    model = DiT(model_cfg)  # same seed on every rank: identical one-device weights to shard
    full_init = model.state_dict()
    parallelize(model, groups)
    load_consolidated(model, full_init, groups)
    del full_init
    if cfg.model.compile:
        apply_compile(model)
    ema = EMA(model, cfg.edm.ema_decay)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=tuple(cfg.optim.betas),
                                  eps=cfg.optim.eps, weight_decay=cfg.optim.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    model, optimizer = fabric.setup(model, optimizer)
    ema.module.to(fabric.device)
    loader = build_loader(cfg.data.path, patch_size=model_cfg.patch_size, patch_size_t=model_cfg.patch_size_t,
                          seq_length=cfg.data.seq_length, batch_size=cfg.train.micro_batch,
                          num_workers=cfg.data.num_workers, dp_rank=groups.dp_rank, dp_size=groups.dims.dp,
                          dp_group=groups.dp_group, shuffle_buffer_size=cfg.data.shuffle_buffer,
                          packing_buffer_size=cfg.data.packing_buffer, seed=cfg.train.seed)
    loss_fn = EDMLoss(cfg.edm.p_mean, cfg.edm.p_std)
    denoiser = EDMPrecond(model)
    history: list[list[float]] = []  # [step, loss]
    state = {"model": model, "optimizer": optimizer, "ema": ema.module, "scheduler": scheduler, "step": 0,
             "history": history}

    # ---------------------------------------------------------------- resume
    ckpt = checkpoint.resume(fabric, run_dir, resume, state, loader)  # verified; a damaged one → the previous
    if ckpt is not None:
        history = state["history"]
        fabric.print(f"resumed from {ckpt} at step {state['step']}")
    start = state["step"]

    # ---------------------------------------------------------------- fit
    peak = (gpu_peak_flops(torch.cuda.get_device_name()) if on_gpu else measure_cpu_peak_flops()) or float("nan")
    texts = Validator(cfg, info, model_cfg, fabric)
    preempted = Preempted()
    bar = tqdm(total=cfg.train.steps, initial=start, desc="train", unit="step", disable=fabric.global_rank != 0,
               dynamic_ncols=True)
    it = iter(loader)
    step, window = start, {"tokens": 0, "flops": 0.0, "time": 0.0, "loss": 0.0, "n": 0}
    while step < cfg.train.steps:
        t0 = time.perf_counter()
        losses = []
        for micro in range(accum):
            batch = next(it)
            # Noise levels, noise and CFG drops depend only on (seed, step, micro, dp rank): TP/CP peers agree.
            g = torch.Generator().manual_seed(hash((cfg.train.seed, step, micro, groups.dp_rank)) % 2**62)
            text_seg, labels = drop_conditions(batch, cfg.edm.cfg_dropout, model_cfg.num_classes, g)
            S = batch.class_labels.shape[1]
            sigma = loss_fn.sample_sigma((batch.x.shape[0], S), generator=g)
            noise = torch.randn(batch.x.shape, generator=g)
            to = fabric.to_device
            cond = {"pos": to(batch.pos), "fps": to(batch.fps)}
            if model_cfg.text_dim:
                cond |= {"text": to(batch.text), "text_seg": to(text_seg)}
            if model_cfg.num_classes:
                cond["class_labels"] = to(labels)
            with fabric.no_backward_sync(model, enabled=micro < accum - 1), fabric.autocast():
                loss = loss_fn(denoiser, to(batch.x), seg=to(batch.seg), mask=to(batch.mask), sigma=to(sigma),
                               noise=to(noise), **cond)
            fabric.backward(loss / accum)
            losses.append(loss.item())
            window["tokens"] += int(batch.mask.sum())
            window["flops"] += batch_flops(model_cfg, batch)
        finalize_grads(model.module, groups)
        grad_norm = clip_grad_norm_(model.module, cfg.train.grad_clip or float("inf"), groups)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        ema.update(model.module)
        step += 1
        state["step"] = step
        history.append([step, sum(losses) / len(losses)])
        window["time"] += time.perf_counter() - t0
        window["loss"] += history[-1][1]
        window["n"] += 1

        if step % cfg.logging.every == 0 or step == cfg.train.steps:
            # tokens and FLOPs of this rank; every data-parallel rank does the same work, so per-process is per-device
            tps = window["tokens"] / window["time"]
            mfu = window["flops"] / window["time"] / (peak * max(1, groups.dims.tp * groups.dims.cp))
            metrics = {"loss": window["loss"] / window["n"], "lr": scheduler.get_last_lr()[0], "tokens_per_s": tps,
                       "mfu": mfu, "grad_norm": float(grad_norm)}
            fabric.log_dict(metrics, step=step)
            bar.set_postfix(loss=f"{metrics['loss']:.4f}", lr=f"{metrics['lr']:.2e}", tok_s=f"{tps:.0f}",
                            mfu=f"{mfu:.1%}")
            window = {"tokens": 0, "flops": 0.0, "time": 0.0, "loss": 0.0, "n": 0}
        bar.update()

        stop = preempted.agreed(fabric.world_size) or step == cfg.train.stop_at
        if step % cfg.checkpoint.every == 0 or step == cfg.train.steps or stop:
            checkpoint.save(fabric, run_dir, step, state, loader, config_yaml or cfg.to_yaml(), cfg.checkpoint.keep)
        if cfg.validation.every and step % cfg.validation.every == 0 and step != cfg.train.steps:
            texts.run(ema.module, step)
        if stop:
            bar.close()
            why = "by signal" if step != cfg.train.stop_at else "at train.stop_at"
            fabric.print(f"stopped {why} at step {step}; checkpoint saved — continue with --resume auto")
            return {"step": step, "stopped": True, "history": history}
    bar.close()

    # ---------------------------------------------------------------- export
    written = texts.run(ema.module, step)
    full = gather_full(model.module, {k: v for k, v in ema.module.state_dict().items()
                                      if not k.endswith("_extra_state")}, groups)
    if fabric.global_rank == 0:
        export_model(run_dir / "export", full, model_cfg, cfg.data.path, extra={"step": step})
        plot_losses(history, run_dir / "loss.png")
    fabric.barrier()
    for logger in loggers:
        logger.finalize("success")
    return {"step": step, "stopped": False, "history": history, "samples": written}


class Validator:
    """Samples the validation prompts with the EMA weights and writes mp4/png under RUN_DIR/samples/."""

    def __init__(self, cfg: TrainConfig, info, model_cfg, fabric):
        self.cfg, self.fabric, self.run_dir = cfg.validation, fabric, Path(cfg.train.run_dir)
        self.enabled = info.codec.get("kind") != "none"  # mock data has nothing to decode
        if not self.enabled:
            return
        self.codec = load_codec(info.codec, Path(cfg.data.path))
        self.stats = LatentStats.from_dict(info.latent_stats)
        self.states = self.labels = None
        if model_cfg.text_dim:
            self.states = load_text_encoder(info.text_encoder["name"]).encode(list(self.cfg.prompts))
        elif model_cfg.num_classes:
            self.labels = list(range(min(model_cfg.num_classes, len(self.cfg.prompts))))

    def run(self, model, step: int) -> list[Path]:
        if not self.enabled:
            return []
        v = self.cfg
        written = []
        for frames in [v.frames] + ([v.clip_frames] if v.clip_frames else []):
            result = sample(model, self.codec, self.stats, text_states=self.states, class_labels=self.labels,
                            num=len(v.prompts), frames=frames, height=v.size, width=v.size, steps=v.steps,
                            guidance=v.guidance, solver=v.solver, seed=v.seed, fps=v.fps)
            if self.fabric.global_rank != 0:
                continue
            for i, (pixels, prompt) in enumerate(zip(result.pixels, v.prompts, strict=False)):
                slug = "".join(c if c.isalnum() else "-" for c in prompt.lower())[:48].strip("-")
                name = f"{i:02d}-{slug}" + (f"-{frames}f" if frames > 1 else "")
                written.append(write_sample(pixels.numpy(), self.run_dir / "samples" / f"step-{step:07d}" / name,
                                            fps=v.fps))
        return written


def plot_losses(history: list[list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not history:
        return
    steps, losses = zip(*history, strict=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, losses, lw=0.6, alpha=0.4, label="loss")
    k = max(1, len(losses) // 50)
    smooth = [sum(losses[max(0, i - k):i + 1]) / len(losses[max(0, i - k):i + 1]) for i in range(len(losses))]
    ax.plot(steps, smooth, lw=1.5, label=f"mean of {k + 1}")
    ax.set(xlabel="step", ylabel="EDM loss", yscale="log", title="training loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
