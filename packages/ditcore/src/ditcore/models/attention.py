"""Attention over packed rows, on the fastest kernel the device has.

A packed row holds several samples, and each token may attend only to its own sample's tokens (and its own
sample's text). Two ways to say so:

- `sdpa`: F.scaled_dot_product_attention. Rows of one sample each, without padding, need no mask at all and
  run on the flash kernel. Packed rows get a dense boolean (B, 1, Nq, Nk) block-diagonal mask: correct on
  every device, but on a GPU a mask leaves the flash kernel. This is the CPU path.
- `flex`: FlexAttention with a block-diagonal BlockMask built once per forward and shared by every block.
  Blocks of 128×128 query/key pairs that cross samples are skipped, so packed rows cost what their samples
  would cost alone. FlexAttention has no CPU backward: on a CPU it serves inference only.
- `auto`: flex to train on CUDA; sdpa elsewhere, and for inference, whose rows hold one whole sample each (flash)
  and whose shapes (batch, frames, size) change from request to request, each a new compilation under flex.

Padding tokens (sample index −1) are no real sample's keys. Under flex, a query with no keys at all (padding, a
sample whose text was dropped) gets a zero output. Under sdpa padding queries attend to the padding (their
outputs are never used), and a query whose sample has no text is zeroed with `has_keys`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ditcore.choices import ATTENTION
from ditcore.errors import ConfigError
from ditcore.layout import on_host, reorder, segment_mask

BACKENDS = ("auto", *ATTENTION)


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ConfigError("model.attention", backend, "one of " + ", ".join(BACKENDS) +
                          " (auto: flex to train on CUDA, sdpa elsewhere)")
    return backend


def resolve(backend: str, device: torch.device, training: bool = True) -> str:
    """The backend `auto` stands for on this device, for training (gradients on) or inference."""
    if check_backend(backend) == "auto":
        return "flex" if device.type == "cuda" and training else "sdpa"
    return backend


@dataclass
class Mask:
    """Which keys each query of a row may see, in the form its backend takes, built once per forward."""

    attn: torch.Tensor | object | None  # dense bool (B, 1, Nq, Nk), a flex BlockMask, or None: every key
    has_keys: torch.Tensor | None = None  # (B, Nq, 1) for sdpa: queries whose sample has keys; None: all do
    run: int = 0  # > 0 (attn None): every `run` consecutive tokens attend among themselves, as rows of their own
    # flex: (q_term (B, Nq), k_weight (B, Nk)), q_term[b, q]·k_weight[b, kv] added to each score: a key that
    # stands for m equal keys scores log m more (Wan's zero-padded text, ditcore.models.wan); sdpa takes such terms
    # in a float `attn`
    bias: tuple[torch.Tensor, torch.Tensor] | None = None


def segments(backend: str, seg_q: torch.Tensor | None, seg_k: torch.Tensor | None) -> Mask:
    """The mask for queries of samples `seg_q` (B, Nq) over keys of samples `seg_k` (B, Nk); −1 is no sample.

    Both None: one sample per row with every token real, so no mask at all (the flash kernel on a GPU).
    """
    if seg_q is None and seg_k is None:
        return Mask(None)
    if backend == "flex":
        return Mask(_block_mask(seg_q, seg_k))
    mask, has_keys = segment_mask(seg_q, seg_k)
    return Mask(mask, has_keys)


def _block_mask(seg_q: torch.Tensor, seg_k: torch.Tensor):
    def same_sample(b, h, q, kv):
        return (seg_q[b, q] == seg_k[b, kv]) & (seg_k[b, kv] >= 0)

    (B, Nq), device = seg_q.shape, seg_q.device
    return block_mask(same_sample, B, Nq, seg_k.shape[1], device)


def block_mask(mask_mod: Callable, B: int, Nq: int, Nk: int, device: torch.device):
    """FlexAttention's BlockMask of mask_mod(b, h, q, kv) → bool for B rows of Nq queries over Nk keys, made by the
    device's kernels (compiled on CUDA): for an architecture whose keys are not only samples' tokens."""
    return _kernels(device.type).create_block_mask(mask_mod, B, None, Nq, Nk, device=device)


@dataclass(frozen=True)
class _Kernels:
    create_block_mask: object
    flex_attention: object


_KERNELS: dict[str, _Kernels] = {}  # by device type; a plain dict, which torch.compile reads without tracing a cache


def _kernels(device_type: str) -> _Kernels:
    if device_type not in _KERNELS:
        # CUDA: fused kernels; the uncompiled ones are slow references that build (Nq, Nk). CPU: forward only,
        # unfused (inference and the tests of the masks).
        _KERNELS[device_type] = compiled_kernels() if device_type == "cuda" else _Kernels(*_flex())
    return _KERNELS[device_type]


def _flex():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    return create_block_mask, flex_attention


def compiled_kernels(**options) -> _Kernels:
    """create_block_mask and flex_attention, each compiled by torch.compile(**options): CUDA's (a test passes a CPU
    backend). The BlockMask is then computed block by block, never as a dense (B, Nq, Nk) tensor. Inside compiled
    blocks flex_attention is compiled with them; the compiled wrapper serves eager blocks.

    Shapes are dynamic (torch.compile's default, not dynamic=False): the key length of cross-attention is the
    batch's text length, which dit-sample and validation do not pad, and a query length changes with each sampled
    size. After the first shapes each function compiles once more with the lengths symbolic, which then serve every
    length. Compiled per length, the 9th length reached dynamo's recompile_limit and every later call ran the
    unfused reference, which builds the whole (Nq, Nk) score matrix.
    """
    create_block_mask, flex_attention = _flex()
    return _Kernels(torch.compile(create_block_mask, **options), torch.compile(flex_attention, **options))


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask, enable_gqa: bool) -> torch.Tensor:
    if enable_gqa and q.device.type == "cuda" and (attn_mask is not None or q.dtype == torch.float32):
        # Of CUDA's kernels only flash (bf16/fp16, no mask) shares key/value heads; the memory-efficient kernel, which
        # takes a mask or fp32, does not, and sdpa would silently run the math kernel, which builds the (Nq, Nk)
        # scores. Copies of the heads cost less. (The CPU's kernel shares them under a mask too.)
        per_kv = q.shape[1] // k.shape[1]  # query heads per key/value head
        k, v, enable_gqa = k.repeat_interleave(per_kv, 1), v.repeat_interleave(per_kv, 1), False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=enable_gqa)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask, enable_gqa: bool = False) -> torch.Tensor:
    """Attention of q (B, H, Nq, hd) over k, v (B, H, Nk, hd) → (B, H, Nq, hd), as `mask` allows.

    enable_gqa: grouped-query attention, k and v have fewer heads (H/G), each shared by G consecutive query heads.
    The kernels read each key/value head for its G query heads: no copies of k and v (nor their gradients) are made.
    """
    if mask.run:  # runs made rows of their own: no mask, so the flash kernel on a GPU
        B, _, N, hd = q.shape
        rows = [t.view(B, t.shape[1], N // mask.run, mask.run, hd).transpose(1, 2).reshape(-1, t.shape[1], mask.run, hd)
                for t in (q, k, v)]
        out = _sdpa(*rows, None, enable_gqa)
        return out.view(B, N // mask.run, -1, mask.run, hd).transpose(1, 2).reshape(q.shape)
    if mask.attn is None or isinstance(mask.attn, torch.Tensor):
        out = _sdpa(q, k, v, mask.attn, enable_gqa)
        return out if mask.has_keys is None else out * mask.has_keys[:, None]
    if on_host(q):  # torch 2.13's compiled CPU flex kernel misreads strided views: give it dense ones
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    score_mod = None
    if mask.bias is not None:  # made here, inside a compiled block: a closure from outside would be guarded on
        q_term, k_weight = mask.bias

        def score_mod(score, b, h, i, j):
            return score + q_term[b, i] * k_weight[b, j]

    return _kernels(q.device.type).flex_attention(q, k, v, block_mask=mask.attn,  # CUDA: strided views, no copies
                                                  score_mod=score_mod, enable_gqa=enable_gqa)


class RowSplit:
    """Which of a row's tokens this process computes: all of them. The seam for context/sequence parallelism.

    ditcore.parallel.context_parallel replaces `DiT.rows` with a split over ranks: each rank then holds a slice of
    every row, attention gathers the keys and values of the whole row, and the output is gathered at the end. A
    model that regroups tokens between blocks moves them with `permutation`, which every split implements (and the
    single-process stand-in of a rank, ditcore.parallel.standins): the model holds no parallel code of its own.
    """

    def spans(self, n: int) -> tuple[slice, slice]:
        """(tokens attention sees as queries, tokens this process holds) of a row of n tokens."""
        return slice(0, n), slice(0, n)

    def keys_values(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (B, H, n, hd) of this process's queries → those of the whole row."""
        return k, v

    def gather(self, out: torch.Tensor) -> torch.Tensor:
        """Sequence-first output (n, B, F) of the tokens held here → (N, B, F) of the whole row."""
        return out

    def permutation(self, index: torch.Tensor, inverse: torch.Tensor,
                    counts: Callable | None) -> Callable[[torch.Tensor], torch.Tensor]:
        """A move of the tokens held here into another order of their rows, for a model that regroups tokens between
        blocks (ST-DiT): token j of row b is then token index[b, j] (index (B or 1, N), `inverse` its inverse).
        counts(n)[r][q]: tokens of all rows in slice r of n tokens in this order and in slice q in the other,
        computed on the host, by which a split over ranks sends each its tokens; None: gather the rows whole. Called
        outside the blocks' forwards (ditcore.traffic counts its collectives once under activation checkpointing)."""
        return lambda x: reorder(x, index, inverse)


def heads_first(x: torch.Tensor, seq: int, batch: int, heads: int, parts: int, head_dim: int):
    """(seq, B, heads·parts·hd) projections → `parts` views of shape (B, heads, seq, hd), without copying.

    Their last dimension is contiguous, which is all the norms, RoPE and the attention kernels need.
    """
    return x.view(seq, batch, heads, parts, head_dim).permute(3, 1, 2, 0, 4).unbind(0)
