"""What the tensor-, sequence- and context-parallel collectives move under bf16 autocast, in one process.

The values are the equivalence tests' business (test_equivalence.py, on real gloo processes); here a rank of a
2-rank layout runs on torch's fake process group, whose collectives move nothing but give results of the right
shapes, and every collective the forward and backward issue is recorded with its input's dtype and shape.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

from ditcore.diffusion import EDMLoss, EDMPrecond
from ditcore.inputs import Inputs
from ditcore.layout import grid_positions
from ditcore.models import build, preset
from ditcore.parallel import ParallelDims, parallelize
from ditcore.parallel.dims import ParallelGroups

COLLECTIVES = {"all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_to_all_single"}
DATA = dict(in_channels=4, num_classes=5, text_dim=16, fps_cond=True)


class Collectives(TorchDispatchMode):
    """(op, dtype, shape) of the input of every functional collective issued while it is on."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, torch.dtype, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "_c10d_functional" and func._opname in COLLECTIVES:
            self.seen.append((func._opname, args[0].dtype, tuple(args[0].shape)))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def fake_world():
    """torch.distributed on the fake backend, 2 ranks in this process: this is rank 0 of every group."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield dist.group.WORLD
    dist.destroy_process_group()


def rank_model(arch: str, dims: ParallelDims, world) -> torch.nn.Module:
    dims = dims.resolve(2)
    groups = ParallelGroups(dims=dims, tp_group=world, cp_group=world, dp_group=world, dp_cp_group=world,
                            tp_rank=0, cp_rank=0, dp_rank=0, dp_cp_rank=0)
    return parallelize(build(preset(arch, **DATA)), groups)


def bf16_step(model: torch.nn.Module) -> Collectives:
    """One bf16-autocast training step on 2 packed rows of 32 tokens (2 samples a row): its collectives."""
    B, S, N, L = 2, 2, 32, 6
    seg = torch.arange(N).expand(B, -1) // (N // S)
    pos = torch.cat([grid_positions((1, 4, 4))] * S)
    x = torch.randn(B, N, model.cfg.patch_dim)
    inputs = Inputs(pos=pos, seg=seg, class_labels=torch.zeros(B, S, dtype=torch.long), fps=torch.ones(B, S),
                    text=torch.randn(B, L, 16), text_seg=torch.arange(L).expand(B, -1) % S)
    recorded = Collectives()
    with recorded:
        with torch.autocast("cpu", torch.bfloat16):
            loss = EDMLoss()(EDMPrecond(model), x, inputs, mask=seg >= 0, sigma=torch.ones(B, S),
                             noise=torch.randn_like(x))
        loss.backward()
    return recorded


@pytest.mark.parametrize(("arch", "dims"), [
    ("DiT-Tiny", ParallelDims(tp=2, sequence_parallel=True)),
    ("DiT-Tiny", ParallelDims(tp=2)),
    ("DiT-Tiny", ParallelDims(cp=2)),
])
def test_collectives_move_activations_in_the_compute_dtype(fake_world, arch, dims):
    """Every collective of a bf16 step moves bf16, but the conditioning's gradient, summed over TP in fp32 once per
    adaLN linear: (B, S, D) a block, 1/N of a token activation's bytes, and summing it in bf16 would round what
    every block adds to it (the matmuls read it in bf16 anyway: no fp32 copy of an activation moves)."""
    model = rank_model(arch, dims, fake_world)
    seen = bf16_step(model).seen
    D, adaln = model.cfg.hidden_size, model.cfg.depth + 1  # every block's adaLN and the final layer's
    fp32 = [s for s in seen if s[1] != torch.bfloat16]
    if dims.tp > 1:
        assert fp32 == [("all_reduce", torch.float32, (2, 2, D))] * adaln
    else:
        assert fp32 == []
    assert len(seen) > len(fp32) + 2 * model.cfg.depth  # not vacuous: the layout's own collectives ran, in bf16


@pytest.mark.parametrize("sp", [False, True])
def test_adaln_is_split_by_columns_and_its_modulations_gathered(fake_world, sp):
    """Each rank holds 1/tp of every adaLN linear's output rows and gathers the (B, S, 6D) modulations of its
    samples, not of its tokens; under SP the modulations' gradient is partial (each rank modulated its own tokens)
    and reduce-scattered back, without SP each rank's is already whole and nothing is sent for it."""
    model = rank_model("DiT-Tiny", ParallelDims(tp=2, sequence_parallel=sp), fake_world)
    D = model.cfg.hidden_size
    assert model.blocks[0].adaLN[1].weight.shape == (6 * D // 2, D)
    assert model.final.adaLN[1].weight.shape == (2 * D // 2, D)
    seen = bf16_step(model).seen
    modulations = [(6 * D // 2, 2, 2)] * model.cfg.depth + [(2 * D // 2, 2, 2)]  # (features, B, S) of each
    gathers = [shape for op, _, shape in seen if op == "all_gather_into_tensor" and shape[1:] == (2, 2)]
    assert gathers == modulations
    scatters = [shape for op, _, shape in seen if op == "reduce_scatter_tensor" and shape[1:] == (2, 2)]
    assert scatters == ([(2 * D, 2, 2)] + [(6 * D, 2, 2)] * model.cfg.depth if sp else [])


@pytest.mark.parametrize("sp", [False, True])
def test_wan_norms_over_heads_sum_one_float32_a_token_over_tp(fake_world, sp):
    """Wan's QK norms (ditcore.models.wan): each rank holds its heads' scales, (heads/tp, head_dim), and sums each
    token's float32 square sum over the ranks, in forward and again for its gradient in backward: per block the self-
    attention's queries and keys and the cross-attention's queries (of all N tokens of the rank's rows, gathered
    under SP), the text's L keys and the zero state's one. No other collective moves float32; nothing gathers
    modulations (the time projection is whole on every rank)."""
    model = rank_model("Wan-Tiny", ParallelDims(tp=2, sequence_parallel=sp), fake_world)
    H, hd, depth = model.cfg.num_heads, model.cfg.head_dim, model.cfg.depth
    assert model.blocks[0].attn.q_norm.weight.shape == model.blocks[1].cross.k_norm.weight.shape == (H // 2, hd)
    seen = bf16_step(model).seen
    fp32 = sorted(shape for op, dtype, shape in seen if dtype != torch.bfloat16)
    N, B, L = 32, 2, 6  # bf16_step's rows
    per_block = [(N, B, 1, 1)] * 3 + [(L, B, 1, 1), (1, 1, 1, 1)]  # forward; backward the same again
    assert fp32 == sorted(per_block * 2 * depth)
    assert all(op == "all_reduce" for op, dtype, _ in seen if dtype != torch.bfloat16)
    assert not [s for op, _, s in seen if op == "all_gather_into_tensor" and s[1:] == (B, 2)]  # (features, B, S)
