"""MovieGen's Llama-style DiT (Polyak et al., "Movie Gen: A Cast of Media Foundation Models", 2024), at the sizes
of NVIDIA NeMo's DiT-Llama configs (nemo/collections/diffusion/models/model.py: DiTLlama1B/5B/30BConfig).

A Llama-3 transformer block made a diffusion block: RMSNorm pre-norms, a SwiGLU MLP, grouped-query attention
(`num_kv_heads` key/value heads shared by groups of query heads) with per-head QK-norm and 3D RoPE, adaLN
modulation (shift, scale, gate) of the self-attention and MLP by the noise level, and cross-attention to the text
tokens (MovieGen's UL2 + ByT5 + MetaCLIP states are one text input of configurable width here). No linear in a
block has a bias, as in Llama.

Everything around the blocks — patch embedding, positions, packing, conditioning, the final layer, the row split
for context parallelism — is the DiT's (ditcore.models.dit): this file only defines the block, so a MovieGen
model goes wherever a DiT goes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ditcore.errors import ConfigError
from ditcore.models.attention import attend
from ditcore.models.dit import (
    DIT_PLAN,
    AttentionInputs,
    DiT,
    DiTBlock,
    DiTConfig,
    add_embedders,
    moe_mlp,
    no_text,
)
from ditcore.models.layers import RMSNorm, apply_rope
from ditcore.models.plan import ColumnParallel, Plan, RowParallel
from ditcore.models.registry import Architecture, register


@dataclass(frozen=True)
class MovieGenConfig(DiTConfig):
    num_kv_heads: int = 0  # key/value heads (grouped-query attention); 0: as many as query heads
    ffn_hidden_size: int = 0  # SwiGLU width; 0: Llama's 8/3 · hidden_size, rounded up to a multiple of 256
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.num_kv_heads, int) or self.num_kv_heads < 0 or (
                self.num_kv_heads and self.num_heads % self.num_kv_heads):
            raise ConfigError("num_kv_heads", self.num_kv_heads, f"a divisor of num_heads={self.num_heads} (or 0)")
        if not isinstance(self.ffn_hidden_size, int) or self.ffn_hidden_size < 0:
            raise ConfigError("ffn_hidden_size", self.ffn_hidden_size, "an integer >= 1 (or 0: 8/3 of hidden_size)")

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or -(-8 * self.hidden_size // 3 // 256) * 256


def heads_by_kv(x: torch.Tensor, seq: int, batch: int, kv_heads: int, per_kv: int, head_dim: int):
    """(seq, B, kv·(per_kv + 2)·hd) projections laid out (kv group, [its queries, key, value], hd) → q (B, H, seq,
    hd) and k, v (B, kv, seq, hd). Grouping by key/value head makes a contiguous split of the output features a
    split by groups, which tensor parallelism needs."""
    x = x.view(seq, batch, kv_heads, per_kv + 2, head_dim).permute(1, 2, 3, 0, 4)  # (B, kv, g + 2, seq, hd)
    q = x[:, :, :per_kv].reshape(batch, kv_heads * per_kv, seq, head_dim)
    return q, x[:, :, per_kv], x[:, :, per_kv + 1]


class GroupedSelfAttention(nn.Module):
    def __init__(self, cfg: MovieGenConfig):
        super().__init__()
        # num_heads / num_kv_heads: this rank's under TP (both divided by the TP size)
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.kv_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, (cfg.num_heads + 2 * cfg.kv_heads) * cfg.head_dim, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, eps=1e-6) if cfg.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(cfg.head_dim, eps=1e-6) if cfg.qk_norm else nn.Identity()
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, a: AttentionInputs) -> torch.Tensor:
        g = self.num_heads // self.num_kv_heads
        q, k, v = heads_by_kv(self.qkv(x), a.seq, a.batch, self.num_kv_heads, g, self.head_dim)
        q, k = self.q_norm(q), self.k_norm(k)
        if a.rope is not None:
            q, k = apply_rope(q, a.rope), apply_rope(k, a.rope)
        k, v = a.rows.keys_values(k, v)  # the whole row's keys and values (context parallelism): kv heads only
        out = attend(q, k, v, a.mask, enable_gqa=g > 1)  # (B, H, seq, hd); each kv head serves its g query heads
        return self.proj(out.permute(2, 0, 1, 3).reshape(a.seq, a.batch, -1))  # (seq, B, D)


class GroupedCrossAttention(nn.Module):
    """Image tokens attend to the (already projected) text tokens with grouped key/value heads; no positions."""

    def __init__(self, cfg: MovieGenConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.kv_heads, cfg.head_dim
        self.q = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.kv = nn.Linear(cfg.hidden_size, 2 * cfg.kv_heads * cfg.head_dim, bias=False)  # (kv, 2, hd)
        self.q_norm = RMSNorm(cfg.head_dim, eps=1e-6) if cfg.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(cfg.head_dim, eps=1e-6) if cfg.qk_norm else nn.Identity()
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, a: AttentionInputs) -> torch.Tensor:
        L = a.text.shape[1]
        q = self.q(x).view(a.seq, a.batch, self.num_heads, self.head_dim).permute(1, 2, 0, 3)  # (B, H, seq, hd)
        kv = self.kv(a.text.transpose(0, 1)).view(L, a.batch, self.num_kv_heads, 2, self.head_dim)
        k, v = kv.permute(3, 1, 2, 0, 4).unbind(0)  # (B, kv, L, hd)
        if L == 0:  # no text at all
            return self.proj(no_text(self.q_norm(q), self.k_norm(k), v, a.seq, a.batch))
        out = attend(self.q_norm(q), self.k_norm(k), v, a.text_mask,  # a sample without text gets zeros
                     enable_gqa=self.num_heads > self.num_kv_heads)
        return self.proj(out.permute(2, 0, 1, 3).reshape(a.seq, a.batch, -1))  # (seq, B, D)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) · up(x)), Llama's MLP, with gate and up as one matrix: one matmul, and under sequence
    parallelism one all-gather of x, not two.

    gate_up's output features are laid out (hidden, 2): each hidden unit's gate row, then its up row. A contiguous
    split of them over tensor-parallel ranks (a column-parallel linear) so gives every rank whole units, gate and up
    alike, whatever the number of ranks; a (2, hidden) layout would give the first ranks only gates.
    """

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).unflatten(-1, (-1, 2)).unbind(-1)  # (..., hidden) each: views
        return self.down(F.silu(gate) * up)


class MovieGenBlock(DiTBlock):
    """DiTBlock's forward (adaLN-modulated attention and MLP, cross-attention between them) over Llama's layers."""

    def __init__(self, cfg: MovieGenConfig, own_embedders: bool = False, moe: bool = False):
        nn.Module.__init__(self)  # the layers are these, not the DiT block's
        D = cfg.hidden_size
        if own_embedders:  # DiTConfig.block_embedders
            self.own_embedders = True
            add_embedders(self, cfg)
        self.norm1 = RMSNorm(D, eps=cfg.norm_eps, elementwise_affine=False)  # adaLN scales it
        self.attn = GroupedSelfAttention(cfg)
        if cfg.text_dim:
            self.norm_cross = RMSNorm(D, eps=cfg.norm_eps)
            self.cross = GroupedCrossAttention(cfg)
        self.norm2 = RMSNorm(D, eps=cfg.norm_eps, elementwise_affine=False)
        self.moe = moe
        self.mlp = moe_mlp(cfg, SwiGLU, glu=True) if moe else SwiGLU(D, cfg.ffn)
        self.adaLN = nn.Sequential(nn.SiLU(), nn.Linear(D, 6 * D))


class MovieGen(DiT):
    """The DiT with MovieGen's blocks (see the module's docstring); same inputs, outputs and initialisation rules."""

    block_class = MovieGenBlock
    norm_class = RMSNorm

    @staticmethod
    def upgrade_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Exports written while gate and up were two matrices (`mlp.gate`, `mlp.up`): the same weights, as one
        `mlp.gate_up` laid out (hidden, 2) (SwiGLU)."""
        state = dict(state)
        for key in [k for k in state if k.endswith(".mlp.gate.weight")]:
            up = key.replace(".mlp.gate.", ".mlp.up.")
            if up in state:
                gate_up = torch.stack([state.pop(key), state.pop(up)], dim=1)  # (hidden, 2, dim)
                state[key.replace(".mlp.gate.", ".mlp.gate_up.")] = gate_up.flatten(0, 1)
        return state


# Sizes of NeMo's DiTLlama{1B,5B,30B}Config (DiTLlama30BConfig: 48 layers, 6144 wide, 48 heads, FFN 16384 and 8
# query groups, which the 5B and 1B inherit; the MovieGen paper's 30B has the same width, depth and heads), patch
# 2 x 2 x 1 as there, and the inputs of NeMo's DiTConfig: 16 latent channels (its video tokenizer's) and text states
# 1024 wide (crossattn_emb_size), which a dataset's replace and `--plan` assumes without one. A tiny one for tests.
_NEMO = dict(in_channels=16, text_dim=1024)
PRESETS: dict[str, MovieGenConfig] = {
    "MovieGen-1B": MovieGenConfig(hidden_size=2048, depth=16, num_heads=32, num_kv_heads=8, ffn_hidden_size=8192,
                                  **_NEMO),
    "MovieGen-5B": MovieGenConfig(hidden_size=3072, depth=32, num_heads=24, num_kv_heads=8, ffn_hidden_size=8192,
                                  **_NEMO),
    "MovieGen-30B": MovieGenConfig(hidden_size=6144, depth=48, num_heads=48, num_kv_heads=8, ffn_hidden_size=16384,
                                   **_NEMO),
    "MovieGen-Tiny": MovieGenConfig(hidden_size=64, depth=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=128),
}

# The DiT's tensor-parallel plan with grouped-query attention and a SwiGLU MLP
MOVIEGEN_PLAN = Plan(
    modules={k: v for k, v in DIT_PLAN.modules.items() if not k.startswith("blocks.*[0-9].mlp.")} | {
        # attn.qkv's output features are laid out (kv group, [queries, key, value], head_dim): a split by groups;
        # cross.kv's (kv group, 2, head_dim), likewise; mlp.gate_up's (hidden, [gate, up]): a split by hidden units
        "blocks.*.mlp.gate_up": ColumnParallel(),
        "blocks.*.mlp.down": RowParallel(),
    },
    heads=DIT_PLAN.heads,
    pipeline=DIT_PLAN.pipeline,
)

register(Architecture("moviegen", MovieGenConfig, MovieGen, PRESETS, tiny="MovieGen-Tiny", plan=MOVIEGEN_PLAN,
                      summary="MovieGen's Llama-style DiT (RMSNorm, SwiGLU, grouped-query attention)"))

__all__ = ["MOVIEGEN_PLAN", "PRESETS", "MovieGen", "MovieGenBlock", "MovieGenConfig"]
