"""The `dit-train` command line: a YAML config plus dotted overrides, validated, then the training loop."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from dit_train.config import SHIPPED_NAMES, shipped_configs
from ditcore.cli import entry_point, fail, new_app, version_option
from ditcore.runs import OUTPUTS

app = new_app("dit-train")


def find_config(name: str) -> Path:
    """A file, or the name of a shipped config (apps/train/configs/NAME.yaml). A folder of that name (a dataset
    called mock, say) does not hide the shipped config."""
    path = Path(name)
    if path.is_file():  # a name with a dot (wan-1.3b-finetune) is still a shipped config's
        return path
    return shipped_configs().get(name, path)


def output_name(name: str) -> str:
    """An entry of ditcore.runs.OUTPUTS as a person reads it: a folder with its slash (checkpoints/), a file
    (loss.png) as it is."""
    return name if Path(name).suffix else f"{name}/"


@app.command()
def main(
    overrides: list[str] = typer.Argument(None, help="Dotted overrides, e.g. train.steps=200 parallel.tp=2."),
    config: str = typer.Option(None, "--config", "-c", help="YAML config file, or a shipped config name: "
                                                            + ", ".join(SHIPPED_NAMES) + "."),
    resume: str = typer.Option("auto", help="auto: continue from the checkpoint written last in RUN_DIR (fresh run "
                                            "if none); none: a new run (refused where checkpoints exist, unless "
                                            "--overwrite); or a checkpoint folder (an older one starts a branch)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Start a new run in RUN_DIR, first removing what an "
                                                              "earlier run wrote there: " + ", ".join(
                                                                  map(output_name, OUTPUTS)) + "."),
    print_config: bool = typer.Option(False, "--print-config", help="Print the resolved config and exit."),
    plan: bool = typer.Option(False, "--plan", help="Print the memory per GPU this config needs (weights, gradients, "
                                                    "optimizer, EMA, buffers, activations) and exit: 0 if it fits in "
                                                    "--gpu-memory, 2 with what to change if not. Starts nothing."),
    world_size: int = typer.Option(None, "--world-size", min=1, help="With --plan: GPUs in all (default: "
                                                                     "parallel.devices)."),
    gpu_memory: float = typer.Option(80.0, "--gpu-memory", min=1, help="With --plan: GiB of memory per GPU."),
    text_len: int = typer.Option(None, "--text-len", min=0, help="With --plan: text tokens per packed row (default: "
                                                                 "one longest caption of the dataset's text encoder: "
                                                                 "128, UMT5's 512)."),
    text_dim: int = typer.Option(None, "--text-dim", min=0, help="With --plan, when data.path does not exist yet: "
                                                                 "width of the text states (default: the preset's "
                                                                 "where it has one, as Wan's 4096 of UMT5 or "
                                                                 "MovieGen's 1024, NeMo's; else 384, MiniLM, "
                                                                 "dit-prepare's default; 4096: T5-XXL; 0: no text). "
                                                                 "The latent channels are the preset's likewise "
                                                                 "(Wan's and MovieGen's 16; else 4)."),
    gpus_per_node: int = typer.Option(None, "--gpus-per-node", help="With --plan: GPUs in a node, joined by NVLink "
                                                                    "(default 8: H100 SXM nodes)."),
    nvlink_gbps: float = typer.Option(None, "--nvlink-gbps", help="With --plan: GB/s each GPU sends within a node "
                                                                  "(default 360: NCCL's bus bandwidth on H100 NVLink, "
                                                                  "450 each way on the datasheet)."),
    ib_gbps: float = typer.Option(None, "--ib-gbps", help="With --plan: GB/s a GPU's own NIC carries between nodes "
                                                          "(default 46: NCCL's on a 400 Gb/s NDR InfiniBand NIC; a "
                                                          "group with k GPUs in each node has k NICs). --plan also "
                                                          "predicts the step at half of it."),
    peak_tflops: float = typer.Option(None, "--peak-tflops", help="With --plan: dense bf16 TFLOP/s of a GPU "
                                                                  "(default 989: H100 SXM)."),
    efficiency: float = typer.Option(None, "--efficiency", help="With --plan: the fraction of the peak the compute "
                                                                "runs at, in (0, 1] (default: measured on an H200 by "
                                                                "width, 0.448 up to 3072 wide, else 0.5)."),
    search: bool = typer.Option(False, "--search", help="With --plan: list the layouts that fit the GPUs (tp, cp, pp, "
                                                        "FSDP or HSDP and its sync, checkpointing, micro_batch), "
                                                        "fastest predicted first, with the overrides that select "
                                                        "them; exit 2 if none fits."),
    top: int = typer.Option(10, "--top", min=1, help="With --search: layouts listed."),
    version_: bool = version_option("dit-train"),
) -> None:
    """Train a diffusion transformer with EDM or flow matching (Lightning Fabric + Megatron-Core parallelism).

    Launch one process (or Fabric starts parallel.devices of them), or run under torchrun for several.
    Writes RUN_DIR (train.run_dir): checkpoints/, samples/, csv/ and tensorboard/ logs (wandb/ with logging.wandb),
    loss.png, export/; one run at a time (a second one on the same RUN_DIR is refused, naming the first).
    SIGTERM, SIGUSR1, SIGHUP or Ctrl-C saves a checkpoint and exits 0 (a second Ctrl-C exits at once). A peer lost
    for parallel.timeout_s (a node that died or stopped answering) ends the run in one line, "error: lost contact
    with rank R on host H ...", and exit code 75: relaunch with --resume auto. --plan checks a layout before any GPU
    is spent on it.
    """
    cfg = _load(config, overrides or [])
    if print_config:
        typer.echo(cfg.to_yaml(), nl=False)
        raise typer.Exit()
    if plan:
        given = {"gpus_per_node": gpus_per_node, "nvlink": nvlink_gbps and nvlink_gbps * 1e9,
                 "infiniband": ib_gbps and ib_gbps * 1e9, "peak_flops": peak_tflops and peak_tflops * 1e12,
                 "efficiency": efficiency}
        fits = _plan(cfg, world_size, gpu_memory, text_len, text_dim, given, search, top)
        raise typer.Exit(0 if fits else 2)
    _train(cfg, resume, overwrite)


def _load(config: str | None, overrides: list[str]):
    from dit_train.config import load_config
    from ditcore.errors import ConfigError

    try:
        return load_config(find_config(config) if config else None, overrides)
    except ConfigError as e:
        if os.environ.get("RANK", "0") != "0":  # under torchrun each process reads the same file: the first process
            raise typer.Exit(2) from None  # of the job says why, the others end with the same exit code, silently
        fail(str(e))


def _plan(cfg, world_size: int | None, gpu_memory: float, text_len: int | None, text_dim: int, given: dict,
          search: bool, top: int) -> bool:
    """--plan: whether the config fits (print_plan); a config or dataset it cannot plan is one line."""
    from dit_train.config import in_config_keys
    from ditcore.data.schema import DatasetError
    from ditcore.errors import ConfigError

    try:
        from ditcore.speed import Cluster

        cluster = Cluster(memory=gpu_memory * 2**30, **{k: v for k, v in given.items() if v is not None})
        return print_plan(cfg, world_size or cfg.parallel.devices, gpu_memory, text_len, text_dim, cluster, search,
                          top)
    except (ConfigError, DatasetError) as e:
        hint, e = "", in_config_keys(e) if isinstance(e, ConfigError) else e  # ditcore's errors name its fields
        if isinstance(e, ConfigError) and e.key == "parallel" and world_size is None:
            hint = f" (the world size is parallel.devices={cfg.parallel.devices}: pass --world-size, the GPUs)"
        fail(f"{e}{hint}")


def _train(cfg, resume: str, overwrite: bool) -> None:
    """The run, each way it can end as one line and its exit code, then (rank 0) where its outputs are."""
    from dit_train.config import in_config_keys
    from dit_train.preemption import Interrupted
    from dit_train.rundir import RunDirInUse
    from dit_train.train import Diverged, train
    from dit_train.wandb_logger import WandBUnavailable
    from ditcore import disk, runs
    from ditcore.data.schema import DatasetError
    from ditcore.errors import ConfigError
    from ditcore.models import NotCompiled

    try:
        result = train(cfg, resume=resume, overwrite=overwrite)
    except (ConfigError, DatasetError, runs.CheckpointError, Diverged, NotCompiled, FileNotFoundError, ValueError,
            RunDirInUse, WandBUnavailable) as e:
        fail(str(in_config_keys(e) if isinstance(e, ConfigError) else e))
    except Interrupted as e:  # a second Ctrl-C
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(130) from None
    except KeyboardInterrupt:  # before the first step, when Python's own handler was still the one
        typer.echo("error: interrupted by Ctrl-C before training began: no step was taken, nothing was saved",
                   err=True)
        raise typer.Exit(130) from None
    except OSError as e:  # a full disk where no writer said so itself (a checkpoint's manifest, the logs)
        if not disk.is_disk_full(e):
            raise
        path = e.filename or Path(cfg.train.run_dir) / "."
        fail(str(e) if isinstance(e, disk.DiskFull) else str(disk.disk_full(f"could not write {path}", path)))
    if not result["stopped"] and result["rank"] == 0:  # one summary, not one per process
        run = Path(cfg.train.run_dir)
        typer.echo(f"done: {result['step']} steps; export {runs.export_dir(run)}; loss curve {run / runs.LOSS_PLOT}")
        for path in result.get("samples") or []:
            typer.echo(f"sample    {path}")


def _assumed_data(cfg, text_dim: int | None):
    """The dataset --plan assumes where data.path does not exist yet: the preset's latent channels (Wan's and
    MovieGen's 16, the DiTs' 4), text states of width text_dim (default: the preset's, as MovieGen's 1024, else
    MiniLM's 384) from UMT5 (512 tokens) for Wan's text_len, else 128."""
    from ditcore.codecs.text import UMT5_MAX_TOKENS
    from ditcore.data.schema import DatasetInfo
    from ditcore.models import preset

    ours = preset(cfg.model.preset)
    dim = text_dim if text_dim is not None else ours.text_dim or 384
    encoder = "umt5:assumed" if dim and getattr(ours, "text_len", 0) == UMT5_MAX_TOKENS else "assumed"
    return DatasetInfo(codec={}, latent_stats={}, text_encoder={"name": encoder, "dim": dim},
                       latent_channels=ours.in_channels, spatial_factor=1, temporal_factor=1)


def print_plan(cfg, world_size: int, gpu_memory: float, text_len: int | None, text_dim: int, cluster=None,
               search: bool = False, top: int = 10) -> bool:
    """Print the memory plan of `cfg` per GPU; on stderr, if it does not fit, what to change. Returns whether it fits.
    With a ditcore.speed.Cluster, then its predicted speed (`print_speed`); with `search` too, the fastest layouts that
    fit, and returns whether there is one.

    Reads only the dataset's ditcore.json (channels, text width, classes); without a dataset, assumes the preset's
    latent channels and text states of width text_dim. text_len: text tokens per row (None: one longest caption).
    """
    from dit_train.config import memory_layout, overrides
    from dit_train.train import model_config
    from ditcore.codecs.text import max_text_tokens
    from ditcore.data.schema import read_info
    from ditcore.interop import is_foreign
    from ditcore.memory import HEADROOM, GiB, advise, choose_fsdp_sync, plan_from

    if Path(cfg.data.path).exists():
        info, source = read_info(cfg.data.path), f"dataset {cfg.data.path}"
    else:
        info, source = _assumed_data(cfg, text_dim), f"data.path {cfg.data.path} does not exist yet: assumed"
    name, init_from = cfg.model.preset, cfg.model.init_from
    if init_from and is_foreign(init_from):  # the architecture is the checkpoint's
        from ditcore.init_from import read_source

        name, model_cfg = init_from, model_config(cfg, info, read_source(init_from, cfg.model.num_heads))
    else:
        model_cfg = model_config(cfg, info)
    longest = max_text_tokens(info.text_encoder["name"])  # one longest caption: 512 for UMT5 (Wan), else 128
    layout = memory_layout(cfg, world_size, (longest if text_len is None else text_len) if model_cfg.text_dim else 0)
    gpu = gpu_memory * GiB
    if cfg.parallel.fsdp_sync == "auto":  # as dit-train chooses on a GPU of gpu_memory
        layout = choose_fsdp_sync(model_cfg, layout, gpu)
    result = plan_from(model_cfg, layout)
    text = f"text states of width {model_cfg.text_dim}" if model_cfg.text_dim else "no text"
    classes = f"{model_cfg.num_classes} classes" if model_cfg.num_classes else "no classes"
    text_tokens = f" + {layout.text_len} text" if layout.text_len else ""
    step = f"{layout.micro_batch} x {layout.seq_length} tokens{text_tokens} per micro-batch"
    tricks = [layout.precision, f"activation checkpointing {layout.activation_checkpointing}"]
    tricks += ["compiled blocks"] if layout.compile else []
    typer.echo(f"model  {name}: {result.params / 1e9:.3g} B parameters, "
               f"{result.params_local / 1e9:.3g} B on each " + ("rank of the stage planned for (its "
                                                                 "tensor-parallel share)" if layout.pp > 1 else
                                                                 "tensor-parallel rank"))
    typer.echo(f"data   {source} {model_cfg.in_channels} latent channels, {text}, {classes}")
    typer.echo(f"layout {layout.describe()}")
    typer.echo(f"step   {step}; {', '.join(tricks)}")
    typer.echo(result.table(gpu))
    if cluster is not None:
        found = print_speed(model_cfg, layout, cluster, cfg.train.global_batch if search else None, top)
        if search:
            return found
    if result.fits(gpu):
        return True
    steps, better = advise(model_cfg, layout, gpu)
    changes = [override for step in steps for override in overrides(step)]
    need = (f"needs {result.total / GiB:.1f} GiB per GPU, more than the {HEADROOM.usable(gpu) / GiB:.1f} GiB usable of "
            f"{gpu_memory:g} GiB")
    if better.fits(gpu):
        typer.echo(f"error: {need} — set {' '.join(changes)} (then {better.total / GiB:.1f} GiB)", err=True)
    else:
        tried = f"even with {' '.join(changes)} it needs {better.total / GiB:.1f} GiB" if changes else "nothing helps"
        typer.echo(f"error: {need} — {tried}: use more GPUs (--world-size) or a smaller model", err=True)
    return False


def print_speed(model_cfg, layout, cluster, global_batch: int | None, top: int) -> bool:
    """Print the layout's predicted step (ditcore.speed.predict); with global_batch, then the `top` fastest layouts of
    the cluster that fit (ditcore.speed.search) with the overrides that select them. Returns whether any fits."""
    import sys

    from tqdm import tqdm

    from dit_train.config import overrides
    from ditcore.memory import GiB
    from ditcore.speed import at_cross_node, predict
    from ditcore.speed import search as search_layouts

    prediction = predict(model_cfg, layout, cluster)
    typer.echo(prediction.table())
    typer.echo(at_cross_node(model_cfg, layout, cluster).versus(prediction))  # how much the verdict rests on the NICs
    if global_batch is None:
        return True
    bar = lambda walk, total: tqdm(walk, total=total, desc="layouts", unit="layout", file=sys.stderr, leave=False)
    found = search_layouts(model_cfg, cluster, layout, global_batch, top, bar)
    if not found:
        typer.echo(f"error: no layout of {layout.world_size} GPUs fits {cluster.memory / GiB:g} GiB: use more GPUs "
                   "(--world-size) or a smaller model", err=True)
        return False
    experts = " x ep" if model_cfg.moe is not None else ""
    typer.echo(f"search: the {len(found)} fastest layouts of {layout.world_size} GPUs that fit, one for each tp x cp x "
               f"pp{experts} (overrides of this config)")
    typer.echo(f"  {'tokens/s/GPU':>12}{'MFU':>7}{'step s':>10}{'exposed':>9}{'GiB':>7}  {'bound':<10}overrides")
    for c in found:
        p = c.prediction
        typer.echo(f"  {p.tokens_per_second_per_gpu:12,.0f}{p.mfu:7.1%}{p.step:10.3g}{p.exposed / p.step:9.0%}"
                   f"{c.plan.total / GiB:7.1f}  {p.bound:<10}{' '.join(overrides(c.changes)) or '(none)'}")
    return True


run = entry_point(app)  # the console script: usage errors are one line, exit code 2
