"""dit_train.wandb_logger and dit_train.media_log in process: which W&B run a training run logs into, and that nothing
imports wandb when it is off. (What a run logs, read back from all three logs, and a resume continuing its W&B run:
test_train.py.)"""

import sys

import numpy as np

from dit_train.cli import find_config
from dit_train.config import load_config
from dit_train.media_log import log_samples
from dit_train.rundir import remove_outputs
from dit_train.train import make_loggers
from dit_train.validation import Samples
from ditcore import runs


def test_nothing_imports_wandb_when_it_is_off(tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m == "wandb" or m.startswith("wandb.")]:
        monkeypatch.delitem(sys.modules, name)  # as if no test had imported it; put back afterwards
    cfg = load_config(find_config("demo"))
    assert cfg.logging.wandb.project is None and cfg.logging.tensorboard
    loggers = make_loggers(cfg, tmp_path, "run-1")
    for logger in loggers:
        logger.log_metrics({"loss": 0.5}, step=1)
    log_samples(loggers, Samples(1, sheet=np.zeros((8, 8, 3), np.uint8)))  # the TensorBoard logger takes it
    for logger in loggers:
        logger.finalize("success")
    assert "wandb" not in sys.modules


def test_a_resumed_run_continues_its_wandb_run_and_an_overwritten_one_starts_another(tmp_path, read_wandb,
                                                                                    monkeypatch):
    from dit_train.wandb_logger import RUN_FILE, WandBLogger

    for name, value in {"WANDB_SILENT": "true", "WANDB_ERROR_REPORTING": "false"}.items():
        monkeypatch.setenv(name, value)  # what the logger sets in the process, gone again after the test

    cfg = load_config(find_config("demo"), ["logging.wandb.project=ditcore-test", "logging.wandb.mode=offline"])

    def segment(resuming: bool, step: int) -> str:
        logger = WandBLogger(cfg.logging.wandb, tmp_path, {"step": step}, resuming)
        logger.log_metrics({"loss": 1 / step}, step=step)
        logger.finalize("success")
        return logger.version

    first = segment(False, 1)
    assert (tmp_path / runs.WANDB / RUN_FILE).is_file()
    assert segment(True, 2) == first  # a resume: the same W&B run
    assert segment(False, 1) != first  # a new run in the same run dir (no checkpoint to continue): another
    assert f"{runs.WANDB}/" in remove_outputs(tmp_path)  # --overwrite: the W&B files go with the other outputs
    assert segment(True, 1) not in {first, None}  # nothing recorded to continue: a new W&B run
    (folder,) = (tmp_path / runs.WANDB).glob("offline-run-*")
    assert read_wandb(folder).history[1]["loss"] == 1.0 and read_wandb(folder).config == {"step": 1}
