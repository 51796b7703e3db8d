import re

import pytest
import torch
from torch import nn

from ditcore.flops import batch_flops, count_params, forward_macs, training_flops_per_token
from ditcore.models import ARCHS, DiT, preset

# DiT paper, Table 4 (Gflops = forward multiply-accumulates at 256×256, i.e. 32×32×4 latents)
PAPER_GFLOPS = {"DiT-S/2": 6.06, "DiT-B/2": 23.01, "DiT-L/2": 80.71, "DiT-XL/2": 118.64, "DiT-XL/4": 29.05,
                "DiT-XL/8": 7.39}


@pytest.mark.parametrize(("name", "gflops"), PAPER_GFLOPS.items())
def test_forward_macs_match_the_paper(name, gflops):
    cfg = preset(name, num_classes=1000)
    tokens = (32 // cfg.patch_size) ** 2
    assert forward_macs(cfg, tokens) / 1e9 == pytest.approx(gflops, rel=0.005)


def per_token_linear_weights(model: DiT) -> int:
    """Independent count: weights of every nn.Linear that is applied to latent tokens (not the conditioning's or the
    text's embedders, the model's or a block's own, nor the adaLN linears of the per-sample conditioning)."""
    total = 0
    for name, m in model.named_modules():
        if not isinstance(m, nn.Linear) or re.search(r"(^|\.)(t|fps|text)_embedder\.", name):
            continue
        if ".adaLN" in name or name.startswith("final.adaLN") or name.endswith("cross.kv"):
            continue
        total += m.weight.numel()
    return total


@pytest.mark.parametrize("text_dim", [0, 32])
@pytest.mark.parametrize("block_embedders", [False, True])
def test_per_token_parameters_match_the_model(text_dim, block_embedders):
    cfg = preset("DiT-Tiny", text_dim=text_dim, in_channels=3, patch_size_t=2, num_classes=5, fps_cond=True,
                 block_embedders=block_embedders)
    with torch.device("meta"):
        model = DiT(cfg)
    assert count_params(cfg).per_token_params == per_token_linear_weights(model)


def test_training_flops_is_6n_plus_attention():
    cfg = preset("DiT-XL/2", num_classes=1000)
    n_tok = count_params(cfg).per_token_params
    assert training_flops_per_token(cfg, 256) == 6 * n_tok + 12 * 28 * 1152 * 256
    with_text = preset("DiT-XL/2", text_dim=512)
    extra = training_flops_per_token(with_text, 256, text_len=77) - training_flops_per_token(with_text, 256)
    assert extra > 12 * 28 * 1152 * 77


def test_batch_flops_counts_every_sample_at_its_own_length():
    from ditcore.data.packing import PackedRow, TokenSample, collate
    from ditcore.layout import grid_positions

    def tok(grid, text_len):
        n = grid[0] * grid[1] * grid[2]
        return TokenSample("k", torch.zeros(n, 4), grid_positions(grid), grid, torch.zeros(text_len, 8), {}, "")

    cfg = preset("DiT-Tiny", text_dim=8)
    b = collate([PackedRow([tok((1, 2, 2), 3), tok((2, 2, 3), 0)]), PackedRow([tok((1, 4, 4), 5)])], seq_length=20)
    want = sum(training_flops_per_token(cfg, n, L) * n for n, L in ((4, 3), (12, 0), (16, 5)))
    assert batch_flops(cfg, b) == pytest.approx(want)


@pytest.mark.parametrize(("name", "block_embedders"), [(arch.tiny, own) for arch in ARCHS.values()
                                                      for own in (False, True) if not (own and arch.name == "wan")])
@pytest.mark.parametrize("text_dim", [0, 16])
def test_weight_counts_match_the_matmuls_of_a_forward(name, text_dim, block_embedders):
    """torch's FLOP counter over one forward of one sample (N tokens, L text tokens): its matmuls with weights are
    per_token·N + per_text_token·L + per_sample multiply-accumulates (attention's own products run in SDPA, which
    the counter leaves out on the CPU, and are the separate 2·L·d·N² term)."""
    from torch.utils.flop_counter import FlopCounterMode

    from ditcore.inputs import Inputs
    from ditcore.layout import grid_positions
    from ditcore.models import build

    cfg = preset(name, in_channels=4, text_dim=text_dim, fps_cond=block_embedders, block_embedders=block_embedders)
    model = build(cfg)
    N, L = 32, 5
    cond = {"text": torch.randn(1, L, text_dim)} if text_dim else {}
    cond |= {"fps": torch.ones(1, 1)} if cfg.fps_cond else {}
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.randn(1, N, cfg.patch_dim), torch.zeros(1, 1), Inputs(grid_positions((2, 4, 4)), **cond))
    ops = counter.get_flop_counts()["Global"]
    macs = sum(int(v) for op, v in ops.items() if str(op) in ("aten.mm", "aten.addmm", "aten.bmm")) // 2
    c = count_params(cfg)
    assert macs == c.per_token_params * N + c.per_text_token_params * (L if text_dim else 0) + c.per_sample_params
    if block_embedders:  # every block after the first embeds the noise level and the fps once per sample
        shared = count_params(cfg.replace(block_embedders=False))
        D = cfg.hidden_size
        assert c.per_sample_params - shared.per_sample_params == (cfg.depth - 1) * 2 * (256 * D + D * D)
        assert (c.per_token_params, c.per_text_token_params) == (shared.per_token_params, shared.per_text_token_params)


@pytest.mark.parametrize("name", ["DiT-Tiny", "ST-DiT-Tiny"])
def test_attention_term_counts_the_query_key_pairs_the_masks_allow(name):
    """12·L·d·attended(n, f) per token is 3 (forward and backward) x 2 (QKᵀ and AV) x 2 (multiply-add) x d x the
    (query, key) pairs a sample's blocks attend over, per token: count those pairs in the model's own masks, for a
    clip of 3 frames of 4 x 5 tokens (ST-DiT: a frame's 20 tokens in half the blocks, a line's 3 in the other)."""
    from ditcore.layout import grid_positions
    from ditcore.models import build

    cfg = preset(name)
    model = build(cfg)
    grid = (3, 4, 5)
    n = grid[0] * grid[1] * grid[2]
    seg = torch.zeros(1, n, dtype=torch.long)  # a mask even for the one sample
    a = model.attention_inputs("sdpa", 1, grid_positions(grid), seg, None, None, slice(0, n), torch.float32)
    views = [a, a.lines] if name.startswith("ST") else [a]
    pairs = sum(int(v.mask.attn.sum()) for v in views) * cfg.depth // len(views)
    c = count_params(cfg)
    attention = training_flops_per_token(cfg, n, frames=grid[0]) - 6 * c.per_token_params
    assert attention == 12 * cfg.hidden_size * pairs / n
    assert pairs == (cfg.depth * n * n if name.startswith("DiT") else cfg.depth // 2 * (n * 20 + n * 3))


def test_batch_flops_counts_each_clip_at_its_own_frames():
    from ditcore.data.packing import PackedRow, TokenSample, collate
    from ditcore.layout import grid_positions

    def tok(grid):
        n = grid[0] * grid[1] * grid[2]
        return TokenSample("k", torch.zeros(n, 4), grid_positions(grid), grid, torch.zeros(0, 8), {}, "")

    cfg = preset("ST-DiT-Tiny")
    b = collate([PackedRow([tok((1, 2, 2)), tok((3, 2, 2))]), PackedRow([tok((4, 2, 3))])], seq_length=24)
    want = sum(training_flops_per_token(cfg, n, frames=f) * n for n, f in ((4, 1), (12, 3), (24, 4)))
    assert batch_flops(cfg, b) == pytest.approx(want)
    assert batch_flops(cfg, b) < batch_flops(preset("DiT-Tiny", depth=4), b)  # the same blocks attending to all
