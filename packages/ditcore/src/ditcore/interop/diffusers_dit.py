"""diffusers' `DiTTransformer2DModel` ↔ ditcore's DiT.

diffusers' port of DiT differs from the original in three ways that change its function, so loading diffusers
weights and loading the original's are different conversions:
- its timestep sinusoid uses frequencies 10000^(-k/(half − 1)) (`downscale_freq_shift=1`), the original's
  10000^(-k/half): ditcore's `freq_shift=1`;
- the LayerNorm before each MLP has eps `norm_eps` (1e-5 by default), the original's 1e-6: `mlp_norm_eps`;
- every block holds its own timestep and class embedders, and the final layer reads block 0's. Converted from the
  original DiT they are copies of its one (ditcore's one embedder, shared); trained in diffusers they differ
  (ditcore's `block_embedders`: block 0's are the model's, as for diffusers' final layer).
Its position table is non-persistent (not in the weights), computed as DiT's for its `sample_size`.
Names map one to one, except the attention's separate q, k, v (ditcore: one qkv, rows (heads, 3, head_dim)) and the
patch layouts that the original shares (ditcore.interop.original).
"""

from __future__ import annotations

import re

import torch

from ditcore.interop.original import ConversionError, output_rows
from ditcore.models.dit import DiTConfig

CONFIG_FILE, WEIGHTS_FILE = "config.json", "diffusion_pytorch_model.safetensors"
CLASS_NAME = "DiTTransformer2DModel"
# diffusers' DiT was first published as a Transformer2DModel (facebook/DiT-XL-2-256's config.json), which diffusers
# loads as the class its norm_type names (its models/model_loading_utils.py, _CLASS_REMAPPING_DICT): this one's.
LEGACY_CLASS_NAME, LEGACY_NORM_TYPE = "Transformer2DModel", "ada_norm_zero"
_EMBEDDERS = "transformer_blocks.{i}.norm1.emb."

_NAMES = [  # diffusers' name prefix ↔ ditcore's, for every tensor that maps one to one ({i}: a block's number)
    ("pos_embed.proj.", "x_embedder."),
    (_EMBEDDERS.format(i=0) + "timestep_embedder.linear_1.", "t_embedder.mlp.0."),
    (_EMBEDDERS.format(i=0) + "timestep_embedder.linear_2.", "t_embedder.mlp.2."),
    (_EMBEDDERS.format(i=0) + "class_embedder.embedding_table.", "y_embedder."),
    (_EMBEDDERS + "timestep_embedder.linear_1.", "blocks.{i}.t_embedder.mlp.0."),  # block_embedders, blocks 1…
    (_EMBEDDERS + "timestep_embedder.linear_2.", "blocks.{i}.t_embedder.mlp.2."),
    (_EMBEDDERS + "class_embedder.embedding_table.", "blocks.{i}.y_embedder."),
    ("transformer_blocks.{i}.norm1.linear.", "blocks.{i}.adaLN.1."),
    ("transformer_blocks.{i}.attn1.to_out.0.", "blocks.{i}.attn.proj."),
    ("transformer_blocks.{i}.ff.net.0.proj.", "blocks.{i}.mlp.0."),
    ("transformer_blocks.{i}.ff.net.2.", "blocks.{i}.mlp.2."),
    ("proj_out_1.", "final.adaLN.1."),
    ("proj_out_2.", "final.linear."),
]


def check_class(config: dict, where: str) -> None:
    """Refuse, naming the field, a config.json that diffusers does not load as a DiTTransformer2DModel."""
    name = config.get("_class_name")
    if name == LEGACY_CLASS_NAME:
        norm = config.get("norm_type", "layer_norm")  # Transformer2DModel's default
        if norm != LEGACY_NORM_TYPE:
            raise ConversionError(f"'{where}' holds a {LEGACY_CLASS_NAME} with norm_type={norm!r}, which diffusers "
                                  f"loads as another model than a DiT (a DiT's is {LEGACY_NORM_TYPE!r})")
        for key in ("cross_attention_dim", "num_vector_embeds"):  # a DiT neither cross-attends nor embeds tokens
            if config.get(key) is not None:
                raise ConversionError(f"'{where}' holds a {LEGACY_CLASS_NAME} with {key}={config[key]!r}: not a DiT "
                                      f"(a DiT's is null)")
    elif name != CLASS_NAME:
        raise ConversionError(f"'{where}' holds a {name!r}, not a {CLASS_NAME} (nor a {LEGACY_CLASS_NAME} with "
                              f"norm_type {LEGACY_NORM_TYPE!r}, as diffusers' first DiTs were saved)")


def config_from_diffusers(config: dict) -> DiTConfig:
    """The DiTConfig of a DiTTransformer2DModel config.json (a field it lacks takes that class's default, as when
    diffusers loads it); ConversionError naming the first setting ditcore's DiT does not have."""
    need = {"norm_type": "ada_norm_zero", "activation_fn": "gelu-approximate", "attention_bias": True,
            "norm_elementwise_affine": False}
    for key, value in need.items():
        if config.get(key, value) != value:
            raise ConversionError(f"{CLASS_NAME} with {key}={config[key]!r} has no ditcore counterpart (it has "
                                  f"{key}={value!r})")
    heads, head_dim = config.get("num_attention_heads", 16), config.get("attention_head_dim", 72)
    C, p, size = config.get("in_channels", 4), config.get("patch_size", 2), config.get("sample_size", 32)
    c_out = config.get("out_channels") or C
    if c_out not in (C, 2 * C):
        raise ConversionError(f"{CLASS_NAME} with out_channels={c_out} for in_channels={C}: ditcore's DiT outputs "
                              f"{C}, or {2 * C} with learned Σ")
    if size % p:
        raise ConversionError(f"{CLASS_NAME} with sample_size={size} that patch_size={p} does not divide")
    classes = config.get("num_embeds_ada_norm", 1000) or 0
    return DiTConfig(hidden_size=heads * head_dim, depth=config.get("num_layers", 28), num_heads=heads, patch_size=p,
                     in_channels=C, num_classes=classes, pos_embed="sincos_2d", max_grid=(1, size // p, size // p),
                     qk_norm=False, learn_sigma=c_out == 2 * C, freq_shift=1,
                     mlp_norm_eps=float(config.get("norm_eps", 1e-5)))


def to_ditcore(config: dict, state: dict[str, torch.Tensor]) -> tuple[DiTConfig, dict[str, torch.Tensor]]:
    """(config, ditcore one-device state dict) of a DiTTransformer2DModel's config.json and weights."""
    cfg = config_from_diffusers(config)
    shared = _shared_embedders(state, cfg.depth)
    cfg = cfg.replace(block_embedders=not shared)
    table = state.get(_EMBEDDERS.format(i=0) + "class_embedder.embedding_table.weight")
    if cfg.num_classes and table is not None and table.shape[0] != cfg.num_classes + 1:
        raise ConversionError(f"the class table has {table.shape[0]} rows for num_embeds_ada_norm={cfg.num_classes}: "
                              "it was built without label dropout, so it has no null class for guidance")
    out = {}
    for name, t in state.items():
        if shared and name.startswith("transformer_blocks.") and ".norm1.emb." in name and not name.startswith(
                "transformer_blocks.0."):
            continue  # the copies of block 0's embedders
        if m := re.fullmatch(r"transformer_blocks\.(\d+)\.attn1\.to_([qkv])\.(weight|bias)", name):
            if m.group(2) == "q":
                i, kind = m.group(1), m.group(3)
                qkv = [state[f"transformer_blocks.{i}.attn1.to_{x}.{kind}"] for x in "qkv"]
                out[f"blocks.{i}.attn.qkv.{kind}"] = _interleave(qkv, cfg.num_heads)
            continue
        new = _rename(name, to_ditcore=True)
        if new == "x_embedder.weight":
            t = t.reshape(t.shape[0], -1)
        elif new.startswith("final.linear."):
            t = output_rows(t, cfg.patch_size, to_ditcore=True)
        out[new] = t.contiguous()
    return cfg, out


def refusal(cfg: DiTConfig, approximate: bool = False, ddpm: bool = True) -> str | None:
    """Why DiTTransformer2DModel cannot hold this model (the first feature it lacks), or None.

    approximate: accept the two numerical differences of diffusers' port (timestep sinusoid, pre-MLP eps), as
    diffusers' own conversion of the original DiT does — for a DDPM-trained network (ddpm) only, the kind that
    conversion accepted them for. Any other (EDM-preconditioned, flow) is refused: nothing measured says what the other
    sinusoid does to it, and on random weights it moves EDM's D(x; σ) by a quarter to a third of its range
    (tests/apps/test_diffusers_config.py); train it with freq_shift=1 instead (apps/train/configs/dit-xl-diffusers)."""
    from ditcore.models.registry import arch_of

    arch = arch_of(cfg)
    if arch != "dit":
        return f"model.arch={arch}: {CLASS_NAME} is the DiT only"
    checks = [
        (cfg.pos_embed == "sincos_2d", f"pos_embed={cfg.pos_embed}: it has DiT's fixed 2-D sin-cos table only "
                                       "(sincos_2d), no RoPE or 3-D table"),
        (not cfg.qk_norm, "qk_norm: its attention has no query/key norm"),
        (not cfg.text_dim, f"text conditioning (text_dim={cfg.text_dim}): it is class-conditional only"),
        (cfg.max_grid[0] == 1 and cfg.patch_size_t == 1, "video: it takes images only"),
        (not cfg.fps_cond, "fps conditioning"),
        (cfg.num_classes > 0, "an unconditional model: it is class-conditional only"),
        (cfg.max_grid[1] == cfg.max_grid[2], f"a non-square grid {cfg.max_grid[1:]}: its sample_size is square"),
        (cfg.mlp_ratio == 4.0, f"mlp_ratio={cfg.mlp_ratio}: its MLP is 4x wide"),
        (approximate or cfg.freq_shift == 1, "freq_shift=0 (the original DiT's timestep sinusoid): its sinusoid is "
                                             "10000^(-k/(half-1)); pass --approximate to export anyway, as diffusers' "
                                             "conversion of the original DiT does"),
        (approximate or (cfg.mlp_norm_eps in (1e-5, 1e-6) and cfg.freq_shift == 1),
         f"mlp_norm_eps={cfg.mlp_norm_eps}"),
        (ddpm or not approximate or cfg.freq_shift == 1,
         "--approximate is for DDPM-trained DiTs (as diffusers' own conversion of DiT-XL/2), and this network is not: "
         "its timestep sinusoid 10000^(-k/half) replaced by diffusers' moves its output far beyond float error "
         "(EDM's D by a quarter to a third of its range on random weights) — train with model.freq_shift=1 (dit-train "
         "--config dit-xl-diffusers) for an exact export"),
    ]
    return next((f"cannot export to diffusers: {why}" for ok, why in checks if not ok), None)


def to_diffusers(cfg: DiTConfig, state: dict[str, torch.Tensor], approximate: bool = False, ddpm: bool = True
                 ) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json, weights) of a DiTTransformer2DModel holding ditcore's `state`; ConversionError when it cannot
    (ddpm: whether the network is DDPM-trained, which `refusal`'s approximate needs)."""
    why = refusal(cfg, approximate, ddpm)
    if why:
        raise ConversionError(why)
    p, D = cfg.patch_size, cfg.hidden_size
    config = {"_class_name": CLASS_NAME, "num_attention_heads": cfg.num_heads, "attention_head_dim": cfg.head_dim,
              "in_channels": cfg.in_channels, "out_channels": cfg.out_dim // p**2, "num_layers": cfg.depth,
              "sample_size": cfg.max_grid[1] * p, "patch_size": p, "num_embeds_ada_norm": cfg.num_classes,
              "norm_eps": cfg.mlp_norm_eps, "activation_fn": "gelu-approximate", "attention_bias": True,
              "norm_type": "ada_norm_zero", "norm_elementwise_affine": False, "upcast_attention": False,
              "dropout": 0.0, "norm_num_groups": 32}
    out = {}
    for name, t in state.items():
        if m := re.fullmatch(r"blocks\.(\d+)\.attn\.qkv\.(weight|bias)", name):
            for x, part in zip("qkv", _split_heads(t, cfg.num_heads), strict=True):
                out[f"transformer_blocks.{m.group(1)}.attn1.to_{x}.{m.group(2)}"] = part
            continue
        if name == "x_embedder.weight":
            t = t.reshape(D, cfg.in_channels, p, p)
        elif name.startswith("final.linear."):
            t = output_rows(t, p, to_ditcore=False)
        new = _rename(name, to_ditcore=False)
        if new.startswith("transformer_blocks.0.norm1.emb.") and not cfg.block_embedders:  # one, copied to each
            for i in range(cfg.depth):
                out[new.replace("transformer_blocks.0.", f"transformer_blocks.{i}.", 1)] = t.clone()
        else:
            out[new] = t.contiguous()
    return config, out


def _rename(name: str, to_ditcore: bool) -> str:
    for diffusers_name, ditcore_name in _NAMES:
        source, target = (diffusers_name, ditcore_name) if to_ditcore else (ditcore_name, diffusers_name)
        if m := re.match("^" + re.escape(source).replace(re.escape("{i}"), r"(\d+)"), name):
            return target.replace("{i}", m.group(1) if m.groups() else "") + name[m.end():]
    source, target = (CLASS_NAME, "ditcore's DiT") if to_ditcore else ("ditcore", CLASS_NAME)
    raise ConversionError(f"{source} weight {name!r} has no place in {target}")


def _interleave(qkv: list[torch.Tensor], heads: int) -> torch.Tensor:
    """[q; k; v] rows, each (heads, hd), → ditcore's qkv rows (heads, 3, hd)."""
    stacked = torch.stack([t.reshape(heads, -1, *t.shape[1:]) for t in qkv], dim=1)  # (heads, 3, hd, ...)
    return stacked.reshape(-1, *qkv[0].shape[1:])


def _split_heads(qkv: torch.Tensor, heads: int) -> list[torch.Tensor]:
    """ditcore's qkv rows (heads, 3, hd) → [q, k, v], each (heads·hd) rows."""
    parts = qkv.reshape(heads, 3, -1, *qkv.shape[1:]).unbind(1)
    return [p.reshape(-1, *qkv.shape[1:]).contiguous() for p in parts]


def _shared_embedders(state: dict[str, torch.Tensor], depth: int) -> bool:
    """Whether every block's embedders equal block 0's (a conversion of the original DiT) or differ (trained in
    diffusers, or fresh from its constructor)."""
    first = _EMBEDDERS.format(i=0)
    return all(torch.equal(state[other], state[name])
               for i in range(1, depth) for name in state if name.startswith(first)
               if (other := name.replace(first, _EMBEDDERS.format(i=i), 1)) in state)
