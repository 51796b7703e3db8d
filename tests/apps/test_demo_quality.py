"""`make demo` as a user runs it, its samples judged as a person would judge them (bench/demo_quality.py:
8 colours x 4 seeds of images and 8 colours x 2 seeds of 8-frame clips, judged by ditcore.data.judge).

Measured on 2 cores with the current recipe (apps/train/configs/demo.yaml, the Makefile's DEMO_PREPARE): images
have the prompted colour 32/32, clips 16/16; 18/32 images pass every shape test but the patch grid one (one
compact, symmetric butterfly with a dark body on a plain background), none passes that one too: the 16-pixel
token seams still show. The rates are asserted with a margin; the full shape rate the demo must reach (80%) is
not asserted yet, because no recipe found so far removes the seams within the demo's time budget.
"""

import importlib.util
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "demo_quality.py"
spec = importlib.util.spec_from_file_location("demo_quality", SCRIPT)
demo_quality = sys.modules["demo_quality"] = importlib.util.module_from_spec(spec)  # bench/ is not a package
spec.loader.exec_module(demo_quality)

IMAGE_COLOUR = 0.85  # measured 1.0 (32/32)
CLIP_COLOUR = 0.75  # measured 1.0 (16/16)
ALL_BUT_GRID = 0.4  # measured 0.56 (18/32)


@pytest.mark.slow  # the whole demo: about 12 minutes on 2 cores
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
    assert rates.image_all_but_grid / rates.images >= ALL_BUT_GRID, rates.lines()
