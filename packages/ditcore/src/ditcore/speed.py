"""How fast a layout trains, predicted before any process starts: `predict(cfg, layout, cluster)`, and the layouts
that fit a cluster ranked by it: `search(cfg, cluster, global_batch)`.

The step time of one rank is its compute plus the communication that nothing hides, by these rules:

- compute: the honest training FLOPs of its tokens (ditcore.flops: 6·N_tok + attention per token, adaLN and embedders
  not counted) run at a fraction of the GPU's peak (`Cluster.efficiency_at`: what a stack of the model's width
  reached on an H200, at most 50%), plus what activation checkpointing recomputes: block
  checkpointing runs every block's forward again in backward (a third of its FLOPs: 2 of 6 per weight, 4 of 12 per
  attended key); selective recomputes no matmul, only elementwise work and norms, which cost `SELECTIVE` more time.
  Measured on one H200 (bench/compute_step.py, bench/results/compute_step_h200_*.json: compiled 8192-token rows of
  the 7B, 28B and 30B widths): block checkpointing ran at 0.76, 0.75 and 0.75 of no checkpointing's speed (the third
  predicts 0.75), selective at 0.94, 0.97 and 0.96. A rank does 1/(tp·cp) of a micro-batch's work, and with pp > 1
  its stage's 1/pp.
- tp, cp (and anything else not listed below): exposed. Tensor- and context-parallel collectives sit between the
  matmuls that need their results (ditcore.parallel.tensor_parallel, context_parallel: synchronous gathers).
- fsdp: overlapped. FSDP2 prefetches the next block's all-gather and issues each block's reduce-scatter as its
  backward ends, so a micro-batch's gathers and reduce-scatters hide behind that micro-batch's compute and exposed
  collectives; what does not fit behind them is exposed, and so is one block's share (the first gather and the last
  reduce-scatter have no compute beside them). Gathered once per step (fsdp_sync=step): behind one micro-batch.
- dp (DDP) and replicate (HSDP's all-reduce across replicas): overlapped with the backward (two thirds of the
  compute) that produces the gradients, except the last bucket: DDP's (torch's default bucket_cap_mb=25), one block's
  for HSDP. With pp > 1 and no FSDP the gradients are all-reduced after the schedule (ditcore.parallel.pipeline):
  exposed. With FSDP over a pipeline stage, as without pp: each backward of the schedule reduce-scatters its own.
- pp: sends between stages are exposed, and the 1F1B schedule's bubble costs pp - 1 micro-batches' time: a step of m
  micro-batches takes (m + pp - 1) of them.

A collective takes latency + bytes / bandwidth (α-β, `collective_seconds`), by NCCL's own model of its rings
(`hops`): the bytes are what a rank sends by the ring (ditcore.parallel.counting: (n-1)/n of the buffer for an
all-gather or reduce-scatter, twice that for an all-reduce), at the bus bandwidth of the group's links (`link`); the
latency is a hop's for each step of the ring, NVLink's within a node and the network's for the steps that cross
nodes. Collectives of different groups are taken not to slow each other down (they share links when two groups are
both within a node). The step is compute-bound when it computes at least half the time; otherwise the group that
exposes the most time bounds it (or the pipeline's bubble). How much the verdict rests on the cross-node bandwidth,
the figure least known before a cluster is measured: `Prediction.versus` of the prediction at half of it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from ditcore.errors import ConfigError
from ditcore.flops import training_flops_per_token
from ditcore.job import Layout
from ditcore.memory import HEADROOM, GiB, Param, Plan, fit_grid, parameters, plan_from
from ditcore.models.dit import DiTConfig
from ditcore.parallel.counting import Collective, Traffic, sent_bytes

GB = 1e9
US = 1e-6
# Selective checkpointing's recomputation (elementwise work and norms, no matmul) as a fraction of the compute:
# measured 6%, 3% and 4% at the 7B, 28B and 30B widths (bench/results/compute_step_h200_*.json).
SELECTIVE = 0.05
# The fraction of the dense bf16 peak a compiled block stack reached on one H200 (bench/compute_step.py, the
# compiled-none row of bench/results/compute_step_h200_dit7b.json: 3072 wide; _dit28b.json and _moviegen30b.json:
# 6144 wide, 53.9% and 52.5%: the lower kept), by width; and the most the model credits (`Cluster.efficiency_at`).
MEASURED_EFFICIENCY = {3072: 0.448, 6144: 0.525}
MAX_EFFICIENCY = 0.5


@dataclass(frozen=True)
class Cluster:
    """The GPUs a layout runs on. Defaults: H100 SXM nodes of 8 (DGX/HGX H100), each GPU with its own InfiniBand NIC.

    - peak_flops: 989 TFLOP/s dense bf16, NVIDIA's H100 SXM datasheet (1,979 with 2:4 sparsity); ditcore.flops' table.
    - efficiency: the fraction of that peak the compute runs at without checkpointing; None: `efficiency_at` the
      model's width, as measured (the H200's compute and peak are the H100's).
    - nvlink: bus bandwidth (bytes/s) of a rank's collectives within a node. The datasheet's NVLink 4 is 900 GB/s,
      both directions together: 450 GB/s each way. NCCL's effective NVLink bandwidth on 8 H100 SXM is about 370 GB/s
      (its ring's bus bandwidth, without NVLink SHARP: S. Jeaugey of NVIDIA, "H100 all reduce performance is poor",
      github.com/NVIDIA/nccl-tests/issues/212); 360 GB/s, 80% of the line rate, is the default.
    - infiniband: bytes/s one 400 Gb/s NDR NIC carries in NCCL's collectives: "For NDR @ 400Gbps you should see
      46-48GB/s per NIC" (NVIDIA's NCCL team, "Single-node and multi-node performance of H100 nodes",
      github.com/NVIDIA/nccl-tests/issues/290); the default is the low end. With 8 GPUs a node and a NIC each, a
      collective over whole nodes reaches 8 NICs' worth of bus bandwidth per rank ("With 8 400 Gbps NICs your peak
      would be at 400 GB/s", NCCL's rings below 380 GB/s by default: "Acceptable performance of nccl-test on 2 HGX
      hosts?", github.com/NVIDIA/nccl-tests/issues/309; on 3 nodes or more a ring's bus bandwidth "is probably
      reflecting the total NIC bandwidth": github.com/NVIDIA/nccl-tests/issues/160): `link` counts the NICs a group
      has.
    - nvlink_latency, infiniband_latency: seconds a step of a ring takes besides its bytes, within a node and between
      nodes: NCCL's own tuning model (src/graph/tuning.cc, hwLat, Ring with the Simple protocol it runs large messages
      in: 3.4 µs over NVLink, 14 µs over the network). NCCL adds about 8 µs a collective to launch it; the model
      leaves that out, as the compute term leaves out kernel launches.
    """

    gpus_per_node: int = 8
    peak_flops: float = 989e12
    efficiency: float | None = None
    memory: float = 80 * GiB  # bytes per GPU
    nvlink: float = 360 * GB
    infiniband: float = 46 * GB
    nvlink_latency: float = 3.4 * US
    infiniband_latency: float = 14 * US

    def __post_init__(self) -> None:
        efficiency = MAX_EFFICIENCY if self.efficiency is None else self.efficiency
        checks = {"--gpus-per-node": (self.gpus_per_node, isinstance(self.gpus_per_node, int) and self.gpus_per_node
                                      >= 1, "an integer >= 1"),
                  "--peak-tflops": (self.peak_flops / 1e12, self.peak_flops > 0, "a number > 0 (TFLOP/s per GPU)"),
                  "--efficiency": (efficiency, 0 < efficiency <= 1, "a fraction of the peak in (0, 1]"),
                  "--gpu-memory": (self.memory / GiB, self.memory > 0, "a number > 0 (GiB per GPU)"),
                  "--nvlink-gbps": (self.nvlink / GB, self.nvlink > 0, "a number > 0 (GB/s per GPU)"),
                  "--ib-gbps": (self.infiniband / GB, self.infiniband > 0, "a number > 0 (GB/s per GPU)"),
                  "nvlink_latency": (self.nvlink_latency / US, self.nvlink_latency >= 0, "µs >= 0"),
                  "infiniband_latency": (self.infiniband_latency / US, self.infiniband_latency >= 0, "µs >= 0")}
        for option, (value, ok, allowed) in checks.items():
            if not ok or not math.isfinite(value):
                raise ConfigError(option, value, allowed)

    def efficiency_at(self, width: int) -> float:
        """The fraction of the peak a model `width` wide computes at: `efficiency` when given, else the measurement
        of the narrowest measured stack at least that wide (narrower matmuls run no faster), at most MAX_EFFICIENCY.
        The cap: a stack timed alone on one GPU is the most a rank reaches, not what it reaches while FSDP's gathers
        and reduce-scatters run beside it (NCCL's kernels take SMs and memory bandwidth), so the 6144-wide stacks'
        52.5-53.9% are not credited; 50% was the model's figure before anything was measured."""
        if self.efficiency is not None:
            return self.efficiency
        wider = [e for w, e in sorted(MEASURED_EFFICIENCY.items()) if w >= width]
        return min(MAX_EFFICIENCY, wider[0] if wider else MAX_EFFICIENCY)

    def describe(self, efficiency: float | None = None) -> str:
        at = efficiency if efficiency is not None else self.efficiency
        at = f"{at * 100:.3g}%" if at is not None else "the efficiency measured at the model's width"
        return (f"nodes of {self.gpus_per_node} GPUs: {self.peak_flops / 1e12:g} TFLOP/s peak at {at}, "
                f"{self.memory / GiB:g} GiB; NVLink {self.nvlink / GB:g} GB/s and InfiniBand {self.infiniband / GB:g} "
                f"GB/s per GPU, {self.nvlink_latency / US:g} and {self.infiniband_latency / US:g} µs a ring's step")


# --------------------------------------------------------------------------------------------------
# Links


def group_ranks(group: str, lay: Layout) -> tuple[int, int]:
    """(size, stride) of a process group: its ranks are r, r + stride, ... in the rank order tp-cp-dp-pp
    (ditcore.parallel.dims). FSDP shards over `fsdp_shard` consecutive ranks of dp x cp (HSDP) and replicates over
    the rest."""
    dpcp = lay.dp * lay.cp
    shard = lay.fsdp_shard or dpcp
    return {"tp": (lay.tp, 1), "cp": (lay.cp, lay.tp), "dp": (dpcp, lay.tp), "fsdp": (shard, lay.tp),
            "replicate": (dpcp // shard, lay.tp * shard), "pp": (lay.pp, lay.tp * dpcp),
            # expert parallelism: ep consecutive DP x CP ranks, and the ranks that hold the same experts
            "ep": (lay.ep, lay.tp), "edp": (dpcp // lay.ep, lay.tp * lay.ep)}[group]


@dataclass(frozen=True)
class Link:
    name: str  # NVLink or InfiniBand
    bandwidth: float  # bus bandwidth (bytes/s) a rank's collectives run at: β
    nodes: int = 1  # nodes a group of it spans, whose ring crosses between them
    nics: int = 1  # InfiniBand: the NICs a node's ranks of the group send through, one ring channel each

    def __str__(self) -> str:
        """NVLink 360 GB/s; InfiniBand 46 GB/s (one NIC); 8×IB 360 GB/s: 8 NICs' rings together, at most NVLink's
        (one 400 Gb/s NIC carries 46 GB/s, so that "InfiniBand 360 GB/s" read as a typo)."""
        return f"{self.nics}×IB {self.bandwidth / GB:.0f} GB/s" if self.several_nics else \
            f"{self.name} {self.bandwidth / GB:.0f} GB/s"

    @property
    def several_nics(self) -> bool:
        return self.name == "InfiniBand" and self.nics > 1

    def legend(self, cluster: Cluster) -> str | None:
        """What a k×IB label stands for, in one line; None for the other links."""
        if not self.several_nics:
            return None
        capped = (f", capped at NVLink's {cluster.nvlink / GB:g} GB/s" if self.nics * cluster.infiniband >
                  cluster.nvlink else "")
        return (f"  {self.nics}×IB: the group's ranks in a node send through their {self.nics} InfiniBand NICs at "
                f"once, {self.nics} x {cluster.infiniband / GB:g} GB/s{capped}")


def link(group: str, lay: Layout, cluster: Cluster, op: str = "all_gather") -> Link:
    """The link a group's collectives run over. Within a node: NVLink. Across nodes: the ring crosses between nodes
    over InfiniBand, NVLink carries the rest, and NCCL runs a ring channel through each NIC the group's ranks in a
    node have (a NIC each, on these nodes): a group with k ranks in each node reaches k NICs' worth of bus bandwidth
    (at most NVLink's: `Cluster`'s sources). A pipeline's sends go to one peer: one NIC."""
    size, stride = group_ranks(group, lay)
    node = cluster.gpus_per_node
    nodes = len({i * stride // node for i in range(size)})  # those of the group of rank 0: the groups are alike
    if nodes == 1:
        return Link("NVLink", cluster.nvlink)
    per_node = 1 if op == "send" else math.ceil(size / nodes)
    return Link("InfiniBand", min(cluster.nvlink, per_node * cluster.infiniband), nodes, per_node)


def hops(op: str, size: int, nodes: int) -> tuple[int, int]:
    """(within a node, between nodes): the steps of one collective over `size` ranks on `nodes` nodes that wait for a
    hop's latency, by NCCL's model of its rings (src/graph/tuning.cc): an all-gather, reduce-scatter or broadcast
    takes size - 1 steps, nodes - 1 of them crossing nodes; an all-reduce, a reduce-scatter then an all-gather, twice
    that. The all-reduce is taken as a ring, not a tree (2·log2 of the nodes between nodes), because the ring is what
    the bytes count (ditcore.parallel.counting) and what NCCL runs the large all-reduces in beyond two nodes; for the
    step's few scalars (grad_norm) it overstates tens of µs a step. An all-to-all sends to each peer in turn; a send
    is one hop."""
    if op == "send":
        return (0, 1) if nodes > 1 else (1, 0)
    if op == "all_to_all":
        in_node = math.ceil(size / nodes)
        return in_node - 1, size - in_node
    rounds = 2 if op == "all_reduce" else 1
    return rounds * (size - nodes), rounds * (nodes - 1)


def collective_seconds(c: Collective, lay: Layout, cluster: Cluster) -> float:
    """α-β: the `c.count` collectives' ring steps at their hops' latency, plus their bytes at the group's bus
    bandwidth."""
    size, _ = group_ranks(c.group, lay)
    via = link(c.group, lay, cluster, c.op)
    within, between = hops(c.op, size, via.nodes)
    latency = within * cluster.nvlink_latency + between * cluster.infiniband_latency
    return c.count * latency + c.bytes / via.bandwidth


# --------------------------------------------------------------------------------------------------
# The prediction


@dataclass(frozen=True)
class GroupTime:
    """One group's communication in a step, and what of it the step waits for."""

    group: str
    link: Link
    bytes_micro_batch: int  # sent every micro-batch by one rank
    bytes_step: int  # sent once per step (besides those)
    seconds: float  # all of it, a step
    exposed: float  # what the step waits for
    overlaps: str  # with what it overlaps, in words


# How a table says what each group overlaps with.
OVERLAPS = {"fsdp": "the micro-batch's compute (prefetched gathers, reduce-scatters as blocks finish)",
            "dp": "backward, except the last 25 MB bucket", "replicate": "backward, except the last block's",
            "tp": "nothing: between the matmuls", "cp": "nothing: before attention", "pp": "nothing, plus the bubble",
            "ep": "nothing: between the router and the experts, and back",
            "edp": "nothing: after backward (finalize_grads)"}
DDP_BUCKET = 25 * 2**20  # torch DDP's bucket_cap_mb


@dataclass(frozen=True)
class Prediction:
    layout: Layout
    cluster: Cluster
    flops_per_token: float  # honest training FLOPs (ditcore.flops), what MFU counts
    compute_micro_batch: float  # seconds a rank computes for one micro-batch, recomputation included
    recompute_fraction: float  # of that, what checkpointing adds
    groups: tuple[GroupTime, ...]
    bubble: float  # seconds of the 1F1B schedule's bubble
    step: float  # seconds
    efficiency: float | None = None  # the fraction of the peak the compute ran at (None: the cluster's)

    @property
    def compute_step(self) -> float:
        return self.compute_micro_batch * self.layout.micro_batches

    @property
    def exposed(self) -> float:
        return self.step - self.compute_step

    @property
    def tokens_per_step(self) -> int:
        lay = self.layout
        return lay.micro_batch * lay.seq_length * lay.micro_batches * lay.dp

    @property
    def tokens_per_second_per_gpu(self) -> float:
        return self.tokens_per_step / self.step / self.layout.world_size

    @property
    def mfu(self) -> float:
        return self.flops_per_token * self.tokens_per_second_per_gpu / self.cluster.peak_flops

    @property
    def bound(self) -> str:
        """compute, when the step computes at least half its time; else the group that exposes the most (or
        'pp bubble')."""
        if self.compute_step >= self.exposed:
            return "compute"
        waits = {g.group: g.exposed for g in self.groups} | {"pp bubble": self.bubble}
        return max(waits, key=waits.get)

    def table(self) -> str:
        lay, m = self.layout, self.layout.micro_batches
        recompute = f", {self.recompute_fraction:.0%} of it recomputation" if self.recompute_fraction else ""
        lines = [f"speed  {self.cluster.describe(self.efficiency)}",
                 f"  compute {self.flops_per_token / 1e9:.4g} GFLOP per token: {self.compute_micro_batch:.3g} s per "
                 f"micro-batch, {self.compute_step:.3g} s per step ({m} micro-batch{'es' if m > 1 else ''}){recompute}",
                 f"  {'group':<10}{'link':<18}{'GB/micro-batch':>15}{'GB/step':>10}{'s/step':>9}{'exposed':>9}  "
                 "overlaps with"]
        for g in self.groups:
            lines.append(f"  {g.group:<10}{g.link!s:<18}{g.bytes_micro_batch / GB:15.3g}"
                         f"{(g.bytes_micro_batch * m + g.bytes_step) / GB:10.3g}{g.seconds:9.3g}{g.exposed:9.3g}  "
                         f"{g.overlaps}")
        lines += dict.fromkeys(g.link.legend(self.cluster) for g in self.groups if g.link.several_nics)
        if lay.pp > 1:
            lines.append(f"  pipeline bubble: {lay.pp - 1} micro-batch times, {self.bubble:.3g} s")
        lines.append(f"predicted step {self.step:.3g} s: compute {self.compute_step:.3g} s + exposed "
                     f"{self.exposed:.3g} s ({self.exposed / self.step:.0%}); {self.tokens_per_second_per_gpu:,.0f} "
                     f"tokens/s per GPU, MFU {self.mfu:.1%}; bound: {self.bound}")
        return "\n".join(lines)

    def versus(self, base: Prediction) -> str:
        """One line: this prediction, of the same layout on a slower cross-node network (`at_cross_node`), against
        `base`'s: how much the verdict rests on the network's bandwidth."""
        ib = self.cluster.infiniband
        head = f"at {ib / base.cluster.infiniband:.3g}x the InfiniBand bandwidth ({ib / GB:g} GB/s per GPU): "
        if self.step == base.step:
            return head + f"the same, MFU {self.mfu:.1%} (no collective crosses nodes)"
        return head + (f"step {self.step:.3g} s, exposed {self.exposed / self.step:.0%}; "
                       f"{self.tokens_per_second_per_gpu:,.0f} tokens/s per GPU, MFU {self.mfu:.1%} "
                       f"({(self.mfu - base.mfu) * 100:+.1f} points); bound: {self.bound}")


def predict(cfg: DiTConfig, lay: Layout, cluster: Cluster, traffic: Traffic | None = None) -> Prediction:
    """The step time of `cfg` trained in layout `lay` on `cluster` (the module docstring gives the rules), from the
    bytes each rank sends (`traffic`; default: ditcore.traffic's model of the layout)."""
    if traffic is None:
        from ditcore.traffic import traffic as model_traffic  # the layer above memory: see tests/ditcore/test_layers

        traffic = model_traffic(cfg, lay)
    per_token = honest_flops_per_token(cfg, lay)
    recompute = {"none": 0.0, "selective": SELECTIVE, "block": 1 / 3}[lay.activation_checkpointing]
    tokens = lay.micro_batch * lay.seq_length / (lay.tp * lay.cp * lay.pp)  # a rank's share of a micro-batch's work
    efficiency = cluster.efficiency_at(cfg.hidden_size)
    compute = per_token * tokens * (1 + recompute) / (cluster.peak_flops * efficiency)
    return time_step(lay, cluster, traffic, per_token, compute, recompute / (1 + recompute), cfg.depth, efficiency)


def at_cross_node(cfg: DiTConfig, lay: Layout, cluster: Cluster, fraction: float = 0.5) -> Prediction:
    """predict() on `cluster` with `fraction` of its cross-node bandwidth: the figure a prediction is least sure of
    (NCCL reaches the NICs' bandwidth only on a well-tuned fabric; `Cluster`'s sources)."""
    return predict(cfg, lay, dataclasses.replace(cluster, infiniband=cluster.infiniband * fraction))


def honest_flops_per_token(cfg: DiTConfig, lay: Layout) -> float:
    """ditcore.flops' training FLOPs per token of the layout's rows: samples_per_row samples of equal grids (as the
    memory plan lays them out, ditcore.memory), each with its share of the row's text."""
    n = lay.seq_length // lay.samples_per_row
    frames = fit_grid(n, cfg.max_grid)[0]
    return training_flops_per_token(cfg, n, lay.text_len // lay.samples_per_row if cfg.text_dim else 0, frames)


def time_step(lay: Layout, cluster: Cluster, traffic: Traffic, flops_per_token: float, compute: float,
              recompute_fraction: float, depth: int, efficiency: float | None = None) -> Prediction:
    """The step of a rank that computes `compute` seconds a micro-batch and sends `traffic`, by the module's rules."""
    m = lay.micro_batches
    by_group: dict[str, list[Collective]] = {}
    for c in traffic.collectives:
        by_group.setdefault(c.group, []).append(c)

    def seconds(group: str, when: str) -> tuple[int, float]:
        mine = [c for c in by_group[group] if c.when == when]
        return sum(c.bytes for c in mine), sum(collective_seconds(c, lay, cluster) for c in mine)

    def main_link(group: str) -> Link:  # the link of the collective that sends the most
        return link(group, lay, cluster, max(by_group[group], key=lambda c: c.bytes).op)

    exposed_kinds = [g for g in by_group if g not in ("fsdp", "dp", "replicate") or (g == "dp" and lay.pp > 1)]
    groups, exposed_mb = {}, 0.0
    for g in exposed_kinds:  # sit on the critical path: every micro-batch's and the step's in full
        (mb_bytes, mb), (step_bytes, st) = seconds(g, "micro_batch"), seconds(g, "step")
        groups[g] = (mb_bytes, step_bytes, mb * m + st, mb * m + st)
        exposed_mb += mb
    window = compute + exposed_mb  # a micro-batch's time, behind which FSDP's collectives run
    backward = compute * 2 / 3  # behind which the gradients' all-reduce runs
    for g in by_group.keys() - set(exposed_kinds):
        (mb_bytes, mb), (step_bytes, st) = seconds(g, "micro_batch"), seconds(g, "step")
        if g == "fsdp":
            hide, tail = window, lambda t: t / depth
        elif g == "replicate":
            hide, tail = backward, lambda t: t / depth
        else:  # DDP: its last bucket waits for the end of backward
            bucket = sent_bytes("all_reduce", DDP_BUCKET, group_ranks(g, lay)[0])
            last = collective_seconds(Collective(g, "all_reduce", "step", 1, bucket), lay, cluster)
            hide, tail = backward, lambda t, last=last: min(t, last)
        exposed = sum(n * min(t, max(0.0, t - hide) + tail(t)) for n, t in ((m, mb), (1, st)) if t)
        groups[g] = (mb_bytes, step_bytes, mb * m + st, exposed)
    order = ["tp", "cp", "ep", "fsdp", "replicate", "dp", "edp", "pp"]
    times = tuple(GroupTime(g, main_link(g), *groups[g], OVERLAPS.get(g, "nothing"))
                  for g in sorted(groups, key=lambda g: order.index(g) if g in order else len(order)))
    per_micro_batch = window  # with pp, one stage's micro-batch: what the bubble repeats
    bubble = (lay.pp - 1) * per_micro_batch
    step = sum(t.exposed for t in times) + compute * m + bubble
    return Prediction(lay, cluster, flops_per_token, compute, recompute_fraction, times, bubble, step, efficiency)


# --------------------------------------------------------------------------------------------------
# Search: the layouts that fit, fastest first


@dataclass(frozen=True)
class Candidate:
    prediction: Prediction
    plan: Plan
    changes: dict  # the Layout fields, with their values, that turn the searched base into it (`changes`)


def search(cfg: DiTConfig, cluster: Cluster, base: Layout, global_batch: int, top: int = 10,
           progress: Callable[[Iterable, int], Iterable] | None = None) -> list[Candidate]:
    """The `top` fastest layouts of `cfg` on base.world_size GPUs of `cluster` whose memory plan fits, by predicted
    tokens/s. Batch shape, precision and kernels come from `base`; global_batch rows a step, as dit-train's
    train.global_batch. progress(iterable, total), when given, wraps the walk (a progress bar).

    Every layout is predicted (cheap: FLOPs and bytes), then planned fastest first (a memory plan records the model's
    activations: seconds at 30B, cached by a rank's shapes), and skipped unplanned where that cannot change the list:
    its weights, gradients, AdamW and EMA alone exceed the card; a layout that needs less memory (`needs_less`) did
    not fit; or a faster one with the same tp, cp and pp fits (they differ only in what trades speed for memory:
    FSDP, its shard and sync, checkpointing, micro_batch): one layout of each model parallelism is listed.
    """
    predicted = [predict(cfg, lay, cluster, rows_scaled_traffic(cfg, lay))
                 for lay in layouts(cfg, base, cluster, global_batch)]
    # fastest first; among equally fast ones (compute-bound layouts tie), the one that needs least memory first
    predicted.sort(key=lambda p: (-round(p.tokens_per_second_per_gpu, 3), state_bytes(cfg, p.layout),
                                  memory_order(p.layout)))
    usable = HEADROOM.usable(cluster.memory)
    found, fitted, failed = [], set(), []
    walk = predicted if progress is None else progress(predicted, len(predicted))
    for pred in walk:
        lay = pred.layout
        family = (lay.tp, lay.cp, lay.pp, lay.ep)
        if family in fitted or state_bytes(cfg, lay) > usable or any(needs_less(f, lay) for f in failed):
            continue
        plan = plan_from(cfg, lay)
        if not plan.fits(cluster.memory):
            failed.append(lay)
            continue
        found.append(Candidate(pred, plan, changes(lay, base)))
        fitted.add(family)
        if len(found) == top:
            break
    return found


# The groups whose per-micro-batch bytes are activations: in proportion to the rows of a micro-batch.
ROW_GROUPS = ("tp", "cp", "pp")


def rows_scaled_traffic(cfg: DiTConfig, lay: Layout) -> Traffic:
    """ditcore.traffic's traffic of `lay`, from that of one row a micro-batch: the activations that tp, cp and pp
    move every micro-batch are the rows' (micro_batch times one row's); the parameters and gradients FSDP and DDP
    move are not, nor is anything by the number of micro-batches. A search then models each layout once for all its
    micro-batch sizes."""
    one = _one_row_traffic(cfg, lay.replace(micro_batch=1, micro_batches=1))
    return Traffic(tuple(dataclasses.replace(c, bytes=c.bytes * lay.micro_batch)
                         if c.when == "micro_batch" and c.group in ROW_GROUPS else c for c in one.collectives))


@functools.lru_cache(maxsize=4096)
def _one_row_traffic(cfg: DiTConfig, lay: Layout) -> Traffic:
    from ditcore.traffic import traffic

    return traffic(cfg, lay)


RECOMPUTES = {"none": 0, "selective": 1, "block": 2}  # more recomputation, less memory


def memory_order(lay: Layout) -> tuple:
    """What trades memory for speed, least memory first: more shards, gathered every micro-batch, no gradients
    accumulated unsharded, fewer rows a micro-batch, more recomputation. (Once-per-step sync accumulates the
    gradients unsharded only over several micro-batches: more rows a micro-batch, hence fewer micro-batches, may then
    need less memory. A key of its own keeps `needs_less` true to that.)"""
    step = lay.fsdp and lay.fsdp_sync == "step"
    return (-fsdp_shards(lay), step, step and lay.micro_batches > 1, lay.micro_batch,
            -RECOMPUTES[lay.activation_checkpointing])


def fsdp_shards(lay: Layout) -> int:
    return (lay.fsdp_shard or lay.dp * lay.cp) if lay.fsdp else 1


def needs_less(small: Layout, lay: Layout) -> bool:
    """Does `small` need no more memory than `lay`? The same model parallelism, and on each of memory_order's keys
    no more: if `small` does not fit, neither does `lay`."""
    same = (small.tp, small.cp, small.pp, small.ep) == (lay.tp, lay.cp, lay.pp, lay.ep)
    return same and all(a <= b for a, b in zip(memory_order(small), memory_order(lay), strict=True))


def layouts(cfg: DiTConfig, base: Layout, cluster: Cluster, global_batch: int) -> Iterator[Layout]:
    """Every layout of base.world_size GPUs that can run cfg: tp a divisor of the heads within a node (with sequence
    parallelism: it moves the same bytes as without and holds less), cp where the rows split and tp x cp ranks fit in
    a node, pp where the blocks split,
    micro_batch dividing a data-parallel rank's share of global_batch (a pipeline with at least pp micro-batches a
    step), then DDP or FSDP, FSDP over all dp x cp ranks or HSDP shards of a divisor of them, gathered every
    micro-batch or once a step, and each activation checkpointing."""
    world = base.world_size
    for tp in divisors(world):
        if tp > cluster.gpus_per_node:
            break
        for cp in divisors(world // tp):
            if tp * cp > cluster.gpus_per_node:  # its key/value exchange is exposed: across nodes dp does better
                break
            for pp in divisors(world // (tp * cp)):
                dp = world // (tp * cp * pp)
                shape = base.replace(tp=tp, cp=cp, pp=pp, ep=1, sequence_parallel=tp > 1, fsdp=False, fsdp_shard=None,
                                     fsdp_sync="micro_batch")
                try:
                    shape.dims.check_model(cfg.num_heads, base.seq_length, cfg.depth,
                                           getattr(cfg, "num_kv_heads", None), moe=cfg.moe)
                    _parameters(cfg, tp)  # every layer the TP plan splits divides by tp
                except ConfigError:
                    continue
                if global_batch % dp:
                    continue
                for micro_batch in divisors(global_batch // dp):
                    micro_batches = global_batch // (dp * micro_batch)
                    if micro_batches < pp:
                        continue
                    for checkpointing in ("none", "selective", "block"):
                        lay = shape.replace(micro_batch=micro_batch, micro_batches=micro_batches,
                                            activation_checkpointing=checkpointing)
                        for each in (lay, *_expert_parallel(cfg, lay)):
                            yield each
                            for shard in [None, *(s for s in divisors(dp * cp)[1:-1])]:
                                for sync in ("micro_batch", "step"):
                                    yield each.replace(fsdp=True, fsdp_shard=shard, fsdp_sync=sync)


def _expert_parallel(cfg: DiTConfig, lay: Layout) -> Iterator[Layout]:
    """`lay` with a mixture of experts' experts split over each ep > 1 that divides dp x cp and the experts."""
    if cfg.moe is None:
        return
    for ep in divisors(lay.dp * lay.cp)[1:]:
        if cfg.moe.experts % ep == 0:
            yield lay.replace(ep=ep)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def state_bytes(cfg: DiTConfig, lay: Layout) -> float:
    """What a rank's weights, gradients, AdamW and EMA need at least (fp32, 20 B a parameter held): the layout's TP
    and FSDP shares of every parameter, over pp stages evenly (the most loaded stage holds no less)."""
    held = sum(p.held(lay) for p in _parameters(cfg, lay.tp, lay.ep))
    return 20 * held / lay.pp


@functools.lru_cache(maxsize=64)
def _parameters(cfg: DiTConfig, tp: int, ep: int = 1) -> list[Param]:
    return parameters(cfg, tp, ep)  # cached: a search asks for every layout's


# The fields a searched layout may change, in the order an app lists them.
SEARCHED = ("tp", "cp", "pp", "ep", "sequence_parallel", "fsdp", "fsdp_shard", "fsdp_sync",
            "activation_checkpointing", "micro_batch")


def changes(lay: Layout, base: Layout) -> dict:
    """The fields that turn base's layout into lay's, with lay's values: those that differ and mean something in lay
    (FSDP's shard and sync only with fsdp, and its sync always then: base may leave it to be chosen; sequence
    parallelism only with tp > 1)."""
    out = {}
    for field in SEARCHED:
        value = getattr(lay, field)
        if (field in ("fsdp_shard", "fsdp_sync") and not lay.fsdp) or (field == "sequence_parallel" and lay.tp == 1):
            continue
        if value != getattr(base, field) or (field == "fsdp_sync" and lay.fsdp):
            out[field] = value
    return out
