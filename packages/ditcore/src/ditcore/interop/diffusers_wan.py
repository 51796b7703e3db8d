"""diffusers' `WanTransformer3DModel` (Wan 2.1 text-to-video) ↔ ditcore's Wan (ditcore.models.wan): configs and state
dicts, both ways, and what a `WanPipeline` around it says of its latent units, text encoder and sampler — in memory
(reading and writing folders is the caller's: ditcore.interop).

The two hold the same tensors. Names map one to one, but for the attention projections, which ditcore fuses (q, k, v
into qkv with rows (heads, 3, head_dim); the cross-attention's k, v into kv, (heads, 2, head_dim)), and the layouts:
- the patch embedding: Conv3d weight (D, C, 1, 2, 2) ↔ a linear on patchify's tokens, whose features are ordered
  (C, pt, p, p) as the Conv3d's flattened kernel is: a reshape;
- the output linear's rows: diffusers unpatchifies them as (pt, p, p, C), ditcore as (C, pt, p, p): a permutation;
- the QK norms' scales (D,) ↔ (heads, head_dim), which tensor parallelism splits by heads;
- the modulation tables (1, 6, D) and (1, 2, D) ↔ (6, D) and (2, D).

What ditcore's Wan does not compute is refused, naming the setting: image-to-video (`image_dim`,
`added_kv_proj_dim`, `pos_embed_seq_len`), Wan 2.2's per-token timesteps (`expand_timesteps`), patches other than
(1, 2, 2), out_channels ≠ in_channels, no cross-attention norm. `qk_norm` is read as diffusers reads it: not at all,
its attention normalises queries and keys whatever the setting. Wan's text length (512) is its pipeline's, not in
this config: `text_len` stays ditcore's default; give a model exported with another the pipeline's
max_sequence_length=text_len.
"""

from __future__ import annotations

import math
import re

import torch

from ditcore.codecs import LatentStats
from ditcore.diffusion.flow import TimeShift, unipc_scheduler
from ditcore.interop.original import ConversionError
from ditcore.layout import SIGMA_DATA
from ditcore.models.wan import WanConfig

CLASS_NAME = "WanTransformer3DModel"
PATCH = (1, 2, 2)

# WanTransformer3DModel's constructor defaults: what diffusers gives a field its config.json leaves out
DEFAULTS = {"patch_size": PATCH, "num_attention_heads": 40, "attention_head_dim": 128, "in_channels": 16,
            "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 13824, "num_layers": 40,
            "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "image_dim": None,
            "added_kv_proj_dim": None, "rope_max_seq_len": 1024, "pos_embed_seq_len": None}

_NAMES = [  # diffusers' name prefix ↔ ditcore's, for every tensor that maps one to one ({i}: a block's number)
    ("patch_embedding.", "x_embedder."),
    ("condition_embedder.time_embedder.linear_1.", "t_embedder.mlp.0."),
    ("condition_embedder.time_embedder.linear_2.", "t_embedder.mlp.2."),
    ("condition_embedder.time_proj.", "time_proj.1."),
    ("condition_embedder.text_embedder.linear_1.", "text_embedder.0."),
    ("condition_embedder.text_embedder.linear_2.", "text_embedder.2."),
    ("blocks.{i}.scale_shift_table", "blocks.{i}.scale_shift.weight"),
    ("blocks.{i}.attn1.norm_q.", "blocks.{i}.attn.q_norm."),
    ("blocks.{i}.attn1.norm_k.", "blocks.{i}.attn.k_norm."),
    ("blocks.{i}.attn1.to_out.0.", "blocks.{i}.attn.proj."),
    ("blocks.{i}.norm2.", "blocks.{i}.norm_cross."),
    ("blocks.{i}.attn2.to_q.", "blocks.{i}.cross.q."),
    ("blocks.{i}.attn2.norm_q.", "blocks.{i}.cross.q_norm."),
    ("blocks.{i}.attn2.norm_k.", "blocks.{i}.cross.k_norm."),
    ("blocks.{i}.attn2.to_out.0.", "blocks.{i}.cross.proj."),
    ("blocks.{i}.ffn.net.0.proj.", "blocks.{i}.mlp.0."),
    ("blocks.{i}.ffn.net.2.", "blocks.{i}.mlp.2."),
    ("scale_shift_table", "final.scale_shift.weight"),
    ("proj_out.", "final.linear."),
]
# the projections ditcore fuses, by head: diffusers' (each heads·head_dim rows) → ditcore's (heads, len, head_dim)
_FUSED = {"attn.qkv": ("attn1.to_q", "attn1.to_k", "attn1.to_v"), "cross.kv": ("attn2.to_k", "attn2.to_v")}


def wan_config_from_diffusers(config: dict) -> WanConfig:
    """The WanConfig of a WanTransformer3DModel's config.json (a field it leaves out takes the constructor's default,
    as diffusers gives it); ConversionError naming the first setting ditcore's Wan does not compute."""
    name = config.get("_class_name", CLASS_NAME)
    if name != CLASS_NAME:
        raise ConversionError(f"the config is a {name!r}, not a {CLASS_NAME}")
    c = DEFAULTS | {k: v for k, v in config.items() if not k.startswith("_")}
    refusals = [
        ("image_dim", c["image_dim"] is None, "null: image-to-video (CLIP image states) is not ditcore's Wan"),
        ("added_kv_proj_dim", c["added_kv_proj_dim"] is None, "null: image-to-video's extra key/value projections"),
        ("pos_embed_seq_len", c["pos_embed_seq_len"] is None, "null: first-last-frame-to-video's image positions"),
        ("expand_timesteps", not c.get("expand_timesteps", False),
         "false: Wan 2.2's per-token timesteps are not ditcore's Wan (one noise level a sample)"),
        ("patch_size", tuple(c["patch_size"]) == PATCH, f"{list(PATCH)}: ditcore's Wan patches 1 x 2 x 2"),
        ("out_channels", (c["out_channels"] or c["in_channels"]) == c["in_channels"],
         f"in_channels={c['in_channels']}: ditcore predicts the channels it is given"),
        ("cross_attn_norm", c["cross_attn_norm"] is True, "true: Wan 2.1's LayerNorm before the cross-attention"),
    ]
    for key, ok, allowed in refusals:
        if not ok:
            value = c.get(key)
            raise ConversionError(f"{CLASS_NAME} with {key}={value!r} has no ditcore counterpart: expected {allowed}")
    heads, R = c["num_attention_heads"], c["rope_max_seq_len"]
    return WanConfig(hidden_size=heads * c["attention_head_dim"], depth=c["num_layers"], num_heads=heads,
                     patch_size=PATCH[1], patch_size_t=PATCH[0], in_channels=c["in_channels"], text_dim=c["text_dim"],
                     ffn_dim=c["ffn_dim"], freq_dim=c["freq_dim"], eps=float(c["eps"]), max_grid=(R, R, R))


def refusal(cfg: WanConfig) -> str | None:
    """Why WanTransformer3DModel cannot hold the model of cfg (the first thing it lacks), or None."""
    prefix = f"cannot export to diffusers' {CLASS_NAME}: "
    if type(cfg) is not WanConfig:
        return prefix + f"a {type(cfg).__name__}: {CLASS_NAME} holds ditcore's Wan (model.arch=wan) only"
    checks = [
        (cfg.text_dim > 0, "text_dim=0: it always cross-attends to text"),
        (cfg.qk_norm, "qk_norm=false: its attention always normalises queries and keys"),
        (cfg.num_classes == 0, f"num_classes={cfg.num_classes}: it has no class embedder"),
        (not cfg.fps_cond, "fps_cond: it has no fps embedder"),
        (not cfg.learn_sigma, "learn_sigma: its output is the prediction alone"),
        (cfg.moe is None, "moe: its feed-forward is dense"),
        ((cfg.patch_size_t, cfg.patch_size) == PATCH[:2], f"patch {cfg.patch_size_t} x {cfg.patch_size} x "
                                                          f"{cfg.patch_size}: it is built for 1 x 2 x 2 here"),
        (cfg.freq_shift == 0, f"freq_shift={cfg.freq_shift}: its timestep sinusoid has none"),
        (cfg.rope_theta == 10000.0, f"rope_theta={cfg.rope_theta}: its RoPE's theta is 10000"),
    ]
    return next((prefix + why for ok, why in checks if not ok), None)


def state_from_diffusers(state: dict[str, torch.Tensor], cfg: WanConfig) -> dict[str, torch.Tensor]:
    """A WanTransformer3DModel's state dict in ditcore's names and layouts (the model of cfg, wan_config_from_diffusers
    of its config); ConversionError for a tensor that has no place there."""
    H, D = cfg.num_heads, cfg.hidden_size
    out, fused = {}, {}
    for name, t in state.items():
        if m := re.fullmatch(r"blocks\.(\d+)\.(attn[12]\.to_[qkv])\.(weight|bias)", name):
            target = next((f"blocks.{m.group(1)}.{k}.{m.group(3)}" for k, parts in _FUSED.items()
                           if m.group(2) in parts), None)
            if target is not None:
                fused.setdefault(target, {})[m.group(2)] = t
                continue
        new = _rename(name, to_ditcore=True)
        if new == "x_embedder.weight":
            t = t.reshape(D, -1)  # (D, C, 1, 2, 2) → (D, C·1·2·2): patchify's (c, pt, p, p)
        elif new.endswith(("q_norm.weight", "k_norm.weight")):
            t = t.reshape(H, -1)
        elif new.endswith("scale_shift.weight"):
            t = t.reshape(-1, D)
        elif new.startswith("final.linear."):
            t = output_rows(t, to_ditcore=True)
        out[new] = t.contiguous()
    for target, parts in fused.items():
        names = _FUSED[target.split(".", 2)[2].rpartition(".")[0]]
        missing = [p for p in names if p not in parts]
        if missing:
            raise ConversionError(f"{CLASS_NAME} state: {target} needs {', '.join(names)}, lacks {', '.join(missing)}")
        out[target] = _interleave([parts[p] for p in names], H)
    return out


def state_to_diffusers(state: dict[str, torch.Tensor], cfg: WanConfig) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json, state dict) of a WanTransformer3DModel holding ditcore's one-device Wan `state` of cfg: the exact
    inverse of state_from_diffusers. ConversionError when diffusers cannot hold it (`refusal`)."""
    why = refusal(cfg)
    if why:
        raise ConversionError(why)
    C, D = cfg.in_channels, cfg.hidden_size
    config = {"_class_name": CLASS_NAME, "patch_size": list(PATCH), "num_attention_heads": cfg.num_heads,
              "attention_head_dim": cfg.head_dim, "in_channels": C, "out_channels": C, "text_dim": cfg.text_dim,
              "freq_dim": cfg.freq_dim, "ffn_dim": cfg.ffn, "num_layers": cfg.depth, "cross_attn_norm": True,
              "qk_norm": "rms_norm_across_heads", "eps": cfg.eps, "image_dim": None, "added_kv_proj_dim": None,
              "rope_max_seq_len": max(cfg.max_grid), "pos_embed_seq_len": None}
    out = {}
    for name, t in state.items():
        if m := re.fullmatch(r"blocks\.(\d+)\.(attn\.qkv|cross\.kv)\.(weight|bias)", name):
            parts = _FUSED[m.group(2)]
            for part, piece in zip(parts, _split_heads(t, cfg.num_heads, len(parts)), strict=True):
                out[f"blocks.{m.group(1)}.{part}.{m.group(3)}"] = piece
            continue
        if name == "x_embedder.weight":
            t = t.reshape(D, C, *PATCH)
        elif name.endswith(("q_norm.weight", "k_norm.weight")):
            t = t.reshape(-1)
        elif name.endswith("scale_shift.weight"):
            t = t.reshape(1, -1, D)
        elif name.startswith("final.linear."):
            t = output_rows(t, to_ditcore=False)
        out[_rename(name, to_ditcore=False)] = t.contiguous()
    return config, out


def output_rows(w: torch.Tensor, to_ditcore: bool) -> torch.Tensor:
    """The output linear's weight or bias rows, diffusers' (pt, p, p, C) ↔ ditcore's (C, pt, p, p)."""
    rest, patch = w.shape[1:], PATCH
    if to_ditcore:
        return w.reshape(*patch, -1, *rest).movedim(3, 0).reshape(w.shape)
    return w.reshape(-1, *patch, *rest).movedim(0, 3).reshape(w.shape)


def _rename(name: str, to_ditcore: bool) -> str:
    for diffusers_name, ditcore_name in _NAMES:
        source, target = (diffusers_name, ditcore_name) if to_ditcore else (ditcore_name, diffusers_name)
        if m := re.match("^" + re.escape(source).replace(re.escape("{i}"), r"(\d+)"), name):
            return target.replace("{i}", m.group(1) if m.groups() else "") + name[m.end():]
    source, target = (CLASS_NAME, "ditcore's Wan") if to_ditcore else ("ditcore's Wan", CLASS_NAME)
    raise ConversionError(f"{source} tensor {name!r} has no place in {target}")


def _interleave(parts: list[torch.Tensor], heads: int) -> torch.Tensor:
    """[q; k; v] (or [k; v]) rows, each (heads, hd), → ditcore's fused rows (heads, len(parts), hd)."""
    stacked = torch.stack([t.reshape(heads, -1, *t.shape[1:]) for t in parts], dim=1)  # (heads, n, hd, ...)
    return stacked.reshape(-1, *parts[0].shape[1:])


def _split_heads(fused: torch.Tensor, heads: int, n: int) -> list[torch.Tensor]:
    """ditcore's fused rows (heads, n, hd) → n tensors of (heads·hd) rows."""
    parts = fused.reshape(heads, n, -1, *fused.shape[1:]).unbind(1)
    return [p.reshape(-1, *fused.shape[1:]).contiguous() for p in parts]


# ---------------------------------------------------------------- the pipeline around the model
#
# A WanPipeline folder (Wan-AI/Wan2.1-T2V-1.3B-Diffusers) holds, beside transformer/, what the network was trained and
# is sampled with: the latent units of its VAE (vae/), its text encoder (text_encoder/, tokenizer/) and its sampler
# (scheduler/). These read their configs (as dicts: the folders are the caller's).

PIPELINE = "WanPipeline"
VAE_CLASS = "AutoencoderKLWan"
TEXT_ENCODER = "umt5"  # the config model_type of WanPipeline's UMT5EncoderModel: ditcore's umt5:<folder> encoder
# WanPipeline's guidance_scale default (its __call__), dit-sample's default for an imported Wan
GUIDANCE = 5.0
# Where a folder has no scheduler to say: Wan 2.1's own text-to-video defaults (its generate.py: sample_shift 5.0,
# 3.0 being its advice for 480p, and sample_solver 'unipc', which the 1.3B pipeline's scheduler/ also holds)
DEFAULT_SHIFT, DEFAULT_SOLVER = 5.0, "unipc"
# The flow schedulers whose loops ditcore samples with, and which of its solvers each is
SOLVERS = {"FlowMatchEulerDiscreteScheduler": "euler", "UniPCMultistepScheduler": "unipc"}
# UniPC settings that flow sigmas never read: the DDPM β table (ᾱ), the integer timestep spacing that the flow
# timesteps replace, and dynamic thresholding's parameters (thresholding itself is compared)
_UNREAD_BY_FLOW_SIGMAS = ("beta_start", "beta_end", "beta_schedule", "trained_betas", "rescale_betas_zero_snr",
                          "timestep_spacing", "steps_offset", "sigma_min", "sigma_max", "dynamic_thresholding_ratio",
                          "sample_max_value")


def pipeline_refusal(index: dict) -> str | None:
    """Why ditcore does not sample a pipeline of this model_index.json as WanPipeline samples it, or None: another
    pipeline class (image-to-video, VACE, video-to-video), or Wan 2.2's second expert or per-token timesteps."""
    name = index.get("_class_name")
    if name != PIPELINE:
        return (f"the pipeline is a {name!r} (model_index.json _class_name): ditcore samples text-to-video Wan as "
                f"{PIPELINE} does — image-to-video and the other Wan pipelines are not ditcore's")
    second = index.get("transformer_2")
    if second not in (None, [None, None]) or index.get("boundary_ratio") is not None:
        return ("the pipeline has a second transformer (transformer_2, boundary_ratio): Wan 2.2's two experts for "
                "high and low noise are not ditcore's Wan, which is one network")
    if index.get("expand_timesteps"):
        return "the pipeline says expand_timesteps=true: Wan 2.2's per-token timesteps are not ditcore's Wan"
    return None


def latent_units(config: dict) -> LatentStats:
    """The latent units WanPipeline's network works in, from its AutoencoderKLWan's config.json: (z − latents_mean) /
    latents_std per channel of the VAE's latents z (WanPipeline decodes latents·latents_std + latents_mean), which is
    ditcore's (z − mean)/std·σ_d for mean = latents_mean, std = latents_std·σ_d. ConversionError for a config that
    does not give them."""
    name = config.get("_class_name")
    if name != VAE_CLASS:
        raise ConversionError(f"the VAE is a {name!r}: Wan's latents are an {VAE_CLASS}'s")
    channels = config.get("z_dim", 16)  # AutoencoderKLWan's default, as diffusers gives it
    units = {}
    for key in ("latents_mean", "latents_std"):
        values = config.get(key)
        if (not isinstance(values, list) or len(values) != channels or not all(
                isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in values)):
            raise ConversionError(f"the VAE config's {key} is {str(values)[:80]}: expected {channels} finite numbers "
                                  f"(z_dim), the per-channel statistics WanPipeline normalises latents by")
        units[key] = torch.tensor(values, dtype=torch.float64)
    if not bool((units["latents_std"] > 0).all()):
        raise ConversionError("the VAE config's latents_std has a value <= 0: expected positive per-channel stds")
    return LatentStats(units["latents_mean"].float(), (units["latents_std"] * SIGMA_DATA).float())


def text_encoder_refusal(config: dict, text_dim: int) -> str | None:
    """Why the pipeline's text_encoder/config.json is not the encoder a network of text width text_dim reads, or
    None."""
    kind, width = config.get("model_type"), config.get("d_model")
    if kind != TEXT_ENCODER:
        return f"its text encoder is a {kind!r} model (model_type): WanPipeline's is a {TEXT_ENCODER} encoder"
    if width != text_dim:
        return f"its text encoder is {width} wide (d_model), the transformer reads text {text_dim} wide (text_dim)"
    return None


def sampling_from_scheduler(config: dict) -> tuple[TimeShift, str]:
    """(the time shift, ditcore's solver) that sample a network as a WanPipeline with this scheduler_config.json does:
    FlowMatchEulerDiscreteScheduler (its `shift`; use_dynamic_shifting: Flux's shift by token count, from its
    base/max fields) is solver euler, UniPCMultistepScheduler with flow sigmas (its `flow_shift`) solver unipc.

    The scheduler ditcore then samples with, built from the shift alone, must be the folder's: every setting it reads
    is compared, and the first that differs is refused by name (ConversionError), as is any other scheduler class."""
    name = config.get("_class_name")
    if name not in SOLVERS:
        raise ConversionError(f"the scheduler is a {name!r} (_class_name): ditcore samples Wan with the loops of "
                              f"{' and '.join(SOLVERS)} — save the pipeline with one of them (Wan 2.1's: "
                              "UniPCMultistepScheduler(prediction_type='flow_prediction', use_flow_sigmas=True, "
                              "flow_shift=3.0))")
    try:
        shift = _time_shift(name, config)
    except (TypeError, ValueError) as e:
        raise ConversionError(f"the {name} config does not give a time shift: {e}") from None
    ours = reference_scheduler(SOLVERS[name], shift).config
    unread = _UNREAD_BY_FLOW_SIGMAS if name == "UniPCMultistepScheduler" else ("shift",) if shift.dynamic else ()
    for key, value in config.items():
        if key.startswith("_") or key in unread or key not in ours:  # a newer diffusers' field: this one ignores it
            continue
        if not _same(value, ours[key]):
            raise ConversionError(f"the scheduler says {key}={value!r}: ditcore samples Wan with {name}'s loop at "
                                  f"{key}={ours[key]!r} (set from the time shift alone), and follows no other")
    return shift, SOLVERS[name]


def reference_scheduler(solver: str, shift: TimeShift):
    """The diffusers scheduler whose loop ditcore's solver follows for this shift: FlowMatchEulerDiscreteScheduler
    (flow_sampler's euler: ditcore.diffusion.flow.flow_timesteps) or UniPC (its own object: unipc_scheduler)."""
    if solver == "unipc":
        return unipc_scheduler(shift)
    from diffusers import FlowMatchEulerDiscreteScheduler  # deferred: importing diffusers takes seconds

    return FlowMatchEulerDiscreteScheduler(shift=shift.shift, use_dynamic_shifting=shift.dynamic,
                                           base_shift=shift.base_shift, max_shift=shift.max_shift,
                                           base_image_seq_len=shift.base_seq_len, max_image_seq_len=shift.max_seq_len)


def _time_shift(name: str, config: dict) -> TimeShift:
    if name == "UniPCMultistepScheduler":
        if config.get("use_dynamic_shifting", False):  # its mu's line in the token count is nowhere in the config
            raise ConversionError("the UniPCMultistepScheduler says use_dynamic_shifting=true: WanPipeline passes it "
                                  "no mu (it cannot sample so), and its config does not say how mu grows with the "
                                  "tokens — save it with a flow_shift")
        return TimeShift(shift=float(config.get("flow_shift", 1.0)))
    if config.get("use_dynamic_shifting", False):
        return TimeShift(dynamic=True, base_shift=config.get("base_shift", 0.5),
                         max_shift=config.get("max_shift", 1.15), base_seq_len=config.get("base_image_seq_len", 256),
                         max_seq_len=config.get("max_image_seq_len", 4096))
    return TimeShift(shift=float(config.get("shift", 1.0)))


def _same(a, b) -> bool:
    """Config values equal as diffusers reads them: JSON's lists are its tuples, 1000 is 1000.0."""
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b and isinstance(a, bool) == isinstance(b, bool)
