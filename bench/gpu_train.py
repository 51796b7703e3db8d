"""The real `dit-train` on one GPU: tokens/s, MFU, peak memory, the cost of packed rows, and the ratio against
diffusers' DiT-XL/2.

Two models, each on two data layouts, each eager and with its blocks compiled: eight cases. DiT-XL/2 on
4096-token rows, and a stack of DiT-7B width (3072, 24 heads) with a few blocks on 8192-token rows with 256
text tokens of width 4096 (as T5-XXL's) per sample. In the "whole" layout every sample fills exactly one row
(XL/2: a 4x1x128x128 image latent; 7B: a 16x8x64x64 clip), so attention spans the row; in the "packed" layout
each row holds several shorter samples (XL/2: 256-token 4x1x32x32 images and 2048-token 4x8x32x32 clips, half
each; 7B: two 4096-token 16x4x64x64 clips), so attention is block-diagonal. For each dataset the script runs
`dit-prepare mock` once; for each case it runs `dit-train` on it in a subprocess and reads its CSV log after
the warm-up steps (the first windows include compilation).

Tokens are real tokens (padding left in a packed row is not counted). Windows of packed rows differ in tokens
and FLOPs, so a rate after warm-up is the windows' rates weighted by dit-train's step_s: the total over the
total time. MFU is dit-train's own mfu column, weighted alike: ditcore.flops.batch_flops, every sample at its
own length (adaLN and embedders excluded), over the GPU's dense bf16 peak. A packed row's FLOPs depend on the
lengths of the samples in it, which this script does not see; for whole rows, where it is exact, the script
recomputes MFU as a check: training_flops_per_token of the model config dit-train exported at the row length,
times tokens/s, over the peak.

"Packing cost" is whole-row tokens/s over packed tokens/s of the same model and mode (> 1: packed rows are
slower; the target is <= 1.10). Packed samples are shorter, so their attention does fewer FLOPs per token: the
cost is what training sees at one row length, and the MFU column shows how well each layout uses the GPU.

The other reference architectures run on the 7B cases' clips and text (not by default: `--cases stdit-...` and
`mg30b-...`): ST-DiT-XL/2 (its blocks attend within 1024-token frames or 8- and 4-token time-lines), with selective
recomputation, and a stack of MovieGen-30B width (6144, 48 heads in 8 key/value groups, SwiGLU 16384) with
`--30b-depth` blocks. Their MFU counts the attention they do: ST-DiT's per frame and per line (ditcore.flops,
`DiTConfig.attended`).

Every case fits one 80 GB H100 by `dit-train --plan`, headroom kept (tests/bench/test_gpu_train.py plans every case
that README.md's commands run): XL/2 with 6 rows a step (8 would need 75 GiB), ST-DiT-XL/2 with selective
recomputation (107 GiB without), MovieGen-30B width with 2 blocks (each block's fp32 weights, gradients, AdamW state
and EMA take 13 GiB).

After the cases, diffusers' DiTTransformer2DModel XL/2 (built as in bench/model_step.py) trains in this process
on the whole-row latents (4x128x128: 4096 tokens per image) and batch, with bf16 autocast like dit-train: "vs
diffusers" is our tokens/s over its tokens/s (> 1: ours is faster), for the whole and the packed XL/2 cases,
eager against eager, compiled against compiled. The peer's step is the model step alone: no data loading, EMA
or gradient clipping, which dit-train's includes (this favours the peer). It is class-conditional where ours on
mock data is not, a per-sample cost too small to matter.

    python bench/gpu_train.py                                      # the eight cases, then the peer
    python bench/gpu_train.py --cases xl-packed-compiled 7b-packed-compiled --depth 8
    python bench/gpu_train.py --cases stdit-whole-compiled stdit-packed-compiled mg30b-whole-compiled \
        mg30b-packed-compiled
    python bench/gpu_train.py --smoke --out /tmp/gpu-train-smoke   # the same on the CPU with DiT-Tiny

Writes OUT/results.json, OUT/results.md (the table), OUT/logs/CASE.log and OUT/metrics/CASE.csv. Run
directories (checkpoints of several GB) are deleted once read, unless --keep-runs.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ditcore import export, runs
from ditcore.flops import gpu_peak_flops, measure_cpu_peak_flops, training_flops_per_token
from ditcore.models import PRESETS, DiTConfig, preset

TRAIN = "from dit_train.cli import app; app()"  # console scripts may not be installed (the device machine)
PREPARE = "from dit_prepare.cli import app; app()"
FAMILIES, LAYOUTS, MODES = ("xl", "7b", "stdit", "mg30b"), ("whole", "packed"), ("eager", "compiled")
NAMES = [f"{f}-{layout}-{mode}" for f in FAMILIES for layout in LAYOUTS for mode in MODES]
DEFAULT = [name for name in NAMES if name.split("-")[0] in ("xl", "7b")]  # the eight DiT cases


@dataclass(frozen=True)
class Data:
    """One mock dataset: images and clips of these latent shapes (C, T, H, W, one C), a fraction of clips, and
    text states of text_len x text_dim per sample."""

    image: tuple[int, int, int, int]
    clip: tuple[int, int, int, int]
    video_ratio: float
    text_len: int
    text_dim: int  # 0: no text (the model then has no cross-attention)

    @property
    def name(self) -> str:
        shapes = "x".join(map(str, self.image))
        if self.clip != self.image:
            shapes += "+" + "x".join(map(str, self.clip)) + f"-clips{self.video_ratio:g}"
        return shapes + (f"-text{self.text_len}x{self.text_dim}" if self.text_dim else "")

    @property
    def latents(self) -> list[tuple[int, int, int, int]]:
        """The shapes samples have."""
        return [s for s, share in ((self.image, 1 - self.video_ratio), (self.clip, self.video_ratio)) if share]


@dataclass(frozen=True)
class Case:
    family: str  # FAMILIES
    layout: str  # "whole": every sample fills one row; "packed": several shorter samples per row
    mode: str  # "eager" or "compiled" (its blocks)
    model: str  # the model's words in the table
    arch: str  # model.arch
    preset: str
    depth: int | None  # None: the preset's
    data: Data
    seq_length: int  # tokens per row
    micro_batch: int  # rows per step
    what: str  # the rows' samples, in words
    checkpointing: str = "none"  # model.activation_checkpointing

    @property
    def name(self) -> str:
        return f"{self.family}-{self.layout}-{self.mode}"

    @property
    def title(self) -> str:
        text = f", {self.data.text_len} text tokens" if self.data.text_dim else ""
        recompute = f", {self.checkpointing} recomputation" if self.checkpointing != "none" else ""
        return f"{self.model}, {self.layout} {self.seq_length}-token rows ({self.what}){text}{recompute}, {self.mode}"

    @property
    def sample_tokens(self) -> list[int]:
        """Tokens of each shape of sample: the row length for whole rows, less for packed ones."""
        p = PRESETS[self.preset]
        return [(T // p.patch_size_t) * (H // p.patch_size) * (W // p.patch_size) for _, T, H, W in self.data.latents]


def make_cases(args) -> list[Case]:
    """All of them, in NAMES's order."""
    if args.smoke:  # tiny stand-ins with the same structure, small enough for the CPU
        models = {"xl": ("DiT-Tiny", "dit", "DiT-Tiny", None, 64, (0, 0)),
                  "7b": ("DiT-Tiny, 1 block", "dit", "DiT-Tiny", 1, 64, (8, 32)),
                  "stdit": ("ST-DiT-Tiny", "stdit", "ST-DiT-Tiny", None, 64, (8, 32)),
                  "mg30b": ("MovieGen-Tiny, 1 block", "moviegen", "MovieGen-Tiny", 1, 64, (8, 32))}
        video = {"whole": ((4, 4, 8, 8), (4, 4, 8, 8), 1.0, "one 4-frame 8x8 clip"),
                 "packed": ((4, 2, 8, 8), (4, 2, 8, 8), 1.0, "two 2-frame 8x8 clips")}
        layouts = {("xl", "whole"): ((4, 1, 16, 16), (4, 1, 16, 16), 0.0, "one 16x16 image"),
                   ("xl", "packed"): ((4, 1, 8, 8), (4, 2, 8, 8), 0.5, "16-token images and 32-token 2-frame clips")}
    else:
        models = {"xl": ("DiT-XL/2", "dit", "DiT-XL/2", None, 4096, (0, 0)),
                  "7b": (f"DiT-7B width, {args.depth} blocks", "dit", "DiT-7B", args.depth, 8192, (256, 4096)),
                  "stdit": ("ST-DiT-XL/2", "stdit", "ST-DiT-XL/2", None, 8192, (256, 4096)),
                  "mg30b": (f"MovieGen-30B width, {args.depth_30b} blocks", "moviegen", "MovieGen-30B",
                            args.depth_30b, 8192, (256, 4096))}
        video = {"whole": ((16, 8, 64, 64), (16, 8, 64, 64), 1.0, "one 8-frame 64x64 clip"),
                 "packed": ((16, 4, 64, 64), (16, 4, 64, 64), 1.0, "two 4-frame 64x64 clips")}
        layouts = {("xl", "whole"): ((4, 1, 128, 128), (4, 1, 128, 128), 0.0, "one 128x128 image"),
                   ("xl", "packed"): ((4, 1, 32, 32), (4, 8, 32, 32), 0.5,
                                      "256-token images and 2048-token 8-frame clips")}
    layouts |= {(family, layout): shapes for family in ("7b", "stdit", "mg30b") for layout, shapes in video.items()}
    batch = {"xl": args.xl_micro_batch, "7b": args.micro_batch_7b, "stdit": args.micro_batch_7b,
             "mg30b": args.micro_batch_7b}
    checkpointing = {"stdit": "selective"}  # ST-DiT-XL/2's 56 blocks keep 74 GiB of activations for 2 rows without
    cases = []
    for name in NAMES:
        family, layout, mode = name.split("-")
        model, arch, preset_name, depth, seq_length, text = models[family]
        image, clip, video_ratio, what = layouts[family, layout]
        data = Data(image, clip, video_ratio, *text)
        cases.append(Case(family, layout, mode, model, arch, preset_name, depth, data, seq_length, batch[family],
                          what, checkpointing.get(family, "none")))
    return cases


# --------------------------------------------------------------------------------------------------
# dit-prepare and dit-train, as a user runs them


def prepare(data: Data, out: Path, num: int, log) -> None:
    cmd = [sys.executable, "-c", PREPARE, "mock", "--out", str(out), "--num", str(num),
           "--latent-shape", ",".join(map(str, data.image)), "--video-latent-shape", ",".join(map(str, data.clip)),
           "--video-ratio", f"{data.video_ratio:g}", "--text-len", str(data.text_len), "--text-dim", str(data.text_dim),
           "--shard-size", str(max(1, num // 8)), "--overwrite"]
    rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env()).returncode
    if rc != 0:
        sys.exit(f"error: dit-prepare mock failed (exit {rc}) for {data.name}: see {log.name}")


def train_args(case: Case, data: Path, run_dir: Path, steps: int, log_every: int, smoke: bool) -> list[str]:
    return ["--config", "mock", "--resume", "none",
            f"model.arch={case.arch}", f"model.preset={case.preset}",
            f"model.compile={str(case.mode == 'compiled').lower()}",
            f"model.activation_checkpointing={case.checkpointing}",
            *([f"model.depth={case.depth}"] if case.depth else []),
            f"data.path={data}", f"data.seq_length={case.seq_length}", f"data.num_workers={0 if smoke else 4}",
            f"train.run_dir={run_dir}", f"train.steps={steps}",
            f"train.micro_batch={case.micro_batch}", f"train.global_batch={case.micro_batch}",
            f"checkpoint.every={steps}", f"logging.every={log_every}", "logging.tensorboard=false",
            *(["parallel.accelerator=cpu"] if smoke else [])]


def child_env() -> dict:
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


def failure(log_path: Path, rc: int) -> str:
    text = log_path.read_text(errors="replace")
    if "OutOfMemoryError" in text or "out of memory" in text:
        return "CUDA OOM"
    return f"failed (exit {rc}, see logs/{log_path.name})"


# --------------------------------------------------------------------------------------------------
# Reading the numbers


def measured(metrics_csv: Path, warmup_steps: int) -> dict:
    """Tokens/s, dit-train's MFU and the peak memory of the windows logged after warm-up.

    Windows of packed rows differ in tokens and FLOPs. Every window has the same number of steps, so a rate
    weighted by the window's seconds per step, sum(rate * step_s) / sum(step_s), is the total tokens (FLOPs)
    over the total time.
    """
    rows = [r for r in csv.DictReader(metrics_csv.open())
            if r.get("tokens_per_s") and int(float(r["step"])) > warmup_steps]
    if not rows:
        raise ValueError(f"{metrics_csv} has no window logged after step {warmup_steps}")
    seconds = [float(r["step_s"]) for r in rows]

    def over_time(key: str) -> float:
        return sum(float(r[key]) * s for r, s in zip(rows, seconds, strict=True)) / sum(seconds)

    mem = [float(r["peak_mem_gib"]) for r in rows if r.get("peak_mem_gib")]
    return {"tokens_per_s": over_time("tokens_per_s"), "mfu": over_time("mfu"),
            "peak_mem_gib": max(mem) if mem else None, "windows": len(rows)}


def exported_config(run_dir: Path) -> DiTConfig:
    """The model config dit-train trained (RUN_DIR/export/model.json): the one its FLOPs are counted for."""
    return export.exported_config(runs.export_dir(run_dir))


# --------------------------------------------------------------------------------------------------
# The diffusers peer


def peer_tokens_per_s(case: Case, device: str, modes: list[str], steps: int, warmup: int) -> dict[str, float | str]:
    """diffusers' DiTTransformer2DModel of `case`'s preset, trained on `case`'s (whole-row) image latents and
    batch: tokens/s in each mode ('eager', then 'compiled': its blocks torch.compile'd, as apply_compile does
    ours), or why not."""
    from model_step import build_peer, make_step, time_steps  # bench/model_step.py, beside this file

    C, _, H, W = case.data.image
    cfg = preset(case.preset, num_classes=1000, in_channels=C, max_grid=(1, H, W))  # model_step's peer config
    try:
        model, forward = build_peer(cfg)
    except ImportError as e:
        return dict.fromkeys(modes, f"diffusers is not importable ({e})")
    model.to(device)
    step = make_step(model, forward)

    def bf16_step(*batch):  # as dit-train on a GPU: fp32 weights, bf16 autocast
        with torch.autocast(device, torch.bfloat16, enabled=device == "cuda"):
            return step(*batch)

    out = {}
    for mode in ("eager", "compiled"):
        if mode == "compiled":
            for block in model.transformer_blocks:
                block.compile()
        if mode not in modes:
            continue
        try:
            sec = time_steps({"diffusers": bf16_step}, case.micro_batch, C, H, steps, warmup, device)["diffusers"]
            out[mode] = case.micro_batch * case.seq_length / sec
        except torch.OutOfMemoryError:
            out[mode] = "CUDA OOM"
        except RuntimeError as e:  # a compiler failure: say so in the table rather than lose the cases' numbers
            out[mode] = f"failed ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
    return out


# --------------------------------------------------------------------------------------------------
# The table


def fmt(value, spec: str) -> str:
    if value is None:
        return "—"
    return value if isinstance(value, str) else format(value, spec)


def packing_costs(results: list[dict]) -> list[dict]:
    """For each model and mode whose whole and packed cases both ran: whole-row tokens/s over packed tokens/s."""
    by_name = {r["case"]: r for r in results}
    costs = []
    for family in FAMILIES:
        for mode in MODES:
            whole, packed = by_name.get(f"{family}-whole-{mode}"), by_name.get(f"{family}-packed-{mode}")
            if not (whole and packed):
                continue
            cost = {"family": family, "mode": mode, "model": whole["model"],
                    "whole_tokens_per_s": whole.get("tokens_per_s"), "packed_tokens_per_s": packed.get("tokens_per_s")}
            failed = [r["case"] for r in (whole, packed) if r.get("error")]
            cost["cost"] = (f"not measured ({' and '.join(failed)} failed)" if failed
                            else cost["whole_tokens_per_s"] / cost["packed_tokens_per_s"])
            costs.append(cost)
    return costs


def table(results: list[dict], costs: list[dict], header: dict) -> str:
    lines = [f"device: {header['device']}; torch {header['torch']}; peak for MFU: {header['peak_note']}",
             f"command: {header['command']}", "",
             "| case | tokens/s | MFU | MFU check (whole rows) | peak memory GiB | vs diffusers |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in results:
        if r.get("error"):
            lines.append(f"| {r['title']} | {r['error']} | | | | |")
            continue
        ratio = r.get("vs_diffusers")
        ratio = f"{ratio:.2f}x" if isinstance(ratio, float) else (ratio or "—")
        lines.append(f"| {r['title']} | {r['tokens_per_s']:,.0f} | {r['mfu']:.1%} | {fmt(r['mfu_check'], '.1%')} "
                     f"| {fmt(r['peak_mem_gib'], '.1f')} | {ratio} |")
    if costs:
        lines.append("")
    for c in costs:
        value = f"{c['cost']:.2f}" if isinstance(c["cost"], float) else c["cost"]
        lines.append(f"packing cost, {c['model']}, {c['mode']}: {value} "
                     "(whole-row tokens/s ÷ packed tokens/s; target ≤ 1.10)")
    for mode, value in header["diffusers"].items():
        lines.append(f"\ndiffusers DiTTransformer2DModel {header['diffusers_preset']}, {mode}: "
                     + (f"{value:,.0f} tokens/s" if isinstance(value, float) else value))
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------


def main() -> int:
    args = parse_args()
    on_gpu = torch.cuda.is_available() and not args.smoke
    if not on_gpu and not args.smoke:
        sys.exit("error: no CUDA GPU here — run on a GPU machine, or prove the script on the CPU with --smoke")
    every = {c.name: c for c in make_cases(args)}
    cases = [every[name] for name in args.cases]
    work, out = args.work.resolve(), args.out.resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    (out / "metrics").mkdir(exist_ok=True)
    train_steps = args.warmup_steps + args.steps

    datasets = {}
    for data in dict.fromkeys(c.data for c in cases):
        datasets[data] = work / "data" / data.name
        print(f"dit-prepare mock {data.name} ...", flush=True)
        with (out / "logs" / f"prepare-{data.name}.log").open("w") as log:
            prepare(data, datasets[data], args.samples, log)

    results = []
    for case in cases:
        run_dir = work / "runs" / case.name
        shutil.rmtree(run_dir, ignore_errors=True)  # one run-* CSV folder per case
        log_path = out / "logs" / f"{case.name}.log"
        print(f"dit-train {case.name}: {case.title}, {case.micro_batch} x {case.seq_length}-token rows per step ...",
              flush=True)
        t0 = time.perf_counter()
        cmd = [sys.executable, "-c", TRAIN,
               *train_args(case, datasets[case.data], run_dir, train_steps, args.log_every, args.smoke)]
        with log_path.open("w") as log:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env()).returncode
        result = {"case": case.name, "title": case.title, "model": case.model, "preset": case.preset,
                  "depth": case.depth, "compile": case.mode == "compiled", "seq_length": case.seq_length,
                  "sample_tokens": case.sample_tokens, "text_len": case.data.text_len, "micro_batch": case.micro_batch,
                  "seconds": round(time.perf_counter() - t0, 1)}
        if rc != 0:
            result["error"] = failure(log_path, rc)
        else:
            metrics_csv = next((run_dir / "csv").glob("run-*/metrics.csv"))
            shutil.copy(metrics_csv, out / "metrics" / f"{case.name}.csv")
            result |= measured(metrics_csv, args.warmup_steps)
            cfg = exported_config(run_dir)
            result["depth"] = cfg.depth
            frames = case.data.image[1] // cfg.patch_size_t  # of the whole row's one sample
            result["flops_per_token"] = (training_flops_per_token(cfg, case.seq_length, case.data.text_len, frames)
                                         if case.layout == "whole" else None)  # packed: per sample, not known here
        if not args.keep_runs:
            shutil.rmtree(run_dir, ignore_errors=True)
        print(f"  {result.get('error') or format(result['tokens_per_s'], ',.0f') + ' tokens/s'} "
              f"({result['seconds']:.0f} s)", flush=True)
        results.append(result)

    # After the cases, so that no dit-train run shares the GPU with this process's CUDA memory.
    device = "cuda" if on_gpu else "cpu"
    if on_gpu:
        name = torch.cuda.get_device_name()
        peak = args.peak_tflops * 1e12 if args.peak_tflops else gpu_peak_flops(name)
        peak_note = f"{peak / 1e12:.0f} TFLOP/s (dense bf16)" if peak else "unknown: pass --peak-tflops"
    else:
        name = f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
        peak = measure_cpu_peak_flops()
        peak_note = (f"{peak / 1e9:.0f} GFLOP/s (fp32 matmul measured here for the check column; dit-train "
                     "measures its own on CPU)")
    for r in results:
        if "tokens_per_s" in r:
            r["mfu_check"] = (r["flops_per_token"] * r["tokens_per_s"] / (peak or math.nan)
                              if r["flops_per_token"] else None)

    xl = [c for c in cases if c.family == "xl"]
    peer = {}
    if xl:
        print("diffusers DiT-XL/2 peer ...", flush=True)
        modes = [m for m in MODES if any(c.mode == m for c in xl)]
        peer = peer_tokens_per_s(every["xl-whole-eager"], device, modes, args.peer_steps, args.peer_warmup)
        for r, case in zip(results, cases, strict=True):
            if case.family == "xl" and "tokens_per_s" in r:
                theirs = peer[case.mode]
                r["diffusers_tokens_per_s"] = theirs
                r["vs_diffusers"] = r["tokens_per_s"] / theirs if isinstance(theirs, float) else theirs

    costs = packing_costs(results)
    header = {"device": name, "torch": torch.__version__, "peak_flops": peak, "peak_note": peak_note,
              "command": " ".join(["python", *sys.argv]), "diffusers": peer,
              "diffusers_preset": every["xl-whole-eager"].preset if xl else None,
              "date": time.strftime("%Y-%m-%d %H:%M"), "warmup_steps": args.warmup_steps,
              "measured_steps": args.steps, "log_every": args.log_every,
              "cases": [{"name": c.name, **dataclasses.asdict(c)} for c in cases]}
    text = table(results, costs, header)
    print("\n" + text, end="")
    (out / "results.md").write_text(text)
    (out / "results.json").write_text(json.dumps({"header": header, "results": results, "packing_cost": costs},
                                                 indent=1))
    print(f"written: {out / 'results.md'}, {out / 'results.json'}")
    return 1 if any(r.get("error") for r in results) else 0


def parse_args(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", choices=NAMES, default=DEFAULT, metavar="CASE",
                    help=f"which to run, in this order (default: the eight DiT cases: {' '.join(DEFAULT)}; also "
                         f"{' '.join(n for n in NAMES if n not in DEFAULT)})")
    ap.add_argument("--depth", type=int, default=4, metavar="N",
                    help="blocks of the DiT-7B-width stack (default: 4; 8 fit one 80 GB GPU)")
    ap.add_argument("--30b-depth", dest="depth_30b", type=int, default=2, metavar="N",
                    help="blocks of the MovieGen-30B-width stack (default: 2; a block's fp32 weights, gradients, AdamW "
                         "state and EMA take 13 GiB)")
    ap.add_argument("--xl-micro-batch", type=int, metavar="N",
                    help="4096-token rows per DiT-XL/2 step, whole or packed (default: 6, as many as fit one 80 GB "
                         "GPU with headroom; --smoke: 2)")
    ap.add_argument("--7b-micro-batch", dest="micro_batch_7b", type=int, metavar="N",
                    help="8192-token rows per step of the 7B-width, ST-DiT-XL/2 and 30B-width models, whole or packed "
                         "(default: 2)")
    ap.add_argument("--warmup-steps", type=int, metavar="N",
                    help="steps not measured, compilation included (default: 10; --smoke: 1)")
    ap.add_argument("--steps", type=int, metavar="N", help="measured steps (default: 20; --smoke: 2)")
    ap.add_argument("--log-every", type=int, metavar="N",
                    help="dit-train's logging.every; divides --warmup-steps and --steps (default: 5; --smoke: 1)")
    ap.add_argument("--samples", type=int, metavar="N",
                    help="samples in each mock dataset; the loader repeats them (default: 64; --smoke: 8)")
    ap.add_argument("--peer-steps", type=int, metavar="N",
                    help="timed diffusers steps per mode (default: 10; --smoke: 2)")
    ap.add_argument("--peer-warmup", type=int, metavar="N",
                    help="untimed diffusers steps first, compilation included (default: 3; --smoke: 1)")
    ap.add_argument("--peak-tflops", type=float, metavar="TFLOPS",
                    help="the GPU's dense bf16 peak for the MFU check column, for a GPU that ditcore.flops does "
                         "not know (H100/H200: 989; dit-train's own MFU is then not a number)")
    ap.add_argument("--work", type=Path, default=Path("runs/gpu-train-bench"), metavar="DIR",
                    help="datasets and run directories (default: runs/gpu-train-bench)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/gpu-train"), metavar="DIR",
                    help="results.json, results.md, logs/ and metrics/ (default: bench/results/gpu-train)")
    ap.add_argument("--keep-runs", action="store_true", help="keep the run directories (checkpoints of GBs)")
    ap.add_argument("--smoke", action="store_true",
                    help="the same pipeline on the CPU with DiT-Tiny and 3 steps: proves the script, measures nothing")
    args = ap.parse_args(argv)
    defaults = {"xl_micro_batch": (6, 2), "micro_batch_7b": (2, 2), "warmup_steps": (10, 1), "steps": (20, 2),
                "log_every": (5, 1), "samples": (64, 8), "peer_steps": (10, 2), "peer_warmup": (3, 1)}
    for key, (gpu, smoke) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, smoke if args.smoke else gpu)
    for flag in ("depth", "30b-depth", "xl-micro-batch", "7b-micro-batch", "steps", "log-every", "samples",
                 "peer-steps"):
        key = {"7b-micro-batch": "micro_batch_7b", "30b-depth": "depth_30b"}.get(flag, flag.replace("-", "_"))
        if getattr(args, key) < 1:
            ap.error(f"--{flag} must be >= 1, got {getattr(args, key)}")
    if args.warmup_steps < 1 or args.peer_warmup < 0:
        ap.error("--warmup-steps must be >= 1 (the first window includes start-up) and --peer-warmup >= 0")
    if args.warmup_steps % args.log_every or args.steps % args.log_every:
        ap.error(f"--log-every {args.log_every} must divide --warmup-steps {args.warmup_steps} and --steps "
                 f"{args.steps}, so that no logged window mixes warm-up and measured steps")
    return args


if __name__ == "__main__":
    sys.exit(main())
