"""`dit-train --plan` prints the predicted step after the memory table, and the step at half the cross-node bandwidth;
`--plan --search` the fastest layouts that fit.
In process (CliRunner), on a tiny model."""

import re

from typer.testing import CliRunner

from dit_train.cli import app
from dit_train.config import CONFIGS, load_config, memory_layout
from dit_train.train import model_config
from ditcore.data.schema import DatasetInfo
from ditcore.memory import GiB, choose_fsdp_sync
from ditcore.speed import Cluster, at_cross_node, predict


def invoke(*args) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


def tiny(tmp_path, *overrides) -> list[str]:
    # sdpa: the memory plan then records the tiny model on real tensors, much faster than flex's fake ones
    return ["--config", "demo", f"data.path={tmp_path / 'absent'}", "model.preset=DiT-Tiny", "model.attention=sdpa",
            "train.micro_batch=2", *overrides]


def test_the_plan_prints_the_predicted_step_after_the_memory_table(tmp_path):
    overrides = ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.fsdp=true"]
    code, out, err = invoke(*tiny(tmp_path, *overrides), "--plan", "--world-size", 8, "--gpus-per-node", 4,
                            "--ib-gbps", 2, "--efficiency", 0.25)
    print(out)
    assert code == 0, err
    lines = out.splitlines()
    speed = lines.index(next(line for line in lines if line.startswith("speed  ")))
    assert lines[speed - 1].startswith("fits in 80 GiB")  # after the memory table, which keeps its lines
    assert "nodes of 4 GPUs: 989 TFLOP/s peak at 25%, 80 GiB; NVLink 360 GB/s and InfiniBand 2 GB/s" in lines[speed]
    # the same numbers as the model's, in process: FSDP's 4 ranks, 2 apart, span two nodes of 4 (2 NICs each)
    cfg = load_config(CONFIGS / "demo.yaml", tiny(tmp_path, *overrides)[2:])
    info = DatasetInfo(codec={}, latent_stats={}, text_encoder={"name": "assumed", "dim": 384}, latent_channels=4,
                       spatial_factor=1, temporal_factor=1)
    model_cfg = model_config(cfg, info)
    layout = choose_fsdp_sync(model_cfg, memory_layout(cfg, 8, 128), 80 * GiB)  # fsdp_sync=auto, as --plan resolves it
    cluster = Cluster(gpus_per_node=4, infiniband=2e9, efficiency=0.25, memory=80 * GiB)
    p = predict(model_cfg, layout, cluster)
    assert [g.group for g in p.groups] == ["tp", "fsdp"] and p.groups[1].link.bandwidth == 4e9
    assert re.search(r"^  fsdp +2×IB 4 GB/s ", out, re.M)  # the ring through both NICs of each node
    assert lines[-2] == (f"predicted step {p.step:.3g} s: compute {p.compute_step:.3g} s + exposed {p.exposed:.3g} s "
                         f"({p.exposed / p.step:.0%}); {p.tokens_per_second_per_gpu:,.0f} tokens/s per GPU, MFU "
                         f"{p.mfu:.1%}; bound: {p.bound}")
    # then the same layout at half the cross-node bandwidth: FSDP's gathers over 2 NICs of 1 GB/s take longer
    half = at_cross_node(model_cfg, layout, cluster)
    assert half.groups[1].link.bandwidth == 2e9 and half.mfu < p.mfu
    assert lines[-1] == (f"at 0.5x the InfiniBand bandwidth (1 GB/s per GPU): step {half.step:.3g} s, exposed "
                         f"{half.exposed / half.step:.0%}; {half.tokens_per_second_per_gpu:,.0f} tokens/s per GPU, MFU "
                         f"{half.mfu:.1%} ({(half.mfu - p.mfu) * 100:+.1f} points); bound: {half.bound}")


def test_bad_cluster_options_are_one_line_errors(tmp_path):
    for option, value, error in (("--efficiency", 1.5, "--efficiency=1.5 is invalid: expected a fraction of the peak "
                                                       "in (0, 1]"),
                                 ("--nvlink-gbps", 0, "--nvlink-gbps=0.0 is invalid: expected a number > 0 (GB/s per "
                                                      "GPU)")):
        code, _, err = invoke(*tiny(tmp_path), "--plan", option, value)
        assert code == 2 and err.strip() == f"error: {error}", err


def test_the_help_states_the_cluster_defaults():
    _, out, _ = invoke("--help")
    text = " ".join(out.replace("│", " ").split())  # the help's box, unwrapped
    c = Cluster()
    for option, default in (("--gpus-per-node", c.gpus_per_node), ("--nvlink-gbps", c.nvlink / 1e9),
                            ("--ib-gbps", c.infiniband / 1e9), ("--peak-tflops", c.peak_flops / 1e12)):
        assert f"(default {default:g}" in text, option
    assert (f"(default: measured on an H200 by width, {c.efficiency_at(3072):g} up to 3072 wide, else "
            f"{c.efficiency_at(6144):g})") in text


def test_the_search_lists_layouts_that_fit_fastest_first(tmp_path):
    args = tiny(tmp_path, "train.global_batch=4")
    code, out, err = invoke(*args, "--plan", "--search", "--top", 2, "--world-size", 4, "--gpus-per-node", 2)
    print(out)
    assert code == 0, err
    rows = out[out.index("search: the 2 fastest layouts of 4 GPUs that fit"):].splitlines()[2:]
    speeds = [float(row.split()[0].replace(",", "")) for row in rows]
    assert len(rows) == 2 and speeds == sorted(speeds, reverse=True)
    code, out, err = invoke(*tiny(tmp_path), "--plan", "--search", "--world-size", 4, "--gpu-memory", 1)
    assert code == 2 and err.strip().splitlines()[-1] == ("error: no layout of 4 GPUs fits 1 GiB: use more GPUs "
                                                          "(--world-size) or a smaller model")
