"""MovieGen's Llama-style DiT: its sizes are NeMo's, its parameters what those sizes give, its layers Llama's."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ditcore.errors import ConfigError
from ditcore.inputs import Inputs
from ditcore.models import MovieGen, preset
from ditcore.models.moviegen import GroupedSelfAttention, MovieGenConfig, SwiGLU
from ditcore.testing import assert_close_fp32

# NeMo's DiTLlama30BConfig / DiTLlama5BConfig / DiTLlama1BConfig (nemo/collections/diffusion/models/model.py; the 5B
# and 1B subclass the 30B and inherit its num_query_groups=8): layers, hidden, FFN, heads, query groups.
NEMO = {"MovieGen-30B": (48, 6144, 16384, 48, 8), "MovieGen-5B": (32, 3072, 8192, 24, 8),
        "MovieGen-1B": (16, 2048, 8192, 32, 8)}


def nemo_block_params(hidden: int, ffn: int, heads: int, groups: int) -> int:
    """One block of NeMo's MovieGen layer, derived from its spec: adaLN Linear(h, 6h); self-attention QKV with
    `groups` key/value heads and its output projection; cross-attention Q, grouped K/V and output projection; the
    SwiGLU MLP's fc1 (h -> 2f) and fc2 (f -> h); no biases in the attention and MLP linears."""
    hd = hidden // heads
    adaln = hidden * 6 * hidden
    attn = hidden * (heads + 2 * groups) * hd + hidden * hidden
    cross = hidden * hidden + hidden * 2 * groups * hd + hidden * hidden
    mlp = hidden * 2 * ffn + ffn * hidden
    return adaln + attn + cross + mlp


@pytest.mark.parametrize("name", NEMO)
def test_presets_have_nemos_sizes_and_their_parameter_counts(name):
    layers, hidden, ffn, heads, groups = NEMO[name]
    cfg = preset(name, in_channels=16, text_dim=1024)
    assert (cfg.depth, cfg.hidden_size, cfg.ffn, cfg.num_heads, cfg.kv_heads) == (layers, hidden, ffn, heads, groups)
    with torch.device("meta"):  # no memory: 34 billion parameters as shapes only
        model = MovieGen(cfg)
    stack = sum(p.numel() for p in model.blocks.parameters())
    # ours adds the adaLN bias, the cross-attention pre-norm and the per-head QK norms to each block
    assert stack == pytest.approx(layers * nemo_block_params(hidden, ffn, heads, groups), rel=0.005)
    total = sum(p.numel() for p in model.parameters())
    print(f"{name}: {total / 1e9:.3f} B parameters, blocks {stack / 1e9:.3f} B")
    assert total - stack < 0.02 * total  # the embedders and the final layer: small beside the blocks


def test_llama_layers_without_biases_and_grouped_heads():
    model = MovieGen(preset("MovieGen-Tiny", in_channels=4, text_dim=8))
    block = model.blocks[0]
    assert isinstance(block.mlp, SwiGLU) and isinstance(block.attn, GroupedSelfAttention)
    for layer in (block.attn.qkv, block.attn.proj, block.cross.q, block.cross.kv, block.cross.proj, block.mlp.gate_up,
                  block.mlp.down):
        assert isinstance(layer, nn.Linear) and layer.bias is None
    cfg = model.cfg
    assert block.attn.qkv.out_features == (cfg.num_heads + 2 * cfg.kv_heads) * cfg.head_dim  # 4 queries, 2 k/v heads
    assert isinstance(block.norm1, nn.RMSNorm) and isinstance(model.final.norm, nn.RMSNorm)


def test_grouped_heads_equal_full_heads_with_shared_keys():
    """Grouped-query attention is multi-head attention whose key/value heads are repeated over their groups: copy
    each group's key/value weights to its query heads and a 4-kv-head model computes the same."""
    cfg = preset("MovieGen-Tiny", in_channels=4, text_dim=8, num_kv_heads=2)
    grouped = MovieGen(cfg)
    full = MovieGen(cfg.replace(num_kv_heads=4))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in grouped.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)
        state = grouped.state_dict()
        hd, per = cfg.head_dim, cfg.num_heads // cfg.kv_heads
        for i in range(cfg.depth):
            w = state[f"blocks.{i}.attn.qkv.weight"].view(cfg.kv_heads, per + 2, hd, -1)  # (group, [q.., k, v], hd)
            q, k, v = w[:, :per], w[:, per:per + 1], w[:, per + 1:]
            heads = [torch.cat([q[:, j:j + 1], k, v], 1) for j in range(per)]  # each query head with its group's k, v
            state[f"blocks.{i}.attn.qkv.weight"] = torch.stack(heads, 1).reshape(-1, w.shape[-1])
            kv = state[f"blocks.{i}.cross.kv.weight"].view(cfg.kv_heads, 2, hd, -1)
            state[f"blocks.{i}.cross.kv.weight"] = kv.repeat_interleave(per, 0).reshape(-1, kv.shape[-1])
        full.load_state_dict(state)
    from ditcore.layout import grid_positions

    x, pos, text = torch.randn(2, 16, cfg.patch_dim), grid_positions((1, 4, 4)), torch.randn(2, 3, 8)
    with torch.no_grad():
        torch.testing.assert_close(grouped(x, torch.zeros(2, 1), Inputs(pos, text=text)),
                                   full(x, torch.zeros(2, 1), Inputs(pos, text=text)), rtol=1e-5, atol=1e-5)


def test_swiglu_is_llamas_and_splits_over_tensor_parallel_ranks_by_whole_units():
    """gate_up's rows are (hidden, [gate, up]): the MLP is down(silu(x Wgᵀ) · x Wuᵀ) with Wg its even rows and Wu its
    odd ones, and a contiguous split of the rows over tp ranks (a column-parallel linear) gives each rank the gate and
    up rows of the same hidden units: rank r computes hidden units r·M/tp .. (r+1)·M/tp exactly."""
    torch.manual_seed(0)
    D, M = 16, 24
    mlp, x = SwiGLU(D, M), torch.randn(5, D)
    W = mlp.gate_up.weight
    with torch.no_grad():
        hidden = F.silu(x @ W[0::2].T) * (x @ W[1::2].T)  # (5, M): Llama's, from two matrices
        # the matmuls group their sums differently: two dot products of length D, SiLU and the product, then down
        assert_close_fp32(mlp(x), mlp.down(hidden), work=2 * D + 4 + M)
        for tp in (2, 4):
            for r, rows in enumerate(W.chunk(tp)):  # rank r's shard of the column-parallel weight
                gate, up = (x @ rows.T).unflatten(-1, (-1, 2)).unbind(-1)  # what SwiGLU.forward does on a rank
                assert_close_fp32(F.silu(gate) * up, hidden.chunk(tp, -1)[r], work=2 * D + 4)


def test_an_export_with_separate_gate_and_up_loads_as_the_same_mlp():
    """State dicts written while gate and up were two matrices are upgraded to gate_up: the same function."""
    torch.manual_seed(0)
    model = MovieGen(preset("MovieGen-Tiny"))
    old = {}
    for k, v in model.state_dict().items():
        if ".mlp.gate_up." in k:  # the weights as the two-matrix version held them: gate rows, up rows
            old[k.replace("gate_up", "gate")], old[k.replace("gate_up", "up")] = v[0::2], v[1::2]
        else:
            old[k] = v
    upgraded = MovieGen.upgrade_state_dict(old)
    assert upgraded.keys() == model.state_dict().keys()
    assert all(torch.equal(upgraded[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize(("changes", "match"), [({"num_kv_heads": 3}, "num_kv_heads=3 is invalid: expected a divisor"),
                                                ({"ffn_hidden_size": -1}, "ffn_hidden_size=-1 is invalid")])
def test_invalid_config_names_field_value_and_range(changes, match):
    with pytest.raises(ConfigError, match=match):
        MovieGenConfig(hidden_size=64, depth=2, num_heads=4, **changes)
