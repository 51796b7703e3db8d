"""The token layout (ditcore.layout): patches, positions, packed-row helpers."""

import pytest
import torch
from torch import nn

from ditcore.layout import grid_positions, patchify, per_token, segment_mask, unpatchify
from ditcore.testing import NoLowPrecisionScatter, assert_close_fp32, fp32_tolerance

# ---------------------------------------------------------------- patches


@pytest.mark.parametrize(("p", "pt"), [(1, 1), (2, 1), (2, 2), (4, 3)])
def test_patchify_roundtrip_exact(p, pt):
    x = torch.randn(2, 3, 6, 8, 12)
    grid = (6 // pt, 8 // p, 12 // p)
    tokens = patchify(x, p, pt)
    assert tokens.shape == (2, grid[0] * grid[1] * grid[2], 3 * pt * p * p)
    assert torch.equal(unpatchify(tokens, grid, p, pt), x)


def test_patch_embedding_equals_strided_conv3d():
    """Token features are laid out like Conv3d weights, so x_embedder on tokens == Conv3d(kernel=stride=patch)."""
    p, pt, C, D = 2, 2, 3, 16
    x = torch.randn(2, C, 4, 6, 8)
    conv = nn.Conv3d(C, D, kernel_size=(pt, p, p), stride=(pt, p, p))
    lin = nn.Linear(C * pt * p * p, D)
    with torch.no_grad():
        lin.weight.copy_(conv.weight.reshape(D, -1))
        lin.bias.copy_(conv.bias)
    want = conv(x).flatten(2).transpose(1, 2)  # (B, T'H'W', D) in (t, h, w) order
    assert_close_fp32(lin(patchify(x, p, pt)), want, work=C * pt * p * p + 1)  # one dot product and the bias
    assert grid_positions((2, 3, 4))[:5].tolist() == [[0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 0, 3], [0, 1, 0]]


def test_patch_size_must_divide_latent():
    with pytest.raises(ValueError, match="latent width 7 is not divisible by the patch size 2"):
        patchify(torch.randn(1, 4, 1, 8, 7), 2, 1)


# ---------------------------------------------------------------- packed rows


def test_per_token_gathers_each_tokens_sample_and_broadcasts_without_seg():
    values = torch.tensor([[[1.0], [2.0], [3.0]]])  # (B=1, S=3, 1)
    seg = torch.tensor([[0, 0, 2, 1, -1]])
    assert per_token(values, seg)[0, :, 0].tolist() == [1.0, 1.0, 3.0, 2.0, 1.0]  # padding takes sample 0
    assert per_token(values, None).shape == (1, 1, 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_per_token_with_gradients_gathers_exactly_and_sums_each_samples_tokens_in_fp32(dtype):
    """Values that need a gradient go through a one-hot matmul: the same values as the gather, and a gradient that is
    each sample's sum of its tokens' gradients, accumulated in fp32 and rounded once (as the exact sum, rounded)."""
    g = torch.Generator().manual_seed(0)
    B, S, N, F = 2, 3, 600, 5
    seg = torch.randint(-1, S, (B, N), generator=g)
    values = torch.randn(B, S, F, generator=g).to(dtype).requires_grad_()
    grad_out = torch.randn(B, N, F, generator=g).to(dtype)
    with NoLowPrecisionScatter():
        out = per_token(values, seg)
        out.backward(grad_out)
    assert out.dtype == dtype
    assert torch.equal(out, torch.gather(values.detach(), 1, seg.clamp(min=0)[..., None].expand(-1, -1, F)))
    one_hot = torch.nn.functional.one_hot(seg.clamp(min=0), S).double()  # padding counts for sample 0, as it reads it
    exact = one_hot.transpose(1, 2) @ grad_out.double()  # (B, S, F)
    # fp32 accumulation of N terms (Higham), then one rounding to the values' dtype
    bound = fp32_tolerance(N, 1.0) * (one_hot.transpose(1, 2) @ grad_out.double().abs()) + exact.abs() * (
        torch.finfo(dtype).eps / 2)
    assert ((values.grad.double() - exact).abs() <= bound).all()
    assert torch.equal(per_token(values.detach(), seg), out.detach())  # without a gradient: the gather


def test_segment_mask_is_block_diagonal_and_keeps_keyless_queries_finite():
    seg_q = torch.tensor([[0, 0, 1, -1]])
    seg_k = torch.tensor([[0, 1, 1]])
    mask, has_keys = segment_mask(seg_q, seg_k)
    assert mask[0, 0].tolist() == [[True, False, False], [True, False, False], [False, True, True],
                                   [True, True, True]]  # the padding query sees every key (zeroed by the caller)
    assert has_keys[0, :, 0].tolist() == [True, True, True, False]
