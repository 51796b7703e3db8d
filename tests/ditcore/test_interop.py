"""ditcore against code its authors did not write: diffusers' DiTTransformer2DModel and DDIMScheduler (random weights:
no hub here), and a state dict laid out as the original DiT's models.py defines it."""

from __future__ import annotations

import argparse
import copy
import json

import pytest
import torch
from diffusers import DDIMScheduler, DiTTransformer2DModel

from ditcore import interop
from ditcore.codecs import LatentStats
from ditcore.diffusion import EDMPrecond, edm_sampler
from ditcore.diffusion.vp import DiscreteVP
from ditcore.interop import ConversionError, diffusers_dit, original
from ditcore.layout import grid_positions, patchify, unpatchify
from ditcore.models import DiT
from ditcore.models.dit import DiTConfig
from ditcore.testing import EPS32, Payload, assert_close_fp32, dit_forward_work

# XL's head width (72) and learned Σ, at a size a CPU runs in milliseconds: 2 blocks of 2 heads, 8x8 latents, patch 2
XL_SHAPED = dict(num_attention_heads=2, attention_head_dim=72, in_channels=4, out_channels=8, num_layers=2,
                 sample_size=8, patch_size=2, num_embeds_ada_norm=10)


def randomise(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every weight random (diffusers and DiT zero their adaLN outputs at init, which would hide a wrong layout)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            std = p.shape[1] ** -0.5 if p.ndim == 2 else 0.3
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


def diffusers_dit_model(seed: int = 0, **changes) -> DiTTransformer2DModel:
    model = randomise(DiTTransformer2DModel(**(XL_SHAPED | changes)), seed).eval()
    with torch.no_grad():  # diffusers' converted DiTs hold one embedder, copied into every block
        for block in model.transformer_blocks[1:]:
            block.norm1.emb.load_state_dict(model.transformer_blocks[0].norm1.emb.state_dict())
    return model


def inputs(model: DiTTransformer2DModel, batch: int = 3, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    c, size = model.config.in_channels, model.config.sample_size
    x = torch.randn(batch, c, size, size, generator=g)
    t = torch.tensor([999, 500, 3][:batch])
    y = torch.tensor([0, 7, model.config.num_embeds_ada_norm][:batch])  # the last: the null class
    return x, t, y


def imported(model: DiTTransformer2DModel, folder) -> tuple[DiT, interop.Imported]:
    model.save_pretrained(folder)
    got = interop.read(folder)
    ours = DiT(got.cfg).eval()
    ours.load_state_dict(got.tensors)  # strict: every tensor has its place, none is left over
    return ours, got


def ours_forward(model: DiT, x, t, y) -> torch.Tensor:
    return model.forward_latents(x[:, :, None], t.float(), class_labels=y)[:, :, 0]


@pytest.mark.parametrize("changes", [{}, dict(out_channels=4, norm_eps=1e-6, num_embeds_ada_norm=1000)],
                         ids=["learned_sigma", "fixed_sigma"])
def test_converted_diffusers_weights_give_diffusers_forward(tmp_path, changes):
    theirs = diffusers_dit_model(**changes)
    ours, got = imported(theirs, tmp_path / "transformer")
    cfg = got.cfg
    assert (cfg.hidden_size, cfg.depth, cfg.num_heads, cfg.learn_sigma) == \
        (144, 2, 2, theirs.config.out_channels == 8)
    assert (cfg.freq_shift, cfg.mlp_norm_eps, cfg.pos_embed, cfg.max_grid) == \
        (1, theirs.config.norm_eps, "sincos_2d", (1, 4, 4))
    x, t, y = inputs(theirs)
    with torch.no_grad():
        expected = theirs(x, timestep=t, class_labels=y).sample
        actual = ours_forward(ours, x, t, y)
    assert actual.shape == expected.shape
    assert_close_fp32(actual, expected, work=dit_forward_work(cfg, 16))


def test_diffusers_deviations_are_what_the_conversion_says(tmp_path):
    """Without freq_shift the converted model is another function: the conversion is not exact by accident. (The
    pre-MLP eps, 1e-5 against 1e-6, moves a LayerNorm of unit-variance activations by ~5e-6 relative, below what
    float32 rounding of the whole forward can tell apart; the conversion sets it exactly all the same.)"""
    theirs = diffusers_dit_model()
    _, got = imported(theirs, tmp_path / "transformer")
    x, t, y = inputs(theirs)
    with torch.no_grad():
        expected = theirs(x, timestep=t, class_labels=y).sample
        other = DiT(got.cfg.replace(freq_shift=0)).eval()
        other.load_state_dict(got.tensors)
        assert (ours_forward(other, x, t, y) - expected).abs().max() > 1e-2 * expected.abs().max()


def test_export_to_diffusers_and_back_is_bitwise(tmp_path):
    cfg = DiTConfig(hidden_size=144, depth=2, num_heads=2, num_classes=10, pos_embed="sincos_2d", qk_norm=False,
                    max_grid=(1, 4, 4), learn_sigma=True, freq_shift=1, mlp_norm_eps=1e-5)
    ours = randomise(DiT(cfg), seed=3).eval()
    state = ours.state_dict()
    stats = LatentStats(torch.zeros(4), torch.full((4,), 0.5 / 0.18215))  # DiT's units: 0.18215 z
    out = interop.export_diffusers(tmp_path / "exported", cfg, state, DiscreteVP(), latent_stats=stats)
    back = interop.read(out)
    assert back.cfg == cfg and back.vp == DiscreteVP() and back.latent_stats.to_dict() == stats.to_dict()
    assert back.tensors.keys() == state.keys()
    assert all(torch.equal(back.tensors[k], v) for k, v in state.items())
    # diffusers loads it as its own (no missing or unexpected weights) and computes what ditcore computes
    theirs = DiTTransformer2DModel.from_pretrained(out, low_cpu_mem_usage=False).eval()
    x, t, y = inputs(theirs)
    with torch.no_grad():
        assert_close_fp32(ours_forward(ours, x, t, y), theirs(x, timestep=t, class_labels=y).sample,
                          work=dit_forward_work(cfg, 16))
    assert json.loads((out / interop.SIDECAR).read_text())["precond"] == "vp"


@pytest.mark.parametrize(("change", "names"), [
    (dict(pos_embed="rope"), "pos_embed=rope"), (dict(qk_norm=True), "qk_norm"),
    (dict(text_dim=8), "text conditioning"), (dict(pos_embed="sincos", max_grid=(4, 4, 4)), "pos_embed=sincos"),
    (dict(num_classes=0), "an unconditional model"), (dict(freq_shift=0), "freq_shift=0"),
])
def test_export_refuses_what_diffusers_cannot_hold_naming_it(tmp_path, change, names):
    cfg = DiTConfig(hidden_size=64, depth=1, num_heads=4, num_classes=10, pos_embed="sincos_2d", qk_norm=False,
                    max_grid=(1, 4, 4), freq_shift=1).replace(**change)
    with pytest.raises(ConversionError, match=f"cannot export to diffusers: {names}"):
        interop.export_diffusers(tmp_path / "out", cfg, DiT(cfg).state_dict(), None)
    assert not (tmp_path / "out").exists()


def test_euler_under_vp_on_ddim_timesteps_is_diffusers_ddim(tmp_path):
    """The EDM paper's reading of DDIM (η = 0) as Euler steps of the probability-flow ODE, checked on the converted
    network: ditcore's sampler (float64 state, VP preconditioning, DDIM's timesteps, x_T ~ N(0, I) scaled by
    √(σ_T² + 1)) against diffusers' own loop."""
    theirs = diffusers_dit_model(seed=5)
    ours, got = imported(theirs, tmp_path / "transformer")
    steps, C = 10, theirs.config.in_channels
    x_T, _, y = inputs(theirs, batch=2, seed=6)

    def ddim(model, dtype, alphas_cumprod=None):
        scheduler = DDIMScheduler(clip_sample=False, set_alpha_to_one=True)  # DiT's schedule: 1000 linear β
        scheduler.set_timesteps(steps)
        if alphas_cumprod is not None:
            scheduler.alphas_cumprod = alphas_cumprod
        x = x_T.to(dtype)
        for t in scheduler.timesteps:
            eps = model(x, timestep=t.expand(len(x)), class_labels=y).sample[:, :C]
            x = scheduler.step(eps, t, x).prev_sample
        assert scheduler.timesteps.tolist() == [900, 800, 700, 600, 500, 400, 300, 200, 100, 0]
        return x

    with torch.no_grad():
        theirs32 = ddim(theirs, torch.float32)
        theirs64 = ddim(copy.deepcopy(theirs).double(), torch.float64, got.vp.alphas_cumprod())
        precond = EDMPrecond(ours, vp=got.vp)
        pos = grid_positions((1, 4, 4))
        denoise = lambda z, s: precond(z, s.expand(len(z)), pos=pos, class_labels=y[:, None])
        ours_x = edm_sampler(lambda z, s: _latents_denoise(denoise, z, s, ours), x_T.double(),
                             sigmas=got.vp.ddim_sigmas(steps), solver="euler", round_sigma=precond.round_sigma,
                             prior_std=precond.prior_std)
    # The random network's x̂₀ reach a few hundred (x_t/√ᾱ at t = 900 is ×50), so the bound is measured, not
    # worked out: diffusers' float32 loop's distance from the same loop in float64 is this computation's float32
    # error; ditcore's (float32 network, float64 sampler) must be as close to the float64 result, within 2x.
    # (Starting from σ_T x_T, EDM's start, instead of √(σ_T² + 1) x_T misses by 300x that.)
    fp32_error = (theirs32.double() - theirs64).abs().max().item()
    assert 0 < fp32_error < 1e-5 * theirs64.abs().max().item()
    assert (ours_x - theirs64).abs().max().item() <= 2 * fp32_error


def _latents_denoise(denoise, z, sigma, model: DiT):
    """D(z; σ) of latents z (B, C, H, W) through the token denoiser (patchify, D, unpatchify)."""
    p = model.cfg.patch_size
    out = denoise(patchify(z[:, :, None].float(), p), sigma.float())
    return unpatchify(out, (1, z.shape[-2] // p, z.shape[-1] // p), p)[:, :, 0].to(z.dtype)


# --------------------------------------------------------------------------------------------------
# The original DiT's state dict: names and shapes as facebookresearch/DiT's models.py defines them


def original_state_dict(theirs: DiTTransformer2DModel) -> dict[str, torch.Tensor]:
    """The original DiT's state dict of the same network as a diffusers DiT (the mapping of diffusers' own
    scripts/convert_dit_to_diffusers.py, inverted): Conv2d patch embedder, fused qkv rows (3, heads, hd), timm MLP
    names, adaLN_modulation, final_layer, and the fixed pos_embed buffer (1, N, D)."""
    s, out = theirs.state_dict(), {}
    out["x_embedder.proj.weight"], out["x_embedder.proj.bias"] = s["pos_embed.proj.weight"], s["pos_embed.proj.bias"]
    out["pos_embed"] = theirs.pos_embed.pos_embed.clone()
    emb = "transformer_blocks.0.norm1.emb."
    for i in (1, 2):
        for kind in ("weight", "bias"):
            out[f"t_embedder.mlp.{2 * (i - 1)}.{kind}"] = s[f"{emb}timestep_embedder.linear_{i}.{kind}"]
    out["y_embedder.embedding_table.weight"] = s[f"{emb}class_embedder.embedding_table.weight"]
    for b in range(theirs.config.num_layers):
        d = f"transformer_blocks.{b}."
        for kind in ("weight", "bias"):
            out[f"blocks.{b}.attn.qkv.{kind}"] = torch.cat([s[f"{d}attn1.to_{x}.{kind}"] for x in "qkv"])
            out[f"blocks.{b}.attn.proj.{kind}"] = s[f"{d}attn1.to_out.0.{kind}"]
            out[f"blocks.{b}.mlp.fc1.{kind}"] = s[f"{d}ff.net.0.proj.{kind}"]
            out[f"blocks.{b}.mlp.fc2.{kind}"] = s[f"{d}ff.net.2.{kind}"]
            out[f"blocks.{b}.adaLN_modulation.1.{kind}"] = s[f"{d}norm1.linear.{kind}"]
    for kind in ("weight", "bias"):
        out[f"final_layer.adaLN_modulation.1.{kind}"] = s[f"proj_out_1.{kind}"]
        out[f"final_layer.linear.{kind}"] = s[f"proj_out_2.{kind}"]
    return out


def as_original_dit(theirs: DiTTransformer2DModel) -> DiTTransformer2DModel:
    """diffusers' DiT with its two documented deviations undone: the original DiT's function (timestep sinusoid
    over half, not half − 1, frequencies; eps 1e-6 before the MLP)."""
    for block in theirs.transformer_blocks:
        block.norm1.emb.time_proj.downscale_freq_shift = 0
        block.norm3.eps = 1e-6
    return theirs


def test_an_original_dit_state_dict_converts_and_runs(tmp_path):
    """DiT-S/2's width (its heads come from the paper's table), 2 blocks, learned Σ, 10 classes + the null class;
    saved as DiT saves it (torch.save of the state dict) and read back without unpickling code."""
    theirs = as_original_dit(diffusers_dit_model(num_attention_heads=6, attention_head_dim=64, seed=7))
    path = tmp_path / "DiT-S-2-tiny.pt"
    torch.save(original_state_dict(theirs), path)
    got = interop.read(path)
    assert got.kind == "DiT checkpoint" and got.vp == DiscreteVP()
    assert (got.cfg.hidden_size, got.cfg.num_heads, got.cfg.num_classes, got.cfg.learn_sigma, got.cfg.freq_shift,
            got.cfg.mlp_norm_eps, got.cfg.max_grid) == (384, 6, 10, True, 0, 1e-6, (1, 4, 4))
    ours = DiT(got.cfg).eval()
    ours.load_state_dict(got.tensors)
    x, t, y = inputs(theirs)
    with torch.no_grad():
        assert_close_fp32(ours_forward(ours, x, t, y), theirs(x, timestep=t, class_labels=y).sample,
                          work=dit_forward_work(got.cfg, 16))
    # DiT's train.py checkpoint keeps {model, ema, opt, args}: its EMA weights are taken, its argparse args (plain
    # data) allowed; anything that would run code on loading is refused in one line, and nothing runs
    args = argparse.Namespace(model="DiT-S/2", image_size=64)
    torch.save({"model": {}, "ema": original_state_dict(theirs), "args": args}, tmp_path / "0001000.pt")
    assert interop.read(tmp_path / "0001000.pt").cfg == got.cfg
    marker = tmp_path / "pwned"
    torch.save({"ema": original_state_dict(theirs), "args": Payload(marker)}, tmp_path / "hostile.pt")
    with pytest.raises(ConversionError, match="loads no pickled Python objects"):
        interop.read(tmp_path / "hostile.pt")
    assert not marker.exists()


def test_original_import_refuses_what_it_cannot_convert(tmp_path):
    theirs = diffusers_dit_model(num_attention_heads=2, attention_head_dim=72)
    state = original_state_dict(theirs)
    with pytest.raises(ConversionError, match="width 144 is none of the paper's sizes"):
        original.to_ditcore(state)
    assert original.to_ditcore(state, num_heads=2)[0].num_heads == 2
    state["pos_embed"] = torch.randn_like(state["pos_embed"])  # a learned table
    with pytest.raises(ConversionError, match="pos_embed differs from DiT's fixed 2-D sin-cos table"):
        original.to_ditcore(state, num_heads=2)


def test_diffusers_blocks_with_their_own_embedders_are_refused(tmp_path):
    theirs = diffusers_dit_model()
    with torch.no_grad():
        theirs.transformer_blocks[1].norm1.emb.timestep_embedder.linear_1.bias.add_(1.0)
    theirs.save_pretrained(tmp_path / "t")
    with pytest.raises(ConversionError, match="block 1's timestep/class embedder differs from block 0's"):
        interop.read(tmp_path / "t")


def test_a_pipeline_folder_gives_its_schedule_and_vae(tmp_path):
    theirs = diffusers_dit_model()
    theirs.save_pretrained(tmp_path / "pipe" / "transformer")
    DDIMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012).save_pretrained(
        tmp_path / "pipe" / "scheduler")
    (tmp_path / "pipe" / "model_index.json").write_text(json.dumps({"_class_name": "DiTPipeline"}))
    got = interop.read(tmp_path / "pipe")
    assert got.vp == DiscreteVP(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012)
    assert got.vae is None  # the pipeline has no vae/ here
    # the schedule itself equals diffusers' (its float32 products against our float64: ~T ε relative)
    ours = got.vp.alphas_cumprod()
    theirs_a = DDIMScheduler.from_pretrained(tmp_path / "pipe" / "scheduler").alphas_cumprod.double()
    assert ((ours - theirs_a).abs() / ours).max() < 1000 * EPS32
    assert diffusers_dit.refusal(got.cfg) is None
