"""What dit-train logs: device values recorded by name where a step computes them, read back all at once, and
reported per logging window as means, beside the window's throughput and MFU.

A step never waits for the device (tests/apps/test_train.py proves it): `record` keeps a value on the device, and
the host reads every queued step's values in one transfer (`read_back`), at the steps that log, checkpoint or
validate. A new device-side metric is one `record("name", value)` where the step computes it: its window mean is
then logged under that name (a CSV column, a TensorBoard tag); an entry in BAR shows it on the progress bar too.

A blend's datasets (ditcore.data.blend) are counted on the host as their batches are loaded (`drawn_counts`) and
logged as data/NAME/{samples,tokens,share} (`BlendWindow`).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import torch

# the progress bar's fields: label → (logged name, format)
BAR = {"loss": ("loss", "{:.4f}"), "lr": ("lr", "{:.2e}"), "tok_s": ("tokens_per_s", "{:.0f}"),
       "mfu": ("mfu", "{:.1%}")}


@dataclass
class Queued:
    """A step queued on the device whose values have not been read back yet."""

    step: int
    values: dict[str, torch.Tensor]  # 0-d, on the device
    seconds: float  # host time to queue it
    tokens: int
    flops: float
    skipped: int  # samples the loader passed over to fill it


@dataclass
class Window:
    """Steps since the last log line: their time, tokens, FLOPs and skipped samples, and the sum of each recorded
    value over the steps that recorded it."""

    time: float = 0.0
    steps: int = 0
    tokens: int = 0
    flops: float = 0.0
    skipped: int = 0
    sums: Counter = field(default_factory=Counter)
    counts: Counter = field(default_factory=Counter)

    def add(self, seconds: float, values: dict[str, float], tokens: int, flops: float, skipped: int = 0) -> None:
        self.time, self.steps = self.time + seconds, self.steps + 1
        self.tokens, self.flops, self.skipped = self.tokens + tokens, self.flops + flops, self.skipped + skipped
        self.sums.update(values)
        self.counts.update(values.keys())

    def metrics(self, peak: float, dims) -> dict:
        # tokens and FLOPs of this rank's rows, whose work tp x cp x pp devices share; every data-parallel rank does
        # the same work
        # step_s weights the window's rates when windows of packed rows differ in tokens and FLOPs
        out = {name: total / self.counts[name] for name, total in self.sums.items()}
        out |= {"tokens_per_s": self.tokens / self.time, "step_s": self.time / self.steps, "skipped": self.skipped,
                "mfu": self.flops / self.time / (peak * dims.tp * dims.cp * dims.pp)}
        if torch.cuda.is_initialized():  # on CPU the column is left out rather than written empty
            out["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30  # this rank's GPU, since the start
        return out


class Metrics:
    """The values of the steps queued since the last read-back, and the window since the last log line."""

    def __init__(self):
        self.recorded: dict[str, torch.Tensor] = {}  # the step under way
        self.queued: list[Queued] = []
        self.window = Window()

    def record(self, name: str, value: torch.Tensor) -> None:
        """A 0-d value of the step under way, on its device; nothing waits for it."""
        self.recorded[name] = value.detach()

    def end_step(self, step: int, seconds: float, tokens: int, flops: float, skipped: int) -> None:
        """The step under way is queued, with what the host counted of it."""
        self.queued.append(Queued(step, self.recorded, seconds, tokens, flops, skipped))
        self.recorded = {}

    def read_back(self) -> list[tuple[int, dict[str, float]]]:
        """Wait for the queued steps and read their values (one transfer); each step joins the window, the time spent
        waiting charged to the last one. Returns (step, values by name) of each."""
        if not self.queued:
            return []
        t0 = time.perf_counter()
        flat = iter(torch.stack([v.double() for q in self.queued for v in q.values.values()]).tolist()
                    if any(q.values for q in self.queued) else [])
        waited = time.perf_counter() - t0
        read = []
        for q in self.queued:
            values = {name: next(flat) for name in q.values}
            last = q is self.queued[-1]
            self.window.add(q.seconds + (waited if last else 0.0), values, q.tokens, q.flops, q.skipped)
            read.append((q.step, values))
        self.queued = []
        return read

    def close_window(self, peak: float, dims) -> dict[str, float]:
        """The window's means and rates, for the loggers (`peak`: FLOP/s of one device); the next window starts."""
        out = self.window.metrics(peak, dims)
        self.window = Window()
        return out


def bar_postfix(logged: dict[str, float]) -> dict[str, str]:
    """The progress bar's fields (BAR) of a logged window."""
    return {label: fmt.format(logged[name]) for label, (name, fmt) in BAR.items() if name in logged}


def drawn_counts(batch) -> Counter:
    """The samples and tokens of each dataset of a blend in `batch`, as "NAME/samples" and "NAME/tokens" counts."""
    out = Counter()
    for name, (samples, tokens) in batch.by_source().items():
        out[f"{name}/samples"] += samples
        out[f"{name}/tokens"] += tokens
    return out


class BlendWindow:
    """The figures of a blend's datasets logged at a step: data/NAME/samples and data/NAME/tokens, drawn since the run
    began (over every data-parallel rank and resume), and data/NAME/share, its share of the samples drawn since the
    previous log line (the weights, within sampling noise)."""

    def __init__(self, names: list[str]):
        self.names, self.last = names, Counter()

    def figures(self, total: Counter) -> dict[str, float]:
        window = {name: total[f"{name}/samples"] - self.last[f"{name}/samples"] for name in self.names}
        drawn = sum(window.values())
        out = {}
        for name in self.names:
            out[f"data/{name}/samples"] = total[f"{name}/samples"]
            out[f"data/{name}/tokens"] = total[f"{name}/tokens"]
            out[f"data/{name}/share"] = window[name] / drawn if drawn else float("nan")
        self.last = total
        return out
