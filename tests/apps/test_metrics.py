"""dit_train.metrics: device values recorded by name, read back in one transfer, logged as window means."""

import pytest
import torch

from dit_train.metrics import Metrics, bar_postfix
from ditcore.parallel import ParallelDims
from ditcore.testing import HostReads

# (loss, gradient norm, a metric a developer adds: the loss of the low-σ samples, recorded on some steps only)
STEPS = [(0.5, 4.0, 0.25), (0.25, 1.0, None), (0.125, 16.0, 0.75)]


def queue(metrics: Metrics, steps=STEPS, first: int = 1) -> None:
    for step, (loss, grad_norm, low) in enumerate(steps, first):
        metrics.record("loss", torch.tensor(loss))
        metrics.record("grad_norm", torch.tensor(grad_norm, dtype=torch.float64))
        if low is not None:
            metrics.record("loss_low_sigma", torch.tensor(low))
        metrics.end_step(step, seconds=0.5, tokens=100, flops=1e9, skipped=step % 2)


def test_a_window_logs_the_mean_of_every_recorded_value_grad_norm_included():
    """Before: grad_norm was the last step's value (here 16.0), and a new device metric took five edits in train.py."""
    metrics = Metrics()
    queue(metrics)
    assert metrics.read_back() == [(1, {"loss": 0.5, "grad_norm": 4.0, "loss_low_sigma": 0.25}),
                                   (2, {"loss": 0.25, "grad_norm": 1.0}),
                                   (3, {"loss": 0.125, "grad_norm": 16.0, "loss_low_sigma": 0.75})]
    logged = metrics.close_window(peak=1e10, dims=ParallelDims())
    assert logged["grad_norm"] == 7.0 and logged["loss"] == pytest.approx(0.875 / 3)
    assert logged["loss_low_sigma"] == 0.5  # the mean over the steps that recorded it
    seconds = 3 * logged["step_s"]  # 3 x 0.5 s to queue, and the wait for the device (charged to step 3)
    assert 1.5 <= seconds < 2 and logged["skipped"] == 2
    assert logged["tokens_per_s"] == pytest.approx(300 / seconds)
    assert logged["mfu"] == pytest.approx(3e9 / seconds / 1e10)
    assert bar_postfix(logged | {"lr": 1e-3, "tokens_per_s": 200.4, "mfu": 0.2}) == {
        "loss": "0.2917", "lr": "1.00e-03", "tok_s": "200", "mfu": "20.0%"}

    queue(metrics, STEPS[1:2], first=4)  # the next window holds only its own steps
    metrics.read_back()
    assert metrics.close_window(peak=1e10, dims=ParallelDims())["grad_norm"] == 1.0


def test_recording_never_waits_and_reading_back_is_one_transfer():
    """record and end_step only queue (HostReads treats the CPU as the device); read_back reads the values of every
    queued step at once: its one host read is of all 8 of them."""
    metrics = Metrics()
    with HostReads("cpu"):
        queue(metrics)
        with pytest.raises(RuntimeError, match=r"on a cpu tensor of shape \(8,\) makes the host wait"):
            metrics.read_back()
