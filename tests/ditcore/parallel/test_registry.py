"""A new architecture is its model file plus one registration.

fourth_arch.py defines one outside ditcore (the DiT with a ReGLU MLP: three matrices under names no shipped plan
knows, and its own TP plan). Registered here, for the length of a test, it gets dit-train's config, the TP plan
check, memory and FLOP estimates; registered in the equivalence worker's processes, TP=2 with SP computes what one
process does (case `reglu:tp2_sp_packed` of test_equivalence.py, in that file's one shared torchrun run). No line
of ditcore names it.
"""

from unittest.mock import patch

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from ditcore.diffusion import EDMLoss, EDMPrecond
from ditcore.errors import ConfigError
from ditcore.flops import training_flops_per_token
from ditcore.inputs import Inputs
from ditcore.job import Layout
from ditcore.layout import grid_positions
from ditcore.memory import GiB, advise, plan_from
from ditcore.models import ARCHS, PRESETS, arch_of, build, plan_for, preset, register
from ditcore.models.dit import DIT_PLAN

from .fourth_arch import ARCH as FOURTH
from .fourth_arch import ReGLUConfig, ReGLUDiT

FULL = dict(text_dim=24, num_classes=5, fps_cond=True, block_embedders=True)  # every optional layer


@pytest.fixture
def fourth():
    with patch.dict(ARCHS):  # registered for this test only: every other test sees the shipped architectures
        yield register(FOURTH)


def test_a_registered_architecture_is_built_and_has_its_plan(fourth):
    cfg = preset("ReGLU-DiT-Tiny", **FULL)
    model = build(cfg)
    assert (type(cfg), type(model), arch_of(cfg)) == (ReGLUConfig, ReGLUDiT, "reglu")
    assert plan_for(model) is FOURTH.plan
    FOURTH.plan.check(model)  # every parameter covered by exactly one entry, every entry names layers that exist
    with pytest.raises(KeyError, match=r"no entry for parameter blocks\.0\.mlp\.gate\.weight"):
        DIT_PLAN.check(model)  # not vacuous: the DiT's plan does not cover it
    assert list(PRESETS)[-1] == "ReGLU-DiT-Tiny"
    with pytest.raises(ValueError, match="repeats a registered name"):
        register(FOURTH)


def test_unregistered_it_is_unknown():
    assert "reglu" not in ARCHS and "ReGLU-DiT-Tiny" not in PRESETS
    with pytest.raises(TypeError, match="no tensor-parallel plan for ReGLUDiT"):
        plan_for(ReGLUDiT(FOURTH.presets["ReGLU-DiT-Tiny"]))


def test_dit_train_s_config_takes_its_preset_and_name(fourth):
    from dit_train.config import CONFIGS, load_config  # not dit_train.train (Lightning): model_config is preset()

    demo = CONFIGS / "demo.yaml"
    cfg = load_config(demo, ["model.preset=ReGLU-DiT-Tiny", "model.depth=1"])
    assert cfg.model.arch == "reglu"  # left out: the preset's architecture
    assert type(preset(cfg.model.preset, depth=cfg.model.depth)) is ReGLUConfig
    assert load_config(demo, ["model.arch=reglu", "model.preset=ReGLU-DiT-Tiny"]).model.arch == "reglu"
    with pytest.raises(ConfigError, match=r"expected a size of model\.arch=reglu: one of ReGLU-DiT-Tiny$"):
        load_config(demo, ["model.arch=reglu"])  # the demo's preset is a DiT's
    with pytest.raises(ConfigError, match=r"'moviegen', 'wan', 'reglu' \(.*reglu: the DiT with a ReGLU MLP"):
        load_config(demo, ["model.arch=regul"])


def test_memory_and_flops_are_planned_for_it(fourth):
    cfg = preset("ReGLU-DiT-Tiny", **FULL)
    model = build(cfg)
    plan = plan_from(cfg, Layout(tp=2, world_size=2, seq_length=64, text_len=8))
    assert plan.params == sum(p.numel() for p in model.parameters())  # counted on the registered model
    # split over TP as its own plan says (gate, up and down included), found through the registry
    assert plan.params_local == sum(p.numel() // (1 if FOURTH.plan.partition_dim(n) is None else 2)
                                    for n, p in model.named_parameters()) < plan.params
    changes, advised = advise(cfg, Layout(seq_length=64, text_len=8), 80 * GiB)
    assert changes == [] and advised.total > 0
    assert training_flops_per_token(cfg, 64, 8) > 0


def saved_bytes(model, b) -> int:
    """Bytes of the tensors autograd saves for backward in a forward of dit-train's loss (EDM preconditioning and
    loss around the model; parameters and the batch apart), as tests/ditcore/test_memory.py measures them."""
    skip = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *b.values()] if torch.is_tensor(t)}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip:
            saved.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        EDMLoss()(EDMPrecond(model), b["x"], Inputs(b["pos"]), mask=b["mask"], sigma=b["sigma"], noise=b["noise"])
    return sum(saved.values())


def test_memory_and_flops_are_those_of_its_model(fourth):
    """Its activations and FLOPs are its own, not a DiT's (its MLP keeps three hidden-wide tensors where the DiT's
    keeps two, and multiplies by three matrices where the DiT's has two). Expected to fail until ditcore.memory and
    ditcore.flops derive their counts from the module (issue 27, "acct"): until then they assume a DiT."""
    cfg = preset("ReGLU-DiT-Tiny")
    model = build(cfg, attention="sdpa")
    B, N, grid = 2, 32, (2, 4, 4)
    batch = dict(x=torch.randn(B, N, cfg.patch_dim), noise=torch.randn(B, N, cfg.patch_dim),
                 sigma=torch.rand(B, 1) + 0.3, mask=torch.ones(B, N, dtype=torch.bool),
                 pos=grid_positions(grid).expand(B, -1, -1))
    plan = plan_from(cfg, Layout(device="cpu", attention="sdpa", micro_batch=B, seq_length=N, packed=False,
                                 precision="fp32"))
    assert plan.saved_activations == pytest.approx(saved_bytes(model, batch), rel=0.10)

    def weight_macs(n: int) -> int:  # multiply-adds of the matmuls with weights in a forward of one n-token sample
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            model(torch.randn(1, n, cfg.patch_dim), torch.zeros(1, 1), Inputs(grid_positions((1, 1, n))))
        ops = counter.get_flop_counts()["Global"]
        return sum(int(v) for op, v in ops.items() if str(op) in ("aten.mm", "aten.addmm", "aten.bmm")) // 2

    per_token = (weight_macs(2 * N) - weight_macs(N)) // N  # the per-sample weights (adaLN, embedders) cancel
    attention = 12 * cfg.depth * cfg.hidden_size * cfg.attended(N, 1)  # the SDPA products, apart from the weights
    assert training_flops_per_token(cfg, N) - attention == 6 * per_token  # forward + backward: 3 x 2 per MAC
