"""The `dit-train` command line: a YAML config plus dotted overrides, validated, then the training loop."""

from __future__ import annotations

from pathlib import Path

import typer

from dit_train.config import SHIPPED_NAMES, shipped_configs
from ditcore.cli import entry_point, version_option

app = typer.Typer(name="dit-train", add_completion=False, pretty_exceptions_enable=False)


def find_config(name: str) -> Path:
    """A path, or the name of a shipped config (apps/train/configs/NAME.yaml)."""
    path = Path(name)
    if path.exists() or path.suffix:
        return path
    return shipped_configs().get(name, path)


@app.command()
def main(
    overrides: list[str] = typer.Argument(None, help="Dotted overrides, e.g. train.steps=200 parallel.tp=2."),
    config: str = typer.Option(None, "--config", "-c", help="YAML config file, or a shipped config name: "
                                                            + ", ".join(SHIPPED_NAMES) + "."),
    resume: str = typer.Option("auto", help="auto: continue from the newest complete checkpoint in RUN_DIR "
                                            "(fresh run if none); none: start over; or a checkpoint folder."),
    print_config: bool = typer.Option(False, "--print-config", help="Print the resolved config and exit."),
    version_: bool = version_option("dit-train"),
) -> None:
    """Train a diffusion transformer with the EDM objective (Lightning Fabric + Megatron-Core parallelism).

    Launch one process (or Fabric starts parallel.devices of them), or run under torchrun for several.
    Writes RUN_DIR (train.run_dir): checkpoints/, samples/, csv/ and tensorboard/ logs, loss.png, export/.
    SIGTERM or SIGUSR1 saves a checkpoint and exits 0.
    """
    from dit_train.config import load_config
    from ditcore.data.schema import DatasetError
    from ditcore.errors import ConfigError

    try:
        cfg = load_config(find_config(config) if config else None, overrides or [])
    except ConfigError as e:
        _fail(str(e))
    if print_config:
        typer.echo(cfg.to_yaml(), nl=False)
        raise typer.Exit()
    from dit_train.train import Diverged, train
    from ditcore import runs

    try:
        result = train(cfg, resume=resume, config_yaml=cfg.to_yaml())
    except (ConfigError, DatasetError, runs.CheckpointError, Diverged, FileNotFoundError, ValueError) as e:
        _fail(str(e))
    if not result["stopped"]:
        run = Path(cfg.train.run_dir)
        typer.echo(f"done: {result['step']} steps; export {runs.export_dir(run)}; loss curve {run / runs.LOSS_PLOT}")
        for path in result.get("samples") or []:
            typer.echo(f"sample    {path}")


def _fail(message: str):
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


run = entry_point(app)  # the console script: usage errors are one line, exit code 2
