"""A model built on the meta device and materialised shard by shard starts from exactly the one-device init.

TP layouts are built in this process on torch's fake process-group backend: Megatron's layers take their shapes for
the rank it names, and building and materialising run no collective.
"""

import contextlib
import resource
import weakref

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

from ditcore.models import DiT, preset
from ditcore.parallel import ParallelDims, ParallelGroups, materialize, parallelize
from ditcore.parallel.tensor_parallel import is_tp_sharded

CFG = preset("DiT-Tiny", num_classes=5, text_dim=16, fps_cond=True)
SEED = 11


@contextlib.contextmanager
def fake_tp(rank: int, tp: int = 2, sequence_parallel: bool = True):
    """The ParallelGroups that `rank` of a TP=`tp` layout gets, with no other process."""
    dist.init_process_group("fake", rank=rank, world_size=tp, store=FakeStore())
    try:
        world = dist.group.WORLD
        yield ParallelGroups(dims=ParallelDims(tp=tp, sequence_parallel=sequence_parallel).resolve(tp),
                             tp_group=world, cp_group=world, dp_group=world, dp_cp_group=world, tp_rank=rank,
                             cp_rank=0, dp_rank=0, dp_cp_rank=0)
    finally:
        dist.destroy_process_group()


def one_device_init(cfg=CFG) -> dict[str, torch.Tensor]:
    model = DiT(cfg)
    model.init_weights(SEED)
    return model.state_dict()


def meta_model(cfg=CFG) -> DiT:
    with torch.device("meta"):
        return DiT(cfg)


def test_meta_build_then_materialize_equals_the_one_device_init():
    model = materialize(meta_model(), SEED, "cpu")
    expected = one_device_init()
    got = model.state_dict()
    assert got.keys() == expected.keys()
    for k in expected:
        assert torch.equal(got[k], expected[k]), k
    assert not any(p.is_meta for p in model.parameters())


@pytest.mark.parametrize("rank", [0, 1])
def test_tp2_shards_materialised_directly_are_slices_of_the_one_device_init(rank):
    full = one_device_init()
    with fake_tp(rank) as groups:
        direct = materialize(parallelize(meta_model(), groups), SEED, "cpu", groups)
        from_full = DiT(CFG)
        from_full.init_weights(SEED)
        parallelize(from_full, groups)  # the other way in: shard real one-device weights
    sharded = 0
    for (name, p), (_, q) in zip(direct.named_parameters(), from_full.named_parameters(), strict=True):
        want = full[name].chunk(2, dim=p.partition_dim)[rank] if is_tp_sharded(p) else full[name]
        assert p.shape == q.shape and torch.equal(p, want) and torch.equal(q, want), name
        assert p.untyped_storage().nbytes() == p.numel() * p.element_size(), f"{name} is a view of a larger tensor"
        tags = ("tensor_model_parallel", "partition_dim", "partition_stride", "sequence_parallel", "tp_partial_grad")
        assert {t: getattr(p, t, None) for t in tags} == {t: getattr(q, t, None) for t in tags}, name
        sharded += is_tp_sharded(p)
        if name.startswith("blocks.") and name.endswith(("qkv.weight", "mlp.2.weight")):  # column-, row-parallel
            assert is_tp_sharded(p) and p.partition_dim == (0 if "qkv" in name else 1) and p.partition_stride == 1
    # per block, of its 7 linears split by heads or MLP columns: 7 weights and the 4 column-parallel biases
    # (row-parallel biases stay whole); its adaLN's weight and bias; the final layer's adaLN's
    assert sharded == 13 * CFG.depth + 2
    assert direct.blocks[0].attn.proj.bias.sequence_parallel  # row-parallel bias under SP: Megatron's tag kept


def test_materialize_holds_one_full_parameter_at_a_time():
    with fake_tp(0) as groups:
        model = parallelize(meta_model(), groups)
    rule, previous, calls = model.initial_value, [], []

    def watched(name, shape, seed, device):
        assert all(ref() is None for ref in previous), f"a full tensor is still alive when {name} is computed"
        value = rule(name, shape, seed, device)
        previous[:] = [weakref.ref(value)]
        calls.append(name)
        return value

    model.initial_value = watched
    materialize(model, SEED, "cpu", groups)
    assert len(calls) == len(list(model.parameters()))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def test_parallelizing_a_meta_model_allocates_nothing():
    """Megatron's own CPU initialisation would build every layer's whole weight on the host (2.7 GB for DiT-XL/2)."""
    cfg = preset("DiT-XL/2", num_classes=1000, text_dim=4096)
    with fake_tp(0) as groups:
        parallelize(meta_model(), groups)  # imports Megatron-Core: not part of what is measured
        before = _rss_bytes()
        model = parallelize(meta_model(cfg), groups)
        grown = _rss_bytes() - before
    assert all(p.is_meta for p in model.parameters())
    # a block's 11 attention, cross-attention and MLP tensors and its adaLN's 2; the final layer's adaLN's 2
    assert sum(is_tp_sharded(p) for p in model.parameters()) == 13 * cfg.depth + 2
    assert grown < 64 * 2**20, f"parallelizing on meta grew RSS by {grown / 2**20:.0f} MiB"


def test_tensor_parallel_linears_keep_the_autocast_dtype():
    """Megatron adds its fp32 bias to the bf16 matmul inside, which would turn the rest of the block into fp32;
    the wrappers add it in the output's dtype, as nn.Linear under autocast does. (TP=1 of 2 ranks: the fake
    backend's collectives return their input, which is all the dtypes need.)"""
    with fake_tp(0, sequence_parallel=False) as groups:
        model = materialize(parallelize(meta_model(), groups), SEED, "cpu", groups)
        x = torch.randn(5, 2, CFG.hidden_size)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            column, row = model.blocks[0].attn.qkv(x), model.blocks[0].mlp[2](torch.randn(5, 2, 128))
    assert column.dtype == row.dtype == torch.bfloat16
