"""bench/gpu_train.py: the numbers it reports are the ones dit-train logged and ditcore.flops counts."""

import csv
import importlib.util
import json
import math
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ditcore.data.schema import DatasetInfo
from ditcore.flops import training_flops_per_token
from ditcore.models import preset

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_train.py"
spec = importlib.util.spec_from_file_location("gpu_train", SCRIPT)
gpu_train = sys.modules["gpu_train"] = importlib.util.module_from_spec(spec)  # bench/ is not a package
spec.loader.exec_module(gpu_train)


def write_metrics(path: Path, rows: list[dict]) -> Path:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=rows[0].keys())
        writer.writeheader()
        writer.writerows(rows)
    return path


def test_throughput_after_warm_up_is_total_tokens_over_total_time(tmp_path):
    # windows of 5 steps; packed rows hold different tokens and FLOPs in each; the first includes compilation
    windows = {5: (40.0, 5 * 4096), 10: (2.0, 5 * 3900), 15: (2.5, 5 * 4030), 20: (1.5, 5 * 3650)}
    flops_per_token = 2e10
    rows = [{"step": s, "loss": 1.0, "tokens_per_s": n / t, "mfu": n * flops_per_token / t / 989e12,
             "step_s": t / 5, "peak_mem_gib": 30.0 + s / 10} for s, (t, n) in windows.items()]
    got = gpu_train.measured(write_metrics(tmp_path / "m.csv", rows), warmup_steps=5)
    tokens = 5 * (3900 + 4030 + 3650)
    assert got["tokens_per_s"] == pytest.approx(tokens / 6.0)
    assert got["mfu"] == pytest.approx(tokens * flops_per_token / 6.0 / 989e12)
    assert (got["peak_mem_gib"], got["windows"]) == (32.0, 3)
    with pytest.raises(ValueError, match="no window logged after step 20"):
        gpu_train.measured(tmp_path / "m.csv", warmup_steps=20)


@pytest.mark.parametrize("smoke", [False, True])
def test_whole_rows_hold_one_sample_and_packed_rows_several(smoke):
    cases = {c.name: c for c in gpu_train.make_cases(gpu_train.parse_args(["--smoke"] if smoke else []))}
    assert gpu_train.parse_args([]).cases == gpu_train.DEFAULT == [
        "xl-whole-eager", "xl-whole-compiled", "xl-packed-eager", "xl-packed-compiled",
        "7b-whole-eager", "7b-whole-compiled", "7b-packed-eager", "7b-packed-compiled"]
    assert list(cases) == gpu_train.NAMES
    assert [(c.seq_length, c.micro_batch, c.mode) for c in cases.values() if c.name in gpu_train.DEFAULT] == (
        [(64, 2, "eager"), (64, 2, "compiled")] * 4 if smoke else
        [(4096, 6, "eager"), (4096, 6, "compiled")] * 2 + [(8192, 2, "eager"), (8192, 2, "compiled")] * 2)
    row = {"xl": 64 if smoke else 4096} | dict.fromkeys(("7b", "stdit", "mg30b"), 64 if smoke else 8192)
    packed = {"xl": [16, 32] if smoke else [256, 2048]} | dict.fromkeys(  # the others: two clips a row
        ("7b", "stdit", "mg30b"), [32] if smoke else [4096])
    for c in cases.values():
        assert c.sample_tokens == ([row[c.family]] if c.layout == "whole" else packed[c.family]), c.name
    wide = cases["7b-packed-eager"]
    assert (wide.preset, wide.depth, wide.data.text_len, wide.data.text_dim) == (
        ("DiT-Tiny", 1, 8, 32) if smoke else ("DiT-7B", 4, 256, 4096))
    assert (cases["stdit-whole-eager"].arch, cases["stdit-whole-eager"].preset) == (
        ("stdit", "ST-DiT-Tiny") if smoke else ("stdit", "ST-DiT-XL/2"))
    big = cases["mg30b-packed-compiled"]
    assert (big.arch, big.preset, big.depth) == (("moviegen", "MovieGen-Tiny", 1) if smoke else
                                                 ("moviegen", "MovieGen-30B", 2))
    assert {c.name for c in cases.values() if c.checkpointing != "none"} == {n for n in cases if n.startswith("stdit")}
    assert cases["stdit-packed-compiled"].checkpointing == "selective"
    assert cases["xl-packed-eager"].data.video_ratio == 0.5
    assert cases["xl-whole-eager"].data.image == ((4, 1, 16, 16) if smoke else (4, 1, 128, 128))  # the peer's


def test_packing_cost_is_whole_row_over_packed_throughput_of_one_model_and_mode():
    results = [{"case": "xl-whole-eager", "model": "DiT-XL/2", "tokens_per_s": 110.0},
               {"case": "xl-packed-eager", "model": "DiT-XL/2", "tokens_per_s": 100.0},
               {"case": "xl-whole-compiled", "model": "DiT-XL/2", "tokens_per_s": 120.0},
               {"case": "xl-packed-compiled", "model": "DiT-XL/2", "error": "CUDA OOM"},
               {"case": "7b-whole-eager", "model": "DiT-7B width, 4 blocks", "tokens_per_s": 50.0}]
    costs = gpu_train.packing_costs(results)
    assert [(c["family"], c["mode"], c["cost"]) for c in costs] == [
        ("xl", "eager", pytest.approx(1.1)), ("xl", "compiled", "not measured (xl-packed-compiled failed)")]


def test_a_log_window_that_would_mix_warm_up_and_measured_steps_is_refused(capsys):
    with pytest.raises(SystemExit):
        gpu_train.parse_args(["--warmup-steps", "7", "--log-every", "5"])
    assert "--log-every 5 must divide --warmup-steps 7 and --steps 20" in capsys.readouterr().err


@pytest.mark.slow
def test_smoke_run_reports_dit_train_s_throughput_and_mfu_the_check_and_the_packing_cost(tmp_path):
    out = tmp_path / "out"
    names = ["xl-whole-eager", "xl-packed-eager", "7b-packed-eager"]
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--cases", *names,
                           "--work", str(tmp_path / "work"), "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "results.json").read_text())
    peak = report["header"]["peak_flops"]
    by_case = {r["case"]: r for r in report["results"]}
    assert list(by_case) == names
    for name, r in by_case.items():
        assert (r["seq_length"], r["micro_batch"], r["windows"]) == (64, 2, 2)
        # the two measured steps (2 and 3) of dit-train's own log, one step a window: their real tokens, and
        # rates weighted by their time
        rows = list(csv.DictReader((out / "metrics" / f"{name}.csv").open()))
        assert [int(row["step"]) for row in rows] == [1, 2, 3]
        seconds = [float(row["step_s"]) for row in rows[1:]]
        tokens = [float(row["tokens_per_s"]) * s for row, s in zip(rows[1:], seconds, strict=True)]
        assert all(t == pytest.approx(round(t)) for t in tokens)
        if name.startswith("xl-whole"):
            assert tokens == pytest.approx([128, 128])  # 2 rows x 64 tokens, one sample each
        else:
            assert all(t <= 128 for t in tokens)  # several shorter samples, perhaps padding
        assert r["tokens_per_s"] == pytest.approx(sum(tokens) / sum(seconds))
        mfus = [float(row["mfu"]) for row in rows[1:]]
        assert r["mfu"] == pytest.approx(sum(m * s for m, s in zip(mfus, seconds, strict=True)) / sum(seconds))
        assert r["peak_mem_gib"] is None  # no GPU: dit-train writes no memory column
        check = "—" if r["mfu_check"] is None else f"{r['mfu_check']:.1%}"
        assert f"| {r['title']} | {r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | {check} |" in proc.stdout
    # the check column: whole rows only, from ditcore.flops and the model config this dataset makes dit-train build
    whole = by_case["xl-whole-eager"]
    cfg = preset("DiT-Tiny", in_channels=4)
    assert whole["mfu_check"] == pytest.approx(training_flops_per_token(cfg, 64, 0) * whole["tokens_per_s"] / peak)
    assert by_case["xl-packed-eager"]["mfu_check"] is None and by_case["7b-packed-eager"]["mfu_check"] is None
    peer = report["header"]["diffusers"]["eager"]
    for name in ("xl-whole-eager", "xl-packed-eager"):
        assert by_case[name]["vs_diffusers"] == pytest.approx(by_case[name]["tokens_per_s"] / peer)
    assert "vs_diffusers" not in by_case["7b-packed-eager"]  # the peer is an XL/2-shaped model only
    (cost,) = report["packing_cost"]
    assert (cost["family"], cost["mode"]) == ("xl", "eager")
    assert cost["cost"] == pytest.approx(whole["tokens_per_s"] / by_case["xl-packed-eager"]["tokens_per_s"])
    assert f"packing cost, DiT-Tiny, eager: {cost['cost']:.2f} " in proc.stdout
    assert (out / "results.md").read_text() in proc.stdout


# --------------------------------------------------------------------------------------------------
# Every benchmark the README runs fits its GPU by dit-train's plan

README = SCRIPT.parents[1] / "README.md"
H100_GIB = 79.0  # an "80 GB" H100's memory as torch reports it (79.1 GiB): what dit-train checks a plan against


def readme_commands() -> list[list[str]]:
    """The arguments of every `bench/gpu_train.py` command in README.md's bash blocks that runs on a GPU (not
    --smoke), with a shell loop's variable expanded to each of its values."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(), re.S):
        block = block.replace("\\\n", " ")
        loop = re.search(r"for (\w+) in ([^;]+); do", block)
        for line in block.splitlines():
            if "bench/gpu_train.py" not in line or "--smoke" in line:
                continue
            args = shlex.split(line.split("bench/gpu_train.py", 1)[1], comments=True)
            if loop and f"${loop[1]}" in line:
                commands += [[a.replace(f"${loop[1]}", value) for a in args] for value in loop[2].split()]
            else:
                commands.append(args)
    return commands


def mock_info(data, root: Path) -> Path:
    """The ditcore.json that `dit-prepare mock` writes for `data`: all that dit-train --plan reads of a dataset."""
    path = root / data.name
    (path / ".nv-meta").mkdir(parents=True)
    DatasetInfo(codec={"kind": "none"}, latent_stats={}, text_encoder={"name": "mock", "dim": data.text_dim},
                latent_channels=data.image[0], spatial_factor=1, temporal_factor=1).write(path)
    return path


def row_text_tokens(case) -> int:
    """The text tokens a row of `case` holds: each of its samples' (all of one length), padded up to a multiple of
    128, as dit-train's loader pads them on a GPU (FlexAttention's key block)."""
    if not case.data.text_dim:
        return 0
    samples = case.seq_length // min(case.sample_tokens)
    return math.ceil(samples * case.data.text_len / 128) * 128


def test_every_benchmark_the_readme_runs_fits_an_h100_by_the_plan(tmp_path):
    from dit_train.cli import app

    cases = {}  # the same case with other settings (--depth 8) is another case
    for argv in readme_commands():
        args = gpu_train.parse_args(argv)
        every = {c.name: c for c in gpu_train.make_cases(args)}
        cases |= {every[name]: argv for name in args.cases}
    assert {c.name for c in cases} == set(gpu_train.DEFAULT) | {
        "stdit-whole-compiled", "stdit-packed-compiled", "mg30b-whole-compiled", "mg30b-packed-compiled"}
    assert len(cases) == 13  # those twelve, and 7b-packed-compiled with --depth 8 (xl-packed-compiled ignores it)
    datasets = {}
    for case, argv in cases.items():
        if case.data not in datasets:
            datasets[case.data] = mock_info(case.data, tmp_path)
        args = gpu_train.train_args(case, datasets[case.data], tmp_path / "run", 30, 5, smoke=False)
        result = CliRunner().invoke(app, [*args, "--plan", "--world-size", "1", "--gpu-memory", str(H100_GIB),
                                          "--text-len", str(row_text_tokens(case))])
        verdict = next(line for line in result.stdout.splitlines() if line.startswith("fits in ")
                       or "NOT fit" in line)  # the memory table's last line; the predicted step follows it
        assert result.exit_code == 0, f"{case.title} ({' '.join(argv)}):\n{result.stdout}{result.stderr}"
        assert verdict.startswith(f"fits in {H100_GIB:g} GiB: 71.0 GiB usable after headroom 4.0 GiB + 5% of the card")
    assert not (tmp_path / "run").exists()  # planned, not run
