"""Activation checkpointing (ditcore.models.techniques): the same numbers from less kept memory, same names."""

import copy

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ditcore.errors import ConfigError
from ditcore.inputs import Inputs
from ditcore.layout import grid_positions
from ditcore.models import DiT, apply_activation_checkpointing, apply_compile, preset
from ditcore.testing import assert_close_fp32, dit_forward_work, dit_grad_work

CFG = preset("DiT-Tiny", text_dim=16, num_classes=5)
ROWS = [[(1, 4, 4), (1, 2, 3), (1, 2, 2)], [(2, 2, 3), (1, 3, 3)]]  # samples' token grids, packed into 2 rows
N, LMAX, S = 32, 9, 3  # tokens and text tokens per row (with padding), samples per row


def packed_batch() -> dict:
    """Two rows packing samples of different sizes and text lengths (one per row without text), padded to N."""
    g = torch.Generator().manual_seed(3)
    pos, seg = torch.zeros(2, N, 3, dtype=torch.long), torch.full((2, N), -1)
    text_seg = torch.full((2, LMAX), -1)
    for r, row in enumerate(ROWS):
        n = t = 0
        for s, grid in enumerate(row):
            k, L = grid[0] * grid[1] * grid[2], [4, 0, 3][s]
            pos[r, n:n + k], seg[r, n:n + k], text_seg[r, t:t + L] = grid_positions(grid), s, s
            n, t = n + k, t + L
    return dict(x=torch.randn(2, N, CFG.patch_dim, generator=g), c_noise=torch.randn(2, S, generator=g), pos=pos,
                seg=seg, class_labels=torch.randint(0, 6, (2, S), generator=g),
                text=torch.randn(2, LMAX, 16, generator=g), text_seg=text_seg,
                target=torch.randn(2, N, CFG.patch_dim, generator=g))


def model(mode: str) -> DiT:
    """The same randomized DiT-Tiny (moved off adaLN-Zero's zeros, so that every path carries a gradient)."""
    torch.manual_seed(0)
    m = DiT(CFG)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)
    return apply_activation_checkpointing(m, mode)


def loss_of(m: nn.Module, b: dict) -> torch.Tensor:
    out = m(b["x"], b["c_noise"], Inputs(b["pos"], seg=b["seg"], class_labels=b["class_labels"], text=b["text"],
            text_seg=b["text_seg"]))
    mask = (b["seg"] >= 0)[..., None]
    return ((out - b["target"]).square() * mask).sum() / mask.sum()


@pytest.mark.parametrize("mode", ["block", "selective"])
def test_loss_and_gradients_are_bitwise_those_without_checkpointing(mode):
    # Recomputation runs the same CPU kernels on the same inputs, and `selective` hands back the very tensors the
    # forward made: nothing is reassociated, so the numbers are identical, not merely within rounding.
    b = packed_batch()
    ref, ckpt = model("none"), model(mode)
    loss_ref, loss = loss_of(ref, b), loss_of(ckpt, b)
    loss_ref.backward()
    loss.backward()
    assert torch.equal(loss, loss_ref)
    for (name, p), q in zip(ckpt.named_parameters(), ref.parameters(), strict=True):
        assert q.grad.abs().sum() > 0, f"{name} has no gradient: the comparison would be vacuous"
        assert torch.equal(p.grad, q.grad), name


class KeptBytes(TorchDispatchMode):
    """Bytes of the tensors made under this mode that are still alive: after a forward, what it keeps for backward.

    Counted from storages, not with torch.autograd.graph.saved_tensors_hooks: inside a checkpointed block the
    checkpoint's own hooks replace any outer ones, and selective checkpointing keeps its tensors in a cache of its
    own, so hooks would see none of either. Views share their base's storage and are counted once.
    """

    def __init__(self, existing: list[torch.Tensor]):
        super().__init__()
        self.existing = {StorageWeakRef(t.untyped_storage()) for t in existing}  # parameters, inputs: not kept
        self.made: dict[StorageWeakRef, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and (ref := StorageWeakRef(t.untyped_storage())) not in self.existing:
                self.made[ref] = t.untyped_storage().nbytes()
        return out

    def alive(self) -> int:
        return sum(n for ref, n in self.made.items() if not ref.expired())


def test_checkpointing_keeps_less_for_backward():
    b = packed_batch()
    kept = {}
    for mode in ("none", "selective", "block"):
        m = model(mode)
        with KeptBytes([*m.parameters(), *b.values()]) as counter:
            loss = loss_of(m, b)
        kept[mode] = counter.alive()
        loss.backward()
        del loss
        assert counter.alive() == 0, f"{mode}: tensors of the forward outlive the backward"
    # none keeps every tensor the backward reads; selective of those only the matmul and attention outputs (the
    # norms, modulations, RoPE, GELU and head-major copies are recomputed); block only each block's inputs. The
    # parts outside the blocks (embedders, final layer) keep the same in all three.
    assert kept["none"] > kept["selective"] > kept["block"], kept


def test_parameter_names_and_state_dict_keys_are_unchanged():
    plain = model("none")
    for mode in ("block", "selective"):
        m = model(mode)
        assert list(m.state_dict()) == list(plain.state_dict())
        assert [n for n, _ in m.named_modules()] == [n for n, _ in plain.named_modules()]
        m.load_state_dict(plain.state_dict())  # strict: a plain checkpoint loads, and the other way round
        plain.load_state_dict(m.state_dict())


@pytest.mark.parametrize("mode", ["block", "selective"])
def test_a_copy_computes_with_its_own_weights(mode):
    """EMA deep-copies the model: the copy's checkpointed blocks must run the copy, not the original."""
    b = packed_batch()
    m = model(mode)
    ema = copy.deepcopy(m)
    with torch.no_grad():
        ema.blocks[0].attn.qkv.weight.mul_(0.5)
        changed, original = loss_of(ema, b), loss_of(m, b)
    assert not torch.equal(changed, original)
    with torch.no_grad():
        ema.blocks[0].attn.qkv.weight.mul_(2.0)  # exactly back (a power of two)
        assert torch.equal(loss_of(ema, b), original)


def test_unknown_mode_is_a_config_error():
    with pytest.raises(ConfigError, match=r"model\.activation_checkpointing='full' is invalid: expected one of "
                                          r"'none', 'block', 'selective'"):
        apply_activation_checkpointing(model("none"), "full")


# ---------------------------------------------------------------- with torch.compile


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["block", "selective"])
def test_compiled_checkpointed_blocks_match_eager(mode):
    b = packed_batch()
    eager, compiled = model("none"), apply_compile(model(mode))
    loss_e, loss_c = loss_of(eager, b), loss_of(compiled, b)
    loss_e.backward()
    loss_c.backward()
    # Inductor fuses and reorders the elementwise work: equal within float32 rounding of the computation
    # (ditcore.testing), the loss a mean over every output element on top of the forward.
    forward = dit_forward_work(CFG, seq_len=N, text_len=LMAX)
    assert_close_fp32(loss_c, loss_e, work=forward + 2 * N * CFG.patch_dim)
    grad_work = dit_grad_work(CFG, seq_len=N, text_len=LMAX, tokens=2 * N)
    for (name, p), q in zip(compiled.named_parameters(), eager.parameters(), strict=True):
        assert_close_fp32(p.grad, q.grad, work=grad_work, msg=name)
