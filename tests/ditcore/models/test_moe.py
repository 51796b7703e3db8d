"""The mixture-of-experts feed-forward (ditcore.models.moe): the grouped expert computation equals a loop over the
experts, routing and its losses equal hand-computed values, padding does not count, and a MoE model counts its active
FLOPs, sums nothing in bf16, reads nothing back and compiles to whole blocks. (Packed rows equal samples run alone:
tests/ditcore/models/test_dit.py, whose test runs MoE models too.)"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import clear_compilation_metrics, counters

from ditcore.diffusion import EDMLoss, EDMPrecond
from ditcore.errors import ConfigError
from ditcore.flops import count_params
from ditcore.inputs import Inputs
from ditcore.layout import grid_positions
from ditcore.memory import parameters, plan_from
from ditcore.models import (
    MoEConfig,
    apply_activation_checkpointing,
    apply_compile,
    build,
    check_compiled,
    dit,
    preset,
)
from ditcore.models.moe import GroupedExperts, MoE, routing_stats
from ditcore.parallel.dims import ParallelDims
from ditcore.probe import block_period, meta_model
from ditcore.testing import HostReads, NoLowPrecisionScatter, assert_close_fp32

from .test_dit import randomize
from .test_numerics import ONE_ROW, ROWS, packed_batch

MOE = MoEConfig(experts=4, top_k=2, every=2, shared_experts=1)


def loop_over_experts(experts: GroupedExperts, x, chosen, weights):
    """The reference: each expert's MLP on the tokens that chose it, one expert after another, weighted and summed."""
    y = torch.zeros_like(x)
    for e in range(experts.w_in.shape[0]):
        h = x @ experts.w_in[e]
        if experts.glu:
            gate, up = h.unflatten(-1, (-1, 2)).unbind(-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate="tanh")
        w = (weights * (chosen == e)).sum(-1, keepdim=True)  # (T, 1): 0 for tokens that did not choose e
        y = y + w * (h @ experts.w_out[e])
    return y


@pytest.mark.parametrize("glu", [False, True], ids=["gelu", "swiglu"])
def test_grouped_experts_equal_a_loop_over_experts_forward_and_gradients(glu):
    g = torch.Generator().manual_seed(0)
    T, D, H, E, k = 13, 8, 12, 4, 2
    experts = GroupedExperts(D, H, E, glu)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
    x = torch.randn(T, D, generator=g, requires_grad=True)
    chosen = torch.stack([torch.randperm(E - 1, generator=g)[:k] for _ in range(T)])  # expert 3 gets no token
    weights = torch.rand(T, k, generator=g, requires_grad=True)
    target = torch.randn(T, D, generator=g)

    grads = []
    for run in (lambda *a: experts(*a)[0], lambda *a: loop_over_experts(experts, *a)):
        y = run(x, chosen, weights)
        (y * target).sum().backward()
        grads.append((y.detach(), x.grad, weights.grad, experts.w_in.grad, experts.w_out.grad))
        x.grad = weights.grad = experts.w_in.grad = experts.w_out.grad = None
    work = D + 2 * H + k  # a value's chain: x·w_in (D), ·w_out (H), Σ over k; the gradients go back down it
    for name, ours, ref in zip(("y", "dx", "dweights", "dw_in", "dw_out"), *grads, strict=True):
        assert_close_fp32(ours, ref, work=2 * work + T * k, msg=name)  # a weight's gradient sums the T·k rows too
    assert torch.equal(grads[0][3][E - 1], torch.zeros_like(grads[0][3][E - 1]))  # the unused expert: exact zeros


def test_router_sends_each_token_to_its_top_k_by_probability(monkeypatch):
    """Known logits (router = identity): the experts chosen are the k most probable, weighted by their probability;
    with `normalize` the weights of a token sum to 1."""
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.5], [0.0, 0.2, -1.0, 4.0]])
    seen = {}
    for normalize in (False, True):
        moe = MoE(4, 8, MoEConfig(experts=4, top_k=2, normalize=normalize), glu=False, shared=None)
        with torch.no_grad():
            moe.router.weight.copy_(torch.eye(4))
        moe.experts.register_forward_hook(lambda m, args, out: seen.update(chosen=args[1], weights=args[2]))
        moe(logits[:, None], None)  # two tokens, sequence-first (n=2, B=1)
        assert seen["chosen"].tolist() == [[0, 2], [3, 1]]
        p = logits.softmax(-1)
        expected = torch.stack([p[0, [0, 2]], p[1, [3, 1]]])
        if normalize:
            expected = expected / expected.sum(-1, keepdim=True)
        torch.testing.assert_close(seen["weights"], expected, rtol=0, atol=1e-7)


def test_balance_and_z_losses_equal_hand_computed_values_over_the_real_tokens():
    """Two experts, top-1, three real tokens and one padding token (its huge logits must not count).
    p = (1/4, 3/4), (3/4, 1/4), (1/4, 3/4) → picks 1, 0, 1: f = (1/3, 2/3), P = (1.25/3, 1.75/3), balance
    2 (f·P) = 9.5/9; every real token's logsumexp is ln 4: z = ln² 4."""
    ln3 = math.log(3)
    logits = torch.tensor([[0.0, ln3], [ln3, 0.0], [0.0, ln3], [50.0, -50.0]])
    real = torch.tensor([True, True, True, False])
    probs = logits.softmax(-1)
    chosen = probs.topk(1, dim=-1).indices
    balance, z, *share = routing_stats(logits, probs, chosen, real).tolist()
    assert balance == pytest.approx(9.5 / 9, rel=1e-6)
    assert z == pytest.approx(math.log(4) ** 2, rel=1e-6)
    assert share == pytest.approx([1 / 3, 2 / 3], rel=1e-6)
    # uniform routing is the balance loss's minimum, 1; every token to one expert its maximum, E
    flat = torch.zeros(4, 2)
    assert routing_stats(flat, flat.softmax(-1), torch.tensor([[0], [1], [0], [1]]), None)[0].item() == 1.0
    peaked = torch.tensor([[9.0, -9.0]] * 4)
    assert routing_stats(peaked, peaked.softmax(-1), torch.zeros(4, 1, dtype=torch.long), None)[0].item() == \
        pytest.approx(2.0, rel=1e-6)


def test_padding_does_not_change_a_models_routing_statistics():
    cfg = preset("DiT-Tiny", moe=MOE)
    model = randomize(build(cfg)).eval()
    g = torch.Generator().manual_seed(4)
    x, c_noise = torch.randn(1, 16, cfg.patch_dim, generator=g), torch.randn(1, 1, generator=g)
    with torch.no_grad():
        model(x, c_noise, Inputs(grid_positions((1, 4, 4))))
        alone = model.routing
        padded = torch.cat([x, 100 * torch.randn(1, 8, cfg.patch_dim, generator=g)], dim=1)  # loud padding
        pos = torch.cat([grid_positions((1, 4, 4)), torch.zeros(8, 3, dtype=torch.long)])
        seg = torch.tensor([[0] * 16 + [-1] * 8])
        model(padded, c_noise, Inputs(pos, seg=seg))
    assert_close_fp32(model.routing.stats, alone.stats, work=200)
    assert torch.equal(model.routing.share.sum(-1), torch.ones(1))  # each block's shares add up to 1


def test_moe_blocks_are_every_nth_and_the_blocks_repeat_so():
    model = build(preset("DiT-Tiny", depth=4, moe=MOE))
    assert [block.moe for block in model.blocks] == [False, True, False, True]
    assert block_period(model) == 2
    assert block_period(build(preset("DiT-Tiny", depth=4, moe=MOE.__class__(every=1)))) == 1
    with pytest.raises(ConfigError, match=r"^moe.every=3 is invalid: expected a divisor of depth=4"):
        preset("DiT-Tiny", depth=4, moe=MoEConfig(every=3))


@pytest.mark.parametrize(("changes", "match"), [
    (dict(top_k=9), r"^moe.top_k=9 is invalid: expected an integer from 1 to experts=8"),
    (dict(experts=1), r"^moe.experts=1 is invalid"),
    (dict(balance_loss=-1), r"^moe.balance_loss=-1 is invalid"),
])
def test_invalid_moe_config_names_the_key(changes, match):
    with pytest.raises(ConfigError, match=match):
        MoEConfig(**changes)


def test_expert_parallelism_needs_experts_it_can_split_in_one_line():
    with pytest.raises(ConfigError, match=r"^ep=2 is invalid: expected 1 for a model without model.moe"):
        ParallelDims(ep=2).check_model(4)
    with pytest.raises(ConfigError, match=r"^ep=4 is invalid: expected a divisor of model.moe.experts=6"):
        ParallelDims(ep=4).check_model(4, moe=MoEConfig(experts=6))
    # every other layout takes MoE (tests/ditcore/parallel/test_equivalence.py's moe: cases)
    ParallelDims(tp=2, pp=2, cp=2, sequence_parallel=True, ep=2).check_model(4, depth=2, moe=MoEConfig())


def test_an_export_config_dict_reads_back_as_moe_config():
    import dataclasses

    cfg = preset("MovieGen-Tiny", moe=MOE)
    assert type(cfg)(**dataclasses.asdict(cfg)) == cfg


# --------------------------------------------------------------------------------------------------
# Estimators: FLOPs (active parameters), memory (all of them)


@pytest.mark.parametrize("tiny", ["DiT-Tiny", "MovieGen-Tiny"])
def test_flops_count_the_active_parameters_router_included(tiny):
    dense = preset(tiny, depth=4)
    moe = MoEConfig(experts=4, top_k=2, every=2, shared_experts=1, expert_hidden=32)
    cfg = dense.replace(moe=moe)
    D, glu = dense.hidden_size, tiny.startswith("MovieGen")
    expert = D * 32 * (3 if glu else 2)  # w_in (D → H, or gate and up) and w_out
    dense_mlp = D * dense.ffn * (3 if glu else 2)
    # two MoE blocks, each: router (D x E), top_k experts and one shared, in place of the dense MLP
    per_moe_block = D * moe.experts + (moe.top_k + moe.shared_experts) * expert - dense_mlp
    assert count_params(cfg).per_token_params == count_params(dense).per_token_params + 2 * per_moe_block
    assert count_params(cfg).per_sample_params == count_params(dense).per_sample_params


def test_memory_plan_holds_every_expert():
    from ditcore.job import Layout

    cfg = preset("DiT-Tiny", moe=MOE)
    assert sum(p.numel for p in parameters(cfg)) == sum(p.numel() for p in meta_model(cfg).parameters())
    lay = Layout(seq_length=16, text_len=0, packed=True, precision="bf16", device="cpu", attention="sdpa")
    plan = plan_from(cfg, lay)
    dense = plan_from(preset("DiT-Tiny"), lay)
    assert plan.weights > dense.weights and plan.activations > 0


def test_under_expert_parallelism_a_rank_plans_its_own_experts_and_the_search_tries_ep():
    """parallel.ep: a rank holds E/ep of each MoE block's stacked expert weights (dim 0) and every other parameter
    whole; --plan --search tries each ep that divides dp x cp and the experts, for MoE configs only."""
    from ditcore.job import Layout
    from ditcore.speed import Cluster, layouts

    cfg = preset("DiT-Tiny", moe=MOE)
    lay = Layout(world_size=4, seq_length=16, text_len=0, precision="fp32", device="cpu", attention="sdpa")
    experts = sum(p.numel() for m in meta_model(cfg).modules() if isinstance(m, GroupedExperts)
                  for p in m.parameters())
    assert experts > 0
    for ep in (2, 4):
        assert plan_from(cfg, lay).weights - plan_from(cfg, lay.replace(ep=ep)).weights == 4 * experts * (ep - 1) // ep
    tried = {(s.ep, s.fsdp) for s in layouts(cfg, lay, Cluster(gpus_per_node=4), 4)}
    assert {(2, False), (4, False), (2, True), (4, True)} <= tried  # EP with DDP, and with FSDP
    assert {s.ep for s in layouts(preset("DiT-Tiny"), lay, Cluster(gpus_per_node=4), 4)} == {1}


# --------------------------------------------------------------------------------------------------
# A training step: bf16 sums, host reads, compile, checkpointing


@pytest.mark.parametrize("rows", [ROWS, ONE_ROW], ids=["two_rows", "one_row"])
@pytest.mark.parametrize("tiny", ["DiT-Tiny", "MovieGen-Tiny"])
def test_a_bf16_moe_training_step_never_scatters_into_bf16(tiny, rows):
    cfg = preset(tiny, text_dim=16, num_classes=5, moe=MOE)
    model = randomize(build(cfg, attention="sdpa"))
    b = packed_batch(cfg, rows, 48, torch.Generator().manual_seed(0))
    with NoLowPrecisionScatter():  # fails on leaving if any op, forward or backward, scattered into bf16
        with torch.autocast("cpu", torch.bfloat16):
            inputs = Inputs(b["pos"], seg=b["seg"], text=b["text"], text_seg=b["text_seg"],
                            class_labels=b["class_labels"])
            loss = EDMLoss()(EDMPrecond(model), b["x"], inputs, mask=b["mask"], sigma=b["sigma"], noise=b["noise"])
        (loss + model.routing.aux_loss).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_a_moe_training_step_reads_nothing_back(monkeypatch):
    cfg = preset("DiT-Tiny", text_dim=16, num_classes=5, moe=MOE)
    model = randomize(build(cfg, attention="sdpa"))
    b = packed_batch(cfg, ROWS, 48, torch.Generator().manual_seed(0))
    watch = HostReads("cpu")
    monkeypatch.setattr(dit, "check_positions", watch.unwatched(dit.check_positions))  # reads CPU positions by design
    with watch:
        inputs = Inputs(b["pos"], seg=b["seg"], text=b["text"], text_seg=b["text_seg"], class_labels=b["class_labels"])
        loss = EDMLoss()(EDMPrecond(model), b["x"], inputs, mask=b["mask"], sigma=b["sigma"], noise=b["noise"])
        (loss + model.routing.aux_loss).backward()
        model.routing.metrics()  # what dit-train records
    assert model.blocks[1].mlp.router.weight.grad.abs().sum() > 0


def moe_step(model, cfg):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 16, cfg.patch_dim, generator=g)
    out = model(x, torch.randn(2, 1, generator=g), Inputs(grid_positions((1, 4, 4))))
    loss = out.square().mean() + model.routing.aux_loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("checkpointing", ["none", "block", "selective"])
def test_compiled_moe_blocks_are_whole_graphs_equal_to_eager(checkpointing):
    from torch._dynamo.utils import get_compilation_metrics

    cfg = preset("DiT-Tiny", depth=4, moe=MOE)
    torch._dynamo.reset()
    counters.clear()
    clear_compilation_metrics()
    try:
        torch.manual_seed(0)
        eager = randomize(build(cfg))
        torch.manual_seed(0)
        compiled = randomize(build(cfg))
        apply_compile(apply_activation_checkpointing(compiled, checkpointing), backend="aot_eager")
        loss, grads = moe_step(eager, cfg)
        loss_c, grads_c = moe_step(compiled, cfg)
        assert check_compiled(compiled) == []  # no graph break
        graphs = [m for m in get_compilation_metrics() if (m.graph_op_count or 0) > 0 and "ditcore" in m.co_filename]
        assert len(graphs) == 2  # one graph per kind of block (dense, MoE), each whole
    finally:
        torch._dynamo.reset()
    assert_close_fp32(loss_c, loss, work=500)
    for name, grad in grads.items():
        assert_close_fp32(grads_c[name], grad, work=1000, msg=name)


@pytest.mark.parametrize("mode", ["block", "selective"])
def test_checkpointed_moe_blocks_give_bitwise_the_same_gradients(mode):
    cfg = preset("MovieGen-Tiny", depth=4, moe=MOE)
    torch.manual_seed(0)
    plain = randomize(build(cfg))
    torch.manual_seed(0)
    checkpointed = apply_activation_checkpointing(randomize(build(cfg)), mode)
    (loss, grads), (loss_c, grads_c) = moe_step(plain, cfg), moe_step(checkpointed, cfg)
    assert torch.equal(loss, loss_c)
    assert all(torch.equal(grads[n], grads_c[n]) for n in grads)
