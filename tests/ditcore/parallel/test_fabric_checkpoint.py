"""MegatronStrategy: TP=2 training through Fabric, sharded checkpoints, exact resume, consolidated export."""

import json
import os
import subprocess
import sys

import pytest
import torch

from ditcore.diffusion import EDMPrecond
from ditcore.models import DiT
from ditcore.parallel import load_consolidated
from ditcore.testing import assert_close_fp32, dit_forward_work

from .conftest import HERE, free_port
from .fabric_worker import CFG, POS, SAVE_AT, STEPS, batch


@pytest.fixture(scope="module")
def runs(tmp_path_factory, run_torchrun):
    out = tmp_path_factory.mktemp("fabric")
    straight = run_torchrun("fabric_worker.py", "straight", str(out))  # launched by torchrun
    assert straight.returncode == 0, straight.stderr[-4000:]
    env = {**os.environ, "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    resume = subprocess.run([sys.executable, str(HERE / "fabric_worker.py"), "resume", str(out)],  # Fabric launches
                            capture_output=True, text=True, timeout=240, env=env)
    assert resume.returncode == 0, resume.stderr[-4000:]
    return out


def test_checkpoint_keeps_every_tensor_parallel_shard(runs):
    shards = sorted((runs / "checkpoint").iterdir())
    assert [p.name for p in shards] == ["model_parallel_rank_00.pt", "model_parallel_rank_01.pt"]
    a, b = (torch.load(p, weights_only=False)["model"] for p in shards)
    qkv = "blocks.0.attn.qkv.weight"
    assert a[qkv].shape == b[qkv].shape == (3 * CFG.hidden_size // 2, CFG.hidden_size)  # half the heads each
    assert not torch.equal(a[qkv], b[qkv])
    assert torch.equal(a["t_embedder.mlp.0.weight"], b["t_embedder.mlp.0.weight"])  # replicated stays equal


def test_resume_in_a_fresh_job_continues_bitwise(runs):
    straight = json.loads((runs / "straight.json").read_text())
    resume = json.loads((runs / "resume.json").read_text())
    assert resume["start"] == SAVE_AT and len(straight["losses"]) == STEPS
    assert resume["losses"] == straight["losses"][SAVE_AT:]  # exact float equality
    a, b = torch.load(runs / "straight.pt"), torch.load(runs / "resume.pt")
    assert a["weights"].keys() == b["weights"].keys()
    for k in a["weights"]:
        assert torch.equal(a["weights"][k], b["weights"][k]), k
    assert torch.equal(a["probe_output"], b["probe_output"])


def test_consolidated_tp2_weights_give_the_same_outputs_on_one_device(runs):
    final = torch.load(runs / "straight.pt")
    model = DiT(CFG)
    load_consolidated(model, final["weights"], None)
    b = batch(99)
    with torch.no_grad():
        out = EDMPrecond(model)(b["x"], b["sigma"], pos=POS, class_labels=b["class_labels"], text=b["text"])
    # not bitwise: TP=2 splits the projections' reductions over the ranks and adds the halves (+2 terms);
    # EDMPrecond adds c_skip·x + c_out·F (+2)
    work = dit_forward_work(CFG, seq_len=len(POS), text_len=b["text"].shape[1]) + 2 + 2
    assert_close_fp32(out, final["probe_output"], work=work)


def test_loading_another_architecture_is_a_clear_error(runs):
    final = torch.load(runs / "straight.pt")
    other = DiT(CFG.replace(text_dim=0))
    with pytest.raises(KeyError, match=r"unexpected .*cross.* another architecture"):
        load_consolidated(other, final["weights"], None)
