"""Test helpers: float32 tolerances derived from the computation, and a check that no op sums in low precision.

A comparison (packed rows vs samples run alone, a parallel layout vs one process, compiled vs eager) passes
when the two results differ by no more than float32 rounding can explain: `fp32_tolerance(work, scale)`,
where work is the accumulated length of the reductions the values went through and scale their magnitude.
A real bug (attention leaking across samples, a wrong sign, a missing term) moves values by 1e-2..1 of their
scale, while ε·work stays below 1e-3 for the tiny models of the tests.
"""

from __future__ import annotations

import inspect

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ditcore.models.dit import DiTConfig, ScalarEmbedder

EPS32 = torch.finfo(torch.float32).eps
EPS64 = torch.finfo(torch.float64).eps  # for float64 comparisons: the same reasoning, 2⁻⁵² instead of 2⁻²³


def fp32_tolerance(work: int, scale: float) -> float:
    """Largest float32 rounding difference for values of magnitude `scale` after `work` accumulated terms.

    A dot product of length n computed in floating point is within γ_n·Σ|x_i·y_i| of the exact one, with
    γ_n = n·u/(1 − n·u) ≈ n·u and u = ε/2 the unit roundoff (Higham, Accuracy and Stability of Numerical
    Algorithms, 2nd ed., §3.1); to first order the errors of a chain of reductions add, so the bound for a value
    is u × the sum of the reduction lengths along its chain, times the magnitude of the terms (for a network with
    normalised activations, the magnitude of its outputs). Using ε rather than u gives a factor 2 of headroom,
    which also covers comparing two computations that are each within the bound of the exact value. The bound
    is worst-case, with every rounding error pointing the same way: typical errors grow like √n·u, far below it.
    """
    return work * EPS32 * scale


def assert_close_fp32(actual: torch.Tensor, expected: torch.Tensor, *, work: int, msg: str | None = None) -> None:
    """torch.testing.assert_close with atol = fp32_tolerance(work, max|expected|) and rtol = 0."""
    scale = expected.detach().abs().max().item() if expected.numel() else 0.0
    atol = fp32_tolerance(work, scale)
    note = f"float32 bound: work {work} × ε × max|expected| {scale:.3g} = {atol:.2e}" + (f"; {msg}" if msg else "")
    torch.testing.assert_close(actual, expected, rtol=0, atol=atol, msg=lambda default: f"{default}\n{note}")


def dit_forward_work(cfg: DiTConfig, seq_len: int, text_len: int = 0) -> int:
    """Accumulated work of one output value of a DiT forward: the reduction lengths along a token's path.

    seq_len: keys each query attends over (a packed row's full length N: masked keys add exact zeros);
    text_len: text tokens each query may attend over. The conditioning vector and the text join the path
    from the side; their own reductions are counted once.
    """
    D, hd, mlp = cfg.hidden_size, cfg.head_dim, cfg.ffn
    freq = inspect.signature(ScalarEmbedder).parameters["freq_dim"].default  # its sinusoidal features

    def attention(keys: int) -> int:
        # q projection, per-head RMS norm, q·k scores (hd), softmax sum and weighted sum over keys, output projection
        return D + (hd if cfg.qk_norm else 0) + hd + 2 * keys + D

    cond = (freq + D) * (1 + cfg.fps_cond)  # noise-level (and fps) embedder MLPs → c (B, S, D)
    text = cfg.text_dim + D if cfg.text_dim else 0  # text embedder MLP → (B, L, D)
    block = D + D + attention(seq_len) + D + D + mlp  # adaLN; LayerNorm, self-attention; LayerNorm, MLP D → mlp → D
    if cfg.text_dim:
        block += D + D + attention(text_len)  # LayerNorm, k/v projection of the text, cross-attention
    final = D + D + D  # adaLN, LayerNorm, linear
    return cfg.patch_dim + cond + text + cfg.depth * block + final


def dit_grad_work(cfg: DiTConfig, seq_len: int, text_len: int, tokens: int) -> int:
    """Accumulated work of a parameter gradient after one forward and backward over `tokens` tokens in all.

    Backward goes back down the same chain, each reduction once more transposed (y = W·x reduces over x's
    features; dL/dx = Wᵀ·dL/dy over y's), so it doubles the forward's work; a weight's gradient then sums
    over every token of the batch, and a per-head RMS norm's weight over every head too.
    """
    return 2 * dit_forward_work(cfg, seq_len, text_len) + tokens * cfg.num_heads


# --------------------------------------------------------------------------------------------------
# Sums into low-precision tensors


class NoLowPrecisionScatter(TorchDispatchMode):
    """Fails, on leaving its `with` block, if an op inside summed values into a bf16 or fp16 tensor by scattering:
    scatter_add, index_add, index_put with accumulate=True, scatter_reduce, ..., forward or backward (the backward
    of a gather, an index_select or an advanced index is one).

    CUDA performs such a sum with atomic adds in the tensor's own dtype, one rounding per added term, so a sample's
    sum over thousands of tokens keeps few of bf16's 8 bits (ditcore.layout.per_token). A CPU performs the same ops
    in fp32, so comparing results on a CPU cannot see it; looking at which ops run can, on any device.
    """

    LOW = (torch.bfloat16, torch.float16)
    SUMS = frozenset({"scatter_add", "scatter_add_", "index_add", "index_add_", "scatter_reduce", "scatter_reduce_",
                      "index_reduce", "index_reduce_"})
    SUMS_IF_ACCUMULATE = frozenset({"index_put", "index_put_", "_index_put_impl_", "_unsafe_index_put", "put", "put_"})
    SUMS_IF_REDUCE = frozenset({"scatter", "scatter_"})  # their overloads with a `reduce` argument ("add", "multiply")

    def __init__(self):
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        named = {a.name: v for a, v in zip(func._schema.arguments, args, strict=False)} | kwargs
        sums = (name in self.SUMS or (name in self.SUMS_IF_ACCUMULATE and named.get("accumulate", False))
                or (name in self.SUMS_IF_REDUCE and named.get("reduce") is not None))
        target = args[0] if args else None
        if sums and isinstance(target, torch.Tensor) and target.dtype in self.LOW:
            node = torch._C._current_autograd_node()  # in backward: whose gradient it computes
            where = f" in {node.name()}" if node is not None else " in forward"
            self.found.append(f"{func}{where}: into {target.dtype} {tuple(target.shape)}")
        return func(*args, **kwargs)

    def __exit__(self, exc_type, exc_value, traceback):
        super().__exit__(exc_type, exc_value, traceback)
        if self.found and exc_type is None:
            raise AssertionError(
                f"{len(self.found)} op(s) summed into a low-precision tensor, which CUDA rounds after every add: "
                + "; ".join(dict.fromkeys(self.found))
                + ". Sum with fp32 accumulation instead (a matmul, fp32 values), or move a permutation's gradient "
                "back by the inverse permutation (ditcore.models.stdit.reorder)")
