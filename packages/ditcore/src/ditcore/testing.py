"""Test helpers: float32 tolerances derived from the computation, and a check that no op sums in low precision.

A comparison (packed rows vs samples run alone, a parallel layout vs one process, compiled vs eager) passes
when the two results differ by no more than float32 rounding can explain: `fp32_tolerance(work, scale)`,
where work is the accumulated length of the reductions the values went through and scale their magnitude.
A real bug (attention leaking across samples, a wrong sign, a missing term) moves values by 1e-2..1 of their
scale, while ε·work stays below 1e-3 for the tiny models of the tests.

`HostReads` is the CPU's stand-in for torch.cuda.set_sync_debug_mode("error"): it fails on every read that would
make the host wait for the device, so a code path meant to queue GPU work without waiting is checked on the CPU.

`Payload` is what a hostile file holds: tests plant it in every kind of file ditcore reads.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import shlex

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ditcore.models.dit import DiTConfig
from ditcore.models.layers import ScalarEmbedder

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
    if cfg.moe is not None:  # router (D) and softmax (E) into the weights, an expert's (or the shared) MLP, Σ over k
        mlp = D + cfg.moe.experts + max(1, cfg.moe.shared_experts) * cfg.moe.hidden(cfg.ffn) + cfg.moe.top_k
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
                "back by the inverse permutation (ditcore.layout.reorder)")


# Host reads

_aten = torch.ops.aten
_PYTHON_READS = {torch.Tensor.tolist: "Tensor.tolist()", torch.Tensor.numpy: "Tensor.numpy()"}  # no aten op on a CPU
_READS = {_aten._local_scalar_dense.default, _aten.is_nonzero.default, _aten.equal.default}  # .item(), bool(), equal
_MASKABLE = {_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default, _aten._index_put_impl_.default}


def waits_for_data(func, args: tuple, kwargs: dict) -> bool:
    """Does this aten op make the host wait for its inputs: does it read a value back, or does its output's shape
    depend on their values (the host must know it to allocate the output)? aten tags the latter
    dynamic_output_shape; some of those depend on the data only for some arguments."""
    if func in _READS:
        return True
    if func in _MASKABLE:  # x[mask] is a nonzero() in disguise; integer indices are not
        return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1])
    if torch.Tag.dynamic_output_shape not in func.tags:  # nonzero, masked_select, unique, bincount, ...
        return False
    if func is _aten.repeat_interleave.Tensor:
        return kwargs.get("output_size") is None
    return True


class HostReads:
    """Raises on anything that makes the host wait for a tensor on `device`: a value read back (`.item()`, `bool()`,
    `int()`, `.tolist()`, `.numpy()`, `torch.equal`) or an op whose output shape depends on the data (`nonzero`,
    boolean-mask indexing, `masked_select`, `unique`, `bincount`, `repeat_interleave` without output_size). On a GPU
    torch.cuda.set_sync_debug_mode("error") catches these; on the CPU nothing waits, so with device="cpu" this treats
    the CPU as the device: the same code path, its mistakes found before a GPU is at hand.

        with HostReads("cpu", host=[...]) as watch:
            ...                     # a host read raises RuntimeError, naming the op
            with watch.paused():    # or a function wrapped as watch.unwatched(f)
                ...                 # code that reads host tensors by design

    host: tensors on `device` that stand for host tensors by design (e.g. a non-fused optimizer's step counters,
    which torch keeps on the host next to GPU parameters too); reading them is allowed. aten ops are watched at the
    dispatcher, forward and backward; `.tolist()` and `.numpy()` read a CPU tensor's memory without an aten op, so
    they are watched as Python calls.
    """

    def __init__(self, device: str | torch.device, host: list[torch.Tensor] = ()):
        self.device = torch.device(device).type
        self.host = {StorageWeakRef(t.untyped_storage()) for t in host}
        self.pauses = 0
        self.modes = [_DispatchWatch(self), _FunctionWatch(self)]

    def check(self, what: str, inputs) -> None:
        if self.pauses:
            return
        for t in tree_leaves(inputs):
            if (isinstance(t, torch.Tensor) and t.device.type == self.device
                    and StorageWeakRef(t.untyped_storage()) not in self.host):
                raise RuntimeError(f"{what} on a {self.device} tensor of shape {tuple(t.shape)} makes the host wait "
                                   "for the device")

    @contextlib.contextmanager
    def paused(self):
        self.pauses += 1
        try:
            yield
        finally:
            self.pauses -= 1

    def unwatched(self, f):
        """f, run with the watch paused: for a function that reads host tensors by design."""

        @functools.wraps(f)
        def run(*args, **kwargs):
            with self.paused():
                return f(*args, **kwargs)

        return run

    def __enter__(self) -> HostReads:
        for mode in self.modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self.modes):
            mode.__exit__(*exc)


class _DispatchWatch(TorchDispatchMode):
    def __init__(self, watch: HostReads):
        super().__init__()
        self.watch = watch

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if waits_for_data(func, args, kwargs):
            self.watch.check(str(func), (args, kwargs))
        return func(*args, **kwargs)


class _FunctionWatch(TorchFunctionMode):
    def __init__(self, watch: HostReads):
        super().__init__()
        self.watch = watch

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _PYTHON_READS:
            self.watch.check(_PYTHON_READS[func], args)
        if func is torch.nn.functional.one_hot and (args[1] if len(args) > 1 else kwargs.get("num_classes", -1)) >= 0:
            with self.watch.paused():  # its CPU kernel checks the values (.item()); CUDA's leaves it to device asserts
                return func(*args, **kwargs)
        return func(*args, **kwargs)


class Payload:
    """Unpickling this runs a shell command that creates `marker` (harmless; a real attack would do anything). Tests
    plant it, pickled or torch.save'd, in each kind of file ditcore reads, and check that the marker never appears."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(self.marker)}",))


@torch.no_grad()
def dit_pipeline_loop(transformer, scheduler, x_T: torch.Tensor, class_labels: list[int], null_class: int,
                      guidance: float, steps: int, alphas_cumprod: torch.Tensor | None = None) -> torch.Tensor:
    """diffusers' own sampling of a DiT (a DiTTransformer2DModel and a diffusers scheduler) as DiTPipeline.__call__
    steps it, from a given x_T (the pipeline draws its own, and fixes the null class at 1000): one batch of
    [conditional rows; null-class rows] under guidance, ε guided over all latent channels, the learned-Σ half
    dropped, `scheduler.step`. In x_T's dtype. alphas_cumprod (float64, the transformer in float64 too) makes it the
    float64 reference: its distance from the float32 loop is this computation's float32 error."""
    scheduler.set_timesteps(steps)
    if alphas_cumprod is not None:  # the scheduler's own tables are float32
        scheduler.alphas_cumprod = alphas_cumprod
        if hasattr(scheduler, "final_alpha_cumprod"):  # DDIM's last landing
            scheduler.final_alpha_cumprod = alphas_cumprod.new_tensor(1.0) if scheduler.config.set_alpha_to_one \
                else alphas_cumprod[0]
    C, y = x_T.shape[1], torch.tensor(class_labels)
    labels = torch.cat([y, torch.full_like(y, null_class)]) if guidance > 1 else y
    x = x_T
    for t in scheduler.timesteps:
        rows = torch.cat([x, x]) if guidance > 1 else x
        eps = transformer(rows, timestep=t.expand(len(rows)), class_labels=labels).sample[:, :C]
        if guidance > 1:
            cond, uncond = eps.chunk(2)
            eps = uncond + guidance * (cond - uncond)
        x = scheduler.step(eps, t, x).prev_sample
    return x
