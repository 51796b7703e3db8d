"""One run of the model at one rank's shapes, watched by the estimators that learn from it: `run(cfg, key, meter)`.

The memory plan (ditcore.memory), the traffic model (ditcore.traffic) and the FLOP count (ditcore.flops) all learn from
the model itself rather than a description of it: each watches the same kind of run with its own meter. A run builds
one period of the model's blocks (`block_period`) as a rank of a layout holds them (`rank_model`: its tensor-parallel
share, its slice of the rows), on fake tensors (shapes only: nothing is allocated, whatever the width), applies the
layout's activation checkpointing and runs the training forward (EDM preconditioning and loss, as dit-train) once on
the planned batch, with the kernels the layout's GPU runs (ditcore.cuda_keeps). Each meter attaches to the model
before the run, is entered around its forward and is read after it; the readings are cached by (cfg, key), so the
memory plan and the traffic model of one layout share one run: every meter registered with `watch_every_run` reads
every run.
"""

from __future__ import annotations

import contextlib
import functools
import gc
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from ditcore.cuda_keeps import CudaNorms, flex_keeps
from ditcore.diffusion import EDMLoss, EDMPrecond
from ditcore.job import Layout
from ditcore.models import apply_activation_checkpointing, build
from ditcore.models.dit import DiTConfig
from ditcore.parallel.standins import rank_share


@dataclass(frozen=True)
class RankShapes:
    """What a run of the model at one rank's shapes depends on: the key of the probe's readings."""

    tp: int
    sp: bool
    cp: int
    micro_batch: int
    seq_length: int
    text_len: int
    samples_per_row: int
    packed: bool
    precision: str
    checkpointing: str = "none"
    cuda: bool = True  # CUDA's kernels keep what the CPU's keep otherwise (ditcore.cuda_keeps)
    flex: bool = True
    compile: bool = False
    periods: int = 1  # of the blocks: the FLOP count tells a period's weights from the rest's with a second one
    ep: int = 1  # expert parallel: the traffic meter sizes the dispatch's all-to-alls by it (the run is one-device)

    @classmethod
    def of(cls, lay: Layout, checkpointing: str) -> RankShapes:
        """A rank of `lay`, run with `checkpointing` (the memory plan runs a checkpointed layout without it too)."""
        return RankShapes(lay.tp, lay.sequence_parallel and lay.tp > 1, lay.cp, lay.micro_batch, lay.seq_length,
                          lay.text_len, lay.samples_per_row, lay.packed, lay.precision, checkpointing,
                          cuda=lay.device == "cuda", flex=lay.attention == "flex", compile=lay.compile, ep=lay.ep)

    def replace(self, **changes) -> RankShapes:
        return replace(self, **changes)


@dataclass(frozen=True)
class Rank:
    """The model a run builds: one rank's (`rank_model`), its rows N tokens, their keys and values gathered over cp."""

    model: nn.Module
    N: int
    cp: int


class Meter(Protocol):
    """A watcher of one run: made (meter(cfg, key, rank)) before it, when it attaches its hooks to rank.model; entered
    around the forward (a TorchDispatchMode sees its ops; hooks alone need nothing); read inside, after the forward,
    while what it made is still alive."""

    def __enter__(self): ...

    def __exit__(self, *exc): ...

    def read(self): ...


class Hooks:
    """A meter that watches through module hooks only: nothing to enter."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


def fake_model(cfg: DiTConfig, attention: str = "sdpa", change=None, real: bool = False) -> nn.Module:
    """The model of `cfg` on fake CPU tensors (torch's FakeTensorMode, as `model.fake_mode`): it runs at any width
    and length, computing shapes, dtypes and strides only, so that a 30B-wide block allocates nothing. Run it, and
    make its inputs, inside `with model.fake_mode:`. `change(model)`, when given, edits the meta model before its
    parameters are made (`rank_model` gives it a tensor-parallel rank's share).

    real: the same model on real, uninitialised CPU tensors (`fake_mode` then does nothing), for a small one: a fake
    op costs about 0.3 ms of Python, a real one on small tensors a few µs, and the shapes and storages are the same.
    """
    with torch.random.fork_rng(devices=[]), torch.device("meta"):  # the constructor draws a seed: leave it be
        model = build(cfg, attention=attention)
    if change is not None:
        change(model)
    # the meta parameters are not fake
    model.fake_mode = contextlib.nullcontext() if real else FakeTensorMode(allow_non_fake_inputs=True)
    with model.fake_mode:
        model.to_empty(device="cpu")
    return model


@functools.lru_cache(maxsize=32)
def meta_model(cfg: DiTConfig) -> nn.Module:
    """The model of cfg on the meta device: shapes only. (Cached: planning a layout and its alternatives reads it
    several times; nothing may change it.)"""
    with torch.random.fork_rng(devices=[]), torch.device("meta"):  # the constructor draws a seed: leave it be
        return build(cfg)


def block_period(model: nn.Module) -> int:
    """The fewest blocks after which the model's blocks repeat (1: all alike; ST-DiT: 2, spatial and temporal; with
    a mixture of experts every `moe.every` blocks, told apart by their MLP's type)."""
    kinds = [(type(block), type(getattr(block, "mlp", None))) for block in model.blocks]
    return next(k for k in range(1, len(kinds) + 1)
                if len(kinds) % k == 0 and all(kind == kinds[i % k] for i, kind in enumerate(kinds)))


# Elements (the run's blocks' parameters on a rank and its largest activation, B x N x max(D, N)) under which a run
# is on real tensors rather than fake ones: ~16 MB in fp32, which small models and the tests' layouts stay under.
REAL_BELOW = 2**22


def rank_model(cfg: DiTConfig, key: RankShapes) -> Rank:
    """`key.periods` periods of cfg's blocks (`block_period`) as a rank of `key` holds them (`rank_share`): the layers
    its TP plan splits cut to this rank's share, its heads divided; with sequence parallelism its tokens split
    outside the split layers; with context parallelism its rows split; on fake tensors, with flex attention or sdpa.
    Its rows hold N tokens, the keys and values gathered over cp ranks. An architecture that moves whole frames to
    ranks (`context_parallel = "all_to_all"`) runs rows of seq_length / cp tokens, as a rank holds them, and gathers
    over none."""
    whole = meta_model(cfg)
    period = block_period(whole) * key.periods
    gather_cp = key.cp > 1 and whole.context_parallel == "all_gather"
    N = key.seq_length if key.cp == 1 or gather_cp else key.seq_length // key.cp
    cp = key.cp if gather_cp else 1
    sp = key.tp if key.sp else 1
    # A small rank runs for real: much faster, the same storages (REAL_BELOW). Not with flex, which attend() would
    # give dense copies of q, k and v on a real CPU tensor (for the CPU's flex kernel).
    held = sum(p.numel() for p in whole.blocks[:period].parameters())
    real = not key.flex and held // key.tp + key.micro_batch * N * max(cfg.hidden_size, N // cp) // cp < REAL_BELOW
    model = fake_model(cfg.replace(depth=period), "flex" if key.flex else "sdpa",
                       change=lambda m: rank_share(m, key.tp, sp, cp), real=real)
    return Rank(model, N, cp)


_EVERY_RUN: list[Callable] = []  # meters that read every run (`watch_every_run`)
_READINGS: OrderedDict[tuple, dict] = OrderedDict()  # (cfg, key, inputs) → {meter: reading}, least recent first
_KEPT = 256  # runs whose readings are kept: a layout search plans hundreds of layouts, a few dozen shapes


def watch_every_run(meter):
    """Have `meter` read every run (as a class decorator): the memory plan's and the traffic model's meters, so that
    whichever of them asks first for a layout's run, the other finds its reading."""
    _EVERY_RUN.append(meter)
    return meter


def run(cfg: DiTConfig, key: RankShapes, meter: Callable[..., Meter], inputs: Callable):
    """`meter`'s reading of the run of cfg at `key`'s shapes (the module docstring), run once for every meter that
    reads it (`watch_every_run`): cached. inputs: the planned batch's maker, ditcore.memory.planned_batch (the planner's
    batch, above this module), called as planned_batch(cfg, B, N, L, S, packed) under the model's fake mode."""
    cached = _READINGS.setdefault((cfg, key, inputs), {})
    _READINGS.move_to_end((cfg, key, inputs))
    if meter not in cached:
        cached |= _run(cfg, key, [m for m in dict.fromkeys([meter, *_EVERY_RUN]) if m not in cached], inputs)
    while len(_READINGS) > _KEPT:
        _READINGS.popitem(last=False)
    return cached[meter]


def _run(cfg: DiTConfig, key: RankShapes, meters: list, inputs: Callable) -> dict:
    rank = rank_model(cfg, key)
    apply_activation_checkpointing(rank.model, key.checkpointing)
    watching = {meter: meter(cfg, key, rank) for meter in meters}  # each attaches its hooks
    autocast = torch.autocast("cpu", torch.bfloat16) if key.precision == "bf16" else contextlib.nullcontext()
    with rank.model.fake_mode, flex_keeps(key.compile) if key.flex else contextlib.nullcontext(), \
            CudaNorms() if key.cuda else contextlib.nullcontext():
        batch = inputs(cfg, key.micro_batch, rank.N, key.text_len if cfg.text_dim else 0, key.samples_per_row,
                       key.packed)
        gc.freeze()  # what exists before the forward: the collection below looks at the forward's objects only
        try:
            with contextlib.ExitStack() as watched:
                for w in watching.values():
                    watched.enter_context(w)
                with autocast:
                    loss = EDMLoss()(EDMPrecond(rank.model), batch.pop("x"), **batch)
                # What the forward dropped is freed as in training, also where a meter's wrappers (traffic's of the
                # row split) hold it in a reference cycle: the memory meter then does not count it as alive
                gc.collect()
                readings = {meter: w.read() for meter, w in watching.items()}
        finally:
            gc.unfreeze()
        del loss
    return readings
