"""`dit-sample eval`: FD of a run's samples against reference statistics, end to end through the CLI (DINOv2 path,
a tiny random Dinov2Model from a folder), the figure checked against the same samples scored by hand."""

import json
from importlib.util import find_spec

import pytest
import torch

from ditcore.eval import FrechetDistance, ReferenceStats, feature_net
from ditcore.eval.features import install_fid_command
from ditcore.export import load_export
from ditcore.sampling import sample


@pytest.fixture(scope="module")
def setup(tmp_path_factory, make_export):
    from transformers import Dinov2Config, Dinov2Model

    tmp = tmp_path_factory.mktemp("eval")
    run = make_export(tmp / "run", num_classes=3)
    torch.manual_seed(0)
    cfg = Dinov2Config(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, patch_size=28)
    Dinov2Model(cfg).save_pretrained(tmp / "dino")
    net = feature_net("dinov2", tmp / "dino")
    real = FrechetDistance(net)
    real.add(torch.randint(0, 256, (6, 32, 32, 3), dtype=torch.uint8), real=True)
    total, outer, n = real.sums(real=True)
    ref = tmp / "ref.safetensors"
    ReferenceStats.of_sums(total, outer, n, features=net.name, height=32, width=32, source="random").write(ref)
    return run, tmp / "dino", ref


def test_eval_scores_the_runs_samples_and_writes_the_result(cli_in_process, setup):
    run, dino, ref = setup
    proc = cli_in_process("sample", "eval", "--checkpoint", run, "--reference", ref, "--num", 5, "--features",
                          "dinov2", "--weights", dino, "--steps", 2, "--batch", 2, "--guidance", 1.5, "--seed", 3)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = proc.stdout.strip().splitlines()[-1]
    result = json.loads((run / "eval" / "fd_dinov2-dinov2-dino-step1-n5.json").read_text())
    assert line.startswith(f"FD_DINOv2 {result['value']:.4f} of 5 samples (step 1, 32x32, 2 steps, guidance 1.5")
    assert (result["num"], result["reference_n"], result["features"], result["ranks"]) == (5, 6, "dinov2:dino", 1)

    # the same samples by hand: batches of 2 with seeds 3, 4, 5; classes drawn uniformly with seed 3
    exported = load_export(run / "export")
    labels = torch.randint(3, (5,), generator=torch.Generator().manual_seed(3)).tolist()
    net = feature_net("dinov2", dino)
    fd = FrechetDistance(net, ReferenceStats.read(ref))
    for b, start in enumerate(range(0, 5, 2)):
        pixels = sample(exported.model, exported.codec, exported.stats, class_labels=labels[start:start + 2],
                        height=32, width=32, steps=2, guidance=1.5, seed=3 + b).pixels[:, 0]
        fd.add(pixels)
    assert result["value"] == pytest.approx(fd.compute(), rel=1e-6)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--num", 1], "--num 1: a Fréchet distance needs at least 2 samples"),
        (["--num", 4, "--height", 64], "--height/--width 64x32 differ from the reference"),
        # here without torch-fidelity, the install line; with it, the reference's other features
        (["--num", 4, "--features", "inception"], install_fid_command() if find_spec("torch_fidelity") is None
         else "holds statistics of dinov2:dino features, and the score asked for inception"),
    ],
)
def test_bad_requests_are_one_line(cli_in_process, setup, args, message):
    run, dino, ref = setup
    proc = cli_in_process("sample", "eval", "--checkpoint", run, "--reference", ref, "--features", "dinov2",
                          "--weights", dino, *args)  # a second --features wins
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: ") and message in proc.stderr, proc.stderr


def test_a_missing_reference_is_one_line(cli_in_process, setup, tmp_path):
    run, dino, _ = setup
    proc = cli_in_process("sample", "eval", "--checkpoint", run, "--reference", tmp_path / "none", "--num", 4,
                          "--features", "dinov2", "--weights", dino)
    assert proc.returncode == 2
    assert "error: reference" in proc.stderr and "does not exist — pass a ditcore dataset folder" in proc.stderr


@pytest.mark.slow  # two processes under torchrun: about 20 s on 2 cores
def test_two_ranks_give_the_figure_of_one(cli_in_process, setup):
    """Under torchrun the 5 samples are split over 2 ranks (batches of 2: rank 0 samples batches 0 and 2, rank 1
    batch 1) and the sums reduced over them, the reference counted once: the figure of one process. (`--` before
    the script: torchrun would read --num as an abbreviation of its own --numa-binding.)"""
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run, dino, ref = setup
    args = ["--checkpoint", run, "--reference", ref, "--num", 5, "--features", "dinov2", "--weights", dino,
            "--steps", 2, "--batch", 2, "--seed", 7]
    one = cli_in_process("sample", "eval", *args)
    assert one.returncode == 0, one.stderr[-2000:]
    written = run / "eval" / "fd_dinov2-dinov2-dino-step1-n5.json"
    alone = json.loads(written.read_text())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={port}",
           "--", str(Path(sys.executable).parent / "dit-sample"), "eval", *map(str, args)]
    two = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    assert two.returncode == 0, two.stderr[-3000:]
    assert len([ln for ln in two.stdout.splitlines() if ln.startswith("FD_DINOv2")]) == 1  # rank 0 prints it
    result = json.loads(written.read_text())
    assert (alone["ranks"], result["ranks"]) == (1, 2)
    assert result["value"] == pytest.approx(alone["value"], rel=1e-9)  # float64 sums, added in another order
