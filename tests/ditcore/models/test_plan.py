"""The tensor-parallel plan covers every parameter of every registered architecture exactly once, and says what it
should."""

import pytest
from torch import nn

from ditcore.models import ARCHS, DiT, MoEConfig, MovieGen, build, plan_for, preset
from ditcore.models.dit import DIT_PLAN
from ditcore.models.moviegen import MOVIEGEN_PLAN
from ditcore.models.plan import ColumnParallel, Plan

# every optional layer of the DiT: a mixture of experts (with shared experts) in every other block too
FULL = dict(text_dim=24, num_classes=5, fps_cond=True, block_embedders=True,
            moe=MoEConfig(experts=2, top_k=1, every=2, shared_experts=1))


@pytest.mark.parametrize("changes", [{}, FULL, dict(text_dim=24), dict(num_classes=5)])
def test_every_parameter_is_covered_by_exactly_one_entry(changes):
    model = DiT(preset("DiT-Tiny", **changes))
    for name, _ in model.named_parameters():
        assert len(DIT_PLAN.matches(name.rpartition(".")[0])) == 1, name
    if changes == FULL:
        DIT_PLAN.check(model)  # and every entry names layers that exist


def test_a_layer_the_plan_does_not_name_fails_the_check():
    model = DiT(preset("DiT-Tiny"))
    model.blocks[0].extra = nn.Linear(4, 4)  # e.g. a layer added or renamed without updating the plan
    with pytest.raises(KeyError, match=r"no entry for parameter blocks\.0\.extra\.weight"):
        DIT_PLAN.check(model)


def test_an_entry_that_names_no_layer_fails_the_check():
    stale = type(DIT_PLAN)({**DIT_PLAN.modules, "blocks.*.attn.qkv_renamed": ColumnParallel()}, DIT_PLAN.heads)
    with pytest.raises(KeyError, match="qkv_renamed, which matches no module"):
        stale.check(DiT(preset("DiT-Tiny", **FULL)))


def test_partition_dims_follow_megatron_layouts():
    dims = {name: DIT_PLAN.partition_dim(name) for name in (
        "blocks.0.attn.qkv.weight", "blocks.0.attn.qkv.bias", "blocks.0.attn.proj.weight", "blocks.0.attn.proj.bias",
        "blocks.1.mlp.0.bias", "blocks.1.mlp.2.weight", "blocks.0.cross.kv.weight", "t_embedder.mlp.0.weight",
        "final.linear.weight", "blocks.0.attn.q_norm.weight", "blocks.0.adaLN.1.weight", "blocks.0.adaLN.1.bias",
        "final.adaLN.1.weight")}
    assert dims == {
        "blocks.0.attn.qkv.weight": 0, "blocks.0.attn.qkv.bias": 0, "blocks.0.attn.proj.weight": 1,
        "blocks.0.attn.proj.bias": None, "blocks.1.mlp.0.bias": 0, "blocks.1.mlp.2.weight": 1,
        "blocks.0.cross.kv.weight": 0, "t_embedder.mlp.0.weight": None, "final.linear.weight": None,
        "blocks.0.attn.q_norm.weight": None,
        # adaLN's output columns (the modulations, gathered after the matmul)
        "blocks.0.adaLN.1.weight": 0, "blocks.0.adaLN.1.bias": 0, "final.adaLN.1.weight": 0}


@pytest.mark.parametrize(("name", "tp_only", "with_sp"), [
    ("blocks.0.attn.q_norm.weight", True, True),  # shared by heads: partial whenever heads are split
    ("blocks.0.cross.k_norm.weight", True, True),
    ("x_embedder.weight", False, True),  # sees this rank's tokens only under SP
    ("final.linear.bias", False, True),
    ("blocks.0.attn.proj.bias", False, True),  # row-parallel bias: added after the reduction
    ("text_embedder.0.weight", False, False),  # feeds cross.kv only, whose input gradient Megatron all-reduces
    ("t_embedder.mlp.0.weight", False, False),  # the conditioning feeds the adaLN linears only, which do the same
    ("y_embedder.weight", False, False),
    ("blocks.0.adaLN.1.weight", False, False),  # sharded, its output's gradient reduce-scattered under SP
    ("blocks.0.attn.qkv.bias", False, False),  # sharded: whole for its shard
])
def test_which_replicated_gradients_are_partial(name, tp_only, with_sp):
    assert DIT_PLAN.partial_over_tp(name, sequence_parallel=False) is tp_only
    assert DIT_PLAN.partial_over_tp(name, sequence_parallel=True) is with_sp


def check_plan(plan: Plan, model: nn.Module) -> None:
    """Every parameter of `model` covered by exactly one entry of `plan`, and every entry names layers that exist
    (give a model with every optional layer)."""
    for name, _ in model.named_parameters():
        assert len(plan.matches(name.rpartition(".")[0])) == 1, name
    plan.check(model)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_registered_architecture_is_covered_by_its_plan(arch):
    full = FULL if arch != "wan" else {k: v for k, v in FULL.items() if k != "block_embedders"}  # Wan refuses them
    model = build(preset(ARCHS[arch].tiny, **full))
    assert plan_for(model) is ARCHS[arch].plan
    check_plan(ARCHS[arch].plan, model)


def test_every_architecture_has_a_plan():
    assert plan_for(DiT(preset("DiT-Tiny"))) is DIT_PLAN
    stdit = build(preset("ST-DiT-Tiny", **FULL))
    assert plan_for(stdit) is DIT_PLAN  # its blocks are DiT blocks
    DIT_PLAN.check(stdit)
    moviegen = MovieGen(preset("MovieGen-Tiny", **FULL))
    assert plan_for(moviegen) is MOVIEGEN_PLAN
    MOVIEGEN_PLAN.check(moviegen)  # every parameter covered once, every entry names layers that exist
    assert MOVIEGEN_PLAN.partition_dim("blocks.0.mlp.gate_up.weight") == 0
    assert MOVIEGEN_PLAN.partition_dim("blocks.0.mlp.down.weight") == 1
    with pytest.raises(TypeError, match="no tensor-parallel plan for Linear"):
        plan_for(nn.Linear(2, 2))
