"""Communication of a training step, modelled before any process starts: `traffic(cfg, layout)`.

What one rank sends, per process group and collective, every micro-batch and once per optimizer step (the types and
the bytes' ring convention: ditcore.parallel.counting, whose counter checks this model in
tests/ditcore/parallel/test_equivalence.py). Learned from the model, not written out per architecture:

- tensor and sequence parallelism: the probe's forward of one period of blocks at a rank's shapes (ditcore.probe's
  run, without checkpointing, which the memory plan's meter reads too: one run for both) reports every linear the TP
  plan splits (ditcore.models.plan), the rows it multiplies and the dtypes it sees. ColumnParallel: with SP an all-
  gather of its input in forward, again in backward for the weight's gradient, and a reduce-scatter of the input's
  gradient; without SP an all-reduce of the input's gradient. `gather_output`: an all-gather of the output features,
  an all-reduce of the input's gradient (under SP, where each rank applies the gathered features to its own tokens,
  their gradient reduce-scattered too). RowParallel: with SP a reduce-scatter of the output in forward and an all-
  gather of its gradient in backward; without SP an all-reduce in forward. Under bf16 every gather of activations runs
  in the autocast dtype. A norm over every head's features (NormOverHeads, Wan's QK norms): each token's float32 sum
  of squares all-reduced in forward, and its gradient in backward;
- context parallelism: each attention's key/value all-gather (a reduce-scatter in backward), and the all-to-alls of
  an architecture that regroups tokens between blocks (ST-DiT: between frames and lines order), as many tokens as
  leave the rank, which its registration counts for the planned rows (`Architecture.token_moves`), with the SP
  gathers around them; the SP/CP gathers of the output;
- activation checkpointing reruns the forward's collectives of every block in backward (block: all of the block;
  selective: its policy keeps matmul and attention outputs only, ditcore.models.techniques, so the collectives run
  again too);
- once per step: finalize_grads' all-reduce of the gradients that are partial over TP (fp32), grad_norm's float64
  scalars, DDP's all-reduce of every gradient (fp32) over DP x CP, the pipeline's all-reduce of the gradients over
  DP x CP and of the stage-shared embedders' over the stages;
- FSDP2 (one unit per block, the root holding the rest): per micro-batch each block's parameters all-gathered in
  forward and again in backward (resharded after forward), but the last block's and the root's once (kept), in the
  param dtype (bf16 under bf16 precision), padded along dim 0 to a multiple of the shard count; their gradients
  reduce-scattered in `reduce_dtype`. HSDP (`fsdp_shard`): the same over the shard group, and an all-reduce of the
  sharded gradients over the replicate group. `fsdp_sync="step"`: the gathers and the reductions once per step;
- the pipeline: per micro-batch the hidden states sent on and their gradient sent back, in the compute dtype;
- expert parallelism: per MoE block and micro-batch (the probe's experts see the rank's (token, choice) rows) the
  dispatch's buffer of ep·C rows sent and the outputs sent back, in the compute dtype, their gradients the other way
  in backward, and the int32 expert ids of the slots in forward, (ep−1)/ep of each leaving the rank
  (ditcore.parallel.expert_parallel); once per step the experts' gradients (1/ep of them: outside DDP's) all-reduced
  over the expert-data-parallel group and a float64 square sum over EP for the norm. Under FSDP the experts are a
  unit of their own per MoE block, gathered and reduce-scattered as the blocks are but over the expert-data-parallel
  group (plain FSDP, HSDP too), with a float64 square sum over it for the norm instead of the all-reduce.

With pp > 1 the stage that sends the most bytes is reported (`traffic_by_stage` gives every stage's).
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import nn

from ditcore.job import Layout
from ditcore.memory import fit_grid, on_stage, planned_batch
from ditcore.models import ARCHS, arch_of, plan_for
from ditcore.models.dit import DiTConfig
from ditcore.models.moe import GroupedExperts
from ditcore.models.plan import ColumnParallel, NormOverHeads, RowParallel
from ditcore.parallel.counting import Collective, Group, Op, Traffic, When, sent_bytes
from ditcore.parallel.pipeline import is_shared, stage_blocks
from ditcore.probe import Hooks, Rank, RankShapes, block_period, meta_model, run, watch_every_run

FP32, FP64 = 4, 8
DDP_BUCKET = 25 * 2**20  # bytes: torch's DistributedDataParallel default
PP_BUCKET = 2**25  # elements: ditcore.parallel.pipeline._all_reduce


@dataclass(frozen=True)
class _Move:
    """One collective of the probe forward: where it ran (a block of the period, or before or after the blocks), and
    what it moves forward and backward."""

    region: int | str  # block index within the period; "pre" (embedders, conditioning); "post" (final layer)
    group: Group
    op: Op
    phase: str  # "forward" or "backward"
    full: int  # bytes of its full buffer
    n: int  # ranks in its group
    inside: bool = True  # within the block's forward, which activation checkpointing reruns in backward


def traffic(cfg: DiTConfig, layout: Layout, grids: tuple | None = None) -> Traffic:
    """What a rank of `layout` sends per micro-batch and per optimizer step: on the stage that sends the most.

    grids: the (T, H, W) token grids of each row's samples (a tuple per row, as PackedBatch.grids) when they are
    known: what ST-DiT's all-to-alls move depends on them. None: rows of planned clips (`_clip`)."""
    return max(traffic_by_stage(cfg, layout, grids), key=lambda t: t.bytes())


def per_step(t: Traffic, micro_batches: int) -> dict[Group, int]:
    """Bytes per group in one optimizer step: the micro-batches' times their number, plus the step's."""
    out: dict[Group, int] = defaultdict(int)
    for c in t.collectives:
        out[c.group] += c.bytes * (micro_batches if c.when == "micro_batch" else 1)
    return dict(out)


@functools.lru_cache(maxsize=64)
def traffic_by_stage(cfg: DiTConfig, layout: Layout, grids: tuple | None = None) -> tuple[Traffic, ...]:
    """traffic() of a rank of every pipeline stage, first to last."""
    lay = layout
    moves = _probe(cfg, RankShapes.of(lay, "none"), grids)  # checkpointing reruns its moves: `_micro_batch_traffic`
    period = block_period(meta_model(cfg))
    return tuple(_stage(cfg, lay, moves, period, s) for s in range(lay.pp))


def _stage(cfg: DiTConfig, lay: Layout, moves: tuple[_Move, ...], period: int, stage: int) -> Traffic:
    out: dict[tuple[Group, Op, When], list[int]] = defaultdict(lambda: [0, 0])

    def add(group: Group, op: Op, when: When, full: int, n: int, times: int = 1, pieces: int = 1) -> None:
        """`times` collectives of `full` bytes, or one in `pieces` (buckets) that add up to `full`."""
        if n > 1 and times:
            c = out[group, op, when]
            c[0] += times * pieces
            c[1] += times * sent_bytes(op, full, n)

    compute = 2 if lay.precision == "bf16" else FP32
    _micro_batch_traffic(cfg, lay, moves, period, stage, add, compute)
    _step_traffic(cfg, lay, stage, add, compute)
    return Traffic(tuple(Collective(g, op, when, count, size) for (g, op, when), (count, size) in sorted(out.items())))


def _micro_batch_traffic(cfg: DiTConfig, lay: Layout, moves: tuple[_Move, ...], period: int, stage: int, add,
                         compute: int) -> None:
    """Each micro-batch's: the probed moves of this stage's blocks (twice inside a recomputed block's forward), of
    the embedders and the final layer, and the pipeline's hidden states."""
    blocks = stage_blocks(cfg.depth, lay.pp, stage)
    kinds = defaultdict(int)  # block of the period → how many of that kind this stage holds
    for i in blocks:
        kinds[i % period] += 1
    recompute = lay.activation_checkpointing != "none"
    for m in moves:
        if isinstance(m.region, int):
            times = kinds[m.region] * (2 if recompute and m.inside and m.phase == "forward" else 1)
        else:  # the embedders and conditioning run on every stage; the final layer on the last
            times = int(m.region == "pre" or stage == lay.pp - 1)
        add(m.group, m.op, "micro_batch", m.full, m.n, times)
    if lay.pp > 1:  # the hidden states of the tokens a rank holds, on to the next stage and their gradient back
        sp = lay.tp if lay.sequence_parallel else 1
        hidden = lay.micro_batch * lay.seq_length // (lay.cp * sp) * cfg.hidden_size * compute
        add("pp", "send", "micro_batch", hidden, 2, (stage < lay.pp - 1) + (stage > 0))


def _step_traffic(cfg: DiTConfig, lay: Layout, stage: int, add, compute: int) -> None:
    """Each step's: FSDP's gathers and reduce-scatters, the gradient reductions and the gradient norm's."""
    params = _stage_params(cfg, lay, stage)
    if lay.fsdp:
        _fsdp(lay, params, add, compute)
    partial = [p for p in params if p.partial]
    if lay.tp > 1 and partial:  # finalize_grads: one flat all-reduce of this rank's (FSDP: local) pieces
        add("tp", "all_reduce", "step", FP32 * sum(p.local(lay) for p in partial), lay.tp)
    dp_cp = lay.dp * lay.cp
    if not lay.fsdp and lay.pp == 1 and dp_cp > 1:  # DDP: every gradient (but EP's experts), in fp32 buckets
        size = FP32 * sum(p.numel for p in params if not p.expert)
        add("dp", "all_reduce", "step", size, dp_cp, pieces=math.ceil(size / DDP_BUCKET))
    _expert_step(lay, params, add)
    if lay.pp > 1:  # pipeline.reduce_grads: over DP x CP in buckets (FSDP has reduced them; EP's experts are
        # averaged by _expert_step's), then the shared embedders (under FSDP: their local pieces) over the stages
        numel = sum(p.numel for p in params if not p.expert)
        if not lay.fsdp:
            add("dp", "all_reduce", "step", FP32 * numel, dp_cp, pieces=math.ceil(numel / PP_BUCKET))
        add("pp", "all_reduce", "step", FP32 * sum(p.local(lay) for p in params if p.shared), lay.pp)
    # grad_norm: a float64 square sum over TP, the FSDP shards and the stages
    add("tp", "all_reduce", "step", FP64, lay.tp)
    if lay.fsdp:
        add("fsdp", "all_reduce", "step", FP64, lay.fsdp_shard or dp_cp)
    add("pp", "all_reduce", "step", FP64, lay.pp)


def _expert_step(lay: Layout, params: tuple[_Param, ...], add) -> None:
    """Expert parallelism's, once per step: expert_parallel.reduce_expert_grads' one flat all-reduce of the experts'
    gradients over the ranks holding the same experts (not under FSDP); grad_norm's float64 square sum of them over
    EP, and under FSDP over those ranks too."""
    if lay.ep > 1:
        edp = lay.dp * lay.cp // lay.ep
        if not lay.fsdp:  # (FSDP's reduce-scatters have summed them: `_fsdp`)
            add("edp", "all_reduce", "step", FP32 * sum(p.numel for p in params if p.expert), edp)
        add("ep", "all_reduce", "step", FP64, lay.ep)
        if lay.fsdp:  # and over the ranks they are sharded over
            add("edp", "all_reduce", "step", FP64, edp)


@dataclass(frozen=True)
class _Param:
    name: str
    shape: tuple[int, ...]  # on this TP rank
    partial: bool  # its gradient is partial over TP (finalize_grads sums it)
    shared: bool  # on every pipeline stage (the conditioning embedders)
    expert: bool = False  # a mixture of experts' expert weights, split over EP (shape: this rank's experts)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def padded(self, shards: int) -> int:
        """Elements FSDP2 gathers: dim 0 padded up to a multiple of the shard count."""
        return math.ceil(self.shape[0] / shards) * shards * math.prod(self.shape[1:])

    def local(self, lay: Layout) -> int:
        """Elements of its gradient on the rank that holds the most (FSDP: the first shard)."""
        if not lay.fsdp:
            return self.numel
        shards = lay.dp * lay.cp // lay.ep if self.expert else lay.fsdp_shard or lay.dp * lay.cp
        return min(self.shape[0], math.ceil(self.shape[0] / shards)) * math.prod(self.shape[1:])


def _stage_params(cfg: DiTConfig, lay: Layout, stage: int) -> tuple[_Param, ...]:
    return _tp_stage_params(cfg, lay.tp, lay.sequence_parallel and lay.tp > 1, lay.pp, stage, lay.ep)


@functools.lru_cache(maxsize=256)
def _tp_stage_params(cfg: DiTConfig, tp: int, sp: bool, pp: int, stage: int, ep: int = 1) -> tuple[_Param, ...]:
    """Cached: matching every parameter against the TP plan takes ~0.1 s at 30B, and a layout search (ditcore.speed)
    asks for the same tp and stage in hundreds of layouts."""
    model = meta_model(cfg)
    plan = plan_for(model)
    experts = {f"{m}.{k}" for m, module in model.named_modules() if isinstance(module, GroupedExperts)
               for k, _ in module.named_parameters(recurse=False)}
    out = []
    for name, p in model.named_parameters():
        if not on_stage(name, cfg, pp, stage):
            continue
        shape, dim = list(p.shape), plan.partition_dim(name)
        if dim is not None:
            shape[dim] //= tp
        expert = ep > 1 and name in experts
        if expert:
            shape[0] //= ep
        partial = tp > 1 and dim is None and plan.partial_over_tp(name, sp)
        out.append(_Param(name, tuple(shape), partial, pp > 1 and is_shared(model, name), expert))
    return tuple(out)


def _fsdp(lay: Layout, params: list[_Param], add, compute: int) -> None:
    """FSDP2's collectives (ditcore.parallel.fsdp): per unit (each block; the root, everything else) a gather of its
    parameters and a reduce-scatter of its gradients, then under HSDP their all-reduce across the replicas. Every
    micro-batch, a block but the last is resharded after forward and gathered again for backward; the last block
    and the root stay gathered. With fsdp_sync="step" each unit is gathered and reduced once per step."""
    units: dict[tuple[str, bool], list[_Param]] = defaultdict(list)  # (block or root, experts) → its parameters
    for p in params:
        units[".".join(p.name.split(".")[:2]) if p.name.startswith("blocks.") else "root", p.expert].append(p)
    reduce = FP32 if lay.reduce_dtype == "fp32" else 2
    once = lay.fsdp_sync == "step"
    when: When = "step" if once else "micro_batch"
    last = max((u for u, _ in units if u != "root"), key=lambda u: int(u.split(".")[1]), default=None)
    for (name, experts), unit in units.items():
        # EP's experts: a unit of their own, plain FSDP over the ranks holding the same experts
        group, shards = ("edp", lay.dp * lay.cp // lay.ep) if experts else ("fsdp", lay.fsdp_shard or lay.dp * lay.cp)
        gathered = sum(p.padded(shards) for p in unit)
        kept = once or name in ("root", last)  # not resharded after forward
        add(group, "all_gather", when, compute * gathered, shards, 1 if kept else 2)
        add(group, "reduce_scatter", when, reduce * gathered, shards)
        if not experts:
            add("replicate", "all_reduce", when, reduce * gathered // shards, lay.dp * lay.cp // shards)


# --------------------------------------------------------------------------------------------------
# The meter of the probe's run: one forward of one period of blocks at a rank's shapes


@functools.lru_cache(maxsize=64)
def _probe(cfg: DiTConfig, key: RankShapes, grids: tuple | None) -> tuple[_Move, ...]:
    """The collectives of one micro-batch's forward and backward on a TP/SP/CP rank, from the probe's run of one
    period of blocks at the rank's shapes (ditcore.probe, which the memory plan's meter reads too), and the all-to-alls
    of an architecture that regroups tokens (its registration's `token_moves`) for `grids`."""
    moves = run(cfg, key, _Meter, planned_batch)
    token_moves = ARCHS[arch_of(cfg)].token_moves
    if token_moves and key.cp > 1:
        model = meta_model(cfg.replace(depth=block_period(meta_model(cfg))))  # the period's blocks
        moves += tuple(_swaps(cfg, key, model, grids, token_moves))
    return moves


@watch_every_run
class _Meter(Hooks):
    """The traffic model's meter of the probe's run: every linear the plan splits and every row gather (the split's
    collectives, `_watch_rows`), with its region: a block of the period, or before or after the blocks."""

    def __init__(self, cfg: DiTConfig, key: RankShapes, rank: Rank):
        model = rank.model
        self.cfg, self.key, self.sp, self.bf16 = cfg, key, (key.tp if key.sp else 1), key.precision == "bf16"
        self.moves: list[_Move] = []
        self.region: int | str = "pre"
        plan = plan_for(model)
        for name, module in model.named_modules():
            style = plan.module_style(name) if name and key.tp > 1 else None
            if isinstance(style, ColumnParallel | RowParallel):
                module.register_forward_hook(lambda m, args, out, s=style: self.linear(s, m, args[0], out))
            elif isinstance(style, NormOverHeads) and next(module.parameters(), None) is not None:
                module.register_forward_hook(lambda m, args, out: self.norm_over_heads(args[0]))
        for i, block in enumerate(model.blocks):
            block.register_forward_pre_hook(lambda *_, i=i: setattr(self, "region", i))
        if key.ep > 1:
            for module in model.modules():
                if isinstance(module, GroupedExperts):
                    module.register_forward_hook(lambda m, args, out: self.dispatch(args[0], args[1]))
        model.final.register_forward_pre_hook(lambda *_: setattr(self, "region", "post"))
        _watch_rows(model, key, self.move, rank.cp)

    def read(self) -> tuple[_Move, ...]:
        return tuple(self.moves)

    def move(self, group: Group, op: Op, phase: str, full_bytes: int, n: int, inside: bool = True) -> None:
        if n > 1:
            self.moves.append(_Move(self.region, group, op, phase, full_bytes, n, inside))

    def dispatch(self, x: torch.Tensor, chosen: torch.Tensor) -> None:
        """Expert parallelism's all-to-alls of a MoE block (ditcore.parallel.expert_parallel.ExpertDispatch): C slots
        per peer for the rank's T·k rows, what leaves for the ep − 1 others."""
        ep = self.key.ep
        slots = (ep - 1) * math.ceil(self.cfg.moe.capacity_factor * chosen.numel() / ep)
        rows = slots * x.shape[-1] * self.activation(x)
        for phase in ("forward", "forward", "backward", "backward"):  # dispatch and combine, their gradients back
            self.move("ep", "all_to_all", phase, rows, ep)
        self.move("ep", "all_to_all", "forward", slots * 4, ep)  # the slots' int32 expert ids

    def activation(self, t: torch.Tensor) -> int:  # gathered in the autocast dtype under bf16
        return 2 if self.bf16 else t.element_size()

    def norm_over_heads(self, x: torch.Tensor) -> None:
        """A norm over every head's features (x: (..., heads, head_dim)): each token's float32 sum of squares
        all-reduced in forward, its gradient in backward."""
        sums = x.numel() // (x.shape[-2] * x.shape[-1]) * FP32
        self.move("tp", "all_reduce", "forward", sums, self.key.tp)
        if x.requires_grad:
            self.move("tp", "all_reduce", "backward", sums, self.key.tp)

    def linear(self, style, layer: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
        move, tp, sp, rows = self.move, self.key.tp, self.sp, x.numel() // x.shape[-1]
        if isinstance(style, ColumnParallel) and style.gather_output:  # every rank's output features
            gathered = y.numel() // y.shape[-1] * layer.weight.shape[0] * tp * y.element_size()
            move("tp", "all_gather", "forward", gathered, tp)
            if sp > 1:  # each rank applied them to its own tokens: their gradients summed
                move("tp", "reduce_scatter", "backward", gathered, tp)
            if x.requires_grad:
                move("tp", "all_reduce", "backward", x.numel() * x.element_size(), tp)
        elif isinstance(style, ColumnParallel) and sp > 1 and style.sequence_parallel:
            gathered = rows * sp * x.shape[-1] * self.activation(x)
            move("tp", "all_gather", "forward", gathered, tp)
            move("tp", "all_gather", "backward", gathered, tp)  # for the weight's gradient
            if x.requires_grad:
                move("tp", "reduce_scatter", "backward", gathered, tp)
        elif isinstance(style, ColumnParallel):
            if x.requires_grad:
                move("tp", "all_reduce", "backward", x.numel() * x.element_size(), tp)
        elif sp > 1:  # row parallel, its output reduce-scattered to the rank's tokens
            move("tp", "reduce_scatter", "forward", y.numel() * sp * y.element_size(), tp)
            move("tp", "all_gather", "backward", y.numel() * sp * y.element_size(), tp)
        else:
            move("tp", "all_reduce", "forward", y.numel() * y.element_size(), tp)


def _watch_rows(model: nn.Module, key: RankShapes, move, cp: int) -> None:
    """Record the row split's collectives (ditcore.parallel.context_parallel.SplitRows): the keys and values each
    attention gathers over `cp` ranks, the output gathered over SP then CP, the SP gathers around each move of a
    model that regroups tokens between blocks (`permutation`, outside the blocks)."""
    rows = model.rows
    sp = key.tp if key.sp else 1
    keys_values, gather = rows.keys_values, rows.gather

    def kv(k: torch.Tensor, v: torch.Tensor):
        move("cp", "all_gather", "forward", (k.numel() + v.numel()) * cp * k.element_size(), cp)
        move("cp", "reduce_scatter", "backward", (k.numel() + v.numel()) * cp * k.element_size(), cp)
        return keys_values(k, v)

    def gathered(out: torch.Tensor):
        move("tp", "all_gather", "forward", out.numel() * sp * out.element_size(), sp)
        # over CP the whole row: a model probed at a rank's rows (rank_model) holds 1/cp of it already (`_probe`)
        move("cp", "all_gather", "forward", out.numel() * sp * key.cp * out.element_size(), key.cp)
        return gather(out)

    rows.keys_values, rows.gather = kv, gathered
    if sp > 1:
        permutation = rows.permutation

        def watched(*args):
            permute = permutation(*args)

            def around(x: torch.Tensor):
                full = x.numel() * sp * (2 if key.precision == "bf16" else x.element_size())
                move("tp", "all_gather", "forward", full, key.tp, inside=False)  # between blocks: not recomputed
                move("tp", "reduce_scatter", "backward", full, key.tp, inside=False)
                return permute(x)

            return around

        rows.permutation = watched


def _swaps(cfg: DiTConfig, key: RankShapes, model: nn.Module, grids: tuple | None, token_moves) -> list[_Move]:
    """The all-to-alls under CP of an architecture that regroups tokens between blocks: each regrouping its
    registration names (`Architecture.token_moves`; ST-DiT: to lines order before a temporal block and back after)
    sends the tokens of the rank's slice that belong to another rank's slice in the other order (of the planned
    rows, the most loaded rank's), in the hidden states' dtype; the backward sends their gradients the same way. The
    rows are the given grids' or planned clips (`_clip`): the moves depend on the samples' grids, which a layout does
    not say."""
    S = key.samples_per_row if key.packed else 1
    rows = [list(row) for row in grids] if grids else [[_clip(key.seq_length // S, cfg.max_grid)] * S] * key.micro_batch
    width = cfg.hidden_size * FP32  # the residual stream stays fp32 under autocast
    out = []
    for i, counts in token_moves(model, rows, key.seq_length, key.cp):
        tokens = max(sum(row) - row[r] for r, row in enumerate(counts))  # leaving the rank that sends the most
        for phase in ("forward", "backward"):
            out.append(_Move(i, "cp", "all_to_all", phase, tokens * width, key.cp, inside=False))
    return out


def _clip(n: int, max_grid: tuple[int, int, int]) -> tuple[int, int, int]:
    """A (T, H, W) clip of n tokens within max_grid with as many frames as it has tokens per frame or fewer: a
    sample that both ST-DiT's frames and its time-lines split (an image, or a clip of one token per frame, would
    move nothing between the orders)."""
    T = max(t for t in range(1, min(n, max_grid[0]) + 1) if n % t == 0 and t * t <= n)
    return (T, *fit_grid(n // T, (1, *max_grid[1:]))[1:])
