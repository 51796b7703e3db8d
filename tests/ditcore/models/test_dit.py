import resource

import pytest
import torch
from torch import nn

from ditcore.errors import ConfigError
from ditcore.inputs import Inputs
from ditcore.layout import grid_positions
from ditcore.models import ARCHS, PRESETS, DiT, DiTConfig, MoEConfig, build, preset
from ditcore.models.dit import DiTBlock
from ditcore.models.layers import apply_rope, rope_angles
from ditcore.testing import assert_close_fp32, dit_forward_work, dit_grad_work

TINY = {name: arch.tiny for name, arch in ARCHS.items()}  # the tests below take `arch`: every registered one
# Wan starts as Wan does, its blocks' modulation tables random: not the identity (tests/ditcore/models/test_wan.py)
ADALN_ZERO = [arch for arch in TINY if arch != "wan"]


def tiny(arch: str = "dit", **changes) -> DiTConfig:
    return preset(TINY[arch], **changes)


def accepting(**changes) -> list[str]:
    """The registered architectures whose tiny preset takes these changes (Wan refuses block_embedders)."""
    def accepts(arch: str) -> bool:
        try:
            tiny(arch, **changes)
        except ConfigError:
            return False
        return True

    return [arch for arch in TINY if accepts(arch)]


def randomize(model: nn.Module, std: float = 0.2) -> nn.Module:
    """Move every weight off its (partly zero) initialisation so the tests exercise every path."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * std)
    return model


# ---------------------------------------------------------------- adaLN-Zero


@pytest.mark.parametrize("arch", ADALN_ZERO)
@pytest.mark.parametrize("text_dim", [0, 24])
def test_each_block_is_identity_at_init(arch, text_dim):
    cfg = tiny(arch, text_dim=text_dim)
    model = build(cfg)
    N, B, D = 10, 2, cfg.hidden_size
    x, c = torch.randn(N, B, D), torch.randn(B, 1, D)  # blocks work sequence-first
    text = torch.randn(B, 5, text_dim) if text_dim else None  # the model's own inputs of 2 frames of 5 tokens:
    a = model.attention_inputs("sdpa", B, grid_positions((2, 1, 5)), None, text, None, slice(0, N), x.dtype)
    for block in model.blocks:
        assert isinstance(block, DiTBlock)  # every architecture's blocks run DiTBlock's forward
        assert torch.equal(block(x, c, None, a), x)


@pytest.mark.parametrize("arch", TINY)
def test_model_output_is_zero_at_init_and_gradients_flow(arch):
    cfg = tiny(arch, num_classes=10)
    model = build(cfg)
    x = torch.randn(2, cfg.in_channels, 1, 8, 8)
    out = model.forward_latents(x, torch.randn(2), class_labels=torch.tensor([3, 10]))
    assert torch.equal(out, torch.zeros_like(out))
    out.square().sum().backward()  # zero output, but the output layer still gets a gradient
    loss = model.forward_latents(x, torch.randn(2), class_labels=torch.tensor([3, 10])).sum()
    loss.backward()
    assert model.final.linear.weight.grad.abs().sum() > 0


# ---------------------------------------------------------------- packing


def _sample(cfg, grid, text_len, g):
    return dict(
        x=torch.randn(1, grid[0] * grid[1] * grid[2], cfg.patch_dim, generator=g),
        pos=grid_positions(grid),
        c_noise=torch.randn(1, 1, generator=g),
        fps=torch.rand(1, 1, generator=g) * 30,
        label=torch.randint(0, cfg.num_classes, (1, 1), generator=g),
        text=torch.randn(1, text_len, cfg.text_dim, generator=g),
    )


# dropless mixture-of-experts blocks route each token alone (ditcore.models.moe): packing changes nothing either
MOE = MoEConfig(experts=4, top_k=2, every=2, shared_experts=1)


@pytest.mark.parametrize(("arch", "pos_embed", "attention", "moe"),
                         [("dit", "rope", "sdpa", None), ("dit", "sincos", "sdpa", None), ("dit", "rope", "flex", None),
                          ("moviegen", "rope", "sdpa", None), ("stdit", "rope", "sdpa", None),
                          ("stdit", "sincos", "sdpa", None), ("stdit", "rope", "flex", None),
                          ("dit", "rope", "sdpa", MOE), ("moviegen", "rope", "sdpa", MOE),
                          ("stdit", "rope", "sdpa", MOE)])
def test_packed_rows_equal_samples_run_alone(arch, pos_embed, attention, moe):
    """flex on a CPU runs forward only (FlexAttention's reference path): the BlockMask says the same as the dense
    mask. tests/ditcore/models/test_attention.py checks it on a GPU with gradients."""
    cfg = tiny(arch, text_dim=24, num_classes=5, fps_cond=True, pos_embed=pos_embed, patch_size_t=1, in_channels=4,
               moe=moe)
    model = randomize(build(cfg, attention=attention)).eval()
    g = torch.Generator().manual_seed(2)
    # Row 0: an image, a 2-frame clip and an image with no text; row 1: one clip. Padding to N = 40 tokens.
    rows = [[((1, 4, 4), 3), ((2, 3, 2), 5), ((1, 2, 2), 0)], [((3, 2, 3), 4)]]
    samples = [[_sample(cfg, grid, L, g) for grid, L in row] for row in rows]

    N, Lmax, S = 40, 10, 3
    x = torch.zeros(2, N, cfg.patch_dim)
    pos = torch.zeros(2, N, 3, dtype=torch.long)
    seg = torch.full((2, N), -1)
    text = torch.zeros(2, Lmax, cfg.text_dim)
    text_seg = torch.full((2, Lmax), -1)
    c_noise, fps, labels = torch.zeros(2, S), torch.zeros(2, S), torch.zeros(2, S, dtype=torch.long)
    spans = []
    for r, row in enumerate(samples):
        n = t = 0
        for s, smp in enumerate(row):
            k, L = smp["x"].shape[1], smp["text"].shape[1]
            x[r, n:n + k], pos[r, n:n + k], seg[r, n:n + k] = smp["x"][0], smp["pos"], s
            text[r, t:t + L], text_seg[r, t:t + L] = smp["text"][0], s
            c_noise[r, s], fps[r, s], labels[r, s] = smp["c_noise"], smp["fps"], smp["label"]
            spans.append((r, n, n + k, smp))
            n, t = n + k, t + L

    with torch.no_grad():
        packed = model(x, c_noise, Inputs(pos, seg=seg, class_labels=labels, fps=fps, text=text, text_seg=text_seg))
        for r, a, b, smp in spans:
            alone = model(smp["x"], smp["c_noise"], Inputs(smp["pos"], class_labels=smp["label"], fps=smp["fps"],
                          text=smp["text"]))
            # the packed row reduces over all N keys (masked ones add exact zeros), the sample alone over its own
            assert_close_fp32(packed[r, a:b], alone[0], work=dit_forward_work(cfg, seq_len=N, text_len=Lmax))
    # The comparison is not vacuous: samples differ from each other and the model is far from identity.
    assert (packed[0, :16] - x[0, :16]).abs().mean() > 0.1


@pytest.mark.parametrize("arch", accepting(block_embedders=True))
def test_blocks_with_their_own_embedders_condition_on_them(arch):
    """block_embedders: block 0 and the final layer read the model's embedders, every later block its own. With
    copies of the model's in every block it is the shared model exactly (the same operations); a change to one
    block's embedders changes the output, and every block's embedders get a gradient."""
    cfg = tiny(arch, text_dim=24, num_classes=5, fps_cond=True, in_channels=4)
    shared = randomize(build(cfg)).eval()
    own = build(cfg.replace(block_embedders=True)).eval()
    state = shared.state_dict()
    for i in range(1, cfg.depth):
        state |= {f"blocks.{i}.{k}": v for k, v in shared.state_dict().items()
                  if k.split(".")[0] in ("t_embedder", "y_embedder", "fps_embedder")}
    own.load_state_dict(state)  # strict: exactly the shared model's tensors and each later block's copies
    g = torch.Generator().manual_seed(3)
    x, c_noise = torch.randn(2, 16, cfg.patch_dim, generator=g), torch.randn(2, 1, generator=g)
    cond = dict(class_labels=torch.tensor([[1], [5]]), fps=torch.tensor([[8.0], [24.0]]),
                text=torch.randn(2, 3, 24, generator=g))
    pos = grid_positions((1, 4, 4))
    with torch.no_grad():
        assert torch.equal(own(x, c_noise, Inputs(pos, **cond)), shared(x, c_noise, Inputs(pos, **cond)))
        own.blocks[cfg.depth - 1].y_embedder.weight[1].add_(1.0)  # the last block's row for class 1 only
        moved = own(x, c_noise, Inputs(pos, **cond)) - shared(x, c_noise, Inputs(pos, **cond))
    assert moved[0].abs().max() > 1e-3 and torch.equal(moved[1], torch.zeros_like(moved[1]))  # class 5 unmoved
    own.train()
    own(x, c_noise, Inputs(pos, **cond)).square().sum().backward()
    for i in range(1, cfg.depth):
        for name in ("t_embedder.mlp.0.weight", "y_embedder.weight", "fps_embedder.mlp.2.weight"):
            assert own.blocks[i].get_parameter(name).grad.abs().sum() > 0, (i, name)


@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_text_padding_is_not_attended(attention):
    cfg = tiny(text_dim=24)
    model = randomize(DiT(cfg, attention=attention)).eval()
    x, pos = torch.randn(1, 16, cfg.patch_dim), grid_positions((1, 4, 4))
    text = torch.randn(1, 6, 24)
    mask = torch.tensor([[True, True, True, False, False, False]])
    garbage = text.clone()
    garbage[:, 3:] = 1e3
    with torch.no_grad():
        a = model(x, torch.zeros(1, 1), Inputs(pos, text=text, text_seg=torch.where(mask, 0, -1)))
        b = model(x, torch.zeros(1, 1), Inputs(pos, text=garbage, text_seg=torch.where(mask, 0, -1)))
        c = model(x, torch.zeros(1, 1), Inputs(pos, text=text[:, :3]))
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert_close_fp32(a, c, work=dit_forward_work(cfg, seq_len=16, text_len=6))


@pytest.mark.parametrize("arch", TINY)
def test_a_batch_without_text_gives_every_weight_a_gradient(arch):
    """A batch whose samples have no text token (captions encoded empty; L = 0) must still give every weight of the
    text path a gradient, zero: DDP failed the next step with "parameters that were not used". Its output is that of
    text the mask hides entirely, exactly."""
    cfg = tiny(arch, text_dim=24)
    model = randomize(DiT(cfg) if arch == "dit" else build(cfg))
    x, pos = torch.randn(1, 16, cfg.patch_dim), grid_positions((1, 4, 4))
    no_text = Inputs(pos, text=torch.zeros(1, 0, 24), text_seg=torch.zeros(1, 0, dtype=torch.long))
    out = model(x, torch.zeros(1, 1), no_text)
    out.square().sum().backward()
    no_grad = [name for name, p in model.named_parameters() if p.grad is None]
    assert not no_grad, no_grad
    if arch != "wan":  # without text Wan attends its zero states (ditcore.models.wan), the text embedder's output
        assert all(not p.grad.any() for name, p in model.named_parameters() if name.startswith("text_embedder"))
    with torch.no_grad():
        hidden = model(x, torch.zeros(1, 1), Inputs(pos, text=torch.randn(1, 3, 24), text_seg=torch.full((1, 3), -1)))
    torch.testing.assert_close(out.detach(), hidden, rtol=0, atol=0)


# ---------------------------------------------------------------- positions


def test_rope_scores_depend_only_on_relative_position():
    hd = 24
    q, k = torch.randn(1, 1, 5, hd), torch.randn(1, 1, 5, hd)
    pos = torch.randint(0, 20, (5, 3))
    shift = torch.tensor([3, 7, 11])

    def scores(p):
        angles = rope_angles(p, hd, 10000.0)
        rope = angles.cos(), angles.sin()
        return apply_rope(q, rope) @ apply_rope(k, rope).transpose(-1, -2)

    # An angle a = position · inv_freq ≤ position is rounded to within a·u, so a rotated pair is off by up to
    # (a + 4)·u of its length (sin, cos and the complex multiply round too); q and k together, with ε = 2u,
    # add max(a) + 4 to the q·k dot product's hd.
    assert_close_fp32(scores(pos), scores(pos + shift), work=hd + int((pos + shift).max()) + 4)
    assert not torch.allclose(scores(pos), scores(pos * 2), atol=1e-2)


@pytest.mark.parametrize("pos_embed", ["rope", "sincos"])
def test_position_out_of_range_is_a_clear_error(pos_embed):
    cfg = tiny(max_grid=(4, 8, 8), pos_embed=pos_embed)
    model = DiT(cfg)
    x = torch.randn(1, cfg.in_channels, 1, 16, 8)  # height 16 → 8 patch rows: fine
    model.forward_latents(x, torch.zeros(1))
    with pytest.raises(ValueError, match=r"position H=8 is outside the model's range 0\.\.7"):
        model.forward_latents(torch.randn(1, cfg.in_channels, 1, 18, 8), torch.zeros(1))


# ---------------------------------------------------------------- initialisation


def dit_init_kind(name: str, shape: torch.Size) -> str:
    """What DiT's initialisation gives a parameter, written out from the paper's code (facebookresearch/DiT)."""
    module, _, kind = name.rpartition(".")
    parts = module.split(".")
    if kind == "bias":
        return "zero"
    block_zero = parts[0] == "blocks" and parts[2:] in (["adaLN", "1"], ["cross", "proj"])
    if module in ("final.linear", "final.adaLN.1") or block_zero:
        return "zero"  # adaLN-Zero: every block starts as the identity, the model's output at zero
    own = module.split(".", 2)[2] if parts[0] == "blocks" and len(parts) > 2 else None  # block_embedders: a block's
    if {module, own} & {"y_embedder", "t_embedder.mlp.0", "t_embedder.mlp.2", "fps_embedder.mlp.0",
                        "fps_embedder.mlp.2"}:
        return "normal"
    return "xavier" if len(shape) == 2 else "one"


@pytest.mark.parametrize("block_embedders", [False, True])
def test_initialisation_follows_dit(block_embedders):
    torch.manual_seed(0)
    model = DiT(tiny(text_dim=24, num_classes=5, fps_cond=True, block_embedders=block_embedders))
    kinds = {}
    for name, p in model.named_parameters():
        kind = kinds[name] = dit_init_kind(name, p.shape)
        if kind == "zero":
            assert torch.equal(p, torch.zeros_like(p)), name
        elif kind == "one":
            assert torch.equal(p, torch.ones_like(p)), name
        elif kind == "normal":  # N(0, 0.02); >= 384 values: the sample std is within 15% (4 sigma)
            assert abs(p.std().item() / 0.02 - 1) < 0.15 and abs(p.mean().item()) < 0.005, name
        else:  # xavier-uniform U(-b, b), b = sqrt(6 / (fan_in + fan_out)) from the full (out, in) shape
            bound = (6 / (p.shape[0] + p.shape[1])) ** 0.5
            assert p.abs().max() <= bound and p.abs().max() > 0.95 * bound, name  # >= 1024 values reach the edge
            assert abs(p.std().item() / (bound / 3**0.5) - 1) < 0.1, name
    counts = {k: list(kinds.values()).count(k) for k in ("zero", "one", "normal", "xavier")}
    # not vacuous: the model's 5 embedder weights, and block 1's own 5 (DiT-Tiny has 2 blocks)
    assert counts["normal"] == (10 if block_embedders else 5) and counts["xavier"] >= 15 and counts["one"] >= 10, \
        counts


def test_the_global_seed_decides_the_weights():
    cfg = tiny(text_dim=24, num_classes=5)

    def build(seed):
        torch.manual_seed(seed)
        return DiT(cfg).state_dict()

    a, b, c = build(0), build(0), build(1)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["blocks.0.attn.qkv.weight"], c["blocks.0.attn.qkv.weight"])
    assert not torch.equal(a["y_embedder.weight"], c["y_embedder.weight"])


def test_a_parameters_initial_value_depends_only_on_seed_and_name():
    """Not on which other parameters exist or in what order they are made: a rank can compute any one alone."""
    plain, full = DiT(tiny()), DiT(tiny(text_dim=24, num_classes=5, fps_cond=True))
    plain.init_weights(seed=7)
    full.init_weights(seed=7)
    shared = plain.state_dict().keys() & full.state_dict().keys()
    assert len(shared) > 20 and all(torch.equal(plain.state_dict()[k], full.state_dict()[k]) for k in shared)
    alone = full.initial_value("blocks.1.mlp.0.weight", full.blocks[1].mlp[0].weight.shape, 7, torch.device("cpu"))
    assert torch.equal(alone, full.blocks[1].mlp[0].weight)
    full.init_weights(seed=8)
    assert not torch.equal(alone, full.blocks[1].mlp[0].weight)


def test_a_parameter_without_a_rule_is_an_error():
    model = DiT(tiny())
    model.blocks[0].gain = nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match=r"no rule for parameter blocks\.0\.gain \(3,\)"):
        model.init_weights()


# ---------------------------------------------------------------- config and presets


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        (dict(hidden_size=100, num_heads=6), r"hidden_size=100 is invalid: expected a multiple of num_heads=6"),
        (dict(depth=0), r"depth=0 is invalid: expected an integer >= 1"),
        (dict(pos_embed="learned"), r"pos_embed='learned' is invalid: expected 'rope', 'sincos' or 'sincos_2d'"),
        (dict(hidden_size=8, num_heads=2), r"head_dim=4"),
    ],
)
def test_invalid_config_names_field_value_and_range(changes, match):
    with pytest.raises(ConfigError, match=match):
        tiny(**changes)


def test_unknown_preset_lists_the_choices():
    with pytest.raises(ConfigError, match=r"preset='DiT-XXL/2' is invalid: expected one of DiT-S/2, .*DiT-7B"):
        preset("DiT-XXL/2")


@pytest.mark.parametrize(("name", "paper_millions"),
                         [("DiT-S/2", 33), ("DiT-B/2", 130), ("DiT-L/2", 458), ("DiT-XL/2", 675)])
def test_class_conditional_parameter_counts_match_the_paper(name, paper_millions):
    with torch.device("meta"):
        model = DiT(preset(name, num_classes=1000, in_channels=4))
    n = sum(p.numel() for p in model.parameters())
    assert abs(n / 1e6 - paper_millions) / paper_millions < 0.005, n


def test_presets_have_the_documented_shapes():
    assert {n: (c.hidden_size, c.depth, c.num_heads, c.patch_size) for n, c in PRESETS.items()
            if n in ("DiT-S/2", "DiT-XL/2", "DiT-7B")} == {
        "DiT-S/2": (384, 12, 6, 2), "DiT-XL/2": (1152, 28, 16, 2), "DiT-7B": (3072, 32, 24, 2)}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def test_meta_device_build_of_7b_allocates_nothing():
    before = _rss_bytes()
    with torch.device("meta"):
        model = DiT(preset("DiT-7B", text_dim=4096, in_channels=16))
    grown = _rss_bytes() - before
    n = sum(p.numel() for p in model.parameters())
    assert n * 4 > 24 * 2**30  # its fp32 weights alone would not fit in this machine's 24 GiB
    assert all(p.is_meta for p in model.parameters())
    assert grown < 64 * 2**20, f"building on meta grew RSS by {grown / 2**20:.0f} MiB"


@pytest.mark.slow
def test_compiled_blocks_match_eager():
    from ditcore.models import apply_compile

    cfg = tiny(num_classes=3, text_dim=16)
    eager = randomize(DiT(cfg))
    compiled = DiT(cfg)
    compiled.load_state_dict(eager.state_dict())
    apply_compile(compiled)
    assert compiled.state_dict().keys() == eager.state_dict().keys()
    x, pos, c_noise = torch.randn(2, 16, cfg.patch_dim), grid_positions((1, 4, 4)), torch.randn(2, 1)
    kw = dict(class_labels=torch.tensor([[0], [3]]), text=torch.randn(2, 5, 16))
    out_e = eager(x, c_noise, Inputs(pos, **kw))
    out_c = compiled(x, c_noise, Inputs(pos, **kw))
    assert_close_fp32(out_c, out_e, work=dit_forward_work(cfg, seq_len=16, text_len=5))
    out_c.sum().backward()
    out_e.sum().backward()
    grad_work = dit_grad_work(cfg, seq_len=16, text_len=5, tokens=x.shape[0] * x.shape[1])
    for (name, a), b in zip(compiled.named_parameters(), eager.parameters(), strict=True):
        assert_close_fp32(a.grad, b.grad, work=grad_work, msg=name)
