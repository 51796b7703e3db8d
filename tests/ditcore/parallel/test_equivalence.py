"""Every parallel layout computes what one process computes (2 gloo processes, fp32, tiny DiT)."""

import json

import pytest

from ditcore.testing import dit_forward_work, dit_grad_work, fp32_tolerance

from .equivalence_worker import CFG, CONFIGS, DATA, GRID, B
from .fourth_arch import ARCH as FOURTH

CASES = ["tp2", "tp2_sp", "cp2", "dp2", "tp2_packed", "tp2_sp_packed", "cp2_packed",
         "tp2_packed_selective", "tp2_sp_packed_block", "cp2_packed_selective",  # + activation checkpointing
         "fsdp_dp2", "fsdp_tp2_sp_packed", "fsdp_cp2_packed_selective",  # + sharded data parallel (FSDP2)
         "pp2", "pp2_packed",  # + pipeline parallel (1F1B over a micro-batch per row)
         # MovieGen's blocks (ditcore.models.moviegen): TP, TP + SP, CP and FSDP over DP, packed rows
         "moviegen:tp2_packed", "moviegen:tp2_sp_packed", "moviegen:cp2_packed", "moviegen:fsdp_dp2",
         # ST-DiT's (ditcore.models.stdit): CP by all-to-all on whole clips (frames split between the ranks) and on
         # packed rows of images and clips; TP, TP + SP, FSDP over DP
         "stdit:cp2", "stdit:cp2_packed", "stdit:tp2_packed", "stdit:tp2_sp_packed", "stdit:fsdp_dp2",
         "stdit:cp2_packed_selective", "stdit:pp2_packed",  # the all-to-all outside the checkpoints; two stages
         "stdit_cut:cp2_packed",  # rows whose halves cut a frame: gathered instead
         # an architecture registered outside ditcore (fourth_arch.py, test_registry.py): its own TP plan, with SP
         "reglu:tp2_sp_packed"]
CASES_4 = ["fsdp_tp2_sp_dp2",  # 4 processes: TP=2 × FSDP over DP=2
           "pp2_tp2_sp_packed",  # two stages of TP=2 + SP
           "stdit:cp2_tp2_sp_packed"]  # ST-DiT: the all-to-all over CP=2 with each CP rank's slice split by SP
CASES_4_SLOW = ["pp2_dp2_selective", "pp2_cp2_packed"]  # two stages × DP=2, two stages of CP=2: make test-slow

# Float32 work of each compared value (ditcore.testing): rows of 32 tokens with at most 12 text tokens (the packed
# batch's); EDMPrecond adds c_skip·x + c_out·F (+2) and the layouts split reductions over 2 ranks, then add the
# partial results (+2).
ROW = GRID[0] * GRID[1] * GRID[2]
CONFIGS = CONFIGS | {"reglu": FOURTH.presets[FOURTH.tiny].replace(**DATA)}  # as the worker makes it, registered


def work(cfg) -> dict[str, int]:
    forward = dit_forward_work(cfg, seq_len=ROW, text_len=12) + 2 + 2
    grad = dit_grad_work(cfg, seq_len=ROW, text_len=12, tokens=B * ROW) + 2 + 2
    return {
        "output": forward,
        "loss": forward + B * ROW * CFG.patch_dim,  # a mean over every element
        "grad": grad,
        "grad_norm": grad,  # summed in float64: only the gradients' own error
        "weights_after_step": grad + 2,  # SGD: w − lr·(momentum buffer = g)
    }


def run_cases(tmp_path_factory, run_torchrun, cases: list[str], nproc: int) -> dict:
    out = tmp_path_factory.mktemp("eq") / "results.json"
    proc = run_torchrun("equivalence_worker.py", str(out), *cases, nproc=nproc)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def results(tmp_path_factory, run_torchrun):
    return run_cases(tmp_path_factory, run_torchrun, CASES, nproc=2)


@pytest.fixture(scope="module")
def results_4(tmp_path_factory, run_torchrun):
    return run_cases(tmp_path_factory, run_torchrun, CASES_4, nproc=4)


@pytest.fixture(scope="module")
def results_4_slow(tmp_path_factory, run_torchrun):
    return run_cases(tmp_path_factory, run_torchrun, CASES_4_SLOW, nproc=4)


def case_results(request, case):
    fixture = "results_4" if case in CASES_4 else "results_4_slow" if case in CASES_4_SLOW else "results"
    return request.getfixturevalue(fixture)[case]


ALL = CASES + CASES_4 + CASES_4_SLOW


def params(cases: list[str]) -> list:
    return [pytest.param(c, marks=pytest.mark.slow) if c in CASES_4_SLOW else c for c in cases]


@pytest.mark.parametrize("case", params(ALL))
def test_layout_matches_one_process(request, case):
    r = case_results(request, case)
    for what, n in work(CONFIGS[case.rpartition(":")[0] or "dit"]).items():
        abs_diff, rel_diff = r[what]
        bound = fp32_tolerance(n, scale=1.0)  # the differences are relative to the reference's largest magnitude
        assert rel_diff < bound, f"{case}: {what} differs by {abs_diff:.2e} (relative {rel_diff:.2e} > {bound:.1e})"
    # not vacuous: every parameter got a gradient, so every one was compared
    assert r["grads_nonzero"] == r["params"] > 40


@pytest.mark.parametrize("case", ["tp2_sp", "tp2_sp_packed", "cp2", "cp2_packed", "tp2"])
def test_finalize_grads_is_what_makes_gradients_right(results, case):
    """Under SP, CP (and for TP's per-head QK-norm weights) the raw gradients are partial; finalize_grads fixes them."""
    _, rel_diff = results[case]["grad_before_finalize"]
    assert rel_diff > 1e-2, f"{case}: gradients were already right before finalize_grads ({rel_diff:.1e})"


@pytest.mark.parametrize("case", params([c for c in ALL if c.startswith("pp")]))
def test_reduce_grads_is_what_makes_pipeline_gradients_right(request, case):
    """Each stage's gradients of the conditioning embedders are partial: summed over the stages by reduce_grads."""
    _, rel_diff = case_results(request, case)["grad_before_reduce"]
    assert rel_diff > 1e-2, f"{case}: gradients were already right before reduce_grads ({rel_diff:.1e})"


@pytest.mark.parametrize("case", params([c for c in ALL if c.rpartition(":")[2].startswith(("fsdp", "pp"))]))
def test_materialised_on_the_meta_device_is_the_one_device_init(request, case):
    """Each rank allocates and fills only its piece of its TP shard (FSDP), or of its stage (PP); gathered, they are
    the one-device weights."""
    assert case_results(request, case)["materialized_equals_init"]


def test_st_dit_context_parallelism_swaps_tokens_by_all_to_all(results):
    """Not vacuous: the CP=2 cases moved tokens between the ranks, as many as SwapRows' docstring says (whole clips:
    2·(cp−1)/cp²·N·B tokens per temporal block and rank); the DiT's CP sent none that way, nor ST-DiT's on rows whose
    slices cut a frame (they are gathered)."""
    stdit = CONFIGS["stdit"]
    temporal_blocks, cp = stdit.depth // 2, 2
    assert results["stdit:cp2"]["all_to_all_tokens"] == temporal_blocks * 2 * (cp - 1) * ROW * B // cp**2
    assert results["stdit:cp2_packed"]["all_to_all_tokens"] > 0
    assert results["cp2"]["all_to_all_tokens"] == results["stdit_cut:cp2_packed"]["all_to_all_tokens"] == 0
