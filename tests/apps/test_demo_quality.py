"""`make demo` as a user runs it, its samples judged as a person would judge them (bench/demo_quality.py:
8 colours x 4 seeds of images and 8 colours x 2 seeds of 8-frame clips, judged by ditcore.data.judge).

Measured on 2 cores with the current recipe (apps/train/configs/demo.yaml, 2,400 steps; the Makefile's DEMO_PREPARE:
one sample in ten a clip, of a butterfly hovering and flapping slowly): images have the prompted colour 32/32 and show
one compact, symmetric butterfly with a dark body on a plain background without a patch grid 30/32; clips have the
prompted colour in every frame 16/16, show one butterfly in every frame 16/16, and pass every shape test in every frame
13/16 (125/128 frames pass every shape test; the others fail the patch-grid test, a wing token cut off at a 16-pixel
border, or the symmetry test; 41/48 clips with 6 seeds a colour). The faint box around the butterfly
(bench/demo_quality.py's box_contrast) is 0.9 grey levels in images and 0.7 in clip frames. With one clip in four,
drifting, and learning rate 1e-3 (the recipe before issue 47) the same training gave 27/32, 15/16, 1/16, 72/128 and a
box of 3.0 and 2.7. Training is deterministic on one machine at one thread count, so these figures repeat there;
another CPU sums in another order (one thread instead of two moved a clip figure by 2 of 16), hence the margins.
"""

import csv
import importlib.util
import itertools
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "demo_quality.py"
spec = importlib.util.spec_from_file_location("demo_quality", SCRIPT)
demo_quality = sys.modules["demo_quality"] = importlib.util.module_from_spec(spec)  # bench/ is not a package
spec.loader.exec_module(demo_quality)

IMAGE_COLOUR = 0.9  # measured 1.0 (32/32)
IMAGE_BUTTERFLY = 0.875  # issue 47's target, 28/32; measured 0.94 (30/32)
CLIP_COLOUR = 0.9  # measured 1.0 (16/16)
CLIP_SHOWN = 0.875  # measured 1.0 (16/16)
CLIP_BUTTERFLY = 0.6875  # every frame passes every shape test; issue 47's target 12/16, measured 0.81 (13/16)
FRAME_BUTTERFLY = 0.93  # clip frames passing every shape test; measured 0.98 (125/128)
BOX = 2.0  # grey levels, images and clip frames each; measured 0.9 and 0.7 (2.6 and 2.7 with learning rate 1e-3)
# the held-out EMA loss (weighted total) every 250 steps and at the end: measured 0.75, 0.15, 0.065, 0.047, 0.039,
# 0.034, 0.030, 0.028, 0.027, 0.026
HELDOUT_DROP = 4  # the last at most a quarter of the first (measured 1/29)
HELDOUT_RISE = 1.05  # no point more than 5% above the one before (measured: each below it)


@pytest.mark.slow  # the whole demo: about 16 minutes on 2 cores
@pytest.mark.demo  # its own target, make test-demo (not in make test-slow), which .ci/run runs
@pytest.mark.skipif(not shutil.which("make"), reason="make is not installed")
def test_make_demo_draws_butterflies_of_the_prompted_colour(tmp_path):
    data, run = tmp_path / "data", tmp_path / "run"
    t0 = time.perf_counter()
    proc = subprocess.run(["make", "-C", str(ROOT), "demo", f"DEMO_DATA={data}", f"DEMO_RUN={run}"],
                          capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    minutes = (time.perf_counter() - t0) / 60
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run / "samples" / "grid.png").is_file() and (run / "loss.png").is_file()
    assert f"{run}/samples/grid.png" in proc.stdout and f"{run}/loss.png" in proc.stdout
    rates = demo_quality.judge_run(run)
    print(f"make demo: {minutes:.1f} min", *rates.lines(), sep="\n")
    assert rates.images == 32 and rates.clips == 16
    assert rates.image_colour / rates.images >= IMAGE_COLOUR, rates.lines()
    assert rates.clip_colour / rates.clips >= CLIP_COLOUR, rates.lines()
    assert rates.image_butterfly / rates.images >= IMAGE_BUTTERFLY, rates.lines()
    assert rates.clip_shown / rates.clips >= CLIP_SHOWN, rates.lines()
    assert rates.clip_butterfly / rates.clips >= CLIP_BUTTERFLY, rates.lines()
    assert rates.frame_butterfly / rates.frames >= FRAME_BUTTERFLY, rates.lines()
    assert all(np.nanmean(boxes) <= BOX for boxes in rates.boxes.values()), rates.lines()  # no pale square
    # the figure that says the model got better: the held-out loss at fixed noise levels falls as training goes on
    assert (run / "heldout.png").is_file() and f"{run}/heldout.png" in proc.stdout
    totals = [float(row["heldout/ema/total"]) for log in sorted((run / "csv").glob("*/metrics.csv"))
              for row in csv.DictReader(log.open()) if row.get("heldout/ema/total")]
    assert len(totals) == 10, totals  # steps 250, 500, ..., 2250 and the end (2400)
    assert totals[-1] <= totals[0] / HELDOUT_DROP, totals
    assert all(b <= a * HELDOUT_RISE for a, b in itertools.pairwise(totals)), totals
