"""DiT with adaLN-Zero (Peebles & Xie, "Scalable Diffusion Models with Transformers", 2023).

Extended for video latents and text: latents [B, C, T, H, W] are cut into pt×p×p patches, positions are
3D RoPE (or fixed 3D sin-cos), queries and keys are RMS-normalised per head, and each block may
cross-attend to text tokens. The model works on token rows that may be *packed* (ditcore.layout): one row
holds several samples one after another, each with its own noise level, conditioning, text and positions,
and every sample attends only to its own tokens and its own text. Per-sample tensors are shaped (B, S).

This file is the one-device model: no process groups, no collectives. ditcore.parallel shards it from the
outside (tensor parallelism by its plan; context/sequence parallelism by replacing `DiT.rows`).

Reads top to bottom: config → conditioning embedders → attention → block → final layer → model → presets →
tensor-parallel plan and registration. The layers it shares with the other architectures (positions, scalar
embedders, norms) are ditcore.models.layers; the row split and the attention kernels, ditcore.models.attention. Its
inputs are a ditcore.inputs.Inputs (`DiT.inputs_class`): an architecture that adds a conditioning input declares it
in its own Inputs subclass and embeds it in its `condition`.
"""

from __future__ import annotations

import dataclasses
import re
import zlib
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from ditcore.errors import ConfigError
from ditcore.inputs import Inputs
from ditcore.layout import grid_positions, on_host, patchify, per_token, unpatchify
from ditcore.models.attention import Mask, RowSplit, attend, check_backend, heads_first, resolve, segments
from ditcore.models.layers import (
    LayerNorm,
    RMSNorm,
    ScalarEmbedder,
    apply_rope,
    check_positions,
    rope_angles,
    sincos_2d,
    sincos_3d,
)
from ditcore.models.moe import MoE, MoEConfig, Routing
from ditcore.models.plan import ColumnParallel, PipelineSplit, Plan, Replicated, RowParallel
from ditcore.models.registry import Architecture, register

# --------------------------------------------------------------------------------------------------
# Config


@dataclass(frozen=True)
class DiTConfig:
    """Architecture only. Data-dependent fields (channels, classes, text width) are set from the dataset."""

    hidden_size: int
    depth: int
    num_heads: int
    patch_size: int = 2  # spatial patch p
    patch_size_t: int = 1  # temporal patch pt
    in_channels: int = 4
    mlp_ratio: float = 4.0
    num_classes: int = 0  # > 0: class-conditional, with one extra "null" class for classifier-free guidance
    text_dim: int = 0  # > 0: cross-attention to text tokens of this width
    fps_cond: bool = False  # add an fps embedding to the conditioning vector
    pos_embed: Literal["rope", "sincos", "sincos_2d"] = "rope"  # sincos_2d: DiT's fixed 2-D table (images only)
    max_grid: tuple[int, int, int] = (64, 256, 256)  # largest (T, H, W) token grid the model accepts
    qk_norm: bool = True
    rope_theta: float = 10000.0
    # What the field's DiT checkpoints need (ditcore.interop): a learned-Σ head, DiT's output channels doubled, the
    # second half the per-channel variance values a DDPM sampler or its variational bound reads (D(x; σ) reads the
    # first half only); the timestep sinusoid's frequencies 10000^(-k/(half - freq_shift)), 1 in diffusers' port of
    # DiT; and the eps of the LayerNorm before the MLP (1e-5 in diffusers' port, 1e-6 in the original).
    learn_sigma: bool = False
    freq_shift: int = 0
    mlp_norm_eps: float = 1e-6
    # Every block after the first with its own timestep/class (and fps) embedders, as diffusers' DiTTransformer2DModel
    # holds them (transformer_blocks.N.norm1.emb); the model's own condition the first block and the final layer, as
    # diffusers' block 0's do. Off: one set shared by every block, as the original DiT.
    block_embedders: bool = False
    # A mixture-of-experts feed-forward in place of the MLP of every `moe.every`-th block (ditcore.models.moe); None:
    # dense MLPs. (A dict, as an export's config file holds it, is read as one.)
    moe: MoEConfig | None = None

    def __post_init__(self) -> None:
        if isinstance(self.moe, dict):
            object.__setattr__(self, "moe", MoEConfig(**self.moe))

        def need(ok: bool, field: str, allowed: str) -> None:
            if not ok:
                raise ConfigError(field, getattr(self, field), allowed)

        for field in ("hidden_size", "depth", "num_heads", "patch_size", "patch_size_t", "in_channels"):
            need(isinstance(getattr(self, field), int) and getattr(self, field) >= 1, field, "an integer >= 1")
        need(self.hidden_size % self.num_heads == 0, "hidden_size",
             f"a multiple of num_heads={self.num_heads}")
        need(self.head_dim % 2 == 0 and self.head_dim >= 6, "hidden_size",
             f"hidden_size/num_heads even and >= 6 (3D RoPE), got head_dim={self.head_dim}")
        need(self.mlp_ratio > 0, "mlp_ratio", "a number > 0")
        need(self.num_classes >= 0, "num_classes", "0 (no class conditioning) or the number of classes")
        need(self.text_dim >= 0, "text_dim", "0 (no text) or the width of the text encoder's states")
        need(self.pos_embed in ("rope", "sincos", "sincos_2d"), "pos_embed", "'rope', 'sincos' or 'sincos_2d'")
        need(len(self.max_grid) == 3 and all(int(g) >= 1 for g in self.max_grid), "max_grid",
             "three integers >= 1: (T, H, W) in tokens")
        if self.pos_embed == "sincos_2d":  # DiT's table has no time axis: frames would be told apart by nothing
            need(self.max_grid[0] == 1 and self.patch_size_t == 1, "pos_embed",
                 f"'rope' or 'sincos' for video: sincos_2d is DiT's image table, it needs max_grid's T = 1 and "
                 f"patch_size_t = 1 (got max_grid={tuple(self.max_grid)}, patch_size_t={self.patch_size_t})")
            need(self.hidden_size % 4 == 0, "hidden_size", "a multiple of 4 for pos_embed sincos_2d")
        need(self.freq_shift in (0, 1), "freq_shift", "0 (DiT's timestep sinusoid) or 1 (diffusers' port of DiT)")
        need(0 < self.mlp_norm_eps < 1, "mlp_norm_eps", "a small number > 0, e.g. 1e-6")
        need(self.moe is None or isinstance(self.moe, MoEConfig), "moe", "None or a MoEConfig")
        if self.moe is not None and self.depth % self.moe.every:  # the blocks then repeat every `every` blocks
            raise ConfigError("moe.every", self.moe.every, f"a divisor of depth={self.depth}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def kv_heads(self) -> int:  # key/value heads: all of them (grouped-query architectures have fewer)
        return self.num_heads

    @property
    def ffn(self) -> int:  # the MLP's hidden width
        return int(self.hidden_size * self.mlp_ratio)

    def attended(self, tokens: float, frames: float) -> float:
        """Keys each query attends over, on average over the blocks, in a sample of `tokens` tokens in `frames`
        frames: all of them (a factorised architecture's over fewer)."""
        return tokens

    @property
    def patch_dim(self) -> int:  # features of one patch token
        return self.in_channels * self.patch_size_t * self.patch_size**2

    @property
    def out_dim(self) -> int:  # features the model outputs per token: a patch, and with learned Σ its variances
        return self.patch_dim * (2 if self.learn_sigma else 1)

    def replace(self, **changes) -> DiTConfig:
        return dataclasses.replace(self, **changes)


# --------------------------------------------------------------------------------------------------
# Conditioning embedders (one vector per sample)


def add_embedders(owner: nn.Module, cfg: DiTConfig) -> None:
    """The conditioning embedders of cfg as `owner`'s t_embedder, y_embedder, fps_embedder: the model's, and with
    cfg.block_embedders every later block's."""
    D = cfg.hidden_size
    owner.t_embedder = ScalarEmbedder(D, shift=cfg.freq_shift)
    if cfg.num_classes:
        owner.y_embedder = nn.Embedding(cfg.num_classes + 1, D)  # index num_classes = null class
    if cfg.fps_cond:
        owner.fps_embedder = ScalarEmbedder(D)


def embed_conditioning(owner: nn.Module, c_noise: torch.Tensor, inputs: Inputs) -> torch.Tensor:
    """Per-sample conditioning vector (B, S, D) of (B, S) noise levels and the inputs' labels and fps, by `owner`'s
    embedders."""
    c = owner.t_embedder(c_noise)
    if getattr(owner, "y_embedder", None) is not None:
        if inputs.class_labels is None:
            raise ValueError("this model is class-conditional: pass class_labels "
                             f"(use {owner.y_embedder.num_embeddings - 1} for the null class)")
        c = c + owner.y_embedder(inputs.class_labels)
    if getattr(owner, "fps_embedder", None) is not None:
        if inputs.fps is None:
            raise ValueError("this model is fps-conditioned: pass fps")
        c = c + owner.fps_embedder(inputs.fps)
    return c


# --------------------------------------------------------------------------------------------------
# Attention. Inside the blocks activations are sequence-first, (N, B, D), the layout Megatron-Core's
# sequence-parallel layers split and gather along.


@dataclass
class AttentionInputs:
    """What every block's attention needs besides its input, computed once per forward."""

    batch: int
    seq: int  # query tokens per row that attention sees (all of them, or this rank's context-parallel slice)
    rope: tuple[torch.Tensor, torch.Tensor] | None  # (cos, sin), each (B or 1, 1, seq, hd/2) in the compute dtype
    mask: Mask  # self-attention: this rank's queries over the full rows
    rows: RowSplit  # whole-row keys/values for this rank's queries (its `keys_values`; ST-DiT: its Orders)
    text: torch.Tensor | None = None  # (B, L, D) projected text tokens
    text_mask: Mask | None = None  # cross-attention: queries over text tokens
    # (c_noise (B, S), the inputs' per-sample conditions alone: Inputs.conditions): what a block with its own
    # embedders (cfg.block_embedders) embeds, inside its own forward (FSDP gathers a block's parameters for its forward
    # only); without the rows' grids, which a compiled block would otherwise guard on
    conditioning: tuple[torch.Tensor, Inputs] | None = None

    def text_masks(self) -> list[Mask]:
        """Every cross-attention mask the blocks take (an architecture whose blocks differ has several)."""
        return [self.text_mask]


class SelfAttention(nn.Module):
    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim  # num_heads: this rank's under TP
        # qkv output features are laid out (heads, 3, head_dim): a contiguous split of the rows is a split
        # by heads, which is what tensor parallelism needs.
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.q_norm = RMSNorm(cfg.head_dim, eps=1e-6) if cfg.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(cfg.head_dim, eps=1e-6) if cfg.qk_norm else nn.Identity()
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, a: AttentionInputs) -> torch.Tensor:
        q, k, v = heads_first(self.qkv(x), a.seq, a.batch, self.num_heads, 3, self.head_dim)  # (B, H, seq, hd)
        q, k = self.q_norm(q), self.k_norm(k)
        if a.rope is not None:
            q, k = apply_rope(q, a.rope), apply_rope(k, a.rope)
        k, v = a.rows.keys_values(k, v)  # every query needs every key of its row: (B, H, N, hd)
        out = attend(q, k, v, a.mask)  # (B, H, seq, hd)
        return self.proj(out.permute(2, 0, 1, 3).reshape(a.seq, a.batch, -1))  # (seq, B, D)


def no_text(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq: int, batch: int) -> torch.Tensor:
    """Cross-attention's output (seq, B, H·hd) when no sample of the batch has a text token: zeros, as for a sample
    whose text is empty. Made of q, k and v times exactly 0, so that every weight of the text path takes part in
    the loss (with a zero gradient): data-parallel training (DDP) fails on a step in which a weight does not."""
    touched = (q.sum() + k.sum() + v.sum()) * 0
    return q.new_zeros(seq, batch, q.shape[1] * q.shape[3]) + touched


class CrossAttention(nn.Module):
    """Image tokens attend to (already projected) text tokens; no positions on either side."""

    def __init__(self, cfg: DiTConfig):
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.q = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.kv = nn.Linear(cfg.hidden_size, 2 * cfg.hidden_size)  # (heads, 2, head_dim)
        self.q_norm = RMSNorm(cfg.head_dim, eps=1e-6) if cfg.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(cfg.head_dim, eps=1e-6) if cfg.qk_norm else nn.Identity()
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, a: AttentionInputs) -> torch.Tensor:
        L = a.text.shape[1]
        (q,) = heads_first(self.q(x), a.seq, a.batch, self.num_heads, 1, self.head_dim)  # (B, H, seq, hd)
        kv = self.kv(a.text.transpose(0, 1))  # (L, B, 2·D)
        k, v = heads_first(kv, L, a.batch, self.num_heads, 2, self.head_dim)  # (B, H, L, hd)
        if L == 0:  # no text at all
            return self.proj(no_text(self.q_norm(q), self.k_norm(k), v, a.seq, a.batch))
        out = attend(self.q_norm(q), self.k_norm(k), v, a.text_mask)  # a sample without text gets zeros
        return self.proj(out.permute(2, 0, 1, 3).reshape(a.seq, a.batch, -1))  # (seq, B, D)


# --------------------------------------------------------------------------------------------------
# Block


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.addcmul(shift, x, 1 + scale)  # x (1 + scale) + shift in one kernel


def gelu_mlp(dim: int, hidden: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(dim, hidden), nn.GELU(approximate="tanh"), nn.Linear(hidden, dim))


def moe_mlp(cfg: DiTConfig, dense: type[nn.Module], glu: bool) -> MoE:
    """The mixture-of-experts feed-forward of cfg.moe, its experts and shared experts MLPs like `dense` (dim,
    hidden): GELU ones (glu False) or SwiGLU ones."""
    shared = cfg.moe.shared_experts * cfg.moe.hidden(cfg.ffn)
    return MoE(cfg.hidden_size, cfg.ffn, cfg.moe, glu=glu, shared=dense(cfg.hidden_size, shared) if shared else None)


class DiTBlock(nn.Module):
    own_embedders = False  # a block of its own embedders (DiTConfig.block_embedders) says so
    moe = False  # a block whose MLP is a mixture of experts (DiTConfig.moe) says so, and returns its routing stats

    def __init__(self, cfg: DiTConfig, own_embedders: bool = False, moe: bool = False):
        super().__init__()
        D = cfg.hidden_size
        if own_embedders:  # it conditions on its own embedding of the inputs
            self.own_embedders = True
            add_embedders(self, cfg)
        self.norm1 = LayerNorm(D, elementwise_affine=False, eps=1e-6)
        self.attn = SelfAttention(cfg)
        if cfg.text_dim:
            self.norm_cross = LayerNorm(D, eps=1e-6)
            self.cross = CrossAttention(cfg)
        self.norm2 = LayerNorm(D, elementwise_affine=False, eps=cfg.mlp_norm_eps)
        self.moe = moe
        self.mlp = moe_mlp(cfg, gelu_mlp, glu=False) if moe else gelu_mlp(D, cfg.ffn)
        self.adaLN = nn.Sequential(nn.SiLU(), nn.Linear(D, 6 * D))

    def forward(self, x: torch.Tensor, c: torch.Tensor, seg: torch.Tensor | None, a: AttentionInputs):
        # x: (n, B, D) this rank's tokens; c: (B, S, D) per-sample conditioning → six (n or 1, B, D) modulations.
        # Returns x, and in a MoE block (x, its routing stats): returned, not stored, as a compiled, checkpointed
        # block may have no side effect
        if self.own_embedders:
            c = embed_conditioning(self, *a.conditioning)
        mods = per_token(self.adaLN(c), seg).transpose(0, 1)
        return self.branches(x, mods.chunk(6, dim=-1), seg, a)

    def branches(self, x: torch.Tensor, mods, seg: torch.Tensor | None, a: AttentionInputs):
        """The block's gated self-attention, cross-attention and MLP residuals, given its six modulations (shift,
        scale, gate of each), each (n or 1, B, D): what an architecture with other modulations (Wan's tables) shares."""
        shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = mods
        x = torch.addcmul(x, gate_a, self.attn(modulate(self.norm1(x), shift_a, scale_a), a))
        if a.text is not None:
            x = x + self.cross(self.norm_cross(x), a)
        h = modulate(self.norm2(x), shift_m, scale_m)
        if not self.moe:
            return torch.addcmul(x, gate_m, self.mlp(h))
        h, stats = self.mlp(h, None if seg is None else seg >= 0)  # padding does not count in the routing losses
        return torch.addcmul(x, gate_m, h), stats


class FinalLayer(nn.Module):
    def __init__(self, cfg: DiTConfig, norm: type[nn.Module] = LayerNorm):
        super().__init__()
        D = cfg.hidden_size
        self.norm = norm(D, elementwise_affine=False, eps=1e-6)
        self.adaLN = nn.Sequential(nn.SiLU(), nn.Linear(D, 2 * D))
        self.linear = nn.Linear(D, cfg.out_dim)  # with learned Σ: [patch features; their variance values]

    def forward(self, x, c, seg):
        shift, scale = per_token(self.adaLN(c), seg).transpose(0, 1).chunk(2, dim=-1)
        return self.linear(modulate(self.norm(x), shift, scale))


# --------------------------------------------------------------------------------------------------
# Model


def symbolic_sizes(c: torch.Tensor, a: AttentionInputs) -> None:
    """Samples per row and text tokens change from batch to batch: compiled blocks take them as symbolic sizes from
    the first batch on, rather than compiling once for the first sizes, again for each new one until dynamo marks
    them dynamic, and again when the recompile limit is near (tests/ditcore/parallel/test_compile.py counts). A size
    of 1 (one sample per row) still gets a graph of its own: dynamo specialises 0 and 1."""
    torch._dynamo.maybe_mark_dynamic(c, 1)
    if a.conditioning is not None:  # what blocks with their own embedders embed (cfg.block_embedders)
        c_noise, conditions = a.conditioning
        for t in (c_noise, *(t for _, t in conditions.tensors())):
            torch._dynamo.maybe_mark_dynamic(t, 1)
    if a.text is not None and a.text.shape[1] > 1:
        torch._dynamo.maybe_mark_dynamic(a.text, 1)
        for mask in a.text_masks():
            if isinstance(mask.attn, torch.Tensor):  # sdpa's dense (B, 1, seq, L) mask
                torch._dynamo.maybe_mark_dynamic(mask.attn, 3)


@torch.compiler.disable  # marks are made before tracing: dynamo would otherwise trace the hook of a compiled block
def symbolic_block_inputs(block: nn.Module, args: tuple) -> None:
    """symbolic_sizes again, on what a block is called with: a forward pre-hook that runs after FSDP2's
    (ditcore.parallel.fsdp.apply_fsdp). FSDP2's hook passes the inputs that require grad (c, a.text) through an
    autograd function to hook their backward, and hands the block its aliases, which carry none of dynamo's marks, in
    a copy of `a` (dataclasses.replace): the compiled block took their first sizes as static and recompiled for each
    new text length and number of samples per row."""
    _, c, _, a = args
    symbolic_sizes(c, a)


class DiT(nn.Module):
    block_class: type[nn.Module] = DiTBlock  # an architecture that differs only in its blocks subclasses DiT
    norm_class: type[nn.Module] = LayerNorm  # the final layer's norm
    context_parallel = "all_gather"  # attention gathers the whole row's keys (ditcore.memory plans a rank so)
    inputs_class: type[Inputs] = Inputs  # what forward takes (ditcore.inputs); an architecture may add conditions
    routing: Routing | None = None  # the last forward's MoE blocks' routing statistics and aux loss (cfg.moe)

    def __init__(self, cfg: DiTConfig, attention: str = "auto"):
        super().__init__()
        self.cfg = cfg
        self.attention = check_backend(attention)  # ditcore.models.attention: auto | sdpa | flex
        D = cfg.hidden_size
        self.x_embedder = nn.Linear(cfg.patch_dim, D)  # a Conv3d with kernel = stride = patch, on tokens
        add_embedders(self, cfg)
        if cfg.text_dim:
            self.text_embedder = nn.Sequential(
                nn.Linear(cfg.text_dim, D), nn.GELU(approximate="tanh"), nn.Linear(D, D))
        self.blocks = nn.ModuleList([self.new_block(i) for i in range(cfg.depth)])
        self.final = FinalLayer(cfg, self.norm_class)
        self.rows = RowSplit()
        self.init_weights()

    def new_block(self, i: int) -> nn.Module:
        """The i-th block (of `cfg.depth`): a `block_class`; an architecture whose blocks differ overrides it."""
        # only the options that are on: an architecture's block without them may take cfg alone
        kinds = dict(own_embedders=self.cfg.block_embedders and i > 0,
                     moe=self.cfg.moe is not None and self.cfg.moe.places(i))
        return self.block_class(self.cfg, **{kind: True for kind, on in kinds.items() if on})

    @staticmethod
    def upgrade_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A one-device state dict written by an earlier ditcore, in this version's names and layout (an
        architecture whose layers changed overrides it; exports are read through it)."""
        return state

    @property
    def null_class(self) -> int:
        return self.cfg.num_classes

    def init_weights(self, seed: int | None = None) -> None:
        """Fill every parameter with its initial value (`initial_value`); this one-device model only.

        seed None: one integer drawn from torch's global CPU generator, so `torch.manual_seed(s); DiT(cfg)` gives
        the same weights for the same s and different ones for different s. Parameters on the meta device are left
        as they are: ditcore.parallel.materialize fills them later, shard by shard, with the same values.
        """
        if seed is None:
            seed = int(torch.randint(2**31, (), device="cpu"))  # drawn even under meta: the same RNG use either way
        with torch.no_grad():
            for name, p in self.named_parameters():
                if not p.is_meta:
                    p.copy_(self.initial_value(name, p.shape, seed, p.device))

    def initial_value(self, name: str, shape: torch.Size, seed: int, device: torch.device) -> torch.Tensor:
        """DiT's initial value of one parameter, from its one-device name and full one-device shape.

        xavier-uniform linears (a MoE expert's each as the linear it stands for), zero biases, N(0, 0.02) class and
        scalar embedders and MoE routers, norms' scales one, and zeros on every adaLN's last linear and on the outputs
        (adaLN-Zero). Random values come from a generator on `device`
        seeded by (seed, name) alone — crc32 of both, as Python's str hash changes from process to process — so a
        value does not depend on the order parameters are made or filled, nor on how many ranks share the
        parameter (each computes the whole and keeps its shard). CPU and CUDA generators differ: the numbers
        depend on the device type.
        """
        owner_name, _, kind = name.rpartition(".")
        owner = self.get_submodule(owner_name)  # the same path after ditcore.parallel swaps in parallel linears
        # by path, as a pipeline stage holds only some of the modules (ditcore.parallel.pipeline)
        # the MoE router too: near-uniform probabilities at first, so that every expert gets tokens from the start
        small = re.fullmatch(r"(blocks\.\d+\.)?((t_embedder|fps_embedder)\.mlp\.[02]|y_embedder|mlp\.router)",
                             owner_name)
        # adaLN-Zero; cross-attention has no gate: its output projection is zero instead
        zero = re.fullmatch(r"final\.(adaLN\.1|linear)|blocks\.\d+\.(adaLN\.1|cross\.proj)", owner_name)
        value = torch.empty(shape, device=device)
        g = torch.Generator(device).manual_seed(zlib.crc32(f"{seed}/{name}".encode()))
        if kind == "bias" or zero:
            return value.zero_()
        if small:
            return value.normal_(0.0, 0.02, generator=g)
        if kind == "weight" and len(shape) == 2 and not isinstance(owner, nn.Embedding):  # a linear, (out, in)
            return nn.init.xavier_uniform_(value, generator=g)
        if kind == "weight" and len(shape) == 1:  # a norm's scale
            return value.fill_(1.0)
        if kind in ("w_in", "w_out") and len(shape) == 3:  # MoE experts (E, in, out): each xavier-uniform as a linear
            bound = (6 / (shape[1] + shape[2])) ** 0.5
            return value.uniform_(-bound, bound, generator=g)
        raise ValueError(f"DiT.initial_value has no rule for parameter {name} {tuple(shape)} "
                         f"({type(owner).__name__}): add one")

    def condition(self, c_noise: torch.Tensor, inputs: Inputs) -> torch.Tensor:
        """Per-sample conditioning vector (B, S, D) from (B, S) noise levels and the inputs' per-sample conditions
        (an architecture that adds a condition embeds it here, on top)."""
        return embed_conditioning(self, c_noise, inputs)

    def attention_inputs(self, backend: str, B: int, pos, seg, text, text_seg, span: slice, dtype,
                         grids=None) -> AttentionInputs:
        """What every block's attention needs for B rows with positions `pos` and samples `seg`, this rank's queries
        being the tokens `span` of each row: positions, masks and the projected text, built once per forward.
        (`grids`, the same layout on the host, is for ST-DiT, ditcore.models.stdit.)"""
        seq = span.stop - span.start
        q_seg = None if seg is None else seg[:, span]
        mask = segments(backend, q_seg, seg)  # block-diagonal over samples; built once, shared by all blocks
        mask.has_keys = None  # every query is a key of its own sample: no output to zero on this hot path
        a = AttentionInputs(batch=B, seq=seq, rope=self.rope(pos[..., span, :], dtype), mask=mask, rows=self.rows)
        if self.cfg.text_dim:
            a.text = self.embed_text(text)
            a.text_mask = self.text_mask(backend, q_seg, text_seg, seq, text)
        return a

    def embed_text(self, text: torch.Tensor | None) -> torch.Tensor:
        """Text states (B, L, text_dim) → (B, L, D) for cross-attention; never split across ranks."""
        if text is None:
            raise ValueError(f"this model cross-attends to text: pass text (B, L, {self.cfg.text_dim}) "
                             "and text_seg (use L=0 for no text)")
        return self.text_embedder(text)

    def rope(self, pos: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """RoPE's (cos, sin), each (B or 1, 1, n, hd/2), of the queries at positions `pos` (B or -, n, 3)."""
        if self.cfg.pos_embed != "rope":
            return None
        angles = rope_angles(pos, self.cfg.head_dim, self.cfg.rope_theta)  # (B or -, n, hd/2)
        angles = angles.reshape(-1, 1, pos.shape[-2], angles.shape[-1])
        return angles.cos().to(dtype), angles.sin().to(dtype)  # shared by all blocks

    @staticmethod
    def text_mask(backend: str, q_seg, text_seg, seq: int, text: torch.Tensor) -> Mask:
        """Cross-attention: each query (samples q_seg, (B, seq) or None) over its own sample's text tokens."""
        if not text.shape[1] or (q_seg is None and text_seg is None):  # every query sees every text token
            return Mask(None)
        if q_seg is None:
            q_seg = torch.zeros(text.shape[0], seq, dtype=torch.long, device=text.device)
        if text_seg is None:
            text_seg = torch.zeros(text.shape[:2], dtype=torch.long, device=text.device)
        return segments(backend, q_seg, text_seg)

    def forward(self, x: torch.Tensor, c_noise: torch.Tensor, inputs: Inputs, *,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Tokens (B, N, patch_dim) → predicted tokens (B, N, out_dim: patch_dim, twice that with learned Σ).

        c_noise: (B, S) per sample, the noise level in the network's units; inputs: everything else of the rows
        (ditcore.inputs.Inputs, of this architecture's `inputs_class`): positions, samples, text, per-sample
        conditions, and the rows' grids on the host, which ST-DiT regroups tokens by without reading the device (off
        the CPU it requires them); the DiT and MovieGen ignore them.

        A pipeline stage (ditcore.parallel.pipeline) without the patch embedder starts from `hidden`, the previous
        stage's hidden states (n, B, D), and one without the final layer returns its own, (n, B, D).
        """
        cfg = self.cfg
        B, N, _ = x.shape
        pos, seg = inputs.pos, inputs.seg
        if on_host(pos):  # free on the host; on a GPU it would stall every forward (callers check)
            check_positions(pos, cfg.max_grid)
        attn_span, local = self.rows.spans(N)  # tokens this rank's attention sees; tokens it holds
        seg_local = None if seg is None else seg[:, local]
        c_noise = c_noise.reshape(B, -1)
        c = self.condition(c_noise, inputs)  # (B, S, D)

        if self.x_embedder is not None:
            h = self.x_embedder(x[:, local].transpose(0, 1))  # (n, B, D): sequence first from here on
            if cfg.pos_embed in ("sincos", "sincos_2d"):
                table = sincos_3d if cfg.pos_embed == "sincos" else sincos_2d
                pe = table(pos[..., local, :], cfg.hidden_size).to(h.dtype)
                h = h + (pe[:, None] if pe.ndim == 2 else pe.transpose(0, 1))
        elif hidden is None:
            raise ValueError("this pipeline stage starts from the previous stage's output: pass hidden (n, B, D)")
        else:
            h = hidden
        backend = resolve(self.attention, x.device, training=torch.is_grad_enabled())
        a = self.attention_inputs(backend, B, pos, seg, inputs.text, inputs.text_seg, attn_span, h.dtype,
                                  inputs.grids)
        if cfg.block_embedders:
            a.conditioning = (c_noise, inputs.conditions())
        symbolic_sizes(c, a)

        stats = []
        for block in self.blocks:
            h = self.run_block(block, h, c, seg_local, a)
            if isinstance(h, tuple):  # a MoE block's output and its routing statistics
                h, block_stats = h
                stats.append(block_stats)
        self.routing = Routing(torch.stack(stats), cfg.moe) if stats else None
        if self.final is None:
            return h  # a pipeline stage's hand-off to the next
        out = self.final(h, c, seg_local)  # (n, B, patch_dim)
        out = self.rows.gather(out)  # the whole rows, when they were split over ranks
        return out.transpose(0, 1)  # (B, N, patch_dim)

    def run_block(self, block: nn.Module, h: torch.Tensor, c: torch.Tensor, seg: torch.Tensor | None,
                  a: AttentionInputs) -> torch.Tensor:
        """One block of `forward`'s loop on this rank's hidden states h (n, B, D): an architecture that moves tokens
        between blocks (ST-DiT) overrides it, so that the blocks themselves (compiled, checkpointed) hold no move."""
        return block(h, c, seg, a)

    def forward_latents(self, x: torch.Tensor, c_noise: torch.Tensor, **cond) -> torch.Tensor:
        """Convenience for unpacked batches: latents (B, C, T, H, W) and (B,) c_noise → same-shape output (with
        learned Σ: 2C channels, the variance values after the C of the prediction, as DiT's).

        cond: the per-sample conditions (class_labels, fps, ...) as (B,), text (B, L, text_dim) with optional text_mask
        (B, L) bool.
        """
        cfg = self.cfg
        B, _, T, H, W = x.shape
        grid = (T // cfg.patch_size_t, H // cfg.patch_size, W // cfg.patch_size)
        check_positions(torch.tensor(grid) - 1, cfg.max_grid)  # the largest position, on the host
        tokens = patchify(x, cfg.patch_size, cfg.patch_size_t)
        text_mask = cond.pop("text_mask", None)
        if text_mask is not None:
            cond["text_seg"] = torch.where(text_mask, 0, -1)
        for key in self.inputs_class.per_sample_fields():
            if cond.get(key) is not None:
                cond[key] = cond[key].reshape(B, 1)
        inputs = self.inputs_class(pos=grid_positions(grid, device=x.device), grids=[[grid]] * B, **cond)
        out = self.forward(tokens, c_noise.reshape(B, 1), inputs)
        halves = out.chunk(2, dim=-1) if cfg.learn_sigma else (out,)
        return torch.cat([unpatchify(o, grid, cfg.patch_size, cfg.patch_size_t) for o in halves], dim=1)


# --------------------------------------------------------------------------------------------------
# Size presets: name → architecture. Paper sizes (DiT Table 1) at patch 2/4/8, the large video sizes, and
# tiny models for tests and the CPU demo.

_PAPER = {"S": (384, 12, 6), "B": (768, 12, 12), "L": (1024, 24, 16), "XL": (1152, 28, 16)}

PRESETS: dict[str, DiTConfig] = {
    f"DiT-{size}/{p}": DiTConfig(hidden_size=d, depth=n, num_heads=h, patch_size=p)
    for size, (d, n, h) in _PAPER.items()
    for p in (2, 4, 8)
}
PRESETS |= {
    "DiT-5B": DiTConfig(hidden_size=3072, depth=16, num_heads=24),
    "DiT-7B": DiTConfig(hidden_size=3072, depth=32, num_heads=24),
    "DiT-28B": DiTConfig(hidden_size=6144, depth=48, num_heads=48),
    "DiT-Tiny": DiTConfig(hidden_size=64, depth=2, num_heads=4),  # unit and parallel tests
    "DiT-Demo": DiTConfig(hidden_size=192, depth=6, num_heads=6),  # the CPU demo: trains in minutes
}


# --------------------------------------------------------------------------------------------------
# Tensor-parallel plan (ditcore.models.plan) and registration

# adaLN's linears are a third of a DiT's parameters: split by output columns, their small per-sample modulations
# all-gathered (in column order) so that every rank modulates its tokens with all of them.
ADALN = ColumnParallel(sequence_parallel=False, gather_output=True)

DIT_PLAN = Plan(
    modules={
        "x_embedder": Replicated(),
        # The conditioning feeds only the adaLN linears, which sum its gradient over TP: whole on every rank.
        "t_embedder.*": Replicated(partial_grad="never"),
        "y_embedder": Replicated(partial_grad="never"),
        "fps_embedder.*": Replicated(partial_grad="never"),
        "blocks.*.t_embedder.*": Replicated(partial_grad="never"),  # block_embedders: each feeds its block's adaLN
        "blocks.*.y_embedder": Replicated(partial_grad="never"),
        "blocks.*.fps_embedder.*": Replicated(partial_grad="never"),
        # Feeds only the column-parallel cross-attention K/V, whose input gradient Megatron already sums over TP.
        "text_embedder.*": Replicated(partial_grad="never"),
        "blocks.*.adaLN.1": ADALN,
        "blocks.*.attn.qkv": ColumnParallel(),  # output features laid out (heads, 3, head_dim): a split by heads
        "blocks.*.attn.[qk]_norm": Replicated(partial_grad="tp"),  # shared by all heads; a rank has some heads
        "blocks.*.attn.proj": RowParallel(),
        "blocks.*.norm_cross": Replicated(),
        "blocks.*.cross.q": ColumnParallel(),
        "blocks.*.cross.kv": ColumnParallel(sequence_parallel=False),  # reads text tokens, never sequence-split
        "blocks.*.cross.[qk]_norm": Replicated(partial_grad="tp"),
        "blocks.*.cross.proj": RowParallel(),
        # [0-9]: a block's own MLP, not its embedders' (block_embedders: blocks.N.t_embedder.mlp.0)
        "blocks.*[0-9].mlp.0": ColumnParallel(),
        "blocks.*[0-9].mlp.2": RowParallel(),
        # A mixture of experts' router, experts and shared experts (cfg.moe): whole, as no layout with tp > 1 takes a
        # MoE model (ParallelDims.check_model) until experts are split over an expert-parallel group
        "blocks.*.mlp.router": Replicated(),
        "blocks.*.mlp.experts": Replicated(),
        "blocks.*.mlp.shared.*": Replicated(),
        "final.adaLN.1": ADALN,
        "final.linear": Replicated(),
    },
    heads=("blocks.*.attn", "blocks.*.cross"),
    pipeline=PipelineSplit(layers="blocks", first=("x_embedder",), last=("final",)),  # the embedders: every stage
)

register(Architecture("dit", DiTConfig, DiT, PRESETS, tiny="DiT-Tiny", plan=DIT_PLAN,
                      summary="the DiT (adaLN-Zero)"))
