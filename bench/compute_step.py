"""One rank's compute of a training step, measured: forward + backward of a block stack on one row, on one GPU.

What `dit-train --plan`'s step-time model (ditcore.speed) calls the compute term: ditcore.flops' honest training
FLOPs of the row (per-sample adaLN/embedder work excluded) at a stated fraction of the GPU's dense bf16 peak. This
script measures the time those FLOPs take, without data loading, optimizer, EMA or communication, so that the
fraction the model assumes can be compared with the one a GPU reaches. It prints, per case, the median
forward + backward time over the timed steps (CUDA events, after warm-up: the first compiled steps compile), the
FLOPs, the fraction of peak reached (FLOPs ÷ time ÷ peak: the MFU of the compute alone; with activation
checkpointing the recomputed forward is work done but not counted, as MFU counts it) and the peak memory.

The default is the stack of DiT-7B width (3072 wide, 24 heads) that bench/gpu_train.py trains: `--depth` blocks on
one 8192-token row (a 16x8x64x64 clip latent, patch 2: 8x32x32 tokens) with 256 text tokens of width 4096 (as
T5-XXL's), fp32 weights under bf16 autocast, flex attention.

    python bench/compute_step.py --out /tmp/compute                   # eager; compiled: none, selective, block
    python bench/compute_step.py --preset MovieGen-30B --depth 2 --cases compiled-selective compiled-block --out OUT
    python bench/compute_step.py --smoke --out /tmp/compute-smoke      # the same logic on the CPU with DiT-Tiny
    python bench/compute_step.py --compare bench/results/compute_step_h200_*.json   # measured vs predicted

Writes OUT/results.json (after every case). `--compare` reads such files (here, no GPU needed) and prints, per case,
the measured time beside the compute term of `ditcore.speed.predict` for the same stack, row and checkpointing on one
GPU (the default cluster's efficiency at the stack's width, `--efficiency` to change it), and the efficiency that
would make them equal.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from ditcore.diffusion import EDMLoss, EDMPrecond
from ditcore.flops import gpu_peak_flops, measure_cpu_peak_flops, training_flops_per_token
from ditcore.layout import grid_rows
from ditcore.models import apply_activation_checkpointing, apply_compile, build, inputs_of, preset

CASES = {"eager-none": (False, "none"), "compiled-none": (True, "none"), "compiled-selective": (True, "selective"),
         "compiled-block": (True, "block")}


def batch(cfg, grid: tuple[int, int, int], text_len: int, device: str) -> dict:
    """One row holding one clip of `grid` tokens, with its text: as dit-train feeds a whole-row sample."""
    N = grid[0] * grid[1] * grid[2]
    seg, pos = grid_rows([[grid]], N)
    g = torch.Generator().manual_seed(0)
    text = text_seg = None
    x, noise = torch.randn(1, N, cfg.patch_dim, generator=g), torch.randn(1, N, cfg.patch_dim, generator=g)
    if cfg.text_dim:
        text, text_seg = torch.randn(1, text_len, cfg.text_dim, generator=g), torch.zeros(1, text_len, dtype=torch.long)
    inputs = inputs_of(cfg)(pos=pos, seg=seg, text=text, text_seg=text_seg, grids=[[grid]])
    return {"x": x.to(device), "noise": noise.to(device), "sigma": torch.ones(1, 1, device=device),
            "mask": (seg >= 0).to(device), "inputs": inputs.to(device)}


def measure(cfg, compiled: bool, checkpointing: str, data: dict, device: str, steps: int, warmup: int) -> dict:
    torch.manual_seed(0)
    model = build(cfg).to(device)
    apply_activation_checkpointing(model, checkpointing)
    if compiled:
        apply_compile(model)
    loss_fn, precond = EDMLoss(), EDMPrecond(model)
    cuda = device == "cuda"
    autocast = torch.autocast(device, torch.bfloat16)

    def step() -> None:
        batch = dict(data)
        with autocast:
            loss = loss_fn(precond, batch.pop("x"), **batch)
        loss.backward()
        model.zero_grad(set_to_none=True)

    t0 = time.perf_counter()
    for _ in range(warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    warm_s = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
    peak_mem = torch.cuda.max_memory_allocated() if cuda else None
    return {"median_s": statistics.median(times), "min_s": min(times), "times_s": times, "warmup_s": warm_s,
            "peak_memory_bytes": peak_mem}


def compare(paths: list[Path], efficiency: float | None) -> None:
    """Measured forward + backward beside the step-time model's compute term for the same work on one GPU."""
    from ditcore.job import Layout
    from ditcore.speed import Cluster, predict

    cluster = Cluster(efficiency=efficiency)
    at = f"{efficiency:.1%}" if efficiency else "the efficiency measured at the stack's width, at most 50%"
    print(f"compute term (ditcore.speed) at {at} of {cluster.peak_flops / 1e12:g} TFLOP/s")
    for path in paths:
        run = json.loads(path.read_text())
        h = run["header"]
        cfg = preset(h["preset"], depth=h["depth"], text_dim=4096, in_channels=16)
        for r in run["results"]:
            compiled, checkpointing = CASES[r["case"]]
            lay = Layout(seq_length=h["tokens"], text_len=h["text_tokens"], activation_checkpointing=checkpointing,
                         compile=compiled)
            p = predict(cfg, lay, cluster)
            term = p.compute_micro_batch
            print(f"{h['preset']:<13} {h['depth']} blocks  {r['case']:<19} measured {r['median_s'] * 1e3:7.1f} ms  "
                  f"predicted {term * 1e3:7.1f} ms  ({term / r['median_s'] - 1:+.0%}; equal at "
                  f"{p.efficiency * term / r['median_s']:.1%} efficiency)  on {h['device']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="DiT-7B", help="the preset whose width the stack has (default: DiT-7B; also "
                                                        "DiT-28B, MovieGen-30B)")
    ap.add_argument("--depth", type=int, default=4, help="blocks of the stack (default: 4)")
    ap.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    ap.add_argument("--steps", type=int, default=10, help="timed steps per case (default: 10)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first, compilation included (default: 3)")
    ap.add_argument("--smoke", action="store_true", help="DiT-Tiny on the CPU, eager: checks the logic")
    ap.add_argument("--out", type=Path, help="folder for results.json")
    ap.add_argument("--compare", type=Path, nargs="+", metavar="RESULTS",
                    help="results.json files: print them beside ditcore.speed's compute term; runs nothing")
    ap.add_argument("--efficiency", type=float, help="with --compare: the fraction of peak assumed (default: "
                                                     "ditcore.speed.Cluster's at the width)")
    args = ap.parse_args(argv)
    if args.compare:
        compare(args.compare, args.efficiency)
        return 0
    if args.out is None:
        ap.error("--out is required (or --compare)")

    if args.smoke:
        device, grid, text_len = "cpu", (2, 4, 4), 8
        cfg = preset("DiT-Tiny", depth=2, text_dim=16, in_channels=4)
        cases = {name: CASES[name] for name in args.cases if not CASES[name][0]}  # the CPU has no flex backward
        peak = measure_cpu_peak_flops()
    else:
        if not torch.cuda.is_available():
            ap.error("no CUDA device: run on a GPU, or pass --smoke")
        device, grid, text_len = "cuda", (8, 32, 32), 256
        cfg = preset(args.preset, depth=args.depth, text_dim=4096, in_channels=16)
        cases = {name: CASES[name] for name in args.cases}
        peak = gpu_peak_flops(torch.cuda.get_device_name())
        if peak is None:
            ap.error(f"no dense bf16 peak known for {torch.cuda.get_device_name()} (ditcore.flops.PEAK_FLOPS)")
    N = grid[0] * grid[1] * grid[2]
    flops = training_flops_per_token(cfg, N, text_len, frames=grid[0]) * N
    data = batch(cfg, grid, text_len, device)
    header = {"preset": "DiT-Tiny" if args.smoke else args.preset, "depth": cfg.depth,
              "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
              "model": f"{cfg.hidden_size} wide, {cfg.depth} blocks, {cfg.num_heads} heads", "tokens": N,
              "text_tokens": text_len, "flops_per_step": flops, "peak_flops": peak}
    print(json.dumps(header), flush=True)
    results = []
    args.out.mkdir(parents=True, exist_ok=True)
    for name, (compiled, checkpointing) in cases.items():
        r = measure(cfg, compiled, checkpointing, data, device, args.steps, args.warmup)
        if device == "cuda":
            torch.cuda.empty_cache()  # the case's model is gone: give its memory back before the next one
        r |= {"case": name, "fraction_of_peak": flops / r["median_s"] / peak}
        results.append(r)
        mem = "" if r["peak_memory_bytes"] is None else f", peak memory {r['peak_memory_bytes'] / 2**30:.1f} GiB"
        print(f"{name:<20} {r['median_s'] * 1e3:9.1f} ms forward+backward (min {r['min_s'] * 1e3:.1f}), "
              f"{r['fraction_of_peak']:.1%} of peak{mem}", flush=True)
        (args.out / "results.json").write_text(json.dumps({"header": header, "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
