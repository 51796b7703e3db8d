"""The token layout (ditcore.layout): patches, positions, packed-row helpers."""

import pytest
import torch
from torch import nn

from ditcore.layout import grid_positions, patchify, per_token, segment_mask, unpatchify
from ditcore.testing import assert_close_fp32

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


def test_segment_mask_is_block_diagonal_and_keeps_keyless_queries_finite():
    seg_q = torch.tensor([[0, 0, 1, -1]])
    seg_k = torch.tensor([[0, 1, 1]])
    mask, has_keys = segment_mask(seg_q, seg_k)
    assert mask[0, 0].tolist() == [[True, False, False], [True, False, False], [False, True, True],
                                   [True, True, True]]  # the padding query sees every key (zeroed by the caller)
    assert has_keys[0, :, 0].tolist() == [True, True, True, False]
