"""Attention backends: sdpa's dense masks and flex's BlockMasks say the same thing, and packed rows equal their
samples run alone under each. FlexAttention has no CPU backward, so gradients under flex are checked on a GPU."""

import pytest
import torch

from ditcore.errors import ConfigError
from ditcore.inputs import Inputs
from ditcore.layout import grid_positions
from ditcore.models import ARCHS, DiT, build, preset
from ditcore.models.attention import Mask, attend, resolve, segments
from ditcore.testing import assert_close_fp32, dit_forward_work, dit_grad_work


def test_auto_picks_flex_to_train_on_cuda_and_sdpa_elsewhere():
    assert resolve("auto", torch.device("cpu")) == "sdpa"
    assert resolve("auto", torch.device("cuda")) == "flex"
    assert resolve("auto", torch.device("cuda"), training=False) == "sdpa"  # sampling: whole rows, flash
    assert resolve("flex", torch.device("cuda"), training=False) == "flex"
    assert resolve("sdpa", torch.device("cuda")) == "sdpa"
    with pytest.raises(ConfigError, match=r"model\.attention.*'fast'.*auto, sdpa, flex"):
        resolve("fast", torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"model\.attention"):
        DiT(preset("DiT-Tiny"), attention="flash")


def random_segments(B: int, N: int, samples: int, g: torch.Generator) -> torch.Tensor:
    """Rows of consecutive samples of random lengths, then padding (−1)."""
    seg = torch.full((B, N), -1)
    for b in range(B):
        cuts = torch.randint(1, N, (samples,), generator=g).sort().values.tolist()
        start = 0
        for s, end in enumerate(cuts):
            seg[b, start:end] = s
            start = end
    return seg


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_block_mask_and_dense_mask_agree(seed):
    g = torch.Generator().manual_seed(seed)
    B, H, N, L, hd = 2, 2, 150, 20, 16  # N > 128: more than one flex block, with a partial last block
    seg = random_segments(B, N, 4, g)
    text_seg = random_segments(B, L, 4, g)
    text_seg[0, text_seg[0] == 1] = -1  # sample 1 of row 0 has its text dropped: its queries see no text
    q, k, v = (torch.randn(B, H, N, hd, generator=g) for _ in range(3))
    tk, tv = (torch.randn(B, H, L, hd, generator=g) for _ in range(2))
    with torch.no_grad():
        for keys, values, seg_k in ((k, v, seg), (tk, tv, text_seg)):
            dense = attend(q, keys, values, segments("sdpa", seg, seg_k))
            flex = attend(q, keys, values, segments("flex", seg, seg_k))
            real = (seg >= 0)[:, None, :, None]  # padding queries: flex gives zeros, sdpa attends padding
            assert_close_fp32(flex * real, dense * real, work=hd + 2 * keys.shape[2])
    assert flex[0, :, seg[0] == 1].abs().max() == 0  # no text: nothing, under both
    assert dense[0, :, seg[0] == 1].abs().max() == 0


@pytest.mark.parametrize("backend", ["sdpa", "flex", "run"])
def test_grouped_query_attention_reads_shared_heads_as_their_copies(backend):
    """enable_gqa: 6 query heads over 2 key/value heads, each shared by 3 consecutive query heads, is attention over
    the copies of each key/value head for its query heads (what MovieGen made before), under every kind of mask."""
    g = torch.Generator().manual_seed(0)
    B, H, kv, N, hd = 2, 6, 2, 150, 16
    q = torch.randn(B, H, N, hd, generator=g)
    k, v = (torch.randn(B, kv, N, hd, generator=g) for _ in range(2))
    if backend == "run":  # runs of 30 tokens as rows of their own (ST-DiT's frames of rows of one sample)
        mask = Mask(None, run=30)
    else:
        mask = segments(backend, *(2 * [random_segments(B, N, 4, g)]))
        mask.has_keys = None
    with torch.no_grad():  # flex: forward only on a CPU
        shared = attend(q, k, v, mask, enable_gqa=True)
        copies = attend(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), mask)
    assert_close_fp32(shared, copies, work=hd + 2 * N)


def packed_and_alone(cfg, device):
    """Two rows: an image, a 2-frame clip and an untexted image; and one clip; padded to 40 tokens."""
    g = torch.Generator().manual_seed(3)
    rows = [[((1, 4, 4), 3), ((2, 3, 2), 5), ((1, 2, 2), 0)], [((3, 2, 3), 4)]]
    B, N, Lmax, S = 2, 40, 10, 3
    x, pos = torch.zeros(B, N, cfg.patch_dim), torch.zeros(B, N, 3, dtype=torch.long)
    seg, text = torch.full((B, N), -1), torch.zeros(B, Lmax, cfg.text_dim)
    text_seg, c_noise = torch.full((B, Lmax), -1), torch.zeros(B, S)
    alone = []
    for r, row in enumerate(rows):
        n = t = 0
        for s, (grid, L) in enumerate(row):
            k = grid[0] * grid[1] * grid[2]
            smp = dict(x=torch.randn(1, k, cfg.patch_dim, generator=g), pos=grid_positions(grid),
                       c_noise=torch.randn(1, 1, generator=g), text=torch.randn(1, L, cfg.text_dim, generator=g))
            x[r, n:n + k], pos[r, n:n + k], seg[r, n:n + k] = smp["x"][0], smp["pos"], s
            text[r, t:t + L], text_seg[r, t:t + L], c_noise[r, s] = smp["text"][0], s, smp["c_noise"]
            alone.append((r, n, n + k, {key: val.to(device) for key, val in smp.items()}))
            n, t = n + k, t + L
    packed = dict(x=x, c_noise=c_noise, pos=pos, seg=seg, text=text, text_seg=text_seg)
    return {key: val.to(device) for key, val in packed.items()}, alone


def check_packed_equals_alone_with_gradients(attention: str, device: str, name: str = "DiT-Tiny") -> None:
    cfg = preset(name, text_dim=24)
    model = build(cfg, attention=attention).to(device)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)  # off the zero initialisation, so every path matters
    packed, alone = packed_and_alone(cfg, device)
    weights = torch.randn(packed["x"].shape, device=device)  # a loss that weighs every output differently

    out = model(packed["x"], packed["c_noise"], Inputs(packed["pos"], seg=packed["seg"], text=packed["text"],
                text_seg=packed["text_seg"]))
    (out * weights * (packed["seg"] >= 0)[..., None]).sum().backward()
    packed_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    for r, a, b, smp in alone:
        one = model(smp["x"], smp["c_noise"], Inputs(smp["pos"], text=smp["text"]))
        assert_close_fp32(out[r, a:b].detach(), one[0].detach(), work=dit_forward_work(cfg, seq_len=40, text_len=10))
        (one[0] * weights[r, a:b]).sum().backward()
    work = dit_grad_work(cfg, seq_len=40, text_len=10, tokens=80)
    for name, p in model.named_parameters():
        assert_close_fp32(packed_grads[name], p.grad, work=work, msg=name)


# Every registered architecture. ST-DiT: frames and time-lines as masks (packed) or rows (alone)
TINY = [arch.tiny for arch in ARCHS.values()]


@pytest.mark.parametrize("name", TINY)
def test_packed_rows_equal_samples_alone_with_gradients_on_cpu(name):
    check_packed_equals_alone_with_gradients("sdpa", "cpu", name)


@pytest.mark.gpu
@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("attention", ["flex", "sdpa"])
def test_packed_rows_equal_samples_alone_with_gradients_on_gpu(attention, name):
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 all through, so the float32 bounds apply
    torch.backends.cudnn.allow_tf32 = False
    check_packed_equals_alone_with_gradients(attention, "cuda", name)


@pytest.mark.slow
def test_compiled_blocks_share_one_graph_across_packings():
    """The BlockMask is an input of the compiled blocks, not baked into them: batches packed differently reuse
    the first graph (no recompilation) and agree with eager sdpa. On a CPU, compiled flex runs forward only, and
    torch 2.13's CPU flex template cannot take RoPE's query layout, so this model uses sin-cos positions."""
    import torch._dynamo

    from ditcore.models import apply_compile

    cfg = preset("DiT-Tiny", text_dim=24, pos_embed="sincos")
    compiled = DiT(cfg, attention="flex").eval()
    with torch.no_grad():
        for p in compiled.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    eager = DiT(cfg, attention="sdpa").eval()
    eager.load_state_dict(compiled.state_dict())
    apply_compile(compiled)
    x, text = torch.randn(2, 16, cfg.patch_dim), torch.randn(2, 5, 24)
    pos, text_seg = grid_positions((1, 4, 4)), torch.tensor([[0, 0, 1, 1, -1], [0, 0, 0, -1, -1]])
    torch._dynamo.reset()
    with torch.no_grad():
        for i, k in enumerate([8, 5, 11]):
            seg = torch.tensor([[0] * k + [1] * (16 - k), [0] * (16 - k) + [-1] * k])
            with torch._dynamo.config.patch(error_on_recompile=i > 0):
                out = compiled(x, torch.ones(2, 2), Inputs(pos, seg=seg, text=text, text_seg=text_seg))
            ref = eager(x, torch.ones(2, 2), Inputs(pos, seg=seg, text=text, text_seg=text_seg))
            real = (seg >= 0)[..., None]
            assert_close_fp32(out * real, ref * real, work=dit_forward_work(cfg, seq_len=16, text_len=5))


def cuda_style_kernels(monkeypatch):
    """On this CPU, the kernels a GPU gets: create_block_mask and flex_attention compiled as
    ditcore.models.attention compiles them for CUDA, with the aot_eager backend (no CPU codegen)."""
    from ditcore.models import attention

    monkeypatch.setitem(attention._KERNELS, "cpu", attention.compiled_kernels(backend="aot_eager"))


def varied_batches(cfg, count: int, g: torch.Generator):
    """`count` batches of 2 rows of 24 tokens: batch i has text length i + 1 (all distinct) and one of 20 packings
    (rows of 1 to 4 samples of random lengths, then padding)."""
    N = 24
    packings = [random_segments(2, N, samples, g) for samples in (1, 2, 3, 4) for _ in range(5)]
    for i in range(count):
        seg = packings[i % len(packings)]
        pos = torch.zeros(2, N, 3, dtype=torch.long)
        for b in range(2):
            for s in seg[b].unique():
                where = seg[b] == s
                pos[b, where, 2] = torch.arange(int(where.sum()))  # each sample a (1, 1, k) strip
        L = i + 1
        text_seg = torch.minimum(torch.arange(L).expand(2, L) * int(seg.max() + 1) // L, seg.max(-1, True).values)
        yield dict(x=torch.randn(2, N, cfg.patch_dim, generator=g), c_noise=torch.randn(2, 4, generator=g), pos=pos,
                   seg=seg, text=torch.randn(2, L, cfg.text_dim, generator=g), text_seg=text_seg)


@pytest.mark.parametrize("compiled_blocks", [False, True], ids=["eager_blocks", "compiled_blocks"])
def test_flex_compiles_a_few_graphs_for_fifty_text_lengths_and_twenty_packings(monkeypatch, compiled_blocks):
    """The text length changes with every batch (dit-sample and validation do not pad it): the compiled flex kernels
    and blocks take it as a dynamic size rather than compiling a graph per length until dynamo's recompile_limit,
    after which every call would run the unfused reference that builds the whole score matrix."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from ditcore.models import apply_compile

    cuda_style_kernels(monkeypatch)
    cfg = preset("DiT-Tiny", text_dim=8, max_grid=(1, 1, 32))
    model = DiT(cfg, attention="flex").eval()
    if compiled_blocks:
        apply_compile(model, backend="aot_eager")
    torch._dynamo.reset()
    counters.clear()
    g = torch.Generator().manual_seed(0)
    # fail_on_recompile_limit_hit: reaching the limit raises instead of quietly running uncompiled from then on
    with torch.no_grad(), torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        for batch in varied_batches(cfg, 50, g):
            model(batch.pop("x"), batch.pop("c_noise"), Inputs(**batch))
    assert not counters["graph_break"]
    # Per compiled function (the two kernels; or the mask kernel and the block): its first shapes, a one-token text
    # (dynamo specialises sizes 0 and 1) and symbolic lengths. Measured: 6 with eager blocks, 5 with compiled ones.
    assert counters["stats"]["unique_graphs"] <= 6
