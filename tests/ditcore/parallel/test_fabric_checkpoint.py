"""MegatronStrategy + layout-free checkpoints: TP=2 training through Fabric, resumed with the same layout (bitwise),
with FSDP over DP=2 (the same losses within fp32 rounding), and FSDP's checkpoint loaded on one process."""

import json
import os
import subprocess
import sys

import pytest
import torch

from ditcore.diffusion import EDMPrecond
from ditcore.inputs import Inputs
from ditcore.job import Layout
from ditcore.memory import plan_from
from ditcore.models import DiT
from ditcore.parallel import load_consolidated
from ditcore.runs import tensors
from ditcore.testing import assert_close_fp32, dit_forward_work, dit_grad_work, fp32_tolerance

from .conftest import HERE, free_port
from .fabric_worker import CFG, POS, ROWS, SAVE_AT, STEPS, batch

# three torchrun jobs, 150 s on 2 cores: make test-slow, which CI runs
pytestmark = pytest.mark.slow


def fabric_launch(*args):
    env = {**os.environ, "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, str(HERE / "fabric_worker.py"), *args], capture_output=True, text=True,
                          timeout=240, env=env)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, run_torchrun):
    out = tmp_path_factory.mktemp("fabric")
    for proc in (run_torchrun("fabric_worker.py", "straight", "tp2", str(out)),  # launched by torchrun
                 fabric_launch("resume", "tp2", str(out)),  # by Fabric's own launcher
                 run_torchrun("fabric_worker.py", "resume", "fsdp", str(out)),
                 run_torchrun("fabric_worker.py", "resume", "tp2_fsdp", str(out)),
                 fabric_launch("load", "one", str(out))):
        assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def result(runs, name):
    return json.loads((runs / f"{name}.json").read_text()), torch.load(runs / f"{name}.pt")


def test_checkpoint_holds_one_device_tensors_written_in_pieces(runs):
    ckpt = runs / "checkpoint"
    assert tensors.files_of_rank(ckpt, 0) == ["__0_0.distcp", tensors.METADATA]
    assert tensors.files_of_rank(ckpt, 1) == ["__1_0.distcp"]
    assert all((ckpt / name).stat().st_size > 1000 for name in ["__0_0.distcp", "__1_0.distcp"])  # both wrote
    model = tensors.read_full(ckpt, tensors.MODEL)  # no process group: consolidated from the TP=2 pieces
    assert model.keys() == DiT(CFG).state_dict().keys()
    assert model["blocks.0.attn.qkv.weight"].shape == (3 * CFG.hidden_size, CFG.hidden_size)
    moments = tensors.read_full(ckpt, tensors.OPTIM)
    assert moments["final.linear.weight.exp_avg"].abs().sum() > 0  # AdamW state is there, whole
    assert float(moments["blocks.0.attn.qkv.weight.step"]) == SAVE_AT


def test_resume_with_the_same_layout_continues_bitwise(runs):
    (straight, a), (resume, b) = result(runs, "straight-tp2"), result(runs, "resume-tp2")
    assert resume["start"] == SAVE_AT and len(straight["losses"]) == STEPS
    assert resume["losses"] == straight["losses"][SAVE_AT:]  # exact float equality
    for k in a["weights"]:
        assert torch.equal(a["weights"][k], b["weights"][k]), k
    assert torch.equal(a["probe_output"], b["probe_output"])


@pytest.mark.parametrize("layout", ["fsdp", "tp2_fsdp"])
def test_resume_with_fsdp_continues_within_fp32_rounding(runs, layout):
    (straight, _), (resume, _) = result(runs, "straight-tp2"), result(runs, f"resume-{layout}")
    assert resume["start"] == SAVE_AT
    # The two layouts split each step's reductions differently (TP halves vs DP halves): relative 1e-6 as the issue
    # asks, and within the float32 bound of two steps of gradients through this model
    work = 2 * (dit_grad_work(CFG, seq_len=len(POS), text_len=5, tokens=ROWS * len(POS)) + 2 + 2)
    for s, r in zip(straight["losses"][SAVE_AT:], resume["losses"], strict=True):
        assert abs(s - r) / abs(s) < min(1e-6, fp32_tolerance(work, scale=1.0)), (s, r)


def test_fsdp_checkpoint_loads_on_one_process(runs):
    (_, a), (one, b) = result(runs, "resume-fsdp"), result(runs, "load-one")
    assert one["start"] == STEPS and one["world_size"] == 1
    for what in ("weights", "ema"):  # model, EMA (and AdamW state, loaded along) are the FSDP run's last ones
        assert a[what].keys() == b[what].keys()
        for k in a[what]:
            assert torch.equal(a[what][k], b[what][k]), (what, k)
    assert not torch.equal(a["weights"]["final.linear.weight"], a["ema"]["final.linear.weight"])


def test_consolidated_tp2_weights_give_the_same_outputs_on_one_device(runs):
    _, final = result(runs, "straight-tp2")
    model = DiT(CFG)
    load_consolidated(model, final["weights"], None)
    b = batch(99)
    with torch.no_grad():
        out = EDMPrecond(model)(b["x"], b["sigma"], Inputs(POS, class_labels=b["class_labels"], text=b["text"]))
    # not bitwise: TP=2 splits the projections' reductions over the ranks and adds the halves (+2 terms);
    # EDMPrecond adds c_skip·x + c_out·F (+2)
    work = dit_forward_work(CFG, seq_len=len(POS), text_len=b["text"].shape[1]) + 2 + 2
    assert_close_fp32(out, final["probe_output"], work=work)


def test_loading_another_architecture_is_a_clear_error(runs):
    _, final = result(runs, "straight-tp2")
    other = DiT(CFG.replace(text_dim=0))
    with pytest.raises(KeyError, match=r"unexpected .*cross.* another architecture"):
        load_consolidated(other, final["weights"], None)


@pytest.mark.parametrize("run, tp, fsdp", [("resume-tp2", 2, False), ("resume-fsdp", 1, True),
                                           ("resume-tp2_fsdp", 2, True)])
def test_each_rank_holds_the_states_the_memory_plan_predicts(runs, run, tp, fsdp):
    """Weights, gradients, AdamW state and EMA per rank (the largest rank's) are exactly the plan's figures."""
    held = result(runs, run)[0]
    layout = Layout(world_size=2, tp=tp, fsdp=fsdp, micro_batch=ROWS, seq_length=len(POS), text_len=5,
                    precision="fp32")
    plan = plan_from(CFG, layout)
    assert held["state_bytes"] == {k: getattr(plan, k) for k in ("weights", "grads", "optimizer", "ema")}
    if fsdp and tp == 1:  # FSDP over 2 ranks: about half of what one process holds (a little more: odd rows are padded)
        one = plan_from(CFG, Layout(world_size=1, micro_batch=ROWS, seq_length=len(POS), text_len=5, precision="fp32"))
        states = ("weights", "grads", "optimizer", "ema")
        ratio = sum(getattr(plan, k) for k in states) / sum(getattr(one, k) for k in states)
        assert 0.5 <= ratio < 0.51, ratio
