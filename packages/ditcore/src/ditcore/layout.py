"""The token layout every layer agrees on: latent scale, patches, positions and packed rows.

Codecs store latents normalised to std SIGMA_DATA; the data pipeline cuts them into patch tokens; the model
reads token rows that may be *packed* (several samples one after another); the diffusion loss weights each
token by its own sample's noise level. All of them import these definitions from here, and this module
imports nothing of ditcore, so the layers above it never import each other for a shape convention.

Token order is (t, h, w) row-major; a token's features are ordered (c, pt, p, p). A packed row is described by
    seg      (B, N)     which sample of the row each token belongs to (0..S-1), -1 for padding
    pos      (B, N, 3)  integer (t, h, w) grid position of each token within its sample
    text_seg (B, L)     which sample each text token belongs to, -1 for padding
and per-sample values shaped (B, S). With seg=None every row is one sample. The same rows' layout on the host, where
reading it never waits for a device, is `grids`: per row, the (T, H, W) token grids of its samples in order
(`grid_rows` makes seg and pos of it). A model that regroups a row's tokens between blocks permutes them with
`reorder`, whose backward is a gather too.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake

SIGMA_DATA = 0.5  # std of the (normalised) latents; datasets are normalised per channel to this scale


def on_host(t: torch.Tensor) -> bool:
    """Can the host read t's values without waiting for a device? A CPU tensor, unless it is a fake one, which has
    none (ditcore.memory runs the model on fake tensors to record what it keeps for backward)."""
    # (a compiled block holds no fake tensor; is_fake is a function dynamo does not trace)
    return t.device.type == "cpu" and (torch.compiler.is_compiling() or not is_fake(t))


def patchify(x: torch.Tensor, p: int, pt: int = 1) -> torch.Tensor:
    """(B, C, T, H, W) latents → (B, T/pt · H/p · W/p, C·pt·p·p) tokens."""
    B, C, T, H, W = x.shape
    for name, size, patch in (("frames", T, pt), ("height", H, p), ("width", W, p)):
        if size % patch:
            raise ValueError(f"latent {name} {size} is not divisible by the patch size {patch}; "
                             f"crop or pad the latent to a multiple of {patch}")
    x = x.reshape(B, C, T // pt, pt, H // p, p, W // p, p)
    x = x.permute(0, 2, 4, 6, 1, 3, 5, 7)  # (B, T', H', W', C, pt, p, p)
    return x.reshape(B, (T // pt) * (H // p) * (W // p), C * pt * p * p)


def unpatchify(tokens: torch.Tensor, grid: tuple[int, int, int], p: int, pt: int = 1) -> torch.Tensor:
    """Exact inverse of `patchify`: (B, T'·H'·W', C·pt·p·p) → (B, C, T'·pt, H'·p, W'·p)."""
    B, _N, D = tokens.shape
    Tg, Hg, Wg = grid
    C = D // (pt * p * p)
    x = tokens.reshape(B, Tg, Hg, Wg, C, pt, p, p)
    x = x.permute(0, 4, 1, 5, 2, 6, 3, 7)  # (B, C, T', pt, H', p, W', p)
    return x.reshape(B, C, Tg * pt, Hg * p, Wg * p)


def grid_positions(grid: tuple[int, int, int], device=None) -> torch.Tensor:
    """(T'·H'·W', 3) integer (t, h, w) positions in patchify's token order."""
    t, h, w = (torch.arange(n, device=device) for n in grid)
    return torch.stack(torch.meshgrid(t, h, w, indexing="ij"), dim=-1).reshape(-1, 3)


def grid_rows(grids: list[list[tuple[int, int, int]]], N: int) -> tuple[torch.Tensor, torch.Tensor]:
    """seg (B, N) and pos (B, N, 3) of rows of N tokens, row b packing samples of the (T, H, W) token grids
    `grids[b]` one after another, then padding (sample −1, position 0), as the data pipeline packs them."""
    seg, pos = torch.full((len(grids), N), -1), torch.zeros(len(grids), N, 3, dtype=torch.long)
    for b, row in enumerate(grids):
        n = 0
        for s, grid in enumerate(row):
            k = grid[0] * grid[1] * grid[2]
            if n + k > N:
                raise ValueError(f"grids {row} hold more than the row's {N} tokens")
            seg[b, n:n + k], pos[b, n:n + k] = s, grid_positions(grid)
            n += k
    return seg, pos


def per_token(values: torch.Tensor, seg: torch.Tensor | None) -> torch.Tensor:
    """Per-sample values (B, S, ...) → per-token (B, N, ...) by each token's sample index.

    seg=None means one sample per row: (B, 1, ...) is returned and broadcasts over tokens. Padding
    tokens (seg = -1) take sample 0's values; their outputs are masked out of every loss.

    Values with a gradient (the adaLN modulations) are spread by a one-hot matmul, (B, N, S) @ (B, S, F): its
    forward is exact (one nonzero term per output), and its backward, (B, S, N) @ (B, N, F), sums each sample's
    token gradients with fp32 accumulation and rounds once. A gather's backward instead scatter-adds into a tensor
    of the values' dtype, which CUDA does with one rounding per token: a 4096-token sample's bf16 gradient is then
    off by 1e-1 to 2e-1, ten times a whole row's (tests/ditcore/models/test_numerics.py).
    Why not gather fp32 values instead: that makes an fp32 copy of the (B, N, F) modulations each way (600 MB a block
    at DiT-7B's width and 8k tokens) and still scatters with atomics, N/S tokens contending for each address. The
    one-hot is N·S values (512 kB at 8192 tokens and 32 samples); both products move what the gather moves, and at S
    FLOPs per byte they are memory-bound like it. Values without a gradient (noise levels) and fp32 values take the
    gather: exact in every dtype, and an fp32 scatter sums in fp32 (an fp32 matmul under TF32 would round them).
    """
    if seg is None:
        return values[:, :1]
    idx = seg.clamp(min=0)
    if not values.requires_grad or values.dtype in (torch.float32, torch.float64):
        return torch.gather(values, 1, idx.view(*idx.shape, *[1] * (values.ndim - 2)).expand(
            -1, -1, *values.shape[2:]))
    B, S = values.shape[:2]
    one_hot = (idx[..., None] == torch.arange(S, device=idx.device)).to(values.dtype)  # (B, N, S)
    with torch.autocast(values.device.type, enabled=False):  # in the values' dtype, as the gather
        out = torch.bmm(one_hot, values.reshape(B, S, -1))  # (B, N, F)
    return out.view(*idx.shape, *values.shape[2:])


def segment_mask(seg_q: torch.Tensor, seg_k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, 1, Nq, Nk) boolean mask: a query sees only keys of its own sample; and (B, Nq, 1) has_keys.

    A query whose sample has no keys (padding rows, an empty text) is given every key so that softmax
    stays finite; its output is zeroed by the caller with `has_keys`.
    """
    mask = seg_q[:, :, None] == seg_k[:, None, :]
    has_keys = mask.any(-1, keepdim=True)
    return (mask | ~has_keys)[:, None], has_keys


def _take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows of x taken along dim 0: index (n,) or (1, n) for all of x's columns alike, (B, n) for each column b of
    a sequence-first x (N, B, D) its own."""
    if index.ndim == 1 or index.shape[0] == 1:
        return x.index_select(0, index.reshape(-1))
    return x.gather(0, index.T[:, :, None].expand(-1, -1, x.shape[-1]))


class _Permute(torch.autograd.Function):
    """A permutation of tokens whose backward moves the gradient back by the inverse permutation: a gather too.

    index_select's and gather's own backwards scatter-add into a zero tensor of the gradient's dtype (index_add,
    scatter_add). For a permutation every sum has one term, so nothing is rounded, but on CUDA it is an atomic
    scatter, and a scatter into bf16 is what must never sum a sample's tokens (`per_token`): the test that no
    training step scatters in low precision (ditcore.testing.NoLowPrecisionScatter) finds none here.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return _take(x, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return _take(grad, inverse), None, None


def reorder(x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """Sequence-first x (N, B, D) → (N, B, D) whose token j of row b is x[index[b, j], b]; index (B or 1, N), or (N,)
    for every row alike (x may then be (N, D)). `inverse` is the inverse permutation (index.argsort(-1))."""
    return _Permute.apply(x, index, inverse)
