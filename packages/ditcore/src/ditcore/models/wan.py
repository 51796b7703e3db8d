"""Wan 2.1's video DiT (Wan Team, "Wan: Open and Advanced Large-Scale Video Generative Models", 2025), computing what
diffusers' `WanTransformer3DModel` computes (diffusers 0.42, models/transformers/transformer_wan.py), at its published
sizes. ditcore.interop.diffusers_wan converts its weights both ways.

Everything around the blocks is the DiT's (ditcore.models.dit): patch embedding on patchify's tokens (Wan's Conv3d
with kernel = stride = (1, 2, 2) is a linear on them), packing, the row split for context and sequence parallelism,
`forward`. What differs:

- One time projection for the whole model. The timestep (the network's c_noise: t·1000 under flow matching) is
  embedded as diffusers' Timesteps(flip_sin_to_cos=True, downscale_freq_shift=0) then Linear → SiLU → Linear: temb
  (D). SiLU → Linear(D, 6D) of temb is computed once (`time_proj`); each block adds its own learned table (6, D) to it,
  in float32 as diffusers does, for the shift, scale and gate of its self-attention and of its FFN (no adaLN linear in
  a block). The output head adds its table (2, D) to temb itself. Class and fps embeddings, where a config asks for
  them (not Wan's), are added to temb as the DiT adds them to its conditioning.
- Query and key RMS norms over the features of all heads together (diffusers' "rms_norm_across_heads"), before the
  heads are split: under tensor parallelism their mean squares are summed over the ranks (plan style NormOverHeads).
- 3-D RoPE splitting each head into time, height and width parts of Wan's sizes (`wan_rope_split`), angles in float64.
- The cross-attention after the self-attention, behind a LayerNorm with a scale and a shift and without modulation,
  with a plain residual. Biases on every linear; every norm's eps 1e-6.
- The text as Wan attends it (`text_len`, `padded_text_mask`).

Zero-padded text. Wan pads every caption's encoder states with zeros to text_len = 512 tokens and cross-attends to all
of them, unmasked (its pipelines do: diffusers' WanPipeline, the original's T2V). A zero state is not nothing: the text
embedder maps it to W₂·gelu(b₁) + b₂, a key and value like any token's, so a caption of n tokens is attended together
with text_len − n copies of that key. ditcore's rows carry each sample's real tokens only (text_seg names their
samples, −1 padding). The model attends one key more per row, the zero state's, whose score for a query of a sample
with n text tokens is raised by log(text_len − n): softmax over m equal keys is softmax over one whose score is raised
by log m (e^(s + log m) = m·e^s), exactly, without the copies. The counts n come from text_seg on the device (no value
is read back, no shape depends on the data). So text_len is part of the model, a config field: it weighs the zero
states against the caption, and a model trained at 512 must be run at 512. A caption of text_len tokens or more sees no
zero state (Wan's encoder truncates captions at text_len: give the dataset's text encoder that maximum length); a
sample without text, as classifier-free guidance drops it, sees text_len of them. Under bf16 sdpa the raise is rounded
to bf16 as the scores are; flex adds it in float32.

Reads top to bottom: config → positions → modulation tables → attention → block → output head → model → presets →
tensor-parallel plan and registration.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass

import torch
from torch import nn

from ditcore.errors import ConfigError
from ditcore.layout import per_token
from ditcore.models.attention import Mask, RowSplit, attend, block_mask, check_backend, segments
from ditcore.models.dit import (
    DIT_PLAN,
    AttentionInputs,
    DiT,
    DiTBlock,
    DiTConfig,
    embed_conditioning,
    gelu_mlp,
    modulate,
    moe_mlp,
)
from ditcore.models.layers import LayerNorm, RMSNorm, ScalarEmbedder, apply_rope
from ditcore.models.plan import ColumnParallel, NormOverHeads, PipelineSplit, Plan, Replicated, RowParallel
from ditcore.models.registry import Architecture, register

# --------------------------------------------------------------------------------------------------
# Config


@dataclass(frozen=True)
class WanConfig(DiTConfig):
    """DiTConfig's fields (pos_embed: rope only; block_embedders: none, a block reads the model's one projection;
    mlp_norm_eps: unused, every norm takes `eps`), and Wan's."""

    ffn_dim: int = 0  # the FFN's hidden width; 0: hidden_size · mlp_ratio
    freq_dim: int = 256  # sinusoidal features of the timestep
    text_len: int = 512  # every caption is attended with zero states up to this many tokens (module docstring)
    eps: float = 1e-6  # of every norm

    def __post_init__(self) -> None:
        super().__post_init__()
        checks = [
            ("ffn_dim", isinstance(self.ffn_dim, int) and self.ffn_dim >= 0, "an integer >= 1 (or 0: mlp_ratio's)"),
            ("freq_dim", isinstance(self.freq_dim, int) and self.freq_dim >= 2 and self.freq_dim % 2 == 0,
             "an even integer >= 2"),
            ("text_len", isinstance(self.text_len, int) and self.text_len >= 1,
             "an integer >= 1: the length Wan pads every caption to with zero states (512)"),
            ("eps", 0 < self.eps < 1, "a small number > 0, e.g. 1e-6"),
            ("pos_embed", self.pos_embed == "rope", "'rope': Wan's positions are its 3-D RoPE"),
            ("block_embedders", not self.block_embedders,
             "false: Wan's blocks read the model's one time projection, with no embedders of their own"),
        ]
        for field, ok, allowed in checks:
            if not ok:
                raise ConfigError(field, getattr(self, field), allowed)

    @property
    def ffn(self) -> int:
        return self.ffn_dim or int(self.hidden_size * self.mlp_ratio)


# --------------------------------------------------------------------------------------------------
# Positions


def wan_rope_split(head_dim: int) -> tuple[int, int, int]:
    """Rotation pairs given to the (t, h, w) axes as WanRotaryPosEmbed splits a head: head_dim // 6 pairs to height
    and to width each, the rest to time (128 → 22, 21, 21)."""
    h = head_dim // 6
    return head_dim // 2 - 2 * h, h, h


def wan_rope_angles(pos: torch.Tensor, head_dim: int, theta: float) -> torch.Tensor:
    """Wan's RoPE angles (..., head_dim/2) in float64, as diffusers computes its tables, for integer (t, h, w)
    positions (..., 3): each axis's n pairs at frequencies theta^(-k/n), k < n, consecutive pairs (x₂ₖ, x₂ₖ₊₁) of
    the head rotated together (ditcore.models.layers.apply_rope)."""
    angles = []
    for axis, n in enumerate(wan_rope_split(head_dim)):
        inv_freq = theta ** (-torch.arange(n, device=pos.device, dtype=torch.float64) / n)
        angles.append(pos[..., axis, None].double() * inv_freq)
    return torch.cat(angles, dim=-1)


# --------------------------------------------------------------------------------------------------
# Modulation


class ScaleShiftTable(nn.Module):
    """A learned table (rows, D) added to the per-sample rows of the noise level's projection (B, S, rows, D): a block's
    shift, scale, gate of its attention and of its FFN, or the head's shift and scale. In float32, as diffusers adds
    them; the caller applies them in its activations' dtype."""

    def __init__(self, rows: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim))

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        return c.float() + self.weight.float()


# --------------------------------------------------------------------------------------------------
# Attention. Sequence-first activations (N, B, D), as the DiT's.


@dataclass
class WanAttentionInputs(AttentionInputs):
    zero_text: torch.Tensor | None = None  # (1, 1, D): the text embedder's output of a zero state


def heads_norm(cfg: WanConfig) -> nn.Module:
    """An RMS norm over (heads, head_dim) together: all of a token's query (or key) features."""
    return RMSNorm((cfg.num_heads, cfg.head_dim), eps=cfg.eps) if cfg.qk_norm else nn.Identity()


def head_major(x: torch.Tensor) -> torch.Tensor:
    """(seq, B, H, hd) → (B, H, seq, hd), a view."""
    return x.permute(1, 2, 0, 3)


class WanSelfAttention(nn.Module):
    def __init__(self, cfg: WanConfig):
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim  # num_heads: this rank's under TP
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)  # output features (heads, 3, head_dim): TP splits
        self.q_norm, self.k_norm = heads_norm(cfg), heads_norm(cfg)  # them by heads
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, a: AttentionInputs) -> torch.Tensor:
        q, k, v = self.qkv(x).view(a.seq, a.batch, self.num_heads, 3, self.head_dim).unbind(3)  # (seq, B, H, hd)
        q, k, v = head_major(self.q_norm(q)), head_major(self.k_norm(k)), head_major(v)  # (B, H, seq, hd)
        q, k = apply_rope(q, a.rope), apply_rope(k, a.rope)
        k, v = a.rows.keys_values(k, v)  # every query needs every key of its row: (B, H, N, hd)
        out = attend(q, k, v, a.mask)  # (B, H, seq, hd)
        return self.proj(out.permute(2, 0, 1, 3).reshape(a.seq, a.batch, -1))  # (seq, B, D)


class WanCrossAttention(nn.Module):
    """Image tokens attend to the (already projected) text tokens of their sample and to the zero state's key, raised
    for the zero states their caption lacks (`padded_text_mask`); no positions."""

    def __init__(self, cfg: WanConfig):
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.q = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.kv = nn.Linear(cfg.hidden_size, 2 * cfg.hidden_size)  # (heads, 2, head_dim)
        self.q_norm, self.k_norm = heads_norm(cfg), heads_norm(cfg)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def keys_values(self, text: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Text tokens (L, B, D) → normalised keys and values (B, H, L, hd)."""
        L, B = text.shape[:2]
        k, v = self.kv(text).view(L, B, self.num_heads, 2, self.head_dim).unbind(3)  # (L, B, H, hd)
        return head_major(self.k_norm(k)), head_major(v)

    def forward(self, x: torch.Tensor, a: WanAttentionInputs) -> torch.Tensor:
        q = self.q(x).view(a.seq, a.batch, self.num_heads, self.head_dim)
        q = head_major(self.q_norm(q))  # (B, H, seq, hd)
        # The zero state's key and value from a row of its own: the FLOP count (ditcore.flops) tells the text's
        # rows, L a sample, from the rows applied once, and the zero state is the same in every row
        k, v = self.keys_values(a.text.transpose(0, 1))  # (B, H, L, hd)
        k0, v0 = (t.expand(a.batch, -1, -1, -1) for t in self.keys_values(a.zero_text))  # (B, H, 1, hd)
        out = attend(q, torch.cat([k, k0], dim=2), torch.cat([v, v0], dim=2), a.text_mask)  # (B, H, seq, hd)
        return self.proj(out.permute(2, 0, 1, 3).reshape(a.seq, a.batch, -1))  # (seq, B, D)


def padded_text_mask(backend: str, q_seg: torch.Tensor | None, seg: torch.Tensor | None,
                     text_seg: torch.Tensor | None, B: int, seq: int, L: int, text_len: int, dtype: torch.dtype,
                     device: torch.device) -> Mask:
    """Cross-attention of queries of samples q_seg (B, seq) over a row's L text tokens (samples text_seg (B, L), −1
    padding; None: all the sample's) and the zero state's key after them, raised by log(text_len − n) for a query
    whose sample has n text tokens, and hidden when n >= text_len (module docstring). seg (B, N): the whole rows'
    samples, whose length bounds the sample indices; q_seg and seg None: rows of one sample each.

    sdpa: a float mask (B, 1, seq or 1, L + 1), 0 or −inf on the text, log(text_len − n) or −inf on the zero state's
    key; flex: a BlockMask and the raise as a score term (`Mask.bias`), for packed rows (one sample a row has one
    raise, which sdpa's mask broadcasts over the queries)."""
    if text_seg is None:  # every text token the row's (or its first sample's) own
        text_seg = torch.zeros(B, L, dtype=torch.long, device=device)
    if q_seg is None:  # one sample a row: each row's queries alike
        n = (text_seg >= 0).sum(1, keepdim=True)  # (B, 1)
        same, real = (text_seg >= 0)[:, None], None  # (B, 1, L)
    else:
        counts = torch.zeros(B, seg.shape[1], dtype=torch.long, device=device)  # by sample index
        counts.scatter_add_(1, text_seg.clamp(min=0), (text_seg >= 0).long())
        n = counts.gather(1, q_seg.clamp(min=0))  # (B, seq): text tokens of each query's sample
        real = q_seg >= 0
        same = None if backend == "flex" else (q_seg[:, :, None] == text_seg[:, None, :]) & real[..., None]
    zeros = text_len - n  # zero states each query's sample is padded with
    sees_zeros = zeros > 0 if real is None else (zeros > 0) & real
    raise_ = zeros.clamp(min=1).double().log().float()  # log m: m equal keys as one
    if backend == "flex" and real is not None:
        kseg = torch.cat([text_seg, text_seg.new_full((B, 1), -1)], dim=1)  # (B, L + 1)
        zero_key = torch.arange(L + 1, device=device) == L  # (L + 1,)

        def text_or_zeros(b, h, i, j):
            return ((q_seg[b, i] == kseg[b, j]) & (kseg[b, j] >= 0)) | (zero_key[j] & sees_zeros[b, i])

        k_weight = zero_key.float().expand(B, -1)
        torch._dynamo.maybe_mark_dynamic(k_weight, 1)  # the text length changes from batch to batch
        return Mask(block_mask(text_or_zeros, B, seq, L + 1, device), bias=(raise_, k_weight))
    inf = torch.tensor(float("-inf"), device=device)
    attn = torch.cat([torch.where(same, 0.0, inf), torch.where(sees_zeros, raise_, inf)[..., None]], dim=-1)
    if real is None:
        return Mask(attn[:, None].to(dtype))  # (B, 1, 1, L + 1)
    # padding queries (no sample) attend to every key, finitely; their outputs are zeroed
    attn = torch.where(real[..., None], attn, 0.0)
    return Mask(attn[:, None].to(dtype), has_keys=real[..., None])  # (B, 1, seq, L + 1)


# --------------------------------------------------------------------------------------------------
# Block


class WanBlock(DiTBlock):
    """Modulated self-attention, cross-attention behind an affine LayerNorm, modulated GELU(tanh) FFN (or a mixture of
    experts, DiTConfig.moe); the shift, scale and gate from the block's table plus the model's time projection."""

    def __init__(self, cfg: WanConfig, moe: bool = False):
        nn.Module.__init__(self)  # the layers are these, not the DiT block's
        D = cfg.hidden_size
        self.scale_shift = ScaleShiftTable(6, D)
        self.norm1 = LayerNorm(D, elementwise_affine=False, eps=cfg.eps)
        self.attn = WanSelfAttention(cfg)
        if cfg.text_dim:
            self.norm_cross = LayerNorm(D, eps=cfg.eps)  # diffusers' cross_attn_norm: with a scale and a shift
            self.cross = WanCrossAttention(cfg)
        self.norm2 = LayerNorm(D, elementwise_affine=False, eps=cfg.eps)
        self.moe = moe
        self.mlp = moe_mlp(cfg, gelu_mlp, glu=False) if moe else gelu_mlp(D, cfg.ffn)

    def forward(self, x: torch.Tensor, c: torch.Tensor, seg: torch.Tensor | None, a: WanAttentionInputs):
        # x: (n, B, D) this rank's tokens; c: (B, S, 7, D) the time projection's 6 rows and temb (Wan.condition)
        mods = per_token(self.scale_shift(c[:, :, :6]).to(x.dtype), seg).transpose(0, 1)  # (n or 1, B, 6, D)
        return self.branches(x, mods.unbind(2), seg, a)


class WanHead(nn.Module):
    """LayerNorm modulated by the head's table plus temb (not the time projection), then the linear to patches."""

    def __init__(self, cfg: WanConfig):
        super().__init__()
        self.norm = LayerNorm(cfg.hidden_size, elementwise_affine=False, eps=cfg.eps)
        self.scale_shift = ScaleShiftTable(2, cfg.hidden_size)
        self.linear = nn.Linear(cfg.hidden_size, cfg.out_dim)  # rows (c, pt, p, p) as patchify orders a token

    def forward(self, x: torch.Tensor, c: torch.Tensor, seg: torch.Tensor | None) -> torch.Tensor:
        mods = per_token(self.scale_shift(c[:, :, 6:]).to(x.dtype), seg).transpose(0, 1)  # (n or 1, B, 2, D)
        shift, scale = mods.unbind(2)
        return self.linear(modulate(self.norm(x), shift, scale))


# --------------------------------------------------------------------------------------------------
# Model


class Wan(DiT):
    """The DiT's forward over Wan's conditioning, attention, blocks and head (module docstring)."""

    block_class = WanBlock

    def __init__(self, cfg: WanConfig, attention: str = "auto"):
        nn.Module.__init__(self)
        self.cfg = cfg
        self.attention = check_backend(attention)
        D = cfg.hidden_size
        self.x_embedder = nn.Linear(cfg.patch_dim, D)  # Wan's Conv3d, kernel = stride = patch, on patchify's tokens
        self.t_embedder = ScalarEmbedder(D, freq_dim=cfg.freq_dim, shift=cfg.freq_shift)  # temb
        if cfg.num_classes:
            self.y_embedder = nn.Embedding(cfg.num_classes + 1, D)  # index num_classes = null class
        if cfg.fps_cond:
            self.fps_embedder = ScalarEmbedder(D)
        self.time_proj = nn.Sequential(nn.SiLU(), nn.Linear(D, 6 * D))
        if cfg.text_dim:
            self.text_embedder = nn.Sequential(nn.Linear(cfg.text_dim, D), nn.GELU(approximate="tanh"),
                                               nn.Linear(D, D))
        self.blocks = nn.ModuleList([self.new_block(i) for i in range(cfg.depth)])
        self.final = WanHead(cfg)
        self.rows = RowSplit()
        self.init_weights()

    def initial_value(self, name: str, shape: torch.Size, seed: int, device: torch.device) -> torch.Tensor:
        """Wan's initialisation (its WanModel.init_weights): xavier-uniform linears with zero biases, N(0, 0.02)
        weights of the text and time embedders, the output linear zero, the modulation tables N(0, 1/D) (its
        randn / √D), norms' scales one; the patch embedder's bias as nn.Conv3d leaves it, U(±1/√patch_dim). A
        mixture of experts (and the class and fps embedders, not Wan's) as the DiT's. Seeded by (seed, name) alone
        (DiT.initial_value)."""
        owner, _, kind = name.rpartition(".")
        if re.fullmatch(r"blocks\.\d+\.mlp\.(router|experts|shared\..+)|y_embedder|fps_embedder\..+", owner):
            return super().initial_value(name, shape, seed, device)
        value = torch.empty(shape, device=device)
        g = torch.Generator(device).manual_seed(zlib.crc32(f"{seed}/{name}".encode()))  # as DiT's
        if owner.rpartition(".")[2] == "scale_shift":
            return value.normal_(0.0, self.cfg.hidden_size ** -0.5, generator=g)
        if name == "x_embedder.bias":
            bound = self.cfg.patch_dim ** -0.5
            return value.uniform_(-bound, bound, generator=g)
        if "norm" in owner.rpartition(".")[2]:  # norm_cross, q_norm, k_norm: scales one, shifts zero
            return value.fill_(1.0 if kind == "weight" else 0.0)
        if kind == "bias" or name == "final.linear.weight":
            return value.zero_()
        if re.fullmatch(r"text_embedder\.[02]|t_embedder\.mlp\.[02]", owner):
            return value.normal_(0.0, 0.02, generator=g)
        if kind == "weight" and len(shape) == 2:  # a linear, (out, in)
            return nn.init.xavier_uniform_(value, generator=g)
        raise ValueError(f"Wan.initial_value has no rule for parameter {name} {tuple(shape)}: add one")

    def condition(self, c_noise: torch.Tensor, inputs) -> torch.Tensor:
        """(B, S, 7, D): the time projection's six rows, computed once for every block, and temb, the head's."""
        temb = embed_conditioning(self, c_noise, inputs)  # (B, S, D)
        proj = self.time_proj(temb).unflatten(-1, (6, -1))  # (B, S, 6, D)
        return torch.cat([proj, temb[:, :, None].to(proj.dtype)], dim=2)

    def rope(self, pos: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Wan's RoPE (cos, sin), each (B or 1, 1, n, hd/2), of the queries at positions `pos` (B or -, n, 3)."""
        angles = wan_rope_angles(pos, self.cfg.head_dim, self.cfg.rope_theta)  # (B or -, n, hd/2), float64
        angles = angles.reshape(-1, 1, pos.shape[-2], angles.shape[-1])
        return angles.cos().to(dtype), angles.sin().to(dtype)  # shared by all blocks

    def attention_inputs(self, backend: str, B: int, pos, seg, text, text_seg, span: slice, dtype,
                         grids=None) -> WanAttentionInputs:
        """DiT.attention_inputs with Wan's positions, the zero state's embedding and the zero-padded text's mask."""
        seq = span.stop - span.start
        q_seg = None if seg is None else seg[:, span]
        mask = segments(backend, q_seg, seg)  # block-diagonal over samples; built once, shared by all blocks
        mask.has_keys = None  # every query is a key of its own sample
        a = WanAttentionInputs(batch=B, seq=seq, rope=self.rope(pos[..., span, :], dtype), mask=mask, rows=self.rows)
        if self.cfg.text_dim:
            a.text = self.embed_text(text)  # (B, L, D)
            a.zero_text = self.text_embedder(text.new_zeros(1, 1, self.cfg.text_dim))  # (1, 1, D)
            a.text_mask = padded_text_mask(backend, q_seg, seg, text_seg, B, seq, text.shape[1], self.cfg.text_len,
                                           dtype, text.device)
        return a


# --------------------------------------------------------------------------------------------------
# Size presets: Wan 2.1's text-to-video models (their diffusers configs: Wan-AI/Wan2.1-T2V-1.3B-Diffusers and
# -14B-Diffusers), UMT5-XXL's 4096-wide states, the 16 channels of Wan's VAE, patch 1 x 2 x 2; positions up to the
# 1024 a side of diffusers' RoPE tables. A tiny one for tests, its text width left to the data as the other
# architectures' tiny presets leave theirs.

_WAN = dict(in_channels=16, text_dim=4096, max_grid=(1024, 1024, 1024))

PRESETS: dict[str, WanConfig] = {
    "Wan-1.3B": WanConfig(hidden_size=1536, depth=30, num_heads=12, ffn_dim=8960, **_WAN),
    "Wan-14B": WanConfig(hidden_size=5120, depth=40, num_heads=40, ffn_dim=13824, **_WAN),
    "Wan-Tiny": WanConfig(hidden_size=64, depth=2, num_heads=2, ffn_dim=128, text_len=16),  # text_dim: the data's
}


# --------------------------------------------------------------------------------------------------
# Tensor-parallel plan (ditcore.models.plan) and registration

WAN_PLAN = Plan(
    modules={
        "x_embedder": Replicated(),
        # temb and the time projection feed the modulations, which each rank applies to its own tokens under SP (the
        # head's directly): their gradients are partial then, as the tables' are. Replicated: one projection, not a
        # block's adaLN, so it is small beside the blocks.
        "t_embedder.*": Replicated(),
        "y_embedder": Replicated(),
        "fps_embedder.*": Replicated(),
        "time_proj.*": Replicated(),
        # Feeds only the column-parallel cross-attention K/V, whose input gradient is summed over TP.
        "text_embedder.*": Replicated(partial_grad="never"),
        "blocks.*.scale_shift": Replicated(),
        "blocks.*.attn.qkv": ColumnParallel(),  # output features laid out (heads, 3, head_dim): a split by heads
        "blocks.*.attn.[qk]_norm": NormOverHeads(),  # scales (heads, head_dim) split as the heads; sums over TP
        "blocks.*.attn.proj": RowParallel(),
        "blocks.*.norm_cross": Replicated(),
        "blocks.*.cross.q": ColumnParallel(),
        "blocks.*.cross.kv": ColumnParallel(sequence_parallel=False),  # reads text tokens, never sequence-split
        "blocks.*.cross.[qk]_norm": NormOverHeads(),
        "blocks.*.cross.proj": RowParallel(),
        "final.scale_shift": Replicated(),
        "final.linear": Replicated(),
    } | {k: v for k, v in DIT_PLAN.modules.items() if k.startswith("blocks.*") and ".mlp." in k},  # FFN or experts
    heads=("blocks.*.attn", "blocks.*.cross"),
    pipeline=PipelineSplit(layers="blocks", first=("x_embedder",), last=("final",)),  # the embedders: every stage
)

register(Architecture("wan", WanConfig, Wan, PRESETS, tiny="Wan-Tiny", plan=WAN_PLAN,
                      summary="Wan 2.1's video DiT (one time projection, QK norms across heads, zero-padded text)"))

__all__ = ["PRESETS", "WAN_PLAN", "Wan", "WanBlock", "WanConfig", "padded_text_mask", "wan_rope_angles",
           "wan_rope_split"]
