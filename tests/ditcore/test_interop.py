"""ditcore against code its authors did not write: diffusers' DiTTransformer2DModel and DDIMScheduler (random weights:
no hub here), and a state dict laid out as the original DiT's models.py defines it."""

from __future__ import annotations

import argparse
import copy
import json
import re

import pytest
import torch
from diffusers import DDIMScheduler, DiTTransformer2DModel

from ditcore import interop
from ditcore.codecs import LatentStats
from ditcore.diffusion import EDMPrecond, ddim_sampler, edm_sampler, guided
from ditcore.diffusion.vp import DiscreteVP
from ditcore.inputs import Inputs
from ditcore.interop import ConversionError, diffusers_dit, original
from ditcore.layout import grid_positions, patchify, unpatchify
from ditcore.models import DiT
from ditcore.models.dit import DiTConfig
from ditcore.testing import EPS32, Payload, assert_close_fp32, dit_forward_work, dit_pipeline_loop

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


def diffusers_dit_model(seed: int = 0, shared: bool = True, **changes) -> DiTTransformer2DModel:
    """shared: one embedder copied into every block, as diffusers' conversion of the original DiT holds it; else
    each block's own, as a DiT made or trained in diffusers has them."""
    model = randomise(DiTTransformer2DModel(**(XL_SHAPED | changes)), seed).eval()
    with torch.no_grad():
        for block in model.transformer_blocks[1:] if shared else []:
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


def assert_imported_forward(got: interop.Imported, x, t, y, expected: torch.Tensor) -> DiT:
    """A DiT built from what was read, loaded strictly, gives `expected` on (x, t, y) within float32 error."""
    ours = DiT(got.cfg).eval()
    ours.load_state_dict(got.tensors)
    with torch.no_grad():
        assert_close_fp32(ours_forward(ours, x, t, y), expected, work=dit_forward_work(got.cfg, 16))
    return ours


@pytest.mark.parametrize("changes", [{}, dict(out_channels=4, norm_eps=1e-6, num_embeds_ada_norm=1000)],
                         ids=["learned_sigma", "fixed_sigma"])
def test_converted_diffusers_weights_give_diffusers_forward(tmp_path, changes):
    theirs = diffusers_dit_model(**changes)
    ours, got = imported(theirs, tmp_path / "transformer")
    cfg = got.cfg
    assert (cfg.hidden_size, cfg.depth, cfg.num_heads, cfg.learn_sigma) == \
        (144, 2, 2, theirs.config.out_channels == 8)
    assert (cfg.freq_shift, cfg.mlp_norm_eps, cfg.pos_embed, cfg.max_grid, cfg.block_embedders) == \
        (1, theirs.config.norm_eps, "sincos_2d", (1, 4, 4), False)  # copies of one embedder: ditcore's shared one
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
        denoise = lambda z, s: precond(z, s.expand(len(z)), Inputs(pos, class_labels=y[:, None]))
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
    x, t, y = inputs(theirs)
    with torch.no_grad():
        assert_imported_forward(got, x, t, y, theirs(x, timestep=t, class_labels=y).sample)
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


def test_diffusers_blocks_with_their_own_embedders_load_per_block_and_export_back(tmp_path):
    """A DiT whose blocks' embedders differ (made or trained in diffusers) imports with block_embedders and computes
    diffusers' forward; exported, diffusers loads it as its own and computes the same again, every tensor intact."""
    theirs = diffusers_dit_model(seed=4, shared=False)
    ours, got = imported(theirs, tmp_path / "transformer")
    assert got.cfg.block_embedders
    x, t, y = inputs(theirs)
    work = dit_forward_work(got.cfg, 16)
    with torch.no_grad():
        expected = theirs(x, timestep=t, class_labels=y).sample
        assert_close_fp32(ours_forward(ours, x, t, y), expected, work=work)
        shared = DiT(got.cfg.replace(block_embedders=False)).eval()  # block 1 read with block 0's embedders
        shared.load_state_dict({k: v for k, v in got.tensors.items()
                                if not re.match(r"blocks\.\d+\.\w+_embedder", k)})
        assert (ours_forward(shared, x, t, y) - expected).abs().max() > 1e-2 * expected.abs().max()  # not vacuous
    out = interop.export_diffusers(tmp_path / "exported", got.cfg, got.tensors, got.vp)
    again = DiTTransformer2DModel.from_pretrained(out, low_cpu_mem_usage=False).eval()
    assert again.state_dict().keys() == theirs.state_dict().keys()
    assert all(torch.equal(again.state_dict()[k], v) for k, v in theirs.state_dict().items())
    with torch.no_grad():
        assert_close_fp32(again(x, timestep=t, class_labels=y).sample, ours_forward(ours, x, t, y), work=work)
    back = interop.read(out)
    assert back.cfg == got.cfg and all(torch.equal(back.tensors[k], v) for k, v in got.tensors.items())


def test_a_pipeline_folder_gives_its_schedule_and_vae(tmp_path):
    theirs = diffusers_dit_model()
    theirs.save_pretrained(tmp_path / "pipe" / "transformer")
    DDIMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012).save_pretrained(
        tmp_path / "pipe" / "scheduler")
    (tmp_path / "pipe" / "model_index.json").write_text(json.dumps({"_class_name": "DiTPipeline"}))
    got = interop.read(tmp_path / "pipe")
    # DDIMScheduler's default clip_sample=True is its config's too
    assert got.vp == DiscreteVP(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012, clip_sample=True)
    assert got.vae is None  # the pipeline has no vae/ here
    # the schedule itself equals diffusers' (its float32 products against our float64: ~T ε relative)
    ours = got.vp.alphas_cumprod()
    theirs_a = DDIMScheduler.from_pretrained(tmp_path / "pipe" / "scheduler").alphas_cumprod.double()
    assert ((ours - theirs_a).abs() / ours).max() < 1000 * EPS32
    assert diffusers_dit.refusal(got.cfg) is None

# --------------------------------------------------------------------------------------------------
# Folders as the hub's were written: facebook/DiT-XL-2-256 came from diffusers' scripts/convert_dit_to_diffusers.py
# under diffusers 0.12, which saved the transformer as a Transformer2DModel (pickled weights; safetensors were added to
# the hub later) and the scheduler as DDIMScheduler(num_train_timesteps=1000, beta_schedule="linear",
# prediction_type="epsilon", clip_sample=False)

# Transformer2DModel's config fields in diffusers 0.12 (no norm_eps yet: the DiT default, 1e-5, applies), DiT-XL/2's
# values but for the size
HUB_TRANSFORMER = {"_class_name": "Transformer2DModel", "_diffusers_version": "0.12.0.dev0",
                   "activation_fn": "gelu-approximate", "attention_bias": True, "cross_attention_dim": None,
                   "dropout": 0.0, "norm_elementwise_affine": False, "norm_num_groups": 32,
                   "norm_type": "ada_norm_zero", "num_vector_embeds": None, "only_cross_attention": False,
                   "upcast_attention": False, "use_linear_projection": False}
HUB_SCHEDULER = {"_class_name": "DDIMScheduler", "_diffusers_version": "0.12.0.dev0", "beta_end": 0.02,
                 "beta_schedule": "linear", "beta_start": 0.0001, "clip_sample": False, "num_train_timesteps": 1000,
                 "prediction_type": "epsilon", "set_alpha_to_one": True, "steps_offset": 0, "trained_betas": None}
HUB_INDEX = {"_class_name": "DiTPipeline", "_diffusers_version": "0.12.0.dev0",
             "scheduler": ["diffusers", "DDIMScheduler"], "transformer": ["diffusers", "Transformer2DModel"],
             "vae": ["diffusers", "AutoencoderKL"]}


def tiny_vae(folder):
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    AutoencoderKL(block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
                  up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1, latent_channels=4,
                  norm_num_groups=8).save_pretrained(folder)


def hub_folder(root, theirs: DiTTransformer2DModel, weights: str = "bin"):
    """A DiT pipeline folder laid out as facebook/DiT-XL-2-256's: model_index.json naming the Transformer2DModel,
    transformer/config.json written as a Transformer2DModel, its weights pickled (.bin, torch.save of the state
    dict) or as safetensors, scheduler/ and vae/."""
    from safetensors.torch import save_file

    (root / "transformer").mkdir(parents=True)
    c = theirs.config
    config = HUB_TRANSFORMER | {k: c[k] for k in ("attention_head_dim", "in_channels", "num_attention_heads",
                                                  "num_embeds_ada_norm", "num_layers", "out_channels", "patch_size",
                                                  "sample_size")}
    (root / "transformer" / "config.json").write_text(json.dumps(config, indent=2))
    state = {k: v.contiguous() for k, v in theirs.state_dict().items()}
    if weights == "bin":
        torch.save(state, root / "transformer" / "diffusion_pytorch_model.bin")
    else:
        save_file(state, root / "transformer" / "diffusion_pytorch_model.safetensors")
    (root / "scheduler").mkdir()
    (root / "scheduler" / "scheduler_config.json").write_text(json.dumps(HUB_SCHEDULER, indent=2))
    tiny_vae(root / "vae")
    labels = {str(i): f"class {i}" for i in range(c.num_embeds_ada_norm)}
    (root / "model_index.json").write_text(json.dumps(HUB_INDEX | {"id2label": labels}, indent=2))
    return root


@pytest.mark.parametrize("weights", ["bin", "safetensors"])
def test_a_folder_as_the_hub_wrote_it_loads_in_diffusers_and_samples_alike_in_ditcore(tmp_path, weights):
    """diffusers itself loads the folder (Transformer2DModel remapped to DiTTransformer2DModel by its norm_type, as
    diffusers does) to the network it was written from, exactly; ditcore reads it too (DiT's schedule, from the
    scheduler's config), and its DDIM under guidance from the same x_T lands where DiTPipeline's own call does,
    within float32 error (1000 classes: DiTPipeline's null class is fixed at 1000)."""
    from diffusers import DiTPipeline, Transformer2DModel

    theirs = diffusers_dit_model(seed=8, num_embeds_ada_norm=1000)
    root = hub_folder(tmp_path / "DiT-XL-2-256", theirs, weights)
    x, t, y = inputs(theirs)
    pipe = DiTPipeline.from_pretrained(root)
    legacy = Transformer2DModel.from_pretrained(root / "transformer")
    with torch.no_grad():
        expected = theirs(x, timestep=t, class_labels=y).sample
        for loaded in (pipe.transformer, legacy, DiTTransformer2DModel.from_pretrained(root / "transformer")):
            assert type(loaded) is DiTTransformer2DModel
            assert torch.equal(loaded.eval()(x, timestep=t, class_labels=y).sample, expected)
    assert type(pipe.scheduler) is DDIMScheduler and not pipe.scheduler.config.clip_sample

    got = interop.read(root)
    assert got.kind == "diffusers DiTTransformer2DModel" and got.vp == DiscreteVP() and got.vae == root / "vae"
    assert not got.cfg.block_embedders and got.cfg.num_classes == 1000
    ours = assert_imported_forward(got, x, t, y, expected)

    # DiTPipeline's own call: its x_T is randn of its generator, its latents what it hands the VAE (x scaling)
    steps, labels, guidance = 6, [3, 999], 4.0
    seen = []
    decode = pipe.vae.decode
    pipe.vae.decode = lambda z, *a, **k: (seen.append(z.clone()), decode(z, *a, **k))[1]
    pipe(class_labels=labels, num_inference_steps=steps, guidance_scale=guidance,
         generator=torch.Generator().manual_seed(9), output_type="pt")
    theirs32 = seen[0] * pipe.vae.config.scaling_factor
    x_T = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(9))
    loop32 = dit_pipeline_loop(pipe.transformer, pipe.scheduler, x_T, labels, 1000, guidance, steps)
    theirs64 = dit_pipeline_loop(copy.deepcopy(pipe.transformer).double(), copy.deepcopy(pipe.scheduler),
                                 x_T.double(), labels, 1000, guidance, steps, got.vp.alphas_cumprod())
    ours_x = ours_ddim(ours, got.vp, x_T, labels, guidance, steps)
    assert_within_fp32_error(ours_x, theirs32, theirs64)
    # the float64 reference is the pipeline's loop: the same loop in float32 is the pipeline's call to float32 error
    assert (loop32 - theirs32).abs().max() <= (theirs32.double() - theirs64).abs().max()


def test_a_sharded_save_loads_and_a_shard_outside_the_folder_is_refused(tmp_path):
    """save_pretrained splits a large model into shards named by an index, which diffusers loads: so does ditcore,
    reading only files beside the index."""
    theirs = diffusers_dit_model(shared=False)
    theirs.save_pretrained(tmp_path / "sharded", max_shard_size="200KB")
    index = tmp_path / "sharded" / "diffusion_pytorch_model.safetensors.index.json"
    assert index.is_file() and len(set(json.loads(index.read_text())["weight_map"].values())) > 1
    got = interop.read(tmp_path / "sharded")
    assert got.tensors.keys() == imported(theirs, tmp_path / "whole")[1].tensors.keys()
    loaded = DiTTransformer2DModel.from_pretrained(tmp_path / "sharded", low_cpu_mem_usage=False).eval()
    x, t, y = inputs(theirs)
    with torch.no_grad():
        assert_imported_forward(got, x, t, y, loaded(x, timestep=t, class_labels=y).sample)
    mapping = json.loads(index.read_text())
    first = next(iter(mapping["weight_map"]))
    index.write_text(json.dumps(mapping | {"weight_map": mapping["weight_map"] | {first: "../elsewhere.safetensors"}}))
    refused = re.escape("names the shard '../elsewhere.safetensors', which is not a file in")
    with pytest.raises(ConversionError, match=refused):
        interop.read(tmp_path / "sharded")


def test_a_hostile_pickled_bin_in_a_folder_is_refused_and_never_runs(tmp_path):
    """The hub folder's .bin is a plain state dict, read with weights_only; one that holds anything else is refused in
    one line, and its payload does not run."""
    theirs = diffusers_dit_model()
    root = hub_folder(tmp_path / "pipe", theirs, "bin")
    marker = tmp_path / "pwned"
    torch.save({**theirs.state_dict(), "payload": Payload(marker)}, root / "transformer" /
               "diffusion_pytorch_model.bin")
    with pytest.raises(ConversionError, match="loads no pickled Python objects") as e:
        interop.read(root)
    assert len(str(e.value).splitlines()) == 1 and not marker.exists()


@pytest.mark.parametrize(("change", "message"), [
    (dict(norm_type="ada_norm_single"), "Transformer2DModel with norm_type='ada_norm_single', which diffusers loads "
                                        "as another model than a DiT"),
    (dict(norm_type=None), "norm_type=None"),
    (dict(cross_attention_dim=64), "Transformer2DModel with cross_attention_dim=64: not a DiT"),
    (dict(_class_name="UNet2DModel"), "holds a 'UNet2DModel', not a DiTTransformer2DModel"),
])
def test_a_transformer_config_that_is_not_a_dit_is_refused_naming_the_field(tmp_path, change, message):
    root = hub_folder(tmp_path / "pipe", diffusers_dit_model())
    config = json.loads((root / "transformer" / "config.json").read_text())
    (root / "transformer" / "config.json").write_text(json.dumps(config | change))
    with pytest.raises(ConversionError, match=re.escape(message)) as e:
        interop.read(root)
    assert len(str(e.value).splitlines()) == 1


# --------------------------------------------------------------------------------------------------
# Scheduler settings: every field that moves the sampled timesteps or ᾱ, honoured (DDIM's loop equals diffusers')
# or refused by name


def ours_ddim(model: DiT, vp: DiscreteVP, x_T, labels: list[int], guidance: float, steps: int) -> torch.Tensor:
    """ditcore's DDIM (ditcore.diffusion.ddim_sampler, float64 state, float32 network) of latents x_T under
    guidance, as ditcore.sampling composes it."""
    precond = EDMPrecond(model, vp=vp)
    p, size = model.cfg.patch_size, x_T.shape[-1]
    pos = grid_positions((1, size // p, size // p))
    y = torch.tensor(labels + ([model.null_class] * len(labels) if guidance != 1 else []))[:, None]
    denoise = lambda z, s: _latents_denoise(lambda t, s: precond(t, s.expand(len(t)), Inputs(pos, class_labels=y)),
                                            z, s, model)
    with torch.no_grad():
        return ddim_sampler(guided(denoise, guidance) if guidance != 1 else denoise, x_T.double(), vp, steps)


def assert_within_fp32_error(ours: torch.Tensor, theirs32: torch.Tensor, theirs64: torch.Tensor) -> None:
    """diffusers' float32 loop's distance from the same loop in float64 is this computation's float32 error (the
    random network's x̂₀ reach hundreds, so it is measured, not worked out): ditcore's, float32 network and float64
    sampler, is as close to the float64 result, within 2x."""
    fp32_error = (theirs32.double() - theirs64).abs().max().item()
    assert 0 < fp32_error < 1e-5 * theirs64.abs().max().item()
    assert (ours.double() - theirs64).abs().max().item() <= 2 * fp32_error


SETTINGS = {  # (scheduler class, its settings, steps)
    "steps_offset=1": ("DDIMScheduler", dict(steps_offset=1), 10),
    "trailing": ("DDIMScheduler", dict(timestep_spacing="trailing"), 10),
    "trailing-7": ("DDIMScheduler", dict(timestep_spacing="trailing"), 7),  # each step lands off the next timestep
    "linspace": ("DDIMScheduler", dict(timestep_spacing="linspace"), 10),
    "set_alpha_to_one=False": ("DDIMScheduler", dict(set_alpha_to_one=False), 10),
    "set_alpha_to_one=False,steps_offset=1": ("DDIMScheduler", dict(set_alpha_to_one=False, steps_offset=1), 10),
    "clip_sample": ("DDIMScheduler", dict(clip_sample=True, clip_sample_range=3.0), 10),
    # a DDPMScheduler config is sampled as DDIMScheduler.from_config(it) samples it
    "DDPMScheduler": ("DDPMScheduler", dict(timestep_spacing="trailing", beta_schedule="scaled_linear",
                                            beta_start=0.00085, beta_end=0.012), 10),
}


@pytest.mark.parametrize("setting", SETTINGS)
def test_ddim_under_each_scheduler_setting_is_diffusers_ddim(tmp_path, setting):
    import diffusers

    kind, settings, steps = SETTINGS[setting]
    config = getattr(diffusers, kind)(**({"clip_sample": False} | settings)).config
    vp = interop.schedule_from_diffusers(dict(config))
    scheduler = DDIMScheduler.from_config(config)
    scheduler.set_timesteps(steps)
    assert vp.ddim_timesteps(steps)[0] == scheduler.timesteps.tolist()
    theirs = diffusers_dit_model(seed=5)
    ours, _ = imported(theirs, tmp_path / "transformer")
    x_T, labels = inputs(theirs, batch=2, seed=6)[0], [1, 7]
    theirs32 = dit_pipeline_loop(theirs, scheduler, x_T, labels, 10, 1.0, steps)
    theirs64 = dit_pipeline_loop(copy.deepcopy(theirs).double(), copy.deepcopy(scheduler), x_T.double(), labels, 10,
                                 1.0, steps, vp.alphas_cumprod())
    assert_within_fp32_error(ours_ddim(ours, vp, x_T, labels, 1.0, steps), theirs32, theirs64)
    # the setting is not idle: DDIM with DiT's own settings on the same schedule lands elsewhere
    plain = ours_ddim(ours, vp.trained(), x_T, labels, 1.0, steps)
    assert (plain.double() - theirs64).abs().max() > 10 * (theirs32.double() - theirs64).abs().max()


@pytest.mark.parametrize(("kind", "change", "message"), [
    ("DDIMScheduler", dict(thresholding=True), "the scheduler says thresholding=True: dynamic thresholding"),
    ("DDIMScheduler", dict(rescale_betas_zero_snr=True), "the scheduler says rescale_betas_zero_snr=True: zero "
                                                         "terminal SNR"),
    ("DDIMScheduler", dict(trained_betas=[1e-4] * 1000), "the scheduler says trained_betas=[0.0001,"),
    ("DDIMScheduler", dict(beta_schedule="sigmoid"), "the scheduler's beta_schedule='sigmoid' is not supported"),
    ("DDIMScheduler", dict(prediction_type="v_prediction"), "the scheduler says prediction_type='v_prediction'"),
    ("DDIMScheduler", dict(timestep_spacing="karras"), "timestep_spacing='karras' is unknown"),
    ("DPMSolverMultistepScheduler", {}, "the scheduler is a 'DPMSolverMultistepScheduler' (_class_name): ditcore "
                                        "reads DDIMScheduler and DDPMScheduler configs"),
    ("EulerDiscreteScheduler", {}, "the scheduler is a 'EulerDiscreteScheduler' (_class_name)"),
])
def test_a_scheduler_setting_ditcore_does_not_follow_is_refused_naming_it(tmp_path, kind, change, message):
    """Through a pipeline folder, as a user meets it: one line naming the field and its value."""
    root = hub_folder(tmp_path / "pipe", diffusers_dit_model())
    config = HUB_SCHEDULER | {"_class_name": kind} | change
    (root / "scheduler" / "scheduler_config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match=re.escape(message)) as e:
        interop.read(root)
    assert len(str(e.value).splitlines()) == 1


def test_ddim_steps_only_ddim_takes_are_refused_for_heun_and_an_offset_past_the_end():
    clipped = DiscreteVP(clip_sample=True)
    assert clipped.ddim_refusal(10, "euler") is None
    assert clipped.ddim_refusal(10, "heun").startswith("schedule ddim with solver heun: this schedule's clip_sample")
    assert DiscreteVP(timestep_spacing="trailing").ddim_refusal(10, "heun") is None  # 10 divides 1000: same levels
    assert "timestep_spacing=trailing at 7 steps" in DiscreteVP(timestep_spacing="trailing").ddim_refusal(7, "heun")
    assert "set_alpha_to_one=False" in DiscreteVP(set_alpha_to_one=False).ddim_refusal(10, "heun")
    with pytest.raises(ValueError, match=re.escape("1000 DDIM steps with timestep_spacing=leading and steps_offset=1 "
                                                   "reach timestep 1000, outside the network's 0..999")):
        DiscreteVP(steps_offset=1).ddim_timesteps(1000)
