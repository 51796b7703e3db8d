"""The small files of a step beside its tensors: each process's RNG states, each data-parallel rank's loader
position, and the resolved training config."""

from __future__ import annotations

from pathlib import Path

import torch
import yaml

from ditcore import durable
from ditcore.data import loader_state

CONFIG_FILE = "config.yaml"
_LOADER = "loader-dp{dp:05d}.json"
_LEGACY_LOADER = "loader-dp{dp:05d}.pkl"  # checkpoints from before JSON loader state
_RNG = "rng-{rank:05d}.pt"


def loader_file(dp_rank: int) -> str:
    return _LOADER.format(dp=dp_rank)


def rng_file(rank: int) -> str:
    return _RNG.format(rank=rank)


def write_rng(ckpt: Path, rank: int) -> str:
    """This process's RNG states (CPU, and every CUDA device's) into the checkpoint; returns the file's name."""
    name = rng_file(rank)
    torch.save({"torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}, Path(ckpt) / name)
    return name


def restore_rng(ckpt: Path, rank: int) -> None:
    """Set this process's RNG states to those `rank` saved."""
    rng = torch.load(Path(ckpt) / rng_file(rank), weights_only=True)
    torch.set_rng_state(rng["torch"])
    if torch.cuda.is_available() and rng["cuda"]:
        torch.cuda.set_rng_state_all(rng["cuda"])


def write_loader_state(ckpt: Path, dp_rank: int, state) -> str:
    """A data-parallel rank's loader position (`loader.save_state_rank()`) as JSON; returns the file's name."""
    name = loader_file(dp_rank)
    (Path(ckpt) / name).write_bytes(loader_state.state_to_json(state))
    return name


def read_loader_state(ckpt: Path, dp_rank: int):
    """A data-parallel rank's loader position from a checkpoint, for `loader.restore_state_rank`."""
    path = Path(ckpt) / loader_file(dp_rank)
    legacy = Path(ckpt) / _LEGACY_LOADER.format(dp=dp_rank)
    if not path.is_file() and legacy.is_file():
        return loader_state.state_from_pickle(legacy.read_bytes(), what=str(legacy))
    return loader_state.state_from_json(path.read_bytes(), what=str(path))


def write_config(ckpt: Path, config_yaml: str) -> str:
    """The resolved training config, durable; returns the file's name."""
    durable.write_text(Path(ckpt) / CONFIG_FILE, config_yaml)
    return CONFIG_FILE


def read_config(ckpt: Path) -> dict | None:
    """The config a checkpoint was written with, as a dict; None if it has none."""
    path = Path(ckpt) / CONFIG_FILE
    if not path.is_file():
        return None
    config = yaml.safe_load(path.read_text())  # verified against the manifest before this is called
    return config if isinstance(config, dict) else None
