"""Every parallel layout computes what one process computes (2 gloo processes, fp32, tiny DiT)."""

import json
from unittest.mock import patch

import pytest

from ditcore.job import Layout
from ditcore.models import ARCHS, build, register
from ditcore.testing import dit_forward_work, dit_grad_work, fp32_tolerance
from ditcore.traffic import traffic_by_stage

from .equivalence_worker import CASES as WORKER_CASES
from .equivalence_worker import CFG, CONFIGS, DATA, GRID, HELDOUT_CASES, PACKED, B
from .fourth_arch import ARCH as FOURTH

CASES = ["tp2", "tp2_sp", "cp2", "dp2", "tp2_packed", "tp2_sp_packed", "cp2_packed",
         "tp2_packed_selective", "tp2_sp_packed_block", "cp2_packed_selective",  # + activation checkpointing
         "fsdp_dp2", "fsdp_tp2_sp_packed", "fsdp_cp2_packed_selective",  # + sharded data parallel (FSDP2)
         "fsdp_dp2_accumulate", "fsdp_dp2_accumulate_step",  # 2 micro-batches: synced each one, or once a step
         "pp2", "pp2_packed",  # + pipeline parallel (1F1B over a micro-batch per row)
         # MovieGen's blocks (ditcore.models.moviegen): TP, TP + SP, CP and FSDP over DP, packed rows
         "moviegen:tp2_packed", "moviegen:tp2_sp_packed", "moviegen:cp2_packed", "moviegen:fsdp_dp2",
         # ST-DiT's (ditcore.models.stdit): CP by all-to-all on whole clips (frames split between the ranks) and on
         # packed rows of images and clips; TP, TP + SP, FSDP over DP
         "stdit:cp2", "stdit:cp2_packed", "stdit:tp2_packed", "stdit:tp2_sp_packed", "stdit:fsdp_dp2",
         "stdit:cp2_packed_selective", "stdit:pp2_packed",  # the all-to-all outside the checkpoints; two stages
         "stdit_cut:cp2_packed",  # rows whose halves cut a frame: gathered instead
         # Wan's (ditcore.models.wan): its QK norms over every head summed over the TP ranks (TP, TP + SP, recomputed
         # under selective checkpointing), its one time projection's partial gradients; CP, FSDP, two stages
         "wan:tp2", "wan:tp2_sp_packed", "wan:tp2_packed_selective", "wan:cp2_packed", "wan:fsdp_dp2",
         "wan:pp2_packed",
         # an architecture registered outside ditcore (fourth_arch.py, test_registry.py): its own TP plan, with SP
         "reglu:tp2_sp_packed",
         # the DiT with each later block's own embedders (block_embedders): replicated under TP, inside each block's
         # FSDP unit, on each block's pipeline stage
         "embedders:tp2_sp_packed", "embedders:fsdp_dp2", "embedders:pp2_packed",
         # a mixture of experts (every other block) with its experts split over 2 ranks (expert parallelism): over
         # DP=2, over CP=2 (ditcore.parallel.expert_parallel)
         "moe:ep2", "moe:ep2_cp2_packed", "moe:pp2_moe",
         "moe:moe_tp2", "moe:moe_tp2_sp_packed",  # MoE under TP (+ SP): the experts replicated, SP's grads summed
         "moe:ep2_fsdp",  # EP + FSDP: each rank's experts an FSDP unit over the one rank holding them
         "moe:ep2_fsdp_step"]  # and 2 micro-batches a rank, gathered and reduced once a step
CASES_4 = ["fsdp_tp2_sp_dp2",  # 4 processes: TP=2 × FSDP over DP=2
           "hsdp_dp4",  # HSDP: sharded over 2 ranks, replicated twice
           "pp2_tp2_sp_packed",  # two stages of TP=2 + SP
           "stdit:cp2_tp2_sp_packed",  # ST-DiT: the all-to-all over CP=2 with each CP rank's slice split by SP
           "wan:pp2_tp2_sp_packed",  # Wan: two stages of TP=2 + SP
           "deep:pp2_fsdp_dp2",  # two stages of two blocks, each stage sharded over its DP=2 ranks with FSDP2
           "moe:ep2_dp4",  # experts over 2 of DP=4: their gradients averaged over the 2 ranks holding the same ones
           "moe:ep2_pp2",  # two stages, the second's experts over its 2 data-parallel ranks
           "moe:ep2_fsdp_dp4"]  # EP + FSDP: the experts sharded over the 2 ranks holding them, the rest over 4
CASES_4_SLOW = ["pp2_dp2_selective", "pp2_cp2_packed",  # two stages × DP=2, two stages of CP=2: make test-slow
                "hsdp_cp2_dp2_step",  # HSDP over each CP pair, replicated over DP=2, gathered once per step
                # two stages sharded by FSDP: over DP=2, gathered once per step, over a CP pair
                "pp2_fsdp_dp2", "pp2_fsdp_dp2_step", "pp2_fsdp_cp2_packed",
                "moe:ep2_tp2_sp",  # experts over 2 data-parallel ranks of each TP rank, TP=2 + SP
                # EP + HSDP (the experts plain FSDP over their 2 ranks), EP + FSDP gathered once per step
                "moe:ep2_hsdp_dp4", "moe:ep2_fsdp_dp4_step",
                "wan:hsdp_dp4"]  # Wan sharded over 2 ranks, replicated twice
CASES_8_SLOW = ["pp2_tp2_sp_fsdp_dp2_packed",  # 8 processes: two stages of TP=2 + SP, each TP shard over DP=2
                "pp2_hsdp_dp4"]  # two stages, each HSDP: sharded over 2, replicated twice
# only their traffic (test_traffic_model_matches_the_counted_step), under bf16 autocast: SP's gathers in bf16, FSDP
# gathering in bf16
BF16 = ["tp2_packed@bf16", "tp2_sp_packed@bf16", "fsdp_dp2@bf16", "wan:tp2_sp_packed@bf16"]

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
    return run_cases(tmp_path_factory, run_torchrun, CASES + BF16, nproc=2)


@pytest.fixture(scope="module")
def results_4(tmp_path_factory, run_torchrun):
    # and a mixture of experts' checkpoint across EP sizes (EP2 → one process → EP4)
    return run_cases(tmp_path_factory, run_torchrun, [*CASES_4, "ep_checkpoints"], nproc=4)


@pytest.fixture(scope="module")
def results_4_slow(tmp_path_factory, run_torchrun):
    # and HSDP's checkpoints resumed with FSDP over 4, read on one process, and back (~8 s on 2 cores)
    return run_cases(tmp_path_factory, run_torchrun, [*CASES_4_SLOW, "hsdp_checkpoints"], nproc=4)


@pytest.fixture(scope="module")
def results_8_slow(tmp_path_factory, run_torchrun):
    return run_cases(tmp_path_factory, run_torchrun, CASES_8_SLOW, nproc=8)


def case_results(request, case):
    fixture = {**dict.fromkeys(CASES_4, "results_4"), **dict.fromkeys(CASES_4_SLOW, "results_4_slow"),
               **dict.fromkeys(CASES_8_SLOW, "results_8_slow")}.get(case, "results")
    return request.getfixturevalue(fixture)[case]


ALL = CASES + CASES_4 + CASES_4_SLOW + CASES_8_SLOW
SLOW = CASES_4_SLOW + CASES_8_SLOW


def params(cases: list[str]) -> list:
    return [pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c for c in cases]


@pytest.mark.parametrize("case", params(ALL))
def test_layout_matches_one_process(request, case):
    r = case_results(request, case)
    for what, n in work(CONFIGS[case.rpartition(":")[0] or "dit"]).items():
        abs_diff, rel_diff = r[what]
        bound = fp32_tolerance(n, scale=1.0)  # the differences are relative to the reference's largest magnitude
        assert rel_diff < bound, f"{case}: {what} differs by {abs_diff:.2e} (relative {rel_diff:.2e} > {bound:.1e})"
    # not vacuous: every parameter got a gradient, so every one was compared
    assert r["grads_nonzero"] == r["params"] > 40


@pytest.mark.parametrize("case", HELDOUT_CASES)
def test_heldout_loss_matches_one_process(request, case):
    """The held-out loss per noise level (ditcore.eval.heldout) of a DiT laid out over TP/SP/CP/FSDP/PP, each
    data-parallel rank scoring its share of the held-out set, equals one process's within fp32 bounds."""
    abs_diff, rel_diff = case_results(request, case)["heldout"]
    bound = fp32_tolerance(work(CFG)["output"] + 2, scale=1.0)  # + the squared error
    assert rel_diff < bound, f"{case}: held-out loss differs by {abs_diff:.2e} (relative {rel_diff:.2e} > {bound:.1e})"


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


@pytest.mark.parametrize("case", params([c for c in ALL if c.rpartition(":")[2].startswith(("fsdp", "hsdp", "pp"))
                                          or "_fsdp" in c or "_hsdp" in c]))
def test_materialised_on_the_meta_device_is_the_one_device_init(request, case):
    """Each rank allocates and fills only its piece of its TP shard (FSDP), or of its stage (PP); gathered, they are
    the one-device weights."""
    assert case_results(request, case)["materialized_equals_init"]


def test_st_dit_context_parallelism_swaps_tokens_by_all_to_all(results):
    """Not vacuous: the CP=2 cases moved tokens between the ranks, as many as ST-DiT's Orders' docstring says (whole
    clips: 2·(cp−1)/cp²·N·B tokens per temporal block and rank); the DiT's CP sent none that way, nor ST-DiT's on rows
    whose slices cut a frame (they are gathered)."""
    stdit = CONFIGS["stdit"]
    temporal_blocks, cp = stdit.depth // 2, 2
    assert results["stdit:cp2"]["all_to_all_tokens"] == temporal_blocks * 2 * (cp - 1) * ROW * B // cp**2
    assert results["stdit:cp2_packed"]["all_to_all_tokens"] > 0
    assert results["cp2"]["all_to_all_tokens"] == results["stdit_cut:cp2_packed"]["all_to_all_tokens"] == 0


# --------------------------------------------------------------------------------------------------
# Communication: each case's training step (forward, backward, finalize, grad norm, optimizer step) counted on gloo
# (ditcore.parallel.counting) against what ditcore.traffic predicts from the config and the layout alone

# Not predictable from a layout: ST-DiT's rows whose slices cut a frame gather instead of swapping (the data decides)
DATA_DEPENDENT_CP = {"stdit_cut:cp2_packed"}


def layout_of(case: str, nproc: int) -> Layout:
    """The memory/traffic Layout of an equivalence case: its parallel dims, rows and micro-batches per rank."""
    spec = WORKER_CASES[case.rpartition(":")[2].removesuffix("@bf16")]
    dims, packed, checkpointing, fsdp, per_row, shard, sync = \
        spec + (None, False, "none", False, False, None, "micro_batch")[len(spec):]
    rows, text_len, samples = (2, 12, 3) if packed else (B, 6, 1)  # the worker's batches
    per_rank = rows // (nproc // (dims.tp * dims.cp * dims.pp))
    micro_batch = 1 if per_row else per_rank
    return Layout(world_size=nproc, tp=dims.tp, cp=dims.cp, pp=dims.pp, sequence_parallel=dims.sequence_parallel,
                  ep=dims.ep,                  fsdp=fsdp, fsdp_shard=shard, fsdp_sync=sync, micro_batch=micro_batch,
                  micro_batches=per_rank // micro_batch, seq_length=ROW,
                  text_len=text_len, samples_per_row=samples, packed=packed,
                  precision="bf16" if case.endswith("@bf16") else "fp32", activation_checkpointing=checkpointing,
                  device="cpu", attention="sdpa")


def per_group(collectives: list[dict]) -> dict[tuple[str, str], tuple[int, int]]:
    """(group, op) → (collectives, bytes) of a step, whatever the frequency each was counted at."""
    out = {}
    for c in collectives:
        count, size = out.get((c["group"], c["op"]), (0, 0))
        out[c["group"], c["op"]] = (count + c["count"], size + c["bytes"])
    return out


@pytest.mark.parametrize("case", params(ALL) + BF16)
def test_traffic_model_matches_the_counted_step(request, case):
    """Per group and collective, the bytes (within 2%) and the number of collectives a rank sends in the case's
    step are what ditcore.traffic predicts for its layout; with pipeline stages, on the stage that sends the most."""
    nproc = 8 if case in CASES_8_SLOW else 4 if case in CASES_4 + CASES_4_SLOW else 2
    r = case_results(request, case)
    lay = layout_of(case, nproc)
    arch = case.rpartition(":")[0] or "dit"
    packed = arch == "stdit" and lay.packed  # ST-DiT's all-to-alls move what the packing's grids say
    with patch.dict(ARCHS):  # the worker's fourth architecture, registered for this test only (test_registry.py)
        if arch == "reglu":
            register(FOURTH)
        stages = traffic_by_stage(CONFIGS[arch], lay, tuple(map(tuple, PACKED["stdit"])) if packed else None)
    # the stage that sends the most in the step, as the most loaded rank below is chosen
    modelled = max(stages, key=lambda t: sum(c.bytes * (lay.micro_batches if c.when == "micro_batch" else 1)
                                             for c in t.collectives))
    expected = {}
    for c in modelled.collectives:
        count, size = expected.get((c.group, c.op), (0, 0))
        times = lay.micro_batches if c.when == "micro_batch" else 1
        expected[c.group, c.op] = (count + c.count * times, size + c.bytes * times)
    ranks = [per_group(t) for t in r["traffic"]]
    counted = max(ranks, key=lambda g: sum(size for _, size in g.values()))  # the most loaded rank
    if case in DATA_DEPENDENT_CP:
        counted, expected = ({k: v for k, v in d.items() if k[0] != "cp"} for d in (counted, expected))
    assert counted.keys() == expected.keys(), f"{case}: counted {sorted(counted)}, modelled {sorted(expected)}"
    for key, (count, size) in counted.items():
        assert abs(expected[key][1] - size) <= 0.02 * size, f"{case}: {key} counted {size} B, modelled {expected[key]}"
        if key != ("dp", "all_reduce"):  # DDP's and the pipeline's buckets: the model states bytes, not buckets
            assert expected[key][0] == count, f"{case}: {key} counted {count} collectives, modelled {expected[key]}"


def test_counter_sees_every_kind_of_collective(results):
    """The counter's numbers against sizes known without ditcore.traffic: DDP's one bucket all-reduces every fp32
    gradient (c10d, from DDP's reducer), FSDP2 gathers every parameter in forward, the first block's again in backward
    (the last one and the root stay gathered), and reduce-scatters every gradient (c10d, from its hooks), grad_norm
    all-reduces one float64 (dist.all_reduce), the pipeline's first stage
    sends each micro-batch's hidden states (P2P), ST-DiT's CP all-to-alls (functional) send the tokens the worker
    counted, forward and backward."""
    model = build(CFG)
    params, first_block = (sum(p.numel() for p in m.parameters()) for m in (model, model.blocks[0]))
    ddp = per_group(results["dp2"]["traffic"][0])
    assert ddp == {("dp", "all_reduce"): (1, 4 * params)}  # 2(n-1)/n of the buffer, n = 2
    fsdp = per_group(results["fsdp_dp2"]["traffic"][0])
    assert CFG.depth == 2  # units: 2 blocks and the root; (n-1)/n = 1/2 of each fp32 buffer
    assert fsdp == {("fsdp", "all_gather"): (4, 2 * (params + first_block)),
                    ("fsdp", "reduce_scatter"): (3, 2 * params), ("fsdp", "all_reduce"): (1, 8)}
    first_stage = per_group(results["pp2"]["traffic"][0])
    assert first_stage["pp", "send"] == (B, B * ROW * CFG.hidden_size * 4)  # a micro-batch per row, fp32
    stdit = CONFIGS["stdit"]
    swapped = per_group(results["stdit:cp2"]["traffic"][0])["cp", "all_to_all"]
    assert swapped[1] == 2 * results["stdit:cp2"]["all_to_all_tokens"] * stdit.hidden_size * 4


@pytest.mark.parametrize("case, sync", [("fsdp_dp2_accumulate", "micro_batch"), ("fsdp_dp2_accumulate_step", "step")])
def test_fsdp_sync_once_per_step_keeps_the_gathered_parameters_and_unreduced_gradients(results, case, sync):
    """Between a step's 2 micro-batches (through Fabric's backward-sync control, as dit-train): with sync="step" every
    parameter is still gathered and no gradient reduce-scattered yet; with "micro_batch" all are resharded and
    reduced. Both then give one process's weights (test_layout_matches_one_process)."""
    between = results[case]["between"]
    n = between["params"]
    assert n > 40
    if sync == "step":
        assert (between["gathered_between"], between["reduced_between"]) == (n, 0)
    else:
        assert (between["gathered_between"], between["reduced_between"]) == (0, n)


def test_hsdp_shards_within_groups_of_consecutive_ranks(results_4):
    """fsdp_shard=2 of dp×cp=4: rank 0's replicate group is {0, 2}, its shard group {0, 1} (consecutive ranks: one
    node); its gradient norm (summed over the shard group only) is one process's (test_layout_matches_one_process)."""
    assert results_4["hsdp_dp4"]["mesh"] == [[0, 2], [0, 1]]
    assert results_4["fsdp_tp2_sp_dp2"]["mesh"] == [[0, 2]]  # FSDP over dp×cp: TP rank 0's DP peers


@pytest.mark.slow
def test_hsdp_checkpoints_reshard_to_fsdp_one_process_and_back(results_4_slow):
    """Weights and AdamW moments written by HSDP (shard 2 x replicate 2) are, exactly, what one process reads and
    FSDP over 4 ranks resumes; FSDP's checkpoint resumes with HSDP exactly too (other weights do not pass)."""
    r = results_4_slow["hsdp_checkpoints"]
    assert r == {"hsdp_to_one": True, "hsdp_to_fsdp": True, "fsdp_to_hsdp": True, "not_vacuous": True}


def test_moe_checkpoints_reshard_across_expert_parallel_sizes(results_4):
    """Weights and AdamW moments of a mixture of 4 experts written with EP2 (4 processes) are one-device tensors
    (E, ., .) under one-device names, and EP4 resumes exactly them (its own other weights do not pass); the same from
    EP2 under FSDP, its experts sharded over the 2 ranks holding them, to EP2 without FSDP."""
    r = results_4["ep_checkpoints"]
    assert r == {"ep2_to_one": True, "one_to_ep4": True, "not_vacuous": True, "full_experts": True,
                 "ep2_fsdp_to_one": True, "one_to_ep2": True, "not_vacuous_fsdp": True, "full_experts_fsdp": True}
