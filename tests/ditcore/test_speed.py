"""ditcore.speed: the step-time model's links, α-β collective times, overlap rules, bound and MFU on hand-built
traffic, the measured efficiency, the cross-node sensitivity, the row scaling a search relies on, and the search
itself on a tiny model."""

import json
from dataclasses import replace as dataclass_replace
from pathlib import Path

import pytest

from ditcore.errors import ConfigError
from ditcore.flops import training_flops_per_token
from ditcore.job import Layout
from ditcore.memory import HEADROOM, plan_from
from ditcore.models import preset
from ditcore.parallel.counting import Collective, Traffic, sent_bytes
from ditcore.speed import (
    DDP_BUCKET,
    MEASURED_EFFICIENCY,
    SELECTIVE,
    Cluster,
    at_cross_node,
    collective_seconds,
    layouts,
    link,
    predict,
    rows_scaled_traffic,
    search,
    time_step,
)
from ditcore.traffic import traffic

GB = 1e9
US = 1e-6
BENCH = Path(__file__).parents[2] / "bench" / "results"
# Round numbers: 100 GB/s within a node of 8, 10 GB/s a GPU between nodes; no latency: the overlap rules' tests below
# count bandwidth alone (test_a_ring_collective_takes_its_steps_latency_and_its_bytes_at_the_bus_bandwidth: latency)
CLUSTER = Cluster(gpus_per_node=8, nvlink=100 * GB, infiniband=10 * GB, nvlink_latency=0, infiniband_latency=0)


def test_a_group_within_a_node_uses_nvlink_and_one_across_nodes_shares_its_nodes_nics():
    lay = Layout(world_size=32, tp=2, fsdp=True)  # dp x cp = 16: ranks 0, 2, 4, ... 30, four nodes
    assert link("tp", lay, CLUSTER).name == "NVLink" and link("tp", lay, CLUSTER).bandwidth == 100 * GB
    fsdp = link("fsdp", lay, CLUSTER)  # 4 of its ranks in each node: 4 NICs' worth
    assert fsdp.name == "InfiniBand" and fsdp.bandwidth == 40 * GB
    hsdp = lay.replace(fsdp_shard=4)  # shards of ranks 0, 2, 4, 6: one node; replicas 8 apart: one a node
    assert link("fsdp", hsdp, CLUSTER).name == "NVLink"
    assert link("replicate", hsdp, CLUSTER).bandwidth == 10 * GB
    assert link("tp", Layout(world_size=32, tp=16), CLUSTER).bandwidth == 80 * GB  # 8 ranks a node, capped at 100
    assert link("tp", Layout(world_size=3, tp=3), Cluster(gpus_per_node=2)).name == "InfiniBand"  # straddles nodes
    pipe = Layout(world_size=32, tp=8, pp=4)  # stages a node apart: a send leaves through one NIC
    assert link("pp", pipe, CLUSTER, "send").bandwidth == 10 * GB


def test_the_default_links_are_nvlink_within_a_node_and_a_nic_per_rank_of_a_node_across():
    c = Cluster()  # 8 GPUs a node, NVLink 360 GB/s, a 46 GB/s NIC each
    within = link("fsdp", Layout(world_size=8, fsdp=True), c)
    assert (within.name, within.bandwidth, within.nodes) == ("NVLink", 360 * GB, 1)
    one_a_node = link("fsdp", Layout(world_size=32, tp=8, fsdp=True), c)  # ranks 0, 8, 16, 24: one NIC each
    assert (one_a_node.name, one_a_node.bandwidth, one_a_node.nodes) == ("InfiniBand", 46 * GB, 4)
    two_a_node = link("fsdp", Layout(world_size=32, tp=4, fsdp=True), c)  # ranks 0, 4, ..., 28: two a node
    assert (two_a_node.bandwidth, two_a_node.nodes) == (92 * GB, 4)
    whole_nodes = link("fsdp", Layout(world_size=32, fsdp=True), c)  # 8 NICs' 368 GB/s, more than NVLink's 360
    assert (whole_nodes.name, whole_nodes.bandwidth) == ("InfiniBand", 360 * GB)


def test_a_ring_collective_takes_its_steps_latency_and_its_bytes_at_the_bus_bandwidth():
    c = Cluster()  # α 3.4 µs a step within a node, 14 µs between; β 360 GB/s NVLink, 46 GB/s a NIC
    full = 10**9  # bytes of the buffer
    tp = Layout(world_size=8, tp=8)  # a ring of 8 within a node: an all-reduce takes 2·7 steps and sends 2·7/8 of it
    one = Collective("tp", "all_reduce", "micro_batch", 1, sent_bytes("all_reduce", full, 8))
    assert collective_seconds(one, tp, c) == pytest.approx(14 * 3.4 * US + 2 * 7 / 8 * full / (360 * GB))
    assert collective_seconds(dataclass_replace(one, count=5, bytes=5 * one.bytes), tp, c) == pytest.approx(
        5 * (14 * 3.4 * US + 2 * 7 / 8 * full / (360 * GB)))
    # 16 ranks, two nodes apart, on 4 nodes (4 a node): of the all-gather's 15 steps 3 cross nodes, the rest NVLink
    fsdp = Layout(world_size=32, tp=2, fsdp=True)
    gather = Collective("fsdp", "all_gather", "micro_batch", 1, sent_bytes("all_gather", full, 16))
    assert collective_seconds(gather, fsdp, c) == pytest.approx(12 * 3.4 * US + 3 * 14 * US + 15 / 16 * full /
                                                                (4 * 46 * GB))
    reduce = Collective("fsdp", "all_reduce", "step", 1, sent_bytes("all_reduce", full, 16))
    assert collective_seconds(reduce, fsdp, c) == pytest.approx(24 * 3.4 * US + 6 * 14 * US + 30 / 16 * full /
                                                                (4 * 46 * GB))
    pipe = Layout(world_size=32, tp=8, pp=4)  # a send to the next node: one hop, one NIC
    send = Collective("pp", "send", "micro_batch", 2, 2 * full)
    assert collective_seconds(send, pipe, c) == pytest.approx(2 * 14 * US + 2 * full / (46 * GB))


def step(lay: Layout, *collectives: Collective, compute: float = 1.0, depth: int = 10):
    return time_step(lay, CLUSTER, Traffic(collectives), 1e9, compute, 0.0, depth)


def test_tensor_parallel_time_is_exposed_and_fsdp_hides_behind_the_micro_batch():
    lay = Layout(world_size=32, tp=2, fsdp=True, micro_batches=4)  # FSDP at 40 GB/s (above), TP at 100
    tp = Collective("tp", "all_gather", "micro_batch", 8, 10 * GB)  # 0.1 s a micro-batch
    hidden = step(lay, tp, Collective("fsdp", "all_gather", "micro_batch", 20, 20 * GB))  # 0.5 s < 1.1 s of window
    (t, f) = hidden.groups
    assert (t.group, t.seconds, t.exposed) == ("tp", pytest.approx(0.4), pytest.approx(0.4))
    assert f.seconds == pytest.approx(2.0) and f.exposed == pytest.approx(4 * 0.5 / 10)  # one block's share each
    assert hidden.step == pytest.approx(4 * 1.0 + 0.4 + 0.2) and hidden.bound == "compute"

    exposed = step(lay, tp, Collective("fsdp", "all_gather", "micro_batch", 20, 80 * GB))  # 2 s against 1.1 s
    assert exposed.groups[1].exposed == pytest.approx(4 * (2.0 - 1.1 + 0.2))
    assert exposed.bound == "fsdp" and exposed.exposed == pytest.approx(0.4 + 4 * 1.1)

    once = step(lay.replace(fsdp_sync="step"), tp, Collective("fsdp", "all_gather", "step", 10, 80 * GB))
    assert once.groups[1].exposed == pytest.approx(2.0 - 1.1 + 0.2)  # behind one micro-batch, once a step
    assert once.groups[1].bytes_step == 80 * GB and once.groups[1].bytes_micro_batch == 0


def test_ddp_hides_behind_backward_but_its_last_bucket_and_a_pipeline_waits():
    lay = Layout(world_size=32, tp=2, micro_batches=4)  # DDP over 16 ranks: 40 GB/s
    ddp = Collective("dp", "all_reduce", "step", 30, 8 * GB)  # 0.2 s, behind 2/3 s of backward
    p = step(lay, ddp)
    last = 2 * DDP_BUCKET * 15 // 16 / (40 * GB)  # the last bucket's all-reduce over 16 ranks
    assert p.groups[0].exposed == pytest.approx(last)
    slow = step(lay, Collective("dp", "all_reduce", "step", 30, 40 * GB))  # 1 s
    assert slow.groups[0].exposed == pytest.approx(1.0 - 2 / 3 + last)

    pipe = Layout(world_size=32, tp=2, pp=4, micro_batches=8)  # dp x cp = 4 ranks 2 apart: one node, NVLink
    sends = Collective("pp", "send", "micro_batch", 2, 1 * GB)  # stages 8 ranks apart: 10 GB/s, 0.1 s
    p = step(pipe, sends, Collective("dp", "all_reduce", "step", 3, 20 * GB))  # after the schedule: 0.2 s exposed
    assert p.bubble == pytest.approx(3 * 1.1)  # pp - 1 micro-batches of compute and exposed sends
    assert p.step == pytest.approx(8 * 1.1 + 3 * 1.1 + 0.2) and p.bound == "compute"
    few = step(pipe.replace(micro_batches=2), Collective("pp", "send", "micro_batch", 2, GB // 10))  # fewer than pp
    assert few.bubble == pytest.approx(3 * 1.01) and few.bound == "pp bubble"


def test_mfu_is_the_efficiency_without_communication_and_checkpointing_costs_its_recomputation():
    cfg = preset("DiT-Tiny", in_channels=4, text_dim=0)
    lay = Layout(world_size=1, seq_length=64, micro_batch=2, micro_batches=3)
    cluster = Cluster(peak_flops=1e12, efficiency=0.4)
    p = predict(cfg, lay, cluster)
    per_token = training_flops_per_token(cfg, 64)
    assert p.flops_per_token == per_token
    assert p.compute_micro_batch == pytest.approx(per_token * 2 * 64 / 0.4e12)
    assert p.mfu == pytest.approx(0.4) and p.tokens_per_second_per_gpu == pytest.approx(0.4e12 / per_token)
    block = predict(cfg, lay.replace(activation_checkpointing="block"), cluster)
    assert block.mfu == pytest.approx(0.4 * 3 / 4) and block.recompute_fraction == pytest.approx(1 / 4)
    selective = predict(cfg, lay.replace(activation_checkpointing="selective"), cluster)
    assert selective.mfu == pytest.approx(0.4 / (1 + SELECTIVE))


def test_the_compute_runs_at_the_efficiency_measured_at_the_models_width_at_most_half_the_peak():
    runs = {w: json.loads((BENCH / f"compute_step_h200_{name}.json").read_text()) for w, name in
            ((3072, "dit7b"), (6144, "moviegen30b"))}
    for width, run in runs.items():  # each constant is its file's compiled row without checkpointing
        assert f"{width} wide" in run["header"]["model"]
        measured = next(r["fraction_of_peak"] for r in run["results"] if r["case"] == "compiled-none")
        assert MEASURED_EFFICIENCY[width] == pytest.approx(measured, abs=5e-4)
    c = Cluster()
    assert (c.efficiency_at(3072), c.efficiency_at(1152), c.efficiency_at(6144), c.efficiency_at(8192)) == (
        0.448, 0.448, 0.5, 0.5)  # narrower: no faster than 3072; 6144's 52.5% capped at 50%; wider: 50%
    assert Cluster(efficiency=0.3).efficiency_at(3072) == 0.3
    cfg = preset("DiT-Tiny", in_channels=4, text_dim=0)
    lay = Layout(world_size=1, seq_length=64)
    p = predict(cfg, lay, c)
    assert p.efficiency == 0.448 and p.mfu == pytest.approx(0.448)
    assert "989 TFLOP/s peak at 44.8%" in p.table().splitlines()[0]


def test_half_the_cross_node_bandwidth_slows_fsdp_across_nodes_and_leaves_a_node_alone():
    cfg = preset("DiT-Tiny", in_channels=4, text_dim=0)
    # compute made negligible: FSDP over 16 ranks on 2 nodes bounds the step
    fast = Cluster(peak_flops=1e18, nvlink_latency=0, infiniband_latency=0)
    lay = Layout(world_size=16, fsdp=True, seq_length=64, micro_batches=2)
    p, half = predict(cfg, lay, fast), at_cross_node(cfg, lay, fast)
    assert p.bound == "fsdp" and half.cluster.infiniband == fast.infiniband / 2
    (f,), (h,) = p.groups, half.groups
    assert f.link.bandwidth == 360 * GB and h.link.bandwidth == 8 * 23 * GB  # 8 NICs, of 46 then 23 GB/s
    sent = 2 * f.bytes_micro_batch + f.bytes_step
    assert h.seconds == pytest.approx(sent / (184 * GB)) and f.seconds == pytest.approx(sent / (360 * GB))
    assert half.mfu == pytest.approx(p.mfu * p.step / half.step) and half.mfu < p.mfu * 0.6
    assert f"MFU {half.mfu:.1%} ({(half.mfu - p.mfu) * 100:+.1f} points); bound: fsdp" in half.versus(p)
    tp = Layout(world_size=4, tp=4, seq_length=64)  # within one node: nothing crosses nodes
    base, slow = predict(cfg, tp, Cluster()), at_cross_node(cfg, tp, Cluster())
    assert slow.step == base.step and slow.mfu == base.mfu
    assert slow.versus(base) == (f"at 0.5x the InfiniBand bandwidth (23 GB/s per GPU): the same, MFU {base.mfu:.1%} "
                                 "(no collective crosses nodes)")


def test_a_micro_batch_of_rows_moves_the_rows_activations_and_the_same_parameters():
    cfg = preset("DiT-Tiny", in_channels=4, text_dim=16)
    for lay in (Layout(world_size=8, tp=2, sequence_parallel=True, cp=2, fsdp=True, micro_batch=3, seq_length=32,
                       text_len=8, activation_checkpointing="selective"),
                Layout(world_size=8, tp=2, pp=2, micro_batch=2, micro_batches=4, seq_length=32, text_len=8)):
        assert rows_scaled_traffic(cfg, lay) == traffic(cfg, lay)


def test_cluster_errors_name_the_option():
    with pytest.raises(ConfigError, match=r"--efficiency=1.5 is invalid: expected a fraction of the peak in \(0, 1\]"):
        Cluster(efficiency=1.5)
    with pytest.raises(ConfigError, match=r"--ib-gbps=0\.0 is invalid"):
        Cluster(infiniband=0)
    with pytest.raises(ConfigError, match=r"--gpus-per-node=0 is invalid"):
        Cluster(gpus_per_node=0)


def test_the_search_lists_the_fastest_layouts_that_fit_one_per_model_parallelism():
    cfg = preset("DiT-Tiny", in_channels=4, text_dim=0)
    base = Layout(world_size=4, seq_length=32, device="cpu", attention="sdpa")
    usable = 2.0e6  # bytes: some of its 108 layouts fit
    cluster = Cluster(gpus_per_node=2, memory=(HEADROOM.fixed + usable) / (1 - HEADROOM.fraction), nvlink=1 * GB,
                      infiniband=0.1 * GB)
    found = search(cfg, cluster, base, global_batch=4, top=3)
    # every layout, predicted and planned: the fastest that fits leads, and every one listed fits
    fitting = []
    for lay in layouts(cfg, base, cluster, 4):
        plan = plan_from(cfg, lay)
        if plan.fits(cluster.memory):
            fitting.append(predict(cfg, lay, cluster))
    assert len(fitting) < len(list(layouts(cfg, base, cluster, 4)))  # the card rules some out
    # pipeline stages sharded by FSDP/HSDP are among them (30 of the 108: pp=2 and pp=4, shards, syncs, checkpointing)
    assert sum(lay.pp > 1 and lay.fsdp for lay in layouts(cfg, base, cluster, 4)) == 30
    best = max(p.tokens_per_second_per_gpu for p in fitting)
    assert found[0].prediction.tokens_per_second_per_gpu == pytest.approx(best)
    assert found[0].prediction == predict(cfg, found[0].prediction.layout, cluster)
    speeds = [c.prediction.tokens_per_second_per_gpu for c in found]
    assert speeds == sorted(speeds, reverse=True) and len(found) == 3
    assert all(c.plan.fits(cluster.memory) for c in found)
    parallelisms = {(c.prediction.layout.tp, c.prediction.layout.cp, c.prediction.layout.pp) for c in found}
    assert len(parallelisms) == 3
    # and each is the fastest that fits of its own model parallelism
    for c in found:
        lay = c.prediction.layout
        own = [p.tokens_per_second_per_gpu for p in fitting if (p.layout.tp, p.layout.cp, p.layout.pp) ==
               (lay.tp, lay.cp, lay.pp)]
        assert c.prediction.tokens_per_second_per_gpu == pytest.approx(max(own))
    lay = found[0].prediction.layout
    assert found[0].changes.get("tp") == lay.tp or lay.tp == 1
