"""The original DiT's checkpoints (Peebles & Xie's facebookresearch/DiT, its `models.py`) ↔ ditcore's DiT.

The architectures coincide; the state dicts differ in names and in two layouts:
- qkv: DiT's timm attention lays its output rows out (3, heads, head_dim), ditcore (heads, 3, head_dim), so that a
  contiguous split of the rows is a split by heads (tensor parallelism);
- the patch embedder is a Conv2d (D, C, p, p) there, a Linear (D, C·p·p) on tokens here (the same numbers), and the
  final linear's rows are (p, p, C_out) there, (C_out, p, p) here, ditcore's token layout (ditcore.layout.patchify).
The modulations' order (shift, scale, gate for attention, then for the MLP) is the same. DiT's fixed `pos_embed`
buffer is checked against ditcore's `sincos_2d` table and not carried over; DiT's learned Σ (its output channels
doubled) becomes `learn_sigma`. The number of heads is not in a state dict: the paper's sizes give it, or the caller.
"""

from __future__ import annotations

import re

import torch

from ditcore.layout import grid_positions
from ditcore.models.dit import DiTConfig
from ditcore.models.layers import sincos_2d

# DiT's Table 1: width → heads (S, B, L, XL); any other width needs the caller's num_heads
PAPER_HEADS = {384: 6, 768: 12, 1024: 16, 1152: 16}
SIGNATURE = "x_embedder.proj.weight"  # the key that tells a DiT state dict apart

_RENAMES = [  # DiT's name → ditcore's (the layouts changed by `_to_ditcore` are renamed here too)
    (r"^x_embedder\.proj\.", "x_embedder."),
    (r"^y_embedder\.embedding_table\.", "y_embedder."),
    (r"^blocks\.(\d+)\.adaLN_modulation\.1\.", r"blocks.\1.adaLN.1."),
    (r"^blocks\.(\d+)\.mlp\.fc1\.", r"blocks.\1.mlp.0."),
    (r"^blocks\.(\d+)\.mlp\.fc2\.", r"blocks.\1.mlp.2."),
    (r"^final_layer\.adaLN_modulation\.1\.", "final.adaLN.1."),
    (r"^final_layer\.linear\.", "final.linear."),
]


class ConversionError(ValueError):
    """Weights that do not convert, with what differs and what to do."""


def is_original(state: dict[str, torch.Tensor]) -> bool:
    return SIGNATURE in state


def qkv_rows(w: torch.Tensor, heads: int, to_ditcore: bool) -> torch.Tensor:
    """qkv weight or bias rows (3, heads, hd) ↔ (heads, 3, hd)."""
    shape = (3, heads, -1) if to_ditcore else (heads, 3, -1)
    return w.reshape(*shape, *w.shape[1:]).transpose(0, 1).reshape(w.shape)


def output_rows(w: torch.Tensor, p: int, to_ditcore: bool) -> torch.Tensor:
    """The final linear's weight or bias rows (p, p, C_out) ↔ (C_out, p, p)."""
    rest = w.shape[1:]
    if to_ditcore:
        return w.reshape(p, p, -1, *rest).movedim(2, 0).reshape(w.shape)
    return w.reshape(-1, p, p, *rest).movedim(0, 2).reshape(w.shape)


def infer_config(state: dict[str, torch.Tensor], num_heads: int | None = None) -> DiTConfig:
    """The DiTConfig of a DiT state dict: width, depth, patch, channels, classes, learned Σ and the grid of its
    position table; heads from the paper's sizes or `num_heads`."""
    D, C, p, _ = state[SIGNATURE].shape
    depth = len({m.group(1) for k in state if (m := re.match(r"blocks\.(\d+)\.", k))})
    if num_heads is None:
        if D not in PAPER_HEADS:
            sizes = ", ".join(map(str, PAPER_HEADS))
            raise ConversionError(f"a DiT of width {D} is none of the paper's sizes ({sizes}),"
                                  " and a state dict does not record its heads: give them (model.num_heads / "
                                  "--num-heads)")
        num_heads = PAPER_HEADS[D]
    c_out = state["final_layer.linear.weight"].shape[0] // p**2
    if c_out not in (C, 2 * C):
        raise ConversionError(f"final_layer.linear outputs {c_out} channels per pixel for {C} input channels: "
                              f"expected {C} or {2 * C} (learned Σ)")
    classes = 0
    if "y_embedder.embedding_table.weight" in state:
        rows = state["y_embedder.embedding_table.weight"].shape[0]
        classes = rows - 1  # DiT trains with label dropout (its train.py always): the null class is the last row
    grid = 256  # without a position table (a DiT always has one), any grid up to the default
    if "pos_embed" in state:
        n = state["pos_embed"].shape[1]
        grid = round(n**0.5)
        if grid * grid != n:
            raise ConversionError(f"pos_embed has {n} positions, not a square grid: DiT's table is square")
    return DiTConfig(hidden_size=D, depth=depth, num_heads=num_heads, patch_size=p, in_channels=C,
                     mlp_ratio=state["blocks.0.mlp.fc1.weight"].shape[0] / D, num_classes=classes,
                     pos_embed="sincos_2d", max_grid=(1, grid, grid), qk_norm=False, learn_sigma=c_out == 2 * C)


def check_position_table(state: dict[str, torch.Tensor], cfg: DiTConfig) -> None:
    """A DiT checkpoint's pos_embed must be DiT's fixed table: ditcore computes it, it does not learn one."""
    if "pos_embed" not in state:
        return
    g = cfg.max_grid[1]
    expected = sincos_2d(grid_positions((1, g, g)), cfg.hidden_size)
    error = (state["pos_embed"].reshape(expected.shape).float() - expected).abs().max().item()
    if error > 1e-4:  # float32 rounding of a float64 table is ~1e-7; a learned or other table differs by O(1)
        raise ConversionError(f"pos_embed differs from DiT's fixed 2-D sin-cos table by up to {error:.3g}: a learned "
                              "or other position table is not supported")


def to_ditcore(state: dict[str, torch.Tensor], num_heads: int | None = None
               ) -> tuple[DiTConfig, dict[str, torch.Tensor]]:
    """(config, ditcore one-device state dict) of an original DiT state dict."""
    cfg = infer_config(state, num_heads)
    check_position_table(state, cfg)
    out = {}
    for name, t in state.items():
        if name == "pos_embed":
            continue
        new = name
        for pattern, repl in _RENAMES:
            new = re.sub(pattern, repl, new)
        if name == SIGNATURE:
            t = t.reshape(t.shape[0], -1)
        elif re.fullmatch(r"blocks\.\d+\.attn\.qkv\.(weight|bias)", name):
            t = qkv_rows(t, cfg.num_heads, to_ditcore=True)
        elif name.startswith("final_layer.linear."):
            t = output_rows(t, cfg.patch_size, to_ditcore=True)
        out[new] = t.contiguous()
    return cfg, out

