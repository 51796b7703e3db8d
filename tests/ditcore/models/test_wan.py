"""Wan 2.1's video DiT (ditcore.models.wan): with diffusers' WanTransformer3DModel's weights it computes what that model
computes on text zero-padded as WanPipeline pads it, packing changes nothing, its weights convert both ways exactly,
its presets are Wan's sizes, and what the planner learns from it (FLOPs) is what its dimensions say."""

import pytest
import torch
from diffusers import WanTransformer3DModel
from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

from ditcore.errors import ConfigError
from ditcore.inputs import Inputs
from ditcore.interop.diffusers_wan import state_from_diffusers, state_to_diffusers, wan_config_from_diffusers
from ditcore.interop.original import ConversionError
from ditcore.layout import grid_positions
from ditcore.models import Wan, WanConfig, build, preset
from ditcore.models.moe import MoEConfig
from ditcore.testing import assert_close_fp32, dit_forward_work

from .test_dit import randomize

CFG = preset("Wan-Tiny", text_dim=32)  # 2 blocks 64 wide, 2 heads, FFN 128, text_len 16, 4 channels


def wan_work(cfg: WanConfig, seq_len: int, text_len: int) -> int:
    """ditcore.testing's float32 work of a DiT forward, with Wan's differences: the time projection (D) on the
    conditioning's path, and QK norms that reduce over all heads' D features rather than a head's hd, in both
    attentions of every block."""
    D = cfg.hidden_size
    return dit_forward_work(cfg, seq_len, text_len) + D + 2 * cfg.depth * (D - cfg.head_dim)


def diffusers_model(config: dict) -> WanTransformer3DModel:
    return WanTransformer3DModel(**{k: v for k, v in config.items() if not k.startswith("_")})


def pair(cfg: WanConfig = CFG, seed: int = 0) -> tuple[WanTransformer3DModel, Wan]:
    """diffusers' model with random weights (every one of them moved off its initialisation), and ditcore's holding
    them, converted from its state dict and config."""
    config, _ = state_to_diffusers(build(cfg).state_dict(), cfg)
    theirs = diffusers_model(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    ours = Wan(wan_config_from_diffusers(config).replace(text_len=cfg.text_len), attention="sdpa").eval()
    ours.load_state_dict(state_from_diffusers(theirs.state_dict(), ours.cfg))  # strict: every tensor has its place
    return theirs, ours


def zero_padded(text: torch.Tensor, lengths: list[int], text_len: int) -> torch.Tensor:
    """Each sample's first n text states, then zeros to text_len: what WanPipeline gives the transformer."""
    padded = torch.zeros(len(lengths), text_len, text.shape[-1])
    for b, n in enumerate(lengths):
        padded[b, :n] = text[b, :n]
    return padded


# ---------------------------------------------------------------- diffusers


@pytest.mark.parametrize("frames", [1, 3], ids=["image", "clip"])
def test_equals_diffusers_on_zero_padded_text(frames):
    """A batch of two samples with captions of 5 and 2 tokens (the second's padding holding garbage, which ditcore
    must not read) at timesteps 130 and 870, whole rows: ditcore's output is diffusers' within float32 error."""
    theirs, ours = pair()
    g = torch.Generator().manual_seed(frames)
    x = torch.randn(2, CFG.in_channels, frames, 8, 6, generator=g)  # frames x 4 x 3 tokens
    t = torch.tensor([130.0, 870.0])
    lengths = [5, 2]
    text = torch.randn(2, 5, CFG.text_dim, generator=g)
    real = torch.arange(5) < torch.tensor(lengths)[:, None]
    garbage = torch.where(real[..., None], text, 1e3)
    with torch.no_grad():
        expected = theirs(x, t, zero_padded(text, lengths, CFG.text_len)).sample
        actual = ours.forward_latents(x, t, text=garbage, text_mask=real)
        unpadded = theirs(x[:1], t[:1], text[:1]).sample  # the same caption without its zero states
    assert actual.shape == expected.shape == x.shape
    assert_close_fp32(actual, expected, work=wan_work(CFG, frames * 12, CFG.text_len))
    # not vacuous: the zero states weigh (11 of 16 keys for the first sample), and the samples differ
    assert (unpadded[0] - expected[0]).abs().max() > 1e-2 * expected.abs().max()
    assert (expected[0] - expected[1]).abs().max() > 0.1 * expected.abs().max()


def test_a_sample_without_text_sees_text_len_zero_states_and_a_full_caption_none():
    """As WanPipeline gives them: a sample whose text classifier-free guidance dropped (text_seg all −1) is diffusers
    given text_len zero states; a caption of exactly text_len tokens is given no zero state, and one longer than
    text_len (which Wan's encoder would have truncated) all its tokens, none either. A batch without any text token
    (L = 0) is all zero states too."""
    theirs, ours = pair()
    g = torch.Generator().manual_seed(5)
    T = CFG.text_len
    x = torch.randn(3, CFG.in_channels, 1, 8, 8, generator=g)
    t = torch.tensor([999.0, 500.0, 1.0])
    text = torch.randn(3, T + 3, CFG.text_dim, generator=g)
    lengths = [0, T, T + 3]
    real = torch.arange(T + 3) < torch.tensor(lengths)[:, None]
    with torch.no_grad():
        actual = ours.forward_latents(x, t, text=text, text_mask=real)
        expected = torch.cat([theirs(x[:1], t[:1], torch.zeros(1, T, CFG.text_dim)).sample,
                              theirs(x[1:2], t[1:2], text[1:2, :T]).sample,
                              theirs(x[2:], t[2:], text[2:]).sample])
        no_text = ours.forward_latents(x[:1], t[:1], text=torch.zeros(1, 0, CFG.text_dim))
    work = wan_work(CFG, 16, T + 3)
    assert_close_fp32(actual, expected, work=work)
    assert_close_fp32(no_text, expected[:1], work=work)


def test_rope_is_diffusers_wan_rotary_pos_embed():
    """The (cos, sin) of every position of a 3 x 5 x 4 grid are WanRotaryPosEmbed's tables (head_dim 32: 12, 10 and
    10 features to time, height and width), each frequency once rather than repeated for the pair it rotates."""
    grid, hd = (3, 5, 4), CFG.head_dim
    cos, sin = Wan(CFG).rope(grid_positions(grid), torch.float32)  # (1, 1, N, hd/2)
    their_cos, their_sin = WanRotaryPosEmbed(hd, (1, 2, 2), 1024)(torch.zeros(1, 1, grid[0], 2 * grid[1],
                                                                                2 * grid[2]))  # (1, N, 1, hd)
    torch.testing.assert_close(cos[0, 0], their_cos[0, :, 0, 0::2], rtol=0, atol=0)
    torch.testing.assert_close(sin[0, 0], their_sin[0, :, 0, 1::2], rtol=0, atol=0)


# ---------------------------------------------------------------- packing


def _sample(cfg, grid, text_len, g):
    return dict(x=torch.randn(1, grid[0] * grid[1] * grid[2], cfg.patch_dim, generator=g), pos=grid_positions(grid),
                c_noise=torch.rand(1, 1, generator=g) * 1000, text=torch.randn(1, text_len, cfg.text_dim, generator=g))


@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_packed_rows_equal_samples_run_alone(attention):
    """Row 0 packs an image with a 3-token caption, a 2-frame clip without text (CFG-dropped) and an image whose
    caption is longer than text_len (17 tokens: no zero state); row 1 a clip with 5 tokens; padding to 40 tokens. Each
    packed sample is what it is alone: its zero states count as its own caption's length says, not the row's. (flex
    on a CPU runs forward only: the BlockMask and the score term say what the float mask says.)"""
    cfg = CFG
    model = randomize(Wan(cfg, attention=attention)).eval()
    g = torch.Generator().manual_seed(2)
    rows = [[((1, 4, 4), 3), ((2, 3, 2), 0), ((1, 2, 2), cfg.text_len + 1)], [((3, 2, 3), 5)]]
    samples = [[_sample(cfg, grid, L, g) for grid, L in row] for row in rows]
    N, Lmax, S = 40, 20, 3
    x, pos = torch.zeros(2, N, cfg.patch_dim), torch.zeros(2, N, 3, dtype=torch.long)
    seg, c_noise = torch.full((2, N), -1), torch.zeros(2, S)
    text, text_seg = torch.full((2, Lmax, cfg.text_dim), 1e3), torch.full((2, Lmax), -1)  # garbage padding
    spans = []
    for r, row in enumerate(samples):
        n = t = 0
        for s, smp in enumerate(row):
            k, L = smp["x"].shape[1], smp["text"].shape[1]
            x[r, n:n + k], pos[r, n:n + k], seg[r, n:n + k] = smp["x"][0], smp["pos"], s
            text[r, t:t + L], text_seg[r, t:t + L], c_noise[r, s] = smp["text"][0], s, smp["c_noise"]
            spans.append((r, n, n + k, smp))
            n, t = n + k, t + L
    with torch.no_grad():
        packed = model(x, c_noise, Inputs(pos, seg=seg, text=text, text_seg=text_seg))
        for r, a, b, smp in spans:
            alone = model(smp["x"], smp["c_noise"], Inputs(smp["pos"], text=smp["text"]))
            assert_close_fp32(packed[r, a:b], alone[0], work=wan_work(cfg, N, Lmax + 1))
    assert (packed[0, :16] - x[0, :16]).abs().mean() > 0.1  # not vacuous: far from identity


# ---------------------------------------------------------------- conversion


def test_conversion_both_ways_is_exact():
    """ditcore → diffusers (loaded strictly into a WanTransformer3DModel) → ditcore gives every tensor back bitwise,
    and the config back (the grid as diffusers' RoPE tables hold it, the text length its pipeline's default)."""
    model = randomize(Wan(CFG))
    config, state = state_to_diffusers(model.state_dict(), CFG)
    theirs = diffusers_model(config)
    theirs.load_state_dict(state)  # strict: each tensor has its place and its shape
    back_cfg = wan_config_from_diffusers(config)
    assert back_cfg == CFG.replace(max_grid=(256, 256, 256), text_len=512)  # Wan-Tiny's max_grid (64, 256, 256)
    back = state_from_diffusers(theirs.state_dict(), back_cfg)
    ours = model.state_dict()
    assert back.keys() == ours.keys()
    assert all(torch.equal(back[k], ours[k]) for k in ours)


# Wan 2.1 T2V's transformer/config.json on the hub (Wan-AI/Wan2.1-T2V-{1.3B,14B}-Diffusers)
HUB = {name: {"_class_name": "WanTransformer3DModel", "added_kv_proj_dim": None, "attention_head_dim": 128,
              "cross_attn_norm": True, "eps": 1e-06, "ffn_dim": ffn, "freq_dim": 256, "image_dim": None,
              "in_channels": 16, "num_attention_heads": heads, "num_layers": layers, "out_channels": 16,
              "patch_size": [1, 2, 2], "qk_norm": "rms_norm_across_heads", "rope_max_seq_len": 1024,
              "text_dim": 4096}
       for name, (heads, layers, ffn) in {"Wan-1.3B": (12, 30, 8960), "Wan-14B": (40, 40, 13824)}.items()}


@pytest.mark.parametrize(("name", "published"), [("Wan-1.3B", 1.3e9), ("Wan-14B", 14e9)])
def test_presets_are_the_hubs_configs_with_diffusers_parameter_counts(name, published):
    cfg = preset(name)
    assert wan_config_from_diffusers(HUB[name]) == cfg
    with torch.device("meta"):  # shapes only: 14 billion parameters, no memory
        ours, theirs = Wan(cfg), diffusers_model(HUB[name])
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in theirs.parameters())
    print(f"{name}: {count / 1e9:.3f} B parameters")
    assert count == pytest.approx(published, rel=0.1)


@pytest.mark.parametrize(("change", "message"), [
    ({"image_dim": 1280}, r"image_dim=1280 has no ditcore counterpart: expected null: image-to-video"),
    ({"added_kv_proj_dim": 5120}, r"added_kv_proj_dim=5120 .*image-to-video's extra key/value projections"),
    ({"pos_embed_seq_len": 514}, r"pos_embed_seq_len=514 .*first-last-frame"),
    ({"expand_timesteps": True}, r"expand_timesteps=True .*Wan 2\.2's per-token timesteps"),
    ({"patch_size": [1, 4, 4]}, r"patch_size=\[1, 4, 4\] .*expected \[1, 2, 2\]"),
    ({"out_channels": 48}, r"out_channels=48 .*expected in_channels=16"),
    ({"cross_attn_norm": False}, r"cross_attn_norm=False .*LayerNorm before the cross-attention"),
    ({"_class_name": "WanVACETransformer3DModel"}, r"'WanVACETransformer3DModel', not a WanTransformer3DModel"),
])
def test_a_diffusers_config_ditcore_does_not_compute_is_refused_naming_it(change, message):
    with pytest.raises(ConversionError, match=message):
        wan_config_from_diffusers(HUB["Wan-1.3B"] | change)


@pytest.mark.parametrize(("cfg", "message"), [
    (CFG.replace(num_classes=5), "num_classes=5: it has no class embedder"),
    (CFG.replace(learn_sigma=True), "learn_sigma"),
    (CFG.replace(moe=MoEConfig(experts=2, top_k=1, every=2)), "moe: its feed-forward is dense"),
    (CFG.replace(text_dim=0), "text_dim=0: it always cross-attends"),
    (CFG.replace(patch_size=4), "patch 1 x 4 x 4"),
    (preset("DiT-Tiny"), r"a DiTConfig: WanTransformer3DModel holds ditcore's Wan \(model.arch=wan\) only"),
])
def test_an_export_diffusers_cannot_hold_is_refused_naming_it(cfg, message):
    with torch.device("meta"):
        state = build(cfg).state_dict()
    with pytest.raises(ConversionError, match=f"cannot export to diffusers' WanTransformer3DModel: {message}"):
        state_to_diffusers(state, cfg)


def test_a_tensor_without_a_place_is_refused_naming_it():
    _, state = state_to_diffusers(Wan(CFG).state_dict(), CFG)
    with pytest.raises(ConversionError, match=r"tensor 'blocks\.0\.attn1\.norm_added_k\.weight' has no place"):
        state_from_diffusers(state | {"blocks.0.attn1.norm_added_k.weight": torch.ones(64)}, CFG)


# ---------------------------------------------------------------- what the planner learns from it


def test_wan_14b_training_flops_per_token_are_its_dimensions():
    """ditcore.flops reads the weights off the model (its probe); written out from Wan-14B's dimensions for a sample
    of 37,440 tokens attending Wan's 512 text tokens: 6 FLOPs a weight applied to every token (the patch embedding
    and the output linear, 64 x D each; per block q, k, v, the output projection, the cross-attention's query and
    output projections, 6 D², and the FFN's 2 D·F), 12 L·D a key for attention's scores and weighted values over the
    sample's tokens and its text, and the text's weights (the text embedder, 4096·D + D², and each block's key and
    value projections, 2 D²) applied to its 512 tokens, spread over the sample's."""
    from ditcore.flops import training_flops_per_token

    D, F, L, S, T = 5120, 13824, 40, 37_440, 512
    per_token = 2 * 64 * D + L * (6 * D * D + 2 * D * F)
    per_text_token = 4096 * D + D * D + L * 2 * D * D
    by_hand = 6 * per_token + 12 * L * D * S + 12 * L * D * T + 6 * per_text_token * T / S
    assert training_flops_per_token(preset("Wan-14B"), S, T) == pytest.approx(by_hand, rel=0.01)


def test_memory_plan_and_traffic_of_wan_14b_split_it_as_its_plan_says():
    """The memory plan and the traffic model run Wan-14B (on fake tensors, at 37,440 tokens a row) under TP=2 + SP and
    FSDP over 4: its 14.3 B parameters counted off the model, each rank holding the shares its plan gives it (QK
    norms' scales split by heads, the time projection whole), and the TP traffic includes the norms' sums."""
    from ditcore.job import Layout
    from ditcore.memory import plan_from
    from ditcore.models.wan import WAN_PLAN
    from ditcore.traffic import traffic

    cfg = preset("Wan-14B")
    with torch.device("meta"):
        model = Wan(cfg)
    layout = Layout(world_size=8, tp=2, sequence_parallel=True, fsdp=True, seq_length=37_440, text_len=512,
                    precision="bf16", activation_checkpointing="block")
    plan = plan_from(cfg, layout)
    assert plan.params == sum(p.numel() for p in model.parameters()) == 14_288_491_584
    assert plan.params_local == sum(p.numel() // (1 if WAN_PLAN.partition_dim(n) is None else 2)
                                    for n, p in model.named_parameters())
    assert (WAN_PLAN.partition_dim("blocks.0.attn.q_norm.weight"), WAN_PLAN.partition_dim("time_proj.1.weight")) == \
        (0, None)
    without_norms = traffic(cfg.replace(qk_norm=False), layout).bytes("tp", "micro_batch")
    # per block the float32 sums of 3 norms over the row's 37,440 tokens (gathered under SP), of the text's 512 keys'
    # and of the zero state's, all-reduced over 2 ranks (each sends 2(n - 1)/n of the buffer): in forward, in the
    # forward that block checkpointing reruns, and their gradients in backward
    forward = cfg.depth * (3 * 37_440 + 512 + 1) * 4
    assert traffic(cfg, layout).bytes("tp", "micro_batch") - without_norms == 3 * forward


@pytest.mark.parametrize("packed", [False, True], ids=["whole_rows", "packed"])
def test_a_training_step_reads_no_value_back(monkeypatch, packed):
    """HostReads treats the CPU as the device (ditcore.testing): the forward and backward of Wan's EDM loss, the zero
    states' counts and masks included, read no value back (but the check of CPU positions, by design)."""
    from ditcore.diffusion import EDMLoss, EDMPrecond
    from ditcore.layout import grid_rows
    from ditcore.models import dit
    from ditcore.testing import HostReads

    model = randomize(Wan(CFG, attention="sdpa"))
    if packed:
        grids = [[(1, 2, 4), (2, 2, 3)], [(1, 3, 3)]]
        seg, pos = grid_rows(grids, 24)
        text_seg = torch.tensor([[0, 0, 1, -1, -1], [0, 0, 0, 0, -1]])
    else:
        grids, seg, pos, text_seg = [[(2, 3, 4)]] * 2, None, grid_positions((2, 3, 4)), None
    x, noise = torch.randn(2, 24, CFG.patch_dim), torch.randn(2, 24, CFG.patch_dim)
    inputs = Inputs(pos, seg=seg, text=torch.randn(2, 5, CFG.text_dim), text_seg=text_seg, grids=grids)
    watch = HostReads("cpu")
    monkeypatch.setattr(dit, "check_positions", watch.unwatched(dit.check_positions))
    with watch:
        loss = EDMLoss()(EDMPrecond(model), x, inputs, sigma=torch.rand(2, 2 if packed else 1) + 0.5, noise=noise)
        loss.backward()
    assert loss.isfinite() and all(p.grad is not None for p in model.parameters())


# ---------------------------------------------------------------- config and initialisation


@pytest.mark.parametrize(("changes", "match"), [
    ({"text_len": 0}, r"text_len=0 is invalid: expected an integer >= 1: the length Wan pads every caption to"),
    ({"pos_embed": "sincos"}, r"pos_embed='sincos' is invalid: expected 'rope'"),
    ({"block_embedders": True}, r"block_embedders=True is invalid: expected false: Wan's blocks read the model's"),
    ({"ffn_dim": -1}, r"ffn_dim=-1 is invalid"),
])
def test_invalid_config_names_field_value_and_range(changes, match):
    with pytest.raises(ConfigError, match=match):
        CFG.replace(**changes)


def test_initialisation_follows_wan():
    """WanModel.init_weights: xavier-uniform linears with zero biases, N(0, 0.02) text and time embedder weights, a zero
    output linear (the model's output is zero at first), modulation tables N(0, 1/D), norms' scales one."""
    torch.manual_seed(0)
    model = Wan(CFG.replace(hidden_size=128))
    D = 128
    params = dict(model.named_parameters())
    for name in ("text_embedder.0.weight", "t_embedder.mlp.2.weight"):
        assert abs(params[name].std().item() / 0.02 - 1) < 0.1, name
    tables = torch.cat([params[f"blocks.{i}.scale_shift.weight"] for i in range(2)] +
                       [params["final.scale_shift.weight"]])
    assert abs(tables.std().item() * D**0.5 - 1) < 0.1
    for name in ("blocks.0.attn.qkv.weight", "blocks.1.cross.proj.weight", "time_proj.1.weight",
                 "blocks.0.mlp.2.weight"):
        bound = (6 / sum(params[name].shape)) ** 0.5  # xavier-uniform: U(-b, b)
        assert 0.95 * bound < params[name].abs().max() <= bound, name
    assert not params["final.linear.weight"].any() and not params["blocks.0.attn.qkv.bias"].any()
    assert torch.equal(params["blocks.0.attn.q_norm.weight"], torch.ones(2, 64))
    assert torch.equal(params["blocks.0.norm_cross.weight"], torch.ones(D))
