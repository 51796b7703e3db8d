"""Memory per GPU of a DiT training step, planned before any process starts: `plan_from(cfg, layout)`.

One rank of a layout holds, in bytes:

- weights, grads, optimizer, ema: fp32 master weights (4 B a parameter), fp32 gradients (4 B), AdamW's exp_avg and
  exp_avg_sq (8 B, and a 4-byte step counter per parameter tensor), the fp32 EMA copy (4 B). A rank holds its
  tensor-parallel share of every parameter: the layers that the TP plan (ditcore.parallel.plan.DIT_PLAN) splits
  divided by tp, the rest whole. With fsdp, FSDP2 shards each again over the dp x cp ranks along dim 0, padded up to a
  multiple of that count: a rank holds ceil(rows / (dp*cp)) rows of each. With pp > 1 a rank holds its pipeline
  stage's parameters only (ditcore.parallel.pipeline): its blocks (`stage_blocks`), the conditioning embedders (on
  every stage), the patch embedder on the first stage and the final layer on the last.
- autocast_cache: under bf16 autocast without fsdp, the bf16 copies of the parameters that the forward makes and
  keeps for backward (autocast's cached casts of linear weights and biases; the norms cast their scales themselves;
  embedding tables are not cast). Counted whole: all of them are alive at the end of the forward. With fsdp the
  gathered parameters are bf16 already.
- comm_buffers: with fsdp (ditcore.parallel.fsdp: one FSDP unit per block, the root holds the embedders and the final
  layer), what is unsharded in the compute dtype: the parameters of the root (gathered again for the whole backward),
  of the running block and of the next one (prefetched), the gradients of the root (they accumulate until the end of
  backward) and of the running block; and that block's reduce-scatter input in the reduce dtype. Without fsdp, DDP's
  buckets are the gradients themselves (gradient_as_bucket_view=True); with pp > 1 there is no DDP, and the
  gradients are the plain fp32 ones counted above. With sequence parallelism, the all-gathered input of the running
  column-parallel linear (ditcore.parallel.tensor_parallel): a rank's whole slice of the rows. With pp > 1, on every
  stage but the last, the buffer that the gradient of its output arrives in: the hidden states (tokens it holds,
  micro_batch, hidden_size) in the compute dtype. (The hidden states a stage receives are its first block's input,
  counted in its activations.)
- activations: the peak, over forward and backward, of what the forward keeps for backward (`_activations`). With
  pp > 1 the non-interleaved 1F1B schedule keeps, at its peak, min(pp - s, micro_batches) micro-batches in flight on
  stage s, each holding what its forward kept there: its blocks', the conditioning's (every stage), the patch
  embedder's input (the first stage), the final layer's and the loss's (the last), and on every other stage the
  hidden states it sent on, until their gradient comes back.

With pp > 1 the plan is computed for every stage and the most loaded one reported (`Plan.stage`): the first stage
keeps the most micro-batches in flight, the last one holds the final layer and the loss.

Not counted, so `Plan.fits` keeps `HEADROOM` free for them: the CUDA context, NCCL's own buffers, kernel workspaces,
gradients of activations in flight during backward, short-lived temporaries, the batch itself and the allocator's
fragmentation. The activations are those of eager PyTorch (tests/ditcore/test_memory.py measures them on CPU);
torch.compile usually keeps less, as its partitioner recomputes cheap elementwise work.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from ditcore.errors import ConfigError
from ditcore.models import build, plan_for
from ditcore.models.dit import DIT_PLAN, DiTConfig, ScalarEmbedder
from ditcore.models.techniques import ACTIVATION_CHECKPOINTING
from ditcore.parallel.dims import ParallelDims
from ditcore.parallel.pipeline import stage_blocks

GiB = 2**30
DTYPE_BYTES = {"fp32": 4, "bf16": 2}
FP32, INT64 = 4, 8
ADAM_STATES = 2  # exp_avg, exp_avg_sq
ADAM_STEP_BYTES = 4  # AdamW's step counter: a float32 tensor per parameter tensor
FREQ_DIM = inspect.signature(ScalarEmbedder).parameters["freq_dim"].default  # sinusoidal features of a scalar


@dataclass(frozen=True)
class Layout:
    """Everything besides the architecture that decides a rank's memory: parallel layout, batch shape, techniques.

    Errors name the dit-train config keys these come from.
    """

    world_size: int = 1
    tp: int = 1
    cp: int = 1
    pp: int = 1  # pipeline stages: the blocks split into pp consecutive runs, one per rank
    sequence_parallel: bool = False
    fsdp: bool = False
    reduce_dtype: Literal["fp32", "bf16"] = "fp32"  # with fsdp: the dtype gradients are reduce-scattered in
    micro_batch: int = 1  # packed rows per forward on one rank
    micro_batches: int = 1  # per optimizer step on one rank (gradient accumulation): global_batch / (micro_batch*dp)
    seq_length: int = 256  # tokens per row
    text_len: int = 0  # text tokens per row, padding included (ignored by a model without text)
    samples_per_row: int = 1  # per-sample conditioning is (B, S, ...): small, but counted
    packed: bool = True  # rows pack several samples: per-token modulation, masked attention
    precision: Literal["bf16", "fp32"] = "bf16"  # bf16: autocast with fp32 master weights, as dit-train on a GPU
    activation_checkpointing: Literal["none", "block", "selective"] = "none"
    device: Literal["cuda", "cpu"] = "cuda"  # CUDA fuses RMSNorm; the CPU decomposes it, in fp32
    attention: Literal["flex", "sdpa"] = "flex"  # dit-train's `auto` trains with flex on a GPU
    compile: bool = False  # compiled blocks: selective checkpointing then sees (and keeps) flex's output too

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ConfigError("world_size", self.world_size, "an integer >= 1 (processes, one per GPU)")
        ParallelDims(self.tp, self.cp, self.pp, sequence_parallel=self.sequence_parallel).resolve(self.world_size)
        if self.fsdp and self.pp > 1:
            raise ConfigError("parallel.fsdp", True, "false with parallel.pp > 1: FSDP over pipeline stages is not "
                                                     "available yet (use tp/dp with pp, or fsdp without it)")
        for key, value in (("train.micro_batch", self.micro_batch), ("data.seq_length", self.seq_length),
                           ("samples_per_row", self.samples_per_row), ("micro_batches", self.micro_batches)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(key, value, "an integer >= 1")
        if not isinstance(self.text_len, int) or self.text_len < 0:
            raise ConfigError("text_len", self.text_len, "an integer >= 0 (text tokens per row)")
        choices = {"parallel.reduce_dtype": ("reduce_dtype", ("fp32", "bf16")),
                   "train.precision": ("precision", ("bf16", "fp32")),
                   "model.activation_checkpointing": ("activation_checkpointing", ACTIVATION_CHECKPOINTING),
                   "device": ("device", ("cuda", "cpu")), "model.attention": ("attention", ("flex", "sdpa"))}
        for key, (field, allowed) in choices.items():
            if getattr(self, field) not in allowed:
                raise ConfigError(key, getattr(self, field), "one of " + ", ".join(map(repr, allowed)))
        if self.device == "cpu" and self.attention == "flex":
            raise ConfigError("model.attention", "flex", "sdpa on a CPU: FlexAttention has no CPU backward")

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.cp * self.pp)

    @property
    def shards(self) -> int:
        """Ranks that FSDP2 shards each parameter over: data parallel x context parallel (1 without fsdp)."""
        return self.dp * self.cp if self.fsdp else 1

    def in_flight(self, stage: int) -> int:
        """Micro-batches whose activations pipeline stage `stage` keeps at once at its peak (1F1B; 1 without pp)."""
        return min(self.pp - stage, self.micro_batches)

    def replace(self, **changes) -> Layout:
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        sp = " + sequence parallel" if self.sequence_parallel and self.tp > 1 else ""
        if self.fsdp:
            wrap = f"FSDP2 over dp x cp = {self.shards}, reduce in {self.reduce_dtype}"
        elif self.pp > 1:
            n = self.micro_batches
            wrap = f"1F1B pipeline, {n} micro-batch{'es' if n > 1 else ''} a step; no DDP, no FSDP"
        else:
            wrap = "DDP, no FSDP"
        return f"world {self.world_size} = tp {self.tp}{sp} x cp {self.cp} x pp {self.pp} x dp {self.dp}; {wrap}"


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

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def shard(self, shards: int) -> int:
        """Elements a rank holds when FSDP2 splits dim 0 over `shards` ranks (padded up to a multiple of them)."""
        return math.ceil(self.shape[0] / shards) * math.prod(self.shape[1:])


def parameters(cfg: DiTConfig, tp: int = 1) -> list[Param]:
    """Every parameter of the DiT, counted on a meta-device model, with its shape on one tensor-parallel rank."""
    with torch.random.fork_rng(devices=[]), torch.device("meta"):  # DiT() draws a seed: leave the caller's RNG be
        model = build(cfg)
    params, plan = [], plan_for(model)
    for name, p in model.named_parameters():
        shape = list(p.shape)
        dim = plan.partition_dim(name)
        if dim is not None:
            if shape[dim] % tp:
                raise ConfigError("parallel.tp", tp, f"a divisor of {shape[dim]}, the size of {name} it splits")
            shape[dim] //= tp
        owner = model.get_submodule(name.rpartition(".")[0])
        params.append(Param(name, tuple(shape), p.numel(), cast=not isinstance(owner, nn.Embedding)))
    return params


def on_stage(name: str, depth: int, pp: int, stage: int) -> bool:
    """Does pipeline stage `stage` of `pp` hold the parameter `name`? Its blocks (`stage_blocks`), the modules of the
    first or the last stage (DIT_PLAN.pipeline), and every other module: the conditioning embedders."""
    split = DIT_PLAN.pipeline
    within = lambda module: name.startswith(module + ".")
    if within(split.layers):
        return int(name[len(split.layers) + 1:].partition(".")[0]) in stage_blocks(depth, pp, stage)
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
    ParallelDims(lay.tp, lay.cp, lay.pp, sequence_parallel=lay.sequence_parallel).check_model(
        cfg.num_heads, lay.seq_length, cfg.depth)
    if stage is not None and not (isinstance(stage, int) and 0 <= stage < lay.pp):
        raise ValueError(f"stage={stage!r} is invalid: expected a pipeline stage in [0, {lay.pp})")
    params = parameters(cfg, lay.tp)
    act = _activations(cfg, lay)
    plans = [_stage_plan(cfg, lay, params, act, s) for s in (range(lay.pp) if stage is None else [stage])]
    return max(plans, key=lambda plan: plan.total)  # the first of the most loaded


def _stage_plan(cfg: DiTConfig, lay: Layout, params: list[Param], act: Activations, stage: int) -> Plan:
    """The plan of a rank of pipeline stage `stage`: its parameters' state, buffers and activations."""
    mine = [p for p in params if on_stage(p.name, cfg.depth, lay.pp, stage)]
    held = sum(p.shard(lay.shards) for p in mine)  # elements of this rank's (TP, then FSDP) shards
    weights = grads = ema = FP32 * held
    optimizer = ADAM_STATES * FP32 * held + ADAM_STEP_BYTES * len(mine)
    compute = DTYPE_BYTES[lay.precision]  # the forward's weights and activations
    autocast_cache = comm = 0
    if lay.fsdp:  # one stage: Layout refuses fsdp with pp > 1
        block = sum(p.numel for p in mine if p.name.startswith("blocks.0."))
        root = sum(p.numel for p in mine if not p.name.startswith("blocks."))
        gathered = root + 2 * block  # parameters: the root's, the running block's and the next one's (prefetched)
        unsharded_grads = root + block  # the root's accumulate through backward; a block's until reduce-scattered
        comm = compute * (gathered + unsharded_grads) + DTYPE_BYTES[lay.reduce_dtype] * block  # + its scatter input
    elif lay.precision == "bf16":
        autocast_cache = compute * sum(p.numel for p in mine if p.cast)
    if lay.sequence_parallel and lay.tp > 1:  # the all-gathered input of the running column-parallel matmul
        comm += lay.micro_batch * lay.seq_length // lay.cp * cfg.hidden_size * compute
    if stage < lay.pp - 1:  # the gradient of the hidden states it sent on, received from the next stage
        comm += act.hidden
    saved, peak = _stage_activations(act, lay, len(stage_blocks(cfg.depth, lay.pp, stage)), stage)
    return Plan(layout=lay, params=sum(p.full for p in params), params_local=sum(p.numel for p in mine),
                weights=weights, grads=grads, optimizer=optimizer, ema=ema, autocast_cache=autocast_cache,
                comm_buffers=comm, activations=peak, saved_activations=saved, stage=stage)


@dataclass(frozen=True)
class Activations:
    """Bytes of activations that one micro-batch's forward keeps for backward on one rank, by where they are kept."""

    block: int  # each transformer block's (with checkpointing: its checkpoint's)
    recompute: int  # what a checkpointed block's backward brings back, less the cached outputs it releases
    shared: int  # outside the blocks, on every pipeline stage: the conditioning, RoPE, the text, masks
    embed: int  # the patch embedder's input: the first stage
    head: int  # the final layer and the loss: the last stage, whose backward runs (and frees them) first
    hidden: int  # the hidden states of the tokens a rank holds: what a stage sends on and keeps for backward


def _stage_activations(act: Activations, lay: Layout, blocks: int, stage: int) -> tuple[int, int]:
    """(bytes the forwards in flight keep for backward, peak bytes over forward and backward) on a rank of `stage`,
    which holds `blocks` blocks. Each micro-batch in flight keeps its forward's. With checkpointing the peak comes
    in the oldest one's backward, when its last block runs again (on the last stage, once the head is freed)."""
    first, last = stage == 0, stage == lay.pp - 1
    kept = blocks * act.block + act.shared + (act.embed if first else 0) + (act.head if last else act.hidden)
    kept *= lay.in_flight(stage)
    return kept, kept + max(0, act.recompute - (act.head if last else 0))


def _activations(cfg: DiTConfig, lay: Layout) -> Activations:
    """What one micro-batch's forward keeps for backward on one rank, block by block and outside the blocks.

    `saved` lists, op by op in DiTBlock.forward's order, what each op keeps for its backward without checkpointing:
    a linear keeps its input, LayerNorm its input, mean and rstd, RMSNorm its input and rstd, addcmul the factor the
    other's gradient needs (so a gate keeps the per-token modulations it is a view of; per_token's one-hot matmul
    keeps its one-hot, which its backward multiplies by, and in fp32 its gather the index), GELU its input,
    attention q, k, v, its output and logsumexp (fp32), SDPA its float mask; RoPE keeps only cos/sin, shared by all
    blocks.
    `cached` is what selective checkpointing keeps: the block's input and the outputs of its matmuls and attention
    kernels (models.techniques.SAVED_OPS). A name in both is one tensor, which backward reads from the cache. A
    matmul's output is the layer's output only for nn.Linear (tp = 1, or a replicated layer) on a contiguous input:
    one addmm. On a strided input (the modulated activations, the transposed text), or in a tensor-parallel linear,
    which adds its bias after the matmul (ditcore.parallel.tensor_parallel), it is a tensor of its own; a
    row-parallel one is whole before its reduction.

    The other architectures differ where their config says so: RMSNorms (`rms_norm`), fewer key/value heads
    (`kv_heads`: smaller keys and values, which attention reads for each query head of their group, without
    copies), a SwiGLU MLP (`gated_mlp`: gate_up's output, twice as wide, SiLU's, their product), and factorised
    attention (`factorised`: two sets of masks, positions and token orders; rows of one sample attend as batches of
    frames or lines, with copies of q, k and v).
    """
    a = DTYPE_BYTES[lay.precision]  # under autocast every activation is bf16, but statistics and logsumexp
    D, H, F, hd = cfg.hidden_size, cfg.num_heads, cfg.patch_dim, cfg.head_dim
    B, N, S, tp = lay.micro_batch, lay.seq_length, lay.samples_per_row, lay.tp
    L = lay.text_len if cfg.text_dim else 0
    sp = lay.sequence_parallel and tp > 1
    Ta = B * N // lay.cp  # tokens a rank's attention queries: its context-parallel slice of every row
    T = Ta // (tp if sp else 1)  # tokens a rank holds outside attention: sequence parallelism splits them again
    Dl, Hl, M = D // tp, H // tp, cfg.ffn // tp  # a rank's share of features, heads, MLP columns
    tok = T if lay.packed else B  # modulations: per token in packed rows, else one per row (broadcast)
    cpu, qk, nn_linear = lay.device == "cpu", cfg.qk_norm, tp == 1
    views = 2 if cfg.factorised else 1  # ST-DiT's blocks attend within frames or within time-lines: two sets of masks
    keys = Ta if cfg.factorised else N  # ... over keys of this rank only (whole frames and lines are local)
    sdpa_mask = lay.attention == "sdpa" and lay.packed  # a dense (B, 1, Nq, Nk) float mask for every call
    # ST-DiT on rows of one sample: frames (lines) become rows of their own, so attention keeps copies of q, k and v
    batched_runs = cfg.factorised and not lay.packed
    kernel_cached = lay.attention == "sdpa" or lay.compile  # eager flex calls a kernel compiled apart: unseen

    def norm(tokens: int) -> int:
        """A LayerNorm's output (the next op keeps it), its mean and rstd (CUDA keeps the statistics in fp32); an
        RMSNorm's output and its rstd (fp32), and on the CPU, whose decomposition computes in fp32, an fp32 copy of
        a bf16 input instead of the input (the residual, which is kept anyway: only the difference counts)."""
        if not cfg.rms_norm:
            return tokens * D * a + 2 * tokens * (a if cpu else FP32)
        return tokens * D * a + tokens * FP32 + (tokens * D * (FP32 - a) if cpu else 0)

    def rms(tokens: int) -> int:
        """QK-RMSNorm: CUDA's fused kernel keeps its input (a projection's output) and rstd (fp32); the CPU's
        decomposition computes in fp32 and keeps the normalised values (and the fp32 copy of a bf16 input)."""
        if not qk:
            return 0
        return tokens * Hl * FP32 + (tokens * Dl * (FP32 if a == FP32 else 2 * FP32) if cpu else 0)

    spread = T * S * a if a < FP32 else T * INT64  # per_token: a bf16 one-hot (T, S) for its matmul, or fp32's index
    KVl = cfg.kv_heads * hd // tp  # a rank's key (or value) features: fewer than Dl under grouped-query attention
    gated = 2 if cfg.gated_mlp else 1  # the MLP's input matrix: gate and up in one, or one
    made = cfg.pos_embed == "rope" or qk  # attention's q and k are made by RoPE or the norm (else views)
    q = Ta * Dl * a if made else 0
    k = B * N * 2 * KVl * a if lay.cp > 1 else Ta * KVl * a if made else 0  # under CP: k and v of the whole row
    if batched_runs:
        k = Ta * 2 * KVl * a  # k and v (else a view of the projection)
    saved = {
        "adaLN_in": B * S * D * a,  # SiLU(c)
        "adaLN": B * S * 6 * D * a,  # per_token's input
        "modulations": T * 6 * D * a + spread if lay.packed else 0,  # per token, and how per_token spread them
        "x": T * D * a,  # the block's input
        "norm1": norm(T),
        "scale_attn": tok * D * a,  # 1 + scale
        "qkv_in": T * D * a,  # modulated (sequence parallel: this rank's tokens, gathered again in backward)
        "qkv": Ta * (Dl + 2 * KVl) * a,  # the norms' input, and v
        "qk_norm": 2 * rms(Ta),
        "q_k": q + k,
        "attn_kernel": Ta * Dl * a + Ta * Hl * FP32,
        "attn_mask": Ta * keys * a if sdpa_mask else 0,
        "proj_in": Ta * Dl * a,  # heads back to features: a copy
        "proj": T * D * a,  # for the gate's gradient
        "x1": T * D * a,  # the residual after attention: the next norm's input
    }
    if L:
        saved |= {
            # an RMSNorm with a scale keeps its normalised input for the scale's gradient (fp32 on the CPU)
            "norm_cross": norm(T) + (T * D * (FP32 if cpu else a) if cfg.rms_norm else 0),
            "text_in": B * L * D * a if nn_linear else 0,  # kv's input: a contiguous copy of the text in each block
            "cross_q": Ta * Dl * a,
            "cross_kv": B * L * 2 * KVl * a,
            "cross_qk_norm": rms(Ta) + rms(B * L) * KVl // Dl,
            "cross_q_k": (Ta * Dl * a + B * L * KVl * a) if qk else 0,
            "cross_kernel": Ta * Dl * a + Ta * Hl * FP32,
            "cross_mask": Ta * (L * a + 1) if sdpa_mask else 0,  # and which queries have keys (bool)
            "cross_proj_in": Ta * Dl * a,
            "x2": T * D * a,  # the residual after cross-attention: norm2's input
        }
    saved |= {
        "norm2": norm(T),
        "scale_mlp": tok * D * a,
        "mlp_in": T * D * a,
        "mlp0": Ta * M * gated * a,  # GELU's input (SwiGLU: gate_up's output, whose views are SiLU's input and up)
        "gelu": Ta * M * a,  # mlp.2's input (SwiGLU: SiLU's output)
        "mlp2": T * D * a,  # for the gate's gradient
    }
    if cfg.gated_mlp:
        saved["glu"] = Ta * M * a  # SiLU's output times up: down's input

    if lay.activation_checkpointing == "none":
        cached = saved
    elif lay.activation_checkpointing == "block":
        cached = {"x": saved["x"]}
    else:
        cached = {
            "x": saved["x"],
            "adaLN": saved["adaLN"],  # a replicated nn.Linear on SiLU's output: the same tensor
            "qkv_mm": Ta * (Dl + 2 * KVl) * a,
            "proj" if nn_linear else "proj_mm": Ta * D * a,
            "mlp0_mm": Ta * M * gated * a,
            "mlp2" if nn_linear else "mlp2_mm": Ta * D * a,
        }
        if L:
            cached |= {"cross_q" if nn_linear else "cross_q_mm": Ta * Dl * a, "cross_kv_mm": B * L * 2 * KVl * a,
                       "cross_proj_mm": Ta * D * a}
        if kernel_cached:
            cached |= {k: saved[k] for k in ("attn_kernel", "cross_kernel") if k in saved}
    # A checkpointed block runs again in its backward: what its backward reads and the cache lacks comes back, and
    # the cached matmul outputs that only fed a recomputed op (a bias add) are released as they are replayed.
    recompute = sum(v for name, v in saved.items() if name not in cached)
    released = sum(v for name, v in cached.items() if name not in saved)

    # Kept outside the blocks until the end of backward: each scalar embedder's sinusoids and MLP hidden values (x 2),
    # c (fp32 when it adds a class embedding: autocast leaves embeddings in fp32), RoPE's cos and sin (B, 1, seq,
    # hd/2), and the text embedder's input (a bf16 copy under autocast) and hidden values: on every pipeline stage.
    shared = (1 + cfg.fps_cond) * B * S * (FREQ_DIM + 2 * D) * a + B * S * D * (FP32 if cfg.num_classes else a)
    shared += views * Ta * hd * a if cfg.pos_embed == "rope" else 0
    if cfg.factorised:  # the two orders (B, N) and the frame and line ids, the positions and samples in lines order
        shared += 4 * B * N * INT64 + B * N * (3 + lay.packed) * INT64
    if L:
        shared += B * L * ((cfg.text_dim if a != FP32 else 0) + 2 * D) * a
        shared += 0 if nn_linear else B * L * D * a  # under TP every block's kv keeps the projected text itself
    if cached is not saved:  # checkpoints keep their arguments: the projected text, the boolean masks
        shared += (B * L * D * a if nn_linear else 0) + (views * Ta * (keys + (L + 1 if L else 0)) if sdpa_mask else 0)
    # The final layer and the loss, whose backward runs (and frees them) first. Final layer: SiLU(c), adaLN's output
    # and per_token's one-hot (or index), its input, norm, 1 + scale and linear's input. The loss (fp32, on whole
    # rows): D - x and, per token, c_out, the loss weight and the mask.
    head = B * S * D * a + (B * S * 2 * D * a + spread if lay.packed else 0) + T * D * a + norm(T)
    head += tok * D * a + T * D * a
    head += B * N * (F + (3 if lay.packed else 1)) * FP32

    return Activations(block=sum(cached.values()), recompute=recompute - released, shared=shared,
                       embed=T * F * a,  # the patch embedding's input
                       head=head, hidden=T * D * a)


# --------------------------------------------------------------------------------------------------
# Advice: what to change when a plan does not fit


def advise(cfg: DiTConfig, layout: Layout, gpu_bytes: float, headroom: Headroom = HEADROOM) -> tuple[list[str], Plan]:
    """Config overrides that make the plan fit, and the plan they give (which may still not fit).

    Changes are tried in order of what they cost in speed: sharding the state (fsdp: communication only), recomputing
    (selective, then block), a larger tensor-parallel degree, one row per micro-batch. One is kept when it lowers the
    total; trying stops as soon as the plan fits.
    """
    candidates = [("fsdp", "parallel.fsdp=true", {"fsdp": True})]
    candidates += [("checkpointing", f"model.activation_checkpointing={mode}", {"activation_checkpointing": mode})
                   for mode in ("selective", "block")]
    tp = layout.tp * 2
    while tp <= layout.world_size // (layout.cp * layout.pp):
        sp = "" if layout.sequence_parallel else " parallel.sequence_parallel=true"
        candidates.append(("tp", f"parallel.tp={tp}{sp}", {"tp": tp, "sequence_parallel": True}))
        tp *= 2
    if layout.micro_batch > 1:
        candidates.append(("micro_batch", "train.micro_batch=1", {"micro_batch": 1}))

    plan, changes, overrides = plan_from(cfg, layout), {}, {}
    for group, text, change in candidates:
        if plan.fits(gpu_bytes, headroom):
            break
        try:
            trial = plan_from(cfg, layout.replace(**(changes | change)))
        except ConfigError:  # e.g. a tp that does not divide the heads
            continue
        if trial.total < plan.total:
            plan, overrides[group] = trial, text
            changes |= change
    return list(overrides.values()), plan


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
