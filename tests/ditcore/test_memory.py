"""ditcore.memory: the plan's parameters, state and activations against what a real tiny DiT holds (CPU).

What is measured, and how:
- parameters: `sum(p.numel())` of the real model; the tensor-parallel share from a closed form of the layers' sizes.
- weights, gradients, AdamW state and EMA: the bytes of the real tensors after one AdamW step, exactly; FSDP2's
  shards as torch.chunk cuts dim 0 (rank 0 holds the first, largest chunk).
- autocast's bf16 copies of parameters: the copies alive at once during a bf16 forward, exactly.
- activations: the bytes of the storages the training step makes (each storage once; parameters, views of them, the
  batch and autocast's parameter copies apart). Without checkpointing, what autograd saves is also counted with
  `saved_tensors_hooks`. Those hooks see nothing inside a checkpointed block (the checkpoint's own pack hooks replace
  any outer ones, and selective checkpointing keeps its tensors in a cache of its own), so for block and selective
  what is alive is tracked instead, op by op: after the forward (what it keeps: `Plan.saved_activations`) and at its
  peak (`Plan.activations`). With checkpointing the peak comes in the backward of the last block, when it is run
  again; without, at the end of the forward, where short-lived temporaries of the final layer and the loss, which
  the plan leaves to its headroom, put the measured peak up to 5% above the plan's.
- pipeline stages: the model pruned to each stage (split_stages), its parameters and state counted as above, its
  activations measured the same way: the forward starts from hidden states made under the meter (as the receive
  buffer is) and the backward from a gradient of ones. A last stage of one block sees the final layer's temporaries
  at up to 8% of its peak.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import subprocess
import sys
from types import SimpleNamespace
from unittest.mock import patch

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ditcore import models
from ditcore.diffusion import EMA, EDMLoss, EDMPrecond
from ditcore.errors import ConfigError
from ditcore.inputs import Inputs
from ditcore.job import Layout
from ditcore.layout import grid_positions
from ditcore.memory import (
    HEADROOM,
    GiB,
    Headroom,
    advise,
    choose_fsdp_sync,
    measured_state_bytes,
    on_stage,
    parameters,
    plan_from,
)
from ditcore.models import DiT, DiTConfig, apply_activation_checkpointing, build, preset
from ditcore.models.dit import DIT_PLAN, DiTBlock
from ditcore.parallel.dims import ParallelDims
from ditcore.parallel.pipeline import split_stages, stage_blocks
from ditcore.training import stage_forward

TOLERANCE = 0.10

CONFIGS = {
    "tiny": preset("DiT-Tiny"),
    "text": preset("DiT-Tiny", text_dim=16),
    "classes": preset("DiT-Tiny", num_classes=5, hidden_size=96, num_heads=4),
    "everything": preset("DiT-Tiny", text_dim=24, num_classes=7, fps_cond=True, depth=3, hidden_size=128),
    "video": preset("DiT-Tiny", patch_size_t=2, in_channels=8, depth=4, qk_norm=False, pos_embed="sincos"),
    # every block after the first with its own embedders (diffusers' DiT layout)
    "block-embedders": preset("DiT-Tiny", text_dim=24, num_classes=7, fps_cond=True, depth=3, block_embedders=True),
}

# Batches: a model, rows (each a list of the (T, H, W) token grids of the samples packed into it), tokens per row,
# text tokens per row (3 for each sample, padding the rest).
SHAPES = {
    "text-2x48": (preset("DiT-Tiny", text_dim=16, num_classes=5), [[(3, 4, 4)], [(2, 3, 4), (1, 4, 4)]], 48, 8),
    "plain-1x64": (preset("DiT-Tiny", depth=4, hidden_size=128), [[(1, 4, 8), (2, 4, 4)]], 64, 0),
    "fps-3x32": (preset("DiT-Tiny", depth=3, hidden_size=96, text_dim=24, fps_cond=True),
                 [[(2, 4, 4)], [(1, 4, 4), (1, 4, 4)], [(1, 2, 4)]], 32, 6),
    "own-embedders-2x48": (preset("DiT-Tiny", depth=3, num_classes=5, fps_cond=True, block_embedders=True),
                           [[(3, 4, 4)], [(2, 3, 4), (1, 4, 4)]], 48, 0),
}


# --------------------------------------------------------------------------------------------------
# Parameters


@pytest.mark.parametrize("name", CONFIGS)
def test_parameter_counts_are_the_models(name):
    cfg = CONFIGS[name]
    plan = plan_from(cfg, Layout())
    assert plan.params == plan.params_local == sum(p.numel() for p in DiT(cfg).parameters())


def test_a_tensor_parallel_rank_holds_the_split_layers_over_tp():
    cfg = CONFIGS["everything"]
    D, M = cfg.hidden_size, int(cfg.hidden_size * cfg.mlp_ratio)
    # Megatron splits qkv, cross.q, cross.kv and mlp.0 by output rows (weights and biases), attn.proj, cross.proj
    # and mlp.2 by input columns (their biases stay whole); so are every adaLN linear's output rows, the blocks' (6D)
    # and the final layer's (2D); everything else is replicated.
    column = (3 * D + D + 2 * D) * (D + 1) + M * (D + 1) + 6 * D * (D + 1)
    row = D * D + D * D + D * M
    split = cfg.depth * (column + row) + 2 * D * (D + 1)
    for tp in (2, 4):
        plan = plan_from(cfg, Layout(world_size=tp, tp=tp))
        assert plan.params_local == plan.params - split + split // tp


def test_planning_leaves_the_callers_random_numbers_alone():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    plan_from(CONFIGS["tiny"], Layout())  # builds a meta model, whose constructor draws a seed
    assert torch.equal(torch.rand(3), expected)


# --------------------------------------------------------------------------------------------------
# Weights, gradients, optimizer state, EMA


def train_one_step(cfg):
    torch.manual_seed(0)
    model = DiT(cfg, attention="sdpa")
    ema = EMA(model, 0.9)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch, _ = packed_batch(cfg, [[(2, 4, 4)], [(1, 4, 4), (1, 2, 4)]], 32, 6, torch.Generator().manual_seed(0))
    training_loss(model, batch).backward()
    optimizer.step()
    ema.update(model)
    return model, optimizer, ema


@pytest.mark.parametrize("name", ["text", "everything", "block-embedders"])
def test_state_bytes_are_those_of_a_real_training_step(name):
    cfg = CONFIGS[name]
    model, optimizer, ema = train_one_step(cfg)
    plan = plan_from(cfg, Layout(precision="fp32", device="cpu", attention="sdpa"))
    assert measured_state_bytes(model, optimizer, ema.module) == {
        "weights": plan.weights, "grads": plan.grads, "optimizer": plan.optimizer, "ema": plan.ema}
    assert plan.autocast_cache == plan.comm_buffers == 0  # fp32, one process


@pytest.mark.parametrize("shards", [3, 5])
def test_fsdp_shards_are_dim0_chunks_padded_up(shards):
    # FSDP2 cuts each parameter's dim 0 with torch.chunk: the first chunk, rank 0's, has ceil(rows / shards) rows and
    # every rank's buffer is that size. Counted here from the real model's tensors, not from the plan's formula.
    cfg = CONFIGS["everything"]
    model = DiT(cfg)
    largest = 4 * sum(torch.chunk(p, shards, dim=0)[0].numel() for p in model.parameters())
    assert largest > 4 * sum(p.numel() for p in model.parameters()) / shards  # the padding is there to see
    plan = plan_from(cfg, Layout(world_size=shards, fsdp=True, precision="fp32"))
    steps = 4 * len(list(model.parameters()))  # AdamW's step counters are not sharded
    assert (plan.weights, plan.grads, plan.ema, plan.optimizer) == (largest, largest, largest, 2 * largest + steps)


def test_fsdp_buffers_and_autocast_copies():
    cfg = CONFIGS["everything"]
    params = dict(DiT(cfg).named_parameters())
    block = sum(p.numel() for n, p in params.items() if n.startswith("blocks.0."))
    root = sum(p.numel() for n, p in params.items() if not n.startswith("blocks."))
    ddp = plan_from(cfg, Layout(world_size=4))
    assert ddp.autocast_cache == 2 * sum(p.numel() for n, p in params.items() if not n.startswith("y_embedder"))
    for reduce, reduce_bytes in (("fp32", 4), ("bf16", 2)):
        plan = plan_from(cfg, Layout(world_size=4, fsdp=True, reduce_dtype=reduce))
        # bf16: the root's and two blocks' parameters, the root's and one block's gradients, a reduce-scatter input
        assert plan.comm_buffers == 2 * (root + 2 * block) + 2 * (root + block) + reduce_bytes * block
        assert plan.autocast_cache == 0


def test_hsdp_shards_each_parameter_over_its_group():
    """fsdp_shard=2 of dp=4: each rank holds what FSDP over 2 ranks holds, the groups replicating each other."""
    cfg = CONFIGS["everything"]
    hsdp, fsdp2 = (plan_from(cfg, Layout(world_size=w, fsdp=True, fsdp_shard=k)) for w, k in ((4, 2), (2, None)))
    assert hsdp.layout.shards == 2
    parts = ("weights", "grads", "optimizer", "ema", "comm_buffers")
    assert [getattr(hsdp, k) for k in parts] == [getattr(fsdp2, k) for k in parts]
    assert "HSDP: FSDP2 over 2 ranks, replicated x 2, reduce in fp32, every micro-batch" in hsdp.layout.describe()
    with pytest.raises(ConfigError, match=r"fsdp_shard=3 is invalid: expected a divisor of dp x cp = 4 x 1: "
                                          r"one of 1, 2, 4, or null"):
        Layout(world_size=4, fsdp=True, fsdp_shard=3)


def test_fsdp_sync_once_per_step_keeps_the_stage_gathered_and_its_gradients_unsharded():
    cfg = CONFIGS["everything"]
    params = dict(DiT(cfg).named_parameters())
    every = sum(p.numel() for p in params.values())
    block = sum(p.numel() for n, p in params.items() if n.startswith("blocks.0."))
    root = sum(p.numel() for n, p in params.items() if not n.startswith("blocks."))
    for reduce, reduce_bytes in (("fp32", 4), ("bf16", 2)):
        layout = Layout(world_size=4, fsdp=True, reduce_dtype=reduce, fsdp_sync="step")
        # bf16: every parameter gathered; the running micro-batch's gradients of the root and a block; its scatter input
        one = plan_from(cfg, layout)
        assert one.comm_buffers == 2 * every + 2 * (root + block) + reduce_bytes * block
        # with 2 micro-batches, every gradient too, summed in the reduce dtype until the last one reduces them
        two = plan_from(cfg, layout.replace(micro_batches=2))
        assert two.comm_buffers == one.comm_buffers + reduce_bytes * every
        assert "gathered and reduced once per step" in layout.describe()


def test_auto_fsdp_sync_is_step_where_it_fits():
    cfg = CONFIGS["everything"]
    layout = Layout(world_size=4, fsdp=True, micro_batches=2)
    micro, step = (plan_from(cfg, layout.replace(fsdp_sync=s)).total for s in ("micro_batch", "step"))
    assert step > micro
    none = Headroom(fixed=0, fraction=0)
    assert choose_fsdp_sync(cfg, layout, None).fsdp_sync == "step"  # a CPU
    assert choose_fsdp_sync(cfg, layout, step, none).fsdp_sync == "step"
    assert choose_fsdp_sync(cfg, layout.replace(fsdp_sync="step"), step - 1, none).fsdp_sync == "micro_batch"
    assert choose_fsdp_sync(cfg, layout.replace(fsdp=False), None) == layout.replace(fsdp=False)
    changes, plan = advise(cfg, layout.replace(fsdp_sync="step"), step - 1, none)
    assert changes == [{"fsdp_sync": "micro_batch"}] and plan.total == micro


def test_autocast_copies_of_parameters_are_counted_exactly():
    cfg, rows, N, L = SHAPES["fps-3x32"]
    model = DiT(cfg, attention="sdpa")
    batch, _ = packed_batch(cfg, rows, N, L, torch.Generator().manual_seed(1))
    meter = ActivationMeter(model)
    with meter, torch.autocast("cpu", torch.bfloat16):
        training_loss(model, batch)
    assert meter.copies_peak == plan_from(cfg, Layout(precision="bf16", device="cpu", attention="sdpa")).autocast_cache


# --------------------------------------------------------------------------------------------------
# Activations


def packed_batch(cfg, rows, N, L, g) -> tuple[dict, int]:
    """Rows of N tokens packing samples of the given grids (padding after them); 3 text tokens per sample."""
    B, S = len(rows), max(len(r) for r in rows)
    pos, seg, text_seg = torch.zeros(B, N, 3, dtype=torch.long), torch.full((B, N), -1), torch.full((B, L), -1)
    for b, row in enumerate(rows):
        n = t = 0
        for s, grid in enumerate(row):
            k, tl = grid[0] * grid[1] * grid[2], min(3, L - t)
            pos[b, n:n + k], seg[b, n:n + k], text_seg[b, t:t + tl] = grid_positions(grid), s, s
            n, t = n + k, t + tl
    batch = dict(x=torch.randn(B, N, cfg.patch_dim, generator=g), noise=torch.randn(B, N, cfg.patch_dim, generator=g),
                 sigma=torch.rand(B, S, generator=g) + 0.3, mask=seg >= 0)
    labels = torch.randint(0, max(cfg.num_classes, 1), (B, S), generator=g)
    text = torch.randn(B, L, max(cfg.text_dim, 1), generator=g)
    batch["inputs"] = Inputs(pos=pos, seg=seg, class_labels=labels, fps=torch.full((B, S), 8.0), text_seg=text_seg,
                             text=text if cfg.text_dim else None)
    return batch, S


def whole_rows_batch(cfg, B, grid, L, g) -> dict:
    """B rows of one sample each, without padding: dit-train passes no seg then (and no text_seg with whole text)."""
    N = grid[0] * grid[1] * grid[2]
    batch = dict(x=torch.randn(B, N, cfg.patch_dim, generator=g), noise=torch.randn(B, N, cfg.patch_dim, generator=g),
                 sigma=torch.rand(B, 1, generator=g) + 0.3, mask=torch.ones(B, N, dtype=torch.bool))
    text = torch.randn(B, L, max(cfg.text_dim, 1), generator=g)
    batch["inputs"] = Inputs(pos=grid_positions(grid).expand(B, -1, -1), text=text if cfg.text_dim else None)
    return batch


def training_loss(model, b) -> torch.Tensor:
    """dit-train's loss for a batch: EDM preconditioning around the model, EDMLoss with the batch's σ and noise."""
    return EDMLoss()(EDMPrecond(model), b["x"], b["inputs"], mask=b["mask"], sigma=b["sigma"], noise=b["noise"])


class ActivationMeter(TorchDispatchMode):
    """Bytes of the storages that a training step's ops make and that are still alive, op by op, and their peak.

    Counted: whatever the forward makes, and in backward what ops run with gradients enabled make, i.e. the
    recomputation of checkpointed blocks (the backward's own ops, which make gradients, run with them disabled).
    Storages are counted once (views share them). A storage that an op reads before any op made it existed before:
    parameters, the batch, gradients, Megatron's all-gather buffer; it is not counted. autocast's bf16 copies of
    parameters are counted apart, in `copies`.
    """

    def __init__(self, model):
        super().__init__()
        self.params = {StorageWeakRef(p.untyped_storage()) for p in model.parameters()}
        self.existing = set(self.params)
        self.alive: dict[StorageWeakRef, int] = {}
        self.copies: dict[StorageWeakRef, int] = {}
        self.in_backward = False
        self.peak = self.copies_peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor):
                ref = StorageWeakRef(t.untyped_storage())
                if ref not in self.alive and ref not in self.copies:
                    self.existing.add(ref)
        out = func(*args, **(kwargs or {}))
        if not self.in_backward or torch.is_grad_enabled():
            source = args[0] if args and isinstance(args[0], torch.Tensor) else None
            copy = (func is torch.ops.aten._to_copy.default and source is not None
                    and StorageWeakRef(source.untyped_storage()) in self.params)
            for t in tree_leaves(out):
                if not isinstance(t, torch.Tensor):
                    continue
                ref = StorageWeakRef(t.untyped_storage())
                if ref in self.existing or (not copy and ref in self.copies):
                    continue
                (self.copies if copy else self.alive).setdefault(ref, t.untyped_storage().nbytes())
        self.peak = max(self.peak, self.bytes(self.alive))
        self.copies_peak = max(self.copies_peak, self.bytes(self.copies))
        return out

    @staticmethod
    def bytes(storages: dict[StorageWeakRef, int]) -> int:
        for ref in [ref for ref in storages if ref.expired()]:
            del storages[ref]
        return sum(storages.values())


def measure(cfg, mode: str, batch: dict, precision: str) -> tuple[int, int]:
    """(bytes alive after the forward, peak bytes over forward and backward) of a training step's activations."""
    torch.manual_seed(0)
    model = apply_activation_checkpointing(build(cfg, attention="sdpa"), mode)
    meter = ActivationMeter(model)
    autocast = torch.autocast("cpu", torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
    with meter:
        with autocast:
            loss = training_loss(model, batch)
        kept = meter.bytes(meter.alive)
        meter.in_backward = True
        loss.backward()
    return kept, meter.peak


def cpu_layout(**kw) -> Layout:
    return Layout(device="cpu", attention="sdpa", **kw)  # the kernels that run here


@pytest.mark.parametrize("shape", SHAPES)
def test_what_autograd_saves_without_checkpointing(shape):
    cfg, rows, N, L = SHAPES[shape]
    batch, S = packed_batch(cfg, rows, N, L, torch.Generator().manual_seed(1))
    model = DiT(cfg, attention="sdpa")
    held = [*model.parameters(), *(t for t in tree_leaves(batch) if torch.is_tensor(t))]
    skip = {StorageWeakRef(t.untyped_storage()) for t in held}
    saved: dict[StorageWeakRef, int] = {}

    def pack(t):
        ref = StorageWeakRef(t.untyped_storage())
        if ref not in skip:
            saved.setdefault(ref, t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        training_loss(model, batch)
    plan = plan_from(cfg, cpu_layout(micro_batch=len(rows), seq_length=N, text_len=L, samples_per_row=S,
                                     precision="fp32"))
    assert plan.saved_activations == pytest.approx(sum(saved.values()), rel=TOLERANCE)
    assert plan.activations == plan.saved_activations


CASES = [(shape, mode, "fp32") for shape in SHAPES for mode in ("none", "block", "selective")]
CASES += [("text-2x48", mode, "bf16") for mode in ("none", "block", "selective")]  # CPU autocast


# The other architectures on the same batches: MovieGen (RMSNorm, grouped-query attention, SwiGLU) and ST-DiT (masks
# and positions of frames and of time-lines, tokens regrouped in its temporal blocks)
ARCHS = [arch.tiny for arch in models.ARCHS.values() if arch.name != "dit"]  # every other registered one


def takes(name: str, shape: str) -> bool:
    """Does an architecture's tiny preset take a shape's options? (Wan refuses blocks with their own embedders.)"""
    try:
        preset(name, block_embedders=SHAPES[shape][0].block_embedders)
    except ConfigError:
        return False
    return True


CASES += [(f"{shape}:{name}", mode, precision) for name in ARCHS for shape, mode, precision in CASES
          if takes(name, shape)]


def shape_of(case: str):
    """A SHAPES entry, its model turned into another architecture's tiny preset by `SHAPE:PRESET`."""
    shape, _, name = case.partition(":")
    cfg, rows, N, L = SHAPES[shape]
    if name:
        cfg = preset(name, text_dim=cfg.text_dim, num_classes=cfg.num_classes, fps_cond=cfg.fps_cond,
                     block_embedders=cfg.block_embedders, depth=2 * cfg.depth)
    return cfg, rows, N, L


@pytest.mark.parametrize(("shape", "mode", "precision"), CASES)
def test_activations_kept_and_peak(shape, mode, precision):
    cfg, rows, N, L = shape_of(shape)
    batch, S = packed_batch(cfg, rows, N, L, torch.Generator().manual_seed(1))
    kept, peak = measure(cfg, mode, batch, precision)
    plan = plan_from(cfg, cpu_layout(micro_batch=len(rows), seq_length=N, text_len=L, samples_per_row=S,
                                     precision=precision, activation_checkpointing=mode))
    assert plan.saved_activations == pytest.approx(kept, rel=TOLERANCE)
    assert plan.activations == pytest.approx(peak, rel=TOLERANCE)


@pytest.mark.parametrize("mode", ["none", "block", "selective"])
@pytest.mark.parametrize("name", ["DiT-Tiny", *ARCHS])
def test_activations_of_whole_rows(mode, name):
    cfg = preset(name, text_dim=16)
    batch = whole_rows_batch(cfg, 2, (2, 4, 6), 8, torch.Generator().manual_seed(1))
    kept, peak = measure(cfg, mode, batch, "fp32")
    plan = plan_from(cfg, cpu_layout(micro_batch=2, seq_length=48, text_len=8, packed=False, precision="fp32",
                                     activation_checkpointing=mode))
    assert plan.saved_activations == pytest.approx(kept, rel=TOLERANCE)
    assert plan.activations == pytest.approx(peak, rel=TOLERANCE)


# An architecture the library has never seen, defined here: a DiT whose MLP is three times as wide as its config's ffn
# says and keeps one activation more (a SiLU after the GELU). Its memory plan and FLOP count must come from its own
# modules: nothing in its config tells them apart from the DiT's.


@dataclasses.dataclass(frozen=True)
class WideConfig(DiTConfig):
    pass


class WideBlock(DiTBlock):
    def __init__(self, cfg: WideConfig):
        super().__init__(cfg)
        D, M = cfg.hidden_size, 3 * cfg.ffn  # mlp.0 and mlp.2 keep their names: the DiT's TP plan covers them
        self.mlp = nn.Sequential(nn.Linear(D, M), nn.Sequential(nn.GELU(approximate="tanh"), nn.SiLU()),
                                 nn.Linear(M, D))


class WideDiT(DiT):
    block_class = WideBlock


@pytest.fixture
def wide():
    cfg = WideConfig(hidden_size=64, depth=2, num_heads=4, text_dim=16, num_classes=5)
    with patch.dict(models.ARCHS):  # registered for this test only
        models.register(models.Architecture("wide", WideConfig, WideDiT, {"Wide-Tiny": cfg}, tiny="Wide-Tiny",
                                            plan=DIT_PLAN, summary="the DiT with a 3x MLP (a test's)"))
        yield cfg


@pytest.mark.parametrize("mode", ["none", "selective"])
def test_a_new_architecture_is_planned_from_its_own_modules(wide, mode):
    _, rows, N, L = SHAPES["text-2x48"]
    batch, S = packed_batch(wide, rows, N, L, torch.Generator().manual_seed(1))
    kept, peak = measure(wide, mode, batch, "fp32")
    layout = cpu_layout(micro_batch=len(rows), seq_length=N, text_len=L, samples_per_row=S, precision="fp32",
                        activation_checkpointing=mode)
    plan = plan_from(wide, layout)
    assert plan.saved_activations == pytest.approx(kept, rel=TOLERANCE)
    assert plan.activations == pytest.approx(peak, rel=TOLERANCE)
    dit = plan_from(DiTConfig(**{f.name: getattr(wide, f.name) for f in dataclasses.fields(wide)}), layout)
    assert plan.saved_activations > dit.saved_activations  # the wider MLP and the SiLU's input, not the DiT's
    assert plan.params == sum(p.numel() for p in WideDiT(wide).parameters())


def test_a_new_architecture_is_counted_from_its_own_linears(wide):
    """FLOPs: its weights by what they multiply, against torch's FLOP counter over a real forward of one sample."""
    from torch.utils.flop_counter import FlopCounterMode

    from ditcore.flops import count_params

    model, N, T = build(wide), 32, 5
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.randn(1, N, wide.patch_dim), torch.zeros(1, 1), Inputs(
            grid_positions((2, 4, 4)), text=torch.randn(1, T, wide.text_dim), class_labels=torch.zeros(1, 1).long()))
    macs = sum(int(v) for op, v in counter.get_flop_counts()["Global"].items()
               if str(op) in ("aten.mm", "aten.addmm", "aten.bmm")) // 2
    c = count_params(wide)
    assert macs == c.per_token_params * N + c.per_text_token_params * T + c.per_sample_params
    assert c.per_token_params - count_params(preset("DiT-Tiny", text_dim=16)).per_token_params == 2 * 2 * 64 * 256 * 2


def test_checkpointing_orders_the_activations():
    cfg = preset("DiT-7B", text_dim=4096)
    act = {mode: plan_from(cfg, Layout(world_size=8, tp=2, sequence_parallel=True, seq_length=8192, text_len=128,
                                       activation_checkpointing=mode)).activations
           for mode in ("none", "selective", "block")}
    assert act["none"] > act["selective"] > act["block"]


# Tensor and context parallelism: two gloo processes, each measuring its own activations (rank 0's are compared).
PARALLEL = {"tp2": dict(tp=2), "tp2_sp": dict(tp=2, sequence_parallel=True), "cp2": dict(cp=2)}


@pytest.mark.slow
def test_activations_of_tensor_and_context_parallel_ranks(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "measured.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                           f"--master-port={port}", __file__, str(out)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    cfg, rows, N, L = SHAPES["text-2x48"]
    for case, (kept, peak, S) in json.loads(out.read_text()).items():
        name, mode = case.split()
        plan = plan_from(cfg, cpu_layout(world_size=2, **PARALLEL[name], micro_batch=len(rows), seq_length=N,
                                         text_len=L, samples_per_row=S, precision="fp32",
                                         activation_checkpointing=mode))
        assert plan.saved_activations == pytest.approx(kept, rel=TOLERANCE), case
        assert plan.activations == pytest.approx(peak, rel=TOLERANCE), case


def parallel_worker(out: str) -> None:
    """Under torchrun (2 processes): measure each layout of PARALLEL with every checkpointing mode; rank 0 writes."""
    import torch.distributed as dist

    from ditcore.parallel import ParallelDims, parallelize

    dist.init_process_group("gloo")
    cfg, rows, N, L = SHAPES["text-2x48"]
    results = {}
    for name, dims in PARALLEL.items():
        groups = ParallelDims(**dims).initialize()
        for mode in ("none", "block", "selective"):
            torch.manual_seed(0)
            model = apply_activation_checkpointing(parallelize(DiT(cfg, attention="sdpa"), groups), mode)
            batch, S = packed_batch(cfg, rows, N, L, torch.Generator().manual_seed(1))  # the same rows on both ranks
            training_loss(model, batch).backward()  # once first: lazily allocated state is not counted as activations
            model.zero_grad(set_to_none=False)
            meter = ActivationMeter(model)
            with meter:
                loss = training_loss(model, batch)
                kept = meter.bytes(meter.alive)
                meter.in_backward = True
                loss.backward()
            results[f"{name} {mode}"] = (kept, meter.peak, S)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------
# Pipeline parallelism: each stage planned from what ditcore.parallel.pipeline leaves on it


def stage_model(cfg, pp: int, stage: int, device="meta") -> DiT:
    """The one-device model pruned to a pipeline stage, as a rank of that stage holds it."""
    with torch.device(device):
        torch.manual_seed(0)
        model = DiT(cfg, attention="sdpa")
    return split_stages(model, SimpleNamespace(dims=ParallelDims(pp=pp), pp_rank=stage))


@pytest.mark.parametrize("pp", [2, 3])
@pytest.mark.parametrize("name", ["everything", "block-embedders"])
def test_a_pipeline_stage_holds_its_blocks_and_the_embedders(pp, name):
    cfg = CONFIGS[name]  # depth 3, every embedder (and with block_embedders each later block's own)
    whole = sum(p.numel() for p in DiT(cfg).parameters())
    for stage in range(pp):
        params = list(stage_model(cfg, pp, stage).parameters())
        held = sum(p.numel() for p in params)
        plan = plan_from(cfg, Layout(world_size=pp, pp=pp, precision="fp32"), stage=stage)
        assert (plan.params, plan.params_local, plan.stage) == (whole, held, stage)
        assert plan.weights == plan.grads == plan.ema == 4 * held  # no DDP: plain fp32 gradients
        assert plan.optimizer == 8 * held + 4 * len(params)
        assert plan.autocast_cache == 0


@pytest.mark.parametrize("tp", [1, 2])
def test_two_stages_halve_the_blocks_of_a_rank(tp):
    cfg = SHAPES["plain-1x64"][0]  # depth 4: two blocks a stage
    params = parameters(cfg, tp)
    size = lambda prefix: sum(p.numel for p in params if p.name.startswith(prefix))
    block, first, last = size("blocks.0."), size("x_embedder."), size("final.")
    one = plan_from(cfg, Layout(world_size=tp, tp=tp))
    stages = [plan_from(cfg, Layout(world_size=2 * tp, tp=tp, pp=2), stage=s) for s in (0, 1)]
    assert one.params_local - stages[0].params_local == 2 * block + last
    assert one.params_local - stages[1].params_local == 2 * block + first
    for plan in stages:  # fp32 weights, a bf16 copy of each (no embedding tables in this model)
        assert (plan.weights, plan.autocast_cache) == (4 * plan.params_local, 2 * plan.params_local)


def test_the_plan_is_the_most_loaded_stages():
    # depth 3 over 2 stages: the last one holds two blocks and the final layer; depth 4 with more micro-batches than
    # stages: the first one keeps two in flight
    for cfg, micro_batches, loaded in ((CONFIGS["everything"], 1, 1), (SHAPES["plain-1x64"][0], 8, 0)):
        layout = Layout(world_size=2, pp=2, micro_batches=micro_batches, seq_length=256)
        stages = [plan_from(cfg, layout, stage=s) for s in (0, 1)]
        plan = plan_from(cfg, layout)
        assert plan.stage == loaded and plan == stages[loaded]
        assert plan.total == max(p.total for p in stages) > min(p.total for p in stages)
        assert plan.table().splitlines()[0].split() == ["per", "GPU,", "pp", "stage", str(loaded), "of", "2", "GiB"]
    with pytest.raises(ValueError, match=r"stage=2 is invalid"):
        plan_from(cfg, layout, stage=2)


def test_1f1b_keeps_min_of_pp_minus_stage_and_the_micro_batches_in_flight():
    cfg = SHAPES["plain-1x64"][0]  # depth 4: a block a stage
    layout = Layout(world_size=4, pp=4, seq_length=64, activation_checkpointing="block")
    for stage in range(4):
        one = plan_from(cfg, layout, stage=stage)
        for micro_batches in (2, 3, 8):
            plan = plan_from(cfg, layout.replace(micro_batches=micro_batches), stage=stage)
            in_flight = min(4 - stage, micro_batches)
            assert plan.saved_activations == in_flight * one.saved_activations
            # the recomputation in backward is that of one block of one micro-batch
            assert plan.activations - plan.saved_activations == one.activations - one.saved_activations > 0
            assert (plan.weights, plan.comm_buffers) == (one.weights, one.comm_buffers)
    # without a pipeline, micro-batches run one after the other
    assert plan_from(cfg, Layout(micro_batches=8)).total == plan_from(cfg, Layout()).total


def test_a_stage_receives_the_gradient_of_its_hidden_states():
    cfg = SHAPES["plain-1x64"][0]
    layout = Layout(world_size=8, tp=2, sequence_parallel=True, pp=2, cp=2, micro_batch=3, seq_length=64)
    first, last = (plan_from(cfg, layout, stage=s) for s in (0, 1))
    megatron = 3 * 64 // 2 * cfg.hidden_size * 2  # SP's all-gather buffer: a rank's slice of the rows, bf16
    hidden = 3 * 64 // (2 * 2) * cfg.hidden_size * 2  # the tokens of this rank (cp, then sp), bf16
    assert (first.comm_buffers, last.comm_buffers) == (megatron + hidden, megatron)
    assert layout.describe().endswith("pp 2 x dp 1; 1F1B pipeline, 1 micro-batch a step; no DDP, no FSDP")


def test_state_bytes_of_a_real_pipeline_stage():
    cfg = CONFIGS["everything"]
    for stage in (0, 1):
        model = stage_model(cfg, 2, stage, device="cpu")
        ema = EMA(model, 0.9)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        optimizer.step()
        ema.update(model)
        plan = plan_from(cfg, Layout(world_size=2, pp=2, precision="fp32", device="cpu", attention="sdpa"),
                         stage=stage)
        assert measured_state_bytes(model, optimizer, ema.module) == {
            "weights": plan.weights, "grads": plan.grads, "optimizer": plan.optimizer, "ema": plan.ema}


def measure_stage(cfg, mode: str, batch: dict, pp: int, stage: int) -> tuple[int, int]:
    """`measure` for one pipeline stage: its forward from the hidden states the previous stage sent (made here, as
    the receive buffer is), and its backward from the gradient the next stage sends back (ones)."""
    model = apply_activation_checkpointing(stage_model(cfg, pp, stage, device="cpu"), mode)
    meter = ActivationMeter(model)
    B, N, _ = batch["x"].shape
    last = stage == pp - 1
    with meter:
        hidden = None if stage == 0 else torch.randn(N, B, cfg.hidden_size).requires_grad_()
        out = stage_forward(EDMLoss(), EDMPrecond(model), batch["x"], batch["inputs"], last=last, hidden=hidden,
                            sigma=batch["sigma"], noise=batch["noise"], mask=batch["mask"])
        kept = meter.bytes(meter.alive)
        meter.in_backward = True
        with torch.no_grad():
            grad = None if last else torch.ones_like(out)
        torch.autograd.backward(out, grad)
    return kept, meter.peak


@pytest.mark.parametrize("mode", ["none", "block", "selective"])
def test_activations_of_each_pipeline_stage(mode):
    cfg, rows, N, L = SHAPES["fps-3x32"]  # depth 3 over 3 stages: the first, one in the middle, the last
    batch, S = packed_batch(cfg, rows, N, L, torch.Generator().manual_seed(1))
    layout = cpu_layout(world_size=3, pp=3, micro_batch=len(rows), seq_length=N, text_len=L, samples_per_row=S,
                        precision="fp32", activation_checkpointing=mode)
    for stage in range(3):
        assert len(stage_blocks(cfg.depth, 3, stage)) == 1
        kept, peak = measure_stage(cfg, mode, batch, 3, stage)
        plan = plan_from(cfg, layout, stage=stage)
        assert plan.saved_activations == pytest.approx(kept, rel=TOLERANCE), stage
        assert plan.activations == pytest.approx(peak, rel=TOLERANCE), stage


# --------------------------------------------------------------------------------------------------
# The plan as a whole


@pytest.mark.parametrize(("layout", "message"), [
    (dict(world_size=6, tp=4), r"model_parallel='tp\*cp\*pp = 4\*1\*1 = 4' is invalid: expected a divisor of the "
                               r"world size 6"),
    (dict(world_size=8, tp=8), r"tp=8 is invalid: expected a divisor of the model's num_heads=4"),
    (dict(world_size=2, cp=2, seq_length=15), r"seq_length=15 is invalid: expected a multiple of cp = 2"),
    (dict(device="cpu"), r"attention='flex' is invalid: expected sdpa on a CPU"),
    (dict(activation_checkpointing="all"), r"activation_checkpointing='all' is invalid: expected one of"),
    (dict(world_size=4, pp=4), r"pp=4 is invalid: expected at most the model's depth=2"),
])
def test_layouts_that_cannot_run_are_refused(layout, message):
    with pytest.raises(ConfigError, match=message):
        plan_from(CONFIGS["tiny"], Layout(**layout))


def test_a_tp_that_splits_the_query_heads_but_not_the_key_value_groups_is_refused():
    # MovieGen-Tiny: 4 query heads in 2 groups; tp=4 (which --plan's advice tries) gave each rank 0 groups and a
    # ZeroDivisionError in the record
    with pytest.raises(ConfigError, match=r"tp=4 is invalid: .* num_kv_heads=2"):
        plan_from(preset("MovieGen-Tiny"), Layout(world_size=4, tp=4))


def test_total_fits_and_table():
    plan = plan_from(CONFIGS["everything"], Layout(world_size=2, micro_batch=2, seq_length=64, text_len=16))
    parts = (plan.weights, plan.grads, plan.optimizer, plan.ema, plan.autocast_cache, plan.comm_buffers,
             plan.activations)
    assert plan.total == sum(parts)
    smallest = (plan.total + 4 * GiB) / 0.95  # the card it just fits, keeping 4 GiB and 5% of the card free
    assert plan.fits(smallest + 1) and not plan.fits(smallest - 1)
    none = Headroom(fixed=0, fraction=0)
    assert plan.fits(plan.total, none) and not plan.fits(plan.total - 1, none)
    table = plan.table(80 * GiB).splitlines()
    assert table[-2].split() == ["total", f"{plan.total / GiB:.2f}"]
    assert table[-1] == ("fits in 80 GiB: 72.0 GiB usable after headroom 4.0 GiB + 5% of the card for the CUDA "
                         "context, cuBLAS/NCCL workspaces, the compiler and fragmentation")
    assert plan.table(smallest - 1).splitlines()[-1].startswith("does NOT fit in ")


def test_the_headroom_is_a_fixed_part_and_a_fraction_of_the_card():
    assert (HEADROOM.fixed, HEADROOM.fraction) == (4 * GiB, 0.05)
    assert HEADROOM.usable(80 * GiB) == 72 * GiB
    assert HEADROOM.usable(79 * GiB) == pytest.approx(71.05 * GiB)  # an H100 "80 GB" as torch reports it, ~79.1
    assert HEADROOM.usable(4 * GiB) == 0  # a card smaller than the headroom holds nothing of the plan
    with pytest.raises(ValueError, match="expected bytes >= 0 and a fraction in \\[0, 1\\)"):
        Headroom(fixed=GiB, fraction=1.0)


def test_advice_for_a_7b_model_on_8_gpus():
    cfg = preset("DiT-7B", text_dim=4096)
    layout = Layout(world_size=8, tp=2, sequence_parallel=True, seq_length=8192, text_len=128,
                    activation_checkpointing="selective")
    assert not plan_from(cfg, layout).fits(80 * GiB)
    changes, plan = advise(cfg, layout, 80 * GiB)
    assert changes == [{"fsdp": True}] and plan.fits(80 * GiB)
    # without checkpointing, 64k-token rows need more than sharding
    changes, plan = advise(cfg, layout.replace(seq_length=65536, activation_checkpointing="none"), 80 * GiB)
    assert changes[0] == {"fsdp": True} and len(changes) > 1 and plan.fits(80 * GiB)


def test_advice_for_pipeline_stages_shards_them_first():
    cfg = preset("DiT-7B", text_dim=4096)
    layout = Layout(world_size=8, tp=2, sequence_parallel=True, pp=2, seq_length=16384, text_len=128,
                    micro_batches=8)
    plan = plan_from(cfg, layout)
    assert plan.stage == 0 and not plan.fits(80 * GiB)  # two micro-batches of 16k tokens in flight on the first
    changes, plan = advise(cfg, layout, 80 * GiB)  # each stage sharded over its dp = 2 ranks, then recomputation
    assert changes == [{"fsdp": True}, {"activation_checkpointing": "selective"}] and plan.fits(80 * GiB)
    assert plan.weights < 0.51 * plan_from(cfg, layout).weights  # the stage's fp32 weights halved (dim 0 padded)


@pytest.mark.parametrize("shards", [2, 3])
def test_fsdp_over_a_pipeline_stage_shards_the_stages_parameters(shards):
    """pp=2 with FSDP: a rank holds the dim-0 chunks (torch.chunk's first, the largest) of its stage's parameters
    only, over the stage's dp ranks; its buffers are those of its own blocks (the later stage's, not blocks.0)."""
    cfg = SHAPES["plain-1x64"][0].replace(block_embedders=True)  # depth 4, later blocks larger: two a stage
    model = DiT(cfg)
    for stage in (0, 1):
        plan = plan_from(cfg, Layout(world_size=2 * shards, pp=2, fsdp=True, precision="fp32"), stage=stage)
        mine = [(n, p) for n, p in model.named_parameters() if on_stage(n, cfg, 2, stage)]
        largest = 4 * sum(torch.chunk(p, shards, dim=0)[0].numel() for _, p in mine)
        assert (plan.weights, plan.grads, plan.ema) == (largest, largest, largest)
        assert plan.optimizer == 2 * largest + 4 * len(mine)
        block = max(sum(p.numel() for n, p in mine if n.startswith(f"blocks.{i}.")) for i in stage_blocks(4, 2, stage))
        root = sum(p.numel() for n, p in mine if not n.startswith("blocks."))
        hidden = 0 if stage else plan_from(cfg, Layout(world_size=2, pp=2, precision="fp32"), stage=0).comm_buffers
        # fp32: the root's and two blocks' parameters, the root's and one block's gradients, a reduce-scatter input
        assert plan.comm_buffers == 4 * (root + 2 * block) + 4 * (root + block) + 4 * block + hidden

if __name__ == "__main__":
    parallel_worker(sys.argv[1])
