"""Memory per GPU of a DiT training step, planned before any process starts: `plan_from(cfg, layout)`.

One rank of a layout holds, in bytes:

- weights, grads, optimizer, ema: fp32 master weights (4 B a parameter), fp32 gradients (4 B), AdamW's exp_avg and
  exp_avg_sq (8 B, and a 4-byte step counter per parameter tensor), the fp32 EMA copy (4 B). A rank holds its
  tensor-parallel share of every parameter: the layers that the TP plan (ditcore.models.plan) splits
  divided by tp, the rest whole. With fsdp, FSDP2 shards each again over the dp x cp ranks along dim 0, padded up to a
  multiple of that count: a rank holds ceil(rows / (dp*cp)) rows of each (HSDP: over fsdp_shard of them, `shards`).
  Under expert parallelism a rank's E/ep experts of each MoE block are split over the dp*cp/ep ranks holding the same
  ones instead (HSDP too: `Param.held`).
  With pp > 1 a rank holds its pipeline stage's parameters only (ditcore.parallel.pipeline): its blocks
  (`stage_blocks`), the conditioning embedders (on every stage), the patch embedder on the first stage and the final
  layer on the last; with fsdp too, those sharded over the stage's dp x cp ranks.
- autocast_cache: under bf16 autocast without fsdp, the bf16 copies of the parameters that the forward makes and
  keeps for backward (autocast's cached casts of linear weights and biases; the norms cast their scales themselves;
  embedding tables are not cast). Counted whole: all of them are alive at the end of the forward. With fsdp the
  gathered parameters are bf16 already.
- comm_buffers: with fsdp (ditcore.parallel.fsdp: one FSDP unit per block, the root holds the embedders and the final
  layer), what is unsharded in the compute dtype: the parameters of the root (not resharded from its forward to the
  end of backward), of the running block and of the next one (prefetched; the last block, not resharded between its
  forward and backward, is the running one then), the gradients of the root (they accumulate until the end of
  backward) and of the running block; and that block's reduce-scatter input in the reduce dtype. Without fsdp, DDP's
  buckets are the gradients themselves (gradient_as_bucket_view=True); with pp > 1 there is no DDP, and the
  gradients are the plain fp32 ones counted above. With sequence parallelism, the all-gathered input of the running
  column-parallel linear (ditcore.parallel.tensor_parallel): a rank's whole slice of the rows. With pp > 1, on every
  stage but the last, the buffer that the gradient of its output arrives in: the hidden states (tokens it holds,
  micro_batch, hidden_size) in the compute dtype.
  With fsdp_sync "step" every block stays gathered from its forward to the step's last backward: the stage's
  parameters in the compute dtype instead of the root's and two blocks'; and with several micro-batches their
  unsharded gradients, summed in the reduce dtype (FSDP2's accumulation), besides the running micro-batch's.
- activations: the peak, over forward and backward, of what the forward keeps for backward, recorded from the model
  itself (`_Meter`): the probe's run (ditcore.probe, shared with the traffic model and the FLOP count) of its training
  forward on fake tensors (shapes only: nothing is allocated, whatever the width) at a rank's shapes, with the
  layout's checkpointing, and what is alive at its end is counted by where it was made. CUDA's kernels keep some
  things otherwise than the CPU's that the record runs: flex attention, fused RMSNorm and LayerNorm's statistics
  (`flex_keeps`, `CudaNorms`, `CUDA_KEEPS`). With pp > 1 the non-interleaved 1F1B schedule keeps, at its peak,
  min(pp - s, micro_batches) micro-batches in flight on stage s, each holding what its forward kept there: its
  blocks', the conditioning's (every stage), the patch embedder's (the first stage; the others keep the hidden states
  they received instead), the final layer's and the loss's (the last).

With pp > 1 the plan is computed for every stage and the most loaded one reported (`Plan.stage`): the first stage
keeps the most micro-batches in flight, the last one holds the final layer and the loss.

Not counted, so `Plan.fits` keeps `HEADROOM` free for them: the CUDA context, NCCL's own buffers, kernel workspaces,
gradients of activations in flight during backward, short-lived temporaries, the batch itself and the allocator's
fragmentation. The activations are those of eager PyTorch (tests/ditcore/test_memory.py measures them on CPU);
torch.compile usually keeps less, as its partitioner recomputes cheap elementwise work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ditcore.cuda_keeps import CUDA_KEEPS
from ditcore.errors import ConfigError
from ditcore.job import Layout
from ditcore.layout import grid_rows
from ditcore.models import inputs_of, plan_for
from ditcore.models.dit import DiTConfig
from ditcore.models.moe import GroupedExperts
from ditcore.parallel.pipeline import stage_blocks
from ditcore.probe import Rank, RankShapes, meta_model, run, watch_every_run

GiB = 2**30
DTYPE_BYTES = {"fp32": 4, "bf16": 2}
FP32 = 4
ADAM_STATES = 2  # exp_avg, exp_avg_sq
ADAM_STEP_BYTES = 4  # AdamW's step counter: a float32 tensor per parameter tensor


# The parts of a Plan that add up to its total, and how a table names them.
PARTS = {"weights": "weights (fp32 master)", "grads": "gradients (fp32)", "optimizer": "optimizer (AdamW, fp32)",
         "ema": "EMA weights (fp32)", "autocast_cache": "autocast bf16 weight copies",
         "comm_buffers": "communication buffers", "activations": "activations (peak)"}


@dataclass(frozen=True)
class Headroom:
    """GPU memory a plan leaves free for what it does not count: `fixed` bytes plus `fraction` of the card."""

    fixed: float  # bytes
    fraction: float

    def __post_init__(self) -> None:
        if not (self.fixed >= 0 and 0 <= self.fraction < 1):
            raise ValueError(f"headroom {self.fixed} B + {self.fraction} of the card is invalid: expected bytes >= 0 "
                             "and a fraction in [0, 1)")

    def usable(self, gpu_bytes: float) -> float:
        """Bytes of a card of `gpu_bytes` left for what the plan counts (0 when the headroom takes it all)."""
        return max(0.0, gpu_bytes * (1 - self.fraction) - self.fixed)

    def __str__(self) -> str:
        return (f"headroom {self.fixed / GiB:.1f} GiB + {self.fraction:.0%} of the card for the CUDA context, "
                "cuBLAS/NCCL workspaces, the compiler and fragmentation")


# What a training process holds on its GPU outside the plan's tensors, on an H100 with CUDA 12:
# - the CUDA context and the kernels it loads: ~0.5-1 GiB (lazily loaded modules, the default since CUDA 12.2);
# - cuBLAS workspaces: 32 MiB for every (handle, stream) on Hopper, which torch takes from its caching allocator
#   (pytorch/pytorch#89027); attention and cuDNN workspaces and Inductor's kernels are temporary, of that order;
# - NCCL: each communicator's buffers grow with its channels (up to 32 on NVLink) and peers: from a few hundred MiB
#   to ~1.6 GB for one communicator on 8 GPUs (NVIDIA/nccl#864, #986); dit-train uses one to four (DP or FSDP, TP,
#   CP, PP);
# - the caching allocator's fragmentation: memory it reserved but cannot hand out, typically 5-10% of the card, and
#   what the plan leaves out (activation gradients in flight, temporaries, the batch): it grows with the card.
# 4 GiB covers the first three; 5% of the card the last (4 GiB on 80 GiB: 72 GiB usable).
HEADROOM = Headroom(fixed=4 * GiB, fraction=0.05)


@dataclass(frozen=True)
class Plan:
    """Bytes per GPU (of the most loaded rank) for one training step: state, buffers and activations."""

    layout: Layout
    params: int  # the whole model's
    params_local: int  # one rank's: its pipeline stage's parameters, their tensor-parallel share
    weights: int
    grads: int
    optimizer: int
    ema: int
    autocast_cache: int
    comm_buffers: int
    activations: int  # the peak over forward and backward
    saved_activations: int  # what the forward keeps for backward; `activations` adds the recomputation in backward
    stage: int = 0  # the pipeline stage of the rank planned for (with pp > 1, the most loaded one)

    @property
    def total(self) -> int:
        return sum(getattr(self, part) for part in PARTS)

    def fits(self, gpu_bytes: float, headroom: Headroom = HEADROOM) -> bool:
        """Does the total fit in `gpu_bytes`, keeping `headroom` free for what the plan leaves out?"""
        return self.total <= headroom.usable(gpu_bytes)

    def table(self, gpu_bytes: float | None = None, headroom: Headroom = HEADROOM) -> str:
        """One line per part in GiB, the total, and whether it fits in gpu_bytes (when given) after `headroom`, which
        it names; with pp > 1 the title names the stage planned for."""
        title = f"per GPU, pp stage {self.stage} of {self.layout.pp}" if self.layout.pp > 1 else "per GPU"
        lines = [f"{title:<33}{'GiB':>8}"]
        lines += [f"  {label:<31}{getattr(self, part) / GiB:8.2f}" for part, label in PARTS.items()]
        lines.append(f"  {'total':<31}{self.total / GiB:8.2f}")
        if gpu_bytes is not None:
            verdict = "fits" if self.fits(gpu_bytes, headroom) else "does NOT fit"
            lines.append(f"{verdict} in {gpu_bytes / GiB:g} GiB: {headroom.usable(gpu_bytes) / GiB:.1f} GiB usable "
                         f"after {headroom}")
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# Parameters


@dataclass(frozen=True)
class Param:
    name: str
    shape: tuple[int, ...]  # on one tensor-parallel rank
    full: int  # elements on one device
    cast: bool  # bf16 autocast copies it (all but embedding tables)
    expert: bool = False  # a mixture of experts' expert weights split over ep > 1 (shape: one EP rank's experts)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def shard(self, shards: int) -> int:
        """Elements a rank holds when FSDP2 splits dim 0 over `shards` ranks (padded up to a multiple of them)."""
        return math.ceil(self.shape[0] / shards) * math.prod(self.shape[1:])

    def held(self, lay: Layout) -> int:
        """Elements a rank holds in `lay`: its FSDP piece, EP's experts over the ranks holding the same ones
        (ditcore.parallel.fsdp)."""
        return self.shard(lay.dp * lay.cp // lay.ep if self.expert and lay.fsdp else lay.shards)


def parameters(cfg: DiTConfig, tp: int = 1, ep: int = 1) -> list[Param]:
    """Every parameter of the model, counted on a meta-device model, with its shape on one tensor-parallel rank (and,
    for a mixture of experts' stacked expert weights, on one expert-parallel rank: its experts, dim 0 over ep)."""
    model = meta_model(cfg)
    params, plan = [], plan_for(model)
    for name, p in model.named_parameters():
        shape = list(p.shape)
        dim = plan.partition_dim(name)
        if dim is not None:
            if shape[dim] % tp:
                raise ConfigError("tp", tp, f"a divisor of {shape[dim]}, the size of {name} it splits")
            shape[dim] //= tp
        owner = model.get_submodule(name.rpartition(".")[0])
        if isinstance(owner, GroupedExperts):  # ditcore.parallel.expert_parallel: rank r holds experts r·E/ep on
            shape[0] //= ep
        params.append(Param(name, tuple(shape), p.numel(), cast=not isinstance(owner, nn.Embedding),
                            expert=ep > 1 and isinstance(owner, GroupedExperts)))
    return params


def on_stage(name: str, cfg: DiTConfig, pp: int, stage: int) -> bool:
    """Does pipeline stage `stage` of `pp` hold the parameter `name`? Its blocks (`stage_blocks`), the modules of the
    first or the last stage (the pipeline split of the model's plan), and every other module: the conditioning
    embedders."""
    split = plan_for(meta_model(cfg)).pipeline
    within = lambda module: name.startswith(module + ".")
    if within(split.layers):
        return int(name[len(split.layers) + 1:].partition(".")[0]) in stage_blocks(cfg.depth, pp, stage)
    if any(map(within, split.first)):
        return stage == 0
    if any(map(within, split.last)):
        return stage == pp - 1
    return True


# --------------------------------------------------------------------------------------------------
# The plan


def plan_from(cfg: DiTConfig, layout: Layout, stage: int | None = None) -> Plan:
    """Bytes per GPU of training `cfg` in `layout` (the module docstring says what each part counts): on a rank of
    pipeline stage `stage`, or by default of the most loaded stage (with pp = 1, the only one)."""
    lay = layout
    lay.dims.check_model(cfg.num_heads, lay.seq_length, cfg.depth, cfg.kv_heads, moe=cfg.moe)
    if stage is not None and not (isinstance(stage, int) and 0 <= stage < lay.pp):
        raise ValueError(f"stage={stage!r} is invalid: expected a pipeline stage in [0, {lay.pp})")
    params = parameters(cfg, lay.tp, lay.ep)
    act = _activations(cfg, lay)
    plans = [_stage_plan(cfg, lay, params, act, s) for s in (range(lay.pp) if stage is None else [stage])]
    return max(plans, key=lambda plan: plan.total)  # the first of the most loaded


def _stage_plan(cfg: DiTConfig, lay: Layout, params: list[Param], act: Activations, stage: int) -> Plan:
    """The plan of a rank of pipeline stage `stage`: its parameters' state, buffers and activations."""
    mine = [p for p in params if on_stage(p.name, cfg, lay.pp, stage)]
    held = sum(p.held(lay) for p in mine)  # elements of this rank's (TP and EP, then FSDP) shards
    weights = grads = ema = FP32 * held
    optimizer = ADAM_STATES * FP32 * held + ADAM_STEP_BYTES * len(mine)
    compute = DTYPE_BYTES[lay.precision]  # the forward's weights and activations
    autocast_cache = comm = 0
    if lay.fsdp:  # over the stage's DP x CP ranks, with pp > 1
        comm = _fsdp_buffers(lay, mine)
    elif lay.precision == "bf16":
        autocast_cache = compute * sum(p.numel for p in mine if p.cast)
    if lay.sequence_parallel and lay.tp > 1:  # the all-gathered input of the running column-parallel matmul
        comm += lay.micro_batch * lay.seq_length // lay.cp * cfg.hidden_size * compute
    if stage < lay.pp - 1:  # the gradient of the hidden states it sent on, received from the next stage
        comm += act.hidden
    saved, peak = _stage_activations(act, lay, stage_blocks(cfg.depth, lay.pp, stage), cfg.depth, stage)
    return Plan(layout=lay, params=sum(p.full for p in params), params_local=sum(p.numel for p in mine),
                weights=weights, grads=grads, optimizer=optimizer, ema=ema, autocast_cache=autocast_cache,
                comm_buffers=comm, activations=peak, saved_activations=saved, stage=stage)


def _fsdp_buffers(lay: Layout, mine: list[Param]) -> int:
    """FSDP2's unsharded parameters and gradients on a rank (the module docstring's comm_buffers)."""
    compute, reduce = DTYPE_BYTES[lay.precision], DTYPE_BYTES[lay.reduce_dtype]
    blocks: dict[str, int] = {}  # the stage's blocks (with pp > 1 not blocks.0 on every stage): the largest counts
    for p in mine:
        if p.name.startswith("blocks."):
            unit = ".".join(p.name.split(".")[:2])
            blocks[unit] = blocks.get(unit, 0) + p.numel
    block = max(blocks.values(), default=0)
    root = sum(p.numel for p in mine if not p.name.startswith("blocks."))
    unsharded_grads = root + block  # the root's accumulate through backward; a block's until reduce-scattered
    comm = compute * unsharded_grads + reduce * block  # + the block's reduce-scatter input
    if lay.fsdp_sync == "micro_batch":
        return comm + compute * (root + 2 * block)  # the root's, the running block's and the next one's parameters
    comm += compute * sum(p.numel for p in mine)  # every parameter, gathered for the whole step
    if lay.micro_batches > 1:  # and every gradient, summed over the micro-batches until the last one reduces them
        comm += reduce * sum(p.numel for p in mine)
    return comm


def choose_fsdp_sync(cfg: DiTConfig, layout: Layout, gpu_bytes: float | None, headroom: Headroom = HEADROOM) -> Layout:
    """An fsdp_sync left to the plan (dit-train's `auto`): gather and reduce once per step where the plan with it fits
    a GPU of gpu_bytes (None: on a CPU, whose memory the plan does not bound), else every micro-batch. Without fsdp,
    the layout as it is."""
    if not layout.fsdp:
        return layout
    step = layout.replace(fsdp_sync="step")
    if gpu_bytes is None or plan_from(cfg, step).fits(gpu_bytes, headroom):
        return step
    return layout.replace(fsdp_sync="micro_batch")


@dataclass(frozen=True)
class Activations:
    """Bytes of activations that one micro-batch's forward keeps for backward on one rank, by where they are kept."""

    blocks: tuple[int, ...]  # each block's (with checkpointing: its checkpoint's), over one period of the blocks
    final: tuple[int, ...]  # the same for the model's last period, whose last output only the head may keep
    recompute: int  # what a checkpointed block's backward brings back, beyond what its checkpoint kept
    shared: int  # outside the blocks, on every pipeline stage: the conditioning, positions, the text, masks
    embed: int  # the patch embedder's and the first block's input: the first stage
    head: int  # the final layer and the loss: the last stage, whose backward runs (and frees them) first
    hidden: int  # the hidden states of the tokens a rank holds: what a stage receives and keeps for backward

    def of_blocks(self, blocks: list[int], depth: int) -> int:
        period = len(self.blocks)
        return sum((self.final if i >= depth - period else self.blocks)[i % period] for i in blocks)


def _stage_activations(act: Activations, lay: Layout, blocks: list[int], depth: int, stage: int) -> tuple[int, int]:
    """(bytes the forwards in flight keep for backward, peak bytes over forward and backward) on a rank of `stage`,
    which holds `blocks`. Each micro-batch in flight keeps its forward's: a block's record holds what it made, its
    output included, so a stage that does not embed the patches keeps the hidden states it received instead. With
    checkpointing the peak comes in the oldest one's backward, when its last block runs again (on the last stage,
    once the head is freed)."""
    first, last = stage == 0, stage == lay.pp - 1
    kept = act.of_blocks(blocks, depth) + act.shared + (act.embed if first else act.hidden) + (act.head if last else 0)
    kept *= lay.in_flight(stage)
    return kept, kept + max(0, act.recompute - (act.head if last else 0))


def _activations(cfg: DiTConfig, lay: Layout) -> Activations:
    """What one micro-batch's forward keeps for backward on one rank, recorded from the model itself (`_Meter`):
    the layout's checkpointing kept per block, and what a checkpointed block's backward brings back, which is what
    it keeps without checkpointing less what its checkpoint kept."""
    kept = run(cfg, RankShapes.of(lay, lay.activation_checkpointing), _Meter, planned_batch)
    whole = run(cfg, RankShapes.of(lay, "none"), _Meter, planned_batch)
    recompute = max(w - k for w, k in zip(whole.blocks, kept.blocks, strict=True))
    return Activations(blocks=kept.blocks, final=kept.final, recompute=recompute,
                       shared=kept.shared, embed=kept.embed, head=kept.head, hidden=kept.hidden)


@dataclass(frozen=True)
class _Record:
    blocks: tuple[int, ...]  # by block, one period of the model's blocks
    final: tuple[int, ...]  # the last period's
    shared: int
    embed: int
    head: int
    hidden: int


@watch_every_run
class _Meter(TorchDispatchMode):
    """The memory plan's meter of the probe's run (ditcore.probe: one period of blocks at a rank's shapes, with the
    layout's activation checkpointing and CUDA's kernels): what is alive at the end of the forward, sorted by where
    it was made: in each block (from its start to the next one's: ST-DiT's regrouping between blocks included), the
    patch embedder (and the first block's input: the first pipeline stage's), the final layer and the loss (the last
    stage's), and everything else (the conditioning, positions, masks, text: every stage's).

    It counts the storages the ops of the forward make, each once (views share theirs), with the region of the
    forward that made it: `region`, which module hooks move along. Storages that existed before (parameters, the
    batch) and autocast's copies of parameters (`Plan.autocast_cache`) are not counted."""

    def __init__(self, cfg: DiTConfig, key: RankShapes, rank: Rank):
        super().__init__()
        model, self.cuda = rank.model, key.cuda
        self.params = {StorageWeakRef(p.untyped_storage()) for p in model.parameters()}
        self.existing: dict[StorageWeakRef, StorageWeakRef] = {ref: ref for ref in self.params}
        self.made: dict[StorageWeakRef, tuple[StorageWeakRef, object, int]] = {}  # storage → (ref, region, bytes)
        self.region: object = "shared"
        self.ends = {}  # the hidden states going into the first block and out of the last one (into the final layer)
        self.period = len(model.blocks)
        T = rank.N // rank.cp // (key.tp if key.sp else 1)  # the tokens a rank holds
        self.hidden = key.micro_batch * T * cfg.hidden_size * DTYPE_BYTES[key.precision]
        for i, block in enumerate(model.blocks):
            block.register_forward_pre_hook(lambda _, args, i=i: setattr(self, "region", i))
        model.x_embedder.register_forward_pre_hook(lambda *_: setattr(self, "region", "embed"))
        model.x_embedder.register_forward_hook(lambda *_: setattr(self, "region", "shared"))
        model.blocks[0].register_forward_pre_hook(self._first_input, prepend=True)
        model.final.register_forward_pre_hook(self._last_output)

    def _first_input(self, _, args) -> None:  # the hidden states a stage receives: the first stage makes them
        self.mark(args[0], "embed")
        self.ends["in"] = StorageWeakRef(args[0].untyped_storage())

    def _last_output(self, _, args) -> None:
        self.region = "head"
        storage = args[0].untyped_storage()
        self.ends["out"], self.ends["bytes"] = StorageWeakRef(storage), storage.nbytes()

    def read(self) -> _Record:
        alive, ends = self.alive(), self.ends
        # Another period's first block would keep the last one's output as the first block kept its input
        handed_on = ends["bytes"] if not ends["in"].expired() and ends["out"].expired() else 0
        final = tuple(alive.get(i, 0) for i in range(self.period))
        return _Record(blocks=(*final[:-1], final[-1] + handed_on), final=final, shared=alive.get("shared", 0),
                       embed=alive.get("embed", 0), head=alive.get("head", 0), hidden=self.hidden)

    @staticmethod
    def _live(table: dict, ref: StorageWeakRef) -> bool:
        """Is ref in table, and not a freed storage whose address a new one took?"""
        entry = table.get(ref)
        held = entry if isinstance(entry, StorageWeakRef) else entry[0] if entry else None
        if held is not None and held.expired():
            del table[ref]
            return False
        return held is not None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        for t in inputs:
            ref = StorageWeakRef(t.untyped_storage())
            if not self._live(self.made, ref) and not self._live(self.existing, ref):
                self.existing[ref] = ref
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and StorageWeakRef(inputs[0].untyped_storage()) in self.params:
            ref = StorageWeakRef(out.untyped_storage())  # autocast's copy of a parameter
            self.existing[ref] = ref
            return out
        keeps = dict(CUDA_KEEPS.get(func, ())) if self.cuda else {}
        for i, t in enumerate(tree_leaves(out)):
            if isinstance(t, torch.Tensor):
                ref = StorageWeakRef(t.untyped_storage())
                size = t.untyped_storage().nbytes()
                if i in keeps:
                    size = size // t.element_size() * keeps[i].itemsize
                if not self._live(self.existing, ref) and not self._live(self.made, ref):
                    self.made[ref] = (ref, self.region, size)
        return out

    def mark(self, t: torch.Tensor, region: object) -> None:
        """Count a tensor's storage as made in `region`."""
        ref = StorageWeakRef(t.untyped_storage())
        if self._live(self.made, ref):
            self.made[ref] = (self.made[ref][0], region, self.made[ref][2])

    def alive(self) -> dict[object, int]:
        by_region: dict[object, int] = {}
        for held, region, size in self.made.values():
            if not held.expired():
                by_region[region] = by_region.get(region, 0) + size
        return by_region


def planned_batch(cfg: DiTConfig, B: int, N: int, L: int, S: int, packed: bool) -> dict:
    """A training batch of the planned shapes (fake tensors: make it under the model's fake mode): B rows of N tokens,
    each packing S samples of equal grids (then padding) with L text tokens shared among them; or, not packed, one
    sample filling each row, without masks. The keyword arguments of the loss after x (the model's `inputs`, of its
    architecture's type)."""
    grid = fit_grid(N // S if packed else N, cfg.max_grid)
    inputs = inputs_of(cfg).planned(cfg, [[grid] * (S if packed else 1)] * B, N, L, packed)
    return {"x": torch.empty(B, N, cfg.patch_dim), "inputs": inputs, "sigma": torch.ones(B, S),
            "noise": torch.empty(B, N, cfg.patch_dim), "mask": grid_rows(inputs.grids, N)[0] >= 0}


def fit_grid(n: int, max_grid: tuple[int, int, int]) -> tuple[int, int, int]:
    """A (T, H, W) token grid of at most n tokens within max_grid: as wide, then as tall, as divides n."""
    for tokens in range(n, 0, -1):
        W = max(w for w in range(1, min(tokens, max_grid[2]) + 1) if tokens % w == 0)
        H = max(h for h in range(1, min(tokens // W, max_grid[1]) + 1) if tokens // W % h == 0)
        if tokens // (W * H) <= max_grid[0]:
            return tokens // (W * H), H, W
    raise ValueError(f"no token grid of {n} tokens fits max_grid={max_grid}")


# --------------------------------------------------------------------------------------------------
# Advice: what to change when a plan does not fit


def advise(cfg: DiTConfig, layout: Layout, gpu_bytes: float,
           headroom: Headroom = HEADROOM) -> tuple[list[dict], Plan]:
    """The changes of the layout's fields (one dict for each step of advice) that make the plan fit, and the plan they
    give (which may still not fit).

    Changes are tried in order of what they cost in speed: FSDP's gathers and reductions every micro-batch rather than
    once per step, sharding the state (fsdp: communication only), recomputing (selective, then block), a larger
    tensor-parallel degree (with sequence parallelism), one row per micro-batch. One is kept when it lowers the total;
    trying stops as soon as the plan fits.
    """
    candidates = [("fsdp_sync", {"fsdp_sync": "micro_batch"}), ("fsdp", {"fsdp": True})]
    candidates += [("checkpointing", {"activation_checkpointing": mode}) for mode in ("selective", "block")]
    tp = layout.tp * 2
    while tp <= layout.world_size // (layout.cp * layout.pp):
        candidates.append(("tp", {"tp": tp, "sequence_parallel": True}))
        tp *= 2
    if layout.micro_batch > 1:
        candidates.append(("micro_batch", {"micro_batch": 1}))

    plan, changes, kept = plan_from(cfg, layout), {}, {}
    for group, change in candidates:
        if plan.fits(gpu_bytes, headroom):
            break
        try:
            trial = plan_from(cfg, layout.replace(**(changes | change)))
        except ConfigError:  # e.g. a tp that does not divide the heads
            continue
        if trial.total < plan.total:
            plan, kept[group] = trial, {k: v for k, v in change.items() if getattr(layout, k) != v}
            changes |= change
    return list(kept.values()), plan


# --------------------------------------------------------------------------------------------------
# Measured


def measured_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                         ema_module: nn.Module | None = None) -> dict[str, int]:
    """Bytes of this process's real tensors: parameters, their gradients, optimizer state, EMA parameters and buffers.

    A sharded tensor counts its local part (a DTensor's `to_local()`); every tensor counts its own elements. Compare
    with a Plan's weights, grads, optimizer and ema.
    """

    def size(t) -> int:
        if not isinstance(t, torch.Tensor):
            return 0
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    params = list(model.parameters())
    out = {"weights": sum(size(p) for p in params), "grads": sum(size(p.grad) for p in params)}
    if optimizer is not None:
        out["optimizer"] = sum(size(v) for state in optimizer.state.values() for v in state.values())
    if ema_module is not None:
        out["ema"] = sum(size(t) for t in [*ema_module.parameters(), *ema_module.buffers()])
    return out
