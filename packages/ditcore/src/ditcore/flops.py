"""FLOP accounting for DiT training (MFU) and for comparing with the DiT paper's forward Gflops.

Training FLOPs per latent token (the usual 6N + attention rule, as in the reference benchmarks):

    6 · N_tok  +  12 · L · d · S  [ + 12 · L · d · S_text  with cross-attention ]

where S is the number of keys a query attends over: the sample's tokens, or for ST-DiT's factorised attention the
mean of a frame's tokens and a time-line's (`DiTConfig.attended`).

N_tok counts only weights applied to every token (patch embedding, attention and MLP projections,
cross-attention queries/outputs, output projection). Weights applied once per sample (adaLN
modulation, timestep/class/fps embedders) are excluded; text-side weights (the caption projection and
the cross-attention key/value projections) run once per text token and are charged per sample.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from ditcore.models import build, inputs_of
from ditcore.models.dit import DiTConfig


@dataclass(frozen=True)
class FlopCount:
    per_token_params: int  # N_tok: weights applied to every latent token
    per_text_token_params: int  # weights applied to every text token
    per_sample_params: int  # weights applied once per sample (adaLN, embedders)


def fake_model(cfg: DiTConfig, attention: str = "sdpa", change=None, real: bool = False) -> nn.Module:
    """The model of `cfg` on fake CPU tensors (torch's FakeTensorMode, as `model.fake_mode`): it runs at any width
    and length, computing shapes, dtypes and strides only, so that a 30B-wide block allocates nothing. Run it, and
    make its inputs, inside `with model.fake_mode:`. `change(model)`, when given, edits the meta model before its
    parameters are made (ditcore.memory gives it a tensor-parallel rank's share).

    real: the same model on real, uninitialised CPU tensors (`fake_mode` then does nothing), for a small one: a fake
    op costs about 0.3 ms of Python, a real one on small tensors a few µs, and the shapes and storages are the same.
    """
    with torch.random.fork_rng(devices=[]), torch.device("meta"):  # the constructor draws a seed: leave it be
        model = build(cfg, attention=attention)
    if change is not None:
        change(model)
    # the meta parameters are not fake
    model.fake_mode = contextlib.nullcontext() if real else FakeTensorMode(allow_non_fake_inputs=True)
    with model.fake_mode:
        model.to_empty(device="cpu")
    return model


# Parameters under which count_params probes a model on real (uninitialised) tensors: 128 MB in fp32.
REAL_BELOW = 2**25

# The rows of the probe forward of `count_params`: one sample of a (1, 2, 3) token grid and 5 text tokens, so that a
# linear applied to every token sees 6 rows, to every text token 5, once per sample 1.
_PROBE_GRID, _PROBE_TEXT = (1, 2, 3), 5


@functools.lru_cache(maxsize=64)
def count_params(cfg: DiTConfig) -> FlopCount:
    """The model's linear weights by what they are applied to, read from the model itself: a forward of its fake
    model (shapes only, nothing allocated) on a probe sample, in which every nn.Linear reports the rows it
    multiplies: the sample's tokens, its text tokens or the sample once. The blocks repeat every `period` blocks, so
    the model is probed with one period and with two: the second period's weights are every later one's."""
    with torch.random.fork_rng(devices=[]), torch.device("meta"):  # the constructor draws a seed: leave it be
        whole = build(cfg)
    period = block_period(whole)
    blocks = sum(p.numel() for p in whole.blocks.parameters())
    probed = sum(p.numel() for p in whole.parameters()) - blocks + 2 * period * blocks // cfg.depth
    real = probed < REAL_BELOW  # a small model's probe runs faster on real tensors (`fake_model`)
    one, two = (_probe(cfg.replace(depth=k * period), real) for k in (1, 2))
    repeats = cfg.depth // period - 1
    return FlopCount(*(a + repeats * (b - a) for a, b in zip(one, two, strict=True)))


def block_period(model: nn.Module) -> int:
    """The fewest blocks after which the model's blocks repeat (1: all alike; ST-DiT: 2, spatial and temporal)."""
    kinds = [type(block) for block in model.blocks]
    return next(k for k in range(1, len(kinds) + 1)
                if len(kinds) % k == 0 and all(kind is kinds[i % k] for i, kind in enumerate(kinds)))


def _probe(cfg: DiTConfig, real: bool) -> tuple[int, int, int]:
    """(per-token, per-text-token, per-sample) weights of the model of cfg, from one forward of its fake model."""
    model = fake_model(cfg, real=real)
    n = _PROBE_GRID[0] * _PROBE_GRID[1] * _PROBE_GRID[2]
    rows = {n: 0, _PROBE_TEXT: 0, 1: 0}  # rows a linear multiplies → its weights' total

    def count(linear: nn.Linear, args, out) -> None:
        applied = args[0].numel() // linear.in_features
        if applied not in rows:
            raise RuntimeError(f"{type(model).__name__}: a linear multiplied {applied} rows in the FLOP probe, "
                               f"neither its {n} tokens, its {_PROBE_TEXT} text tokens nor its one sample")
        rows[applied] += linear.weight.numel()

    hooks = [m.register_forward_hook(count) for m in model.modules() if isinstance(m, nn.Linear)]
    with torch.no_grad(), model.fake_mode:
        inputs = inputs_of(cfg).planned(cfg, [[_PROBE_GRID]], n, _PROBE_TEXT, packed=False)  # every input it reads
        model(torch.empty(1, n, cfg.patch_dim), torch.zeros(1, 1), inputs)
    for hook in hooks:
        hook.remove()
    return rows[n], rows[_PROBE_TEXT], rows[1]


def training_flops_per_token(cfg: DiTConfig, seq_len: int, text_len: int = 0, frames: int = 1) -> float:
    """Training FLOPs (forward + backward) per latent token, for samples of seq_len latent tokens in `frames`
    frames (of tokens: after the temporal patch)."""
    c = count_params(cfg)
    d, L = cfg.hidden_size, cfg.depth
    flops = 6 * c.per_token_params + 12 * L * d * cfg.attended(seq_len, frames)
    if cfg.text_dim and text_len:
        flops += 12 * L * d * text_len  # cross-attention scores and weighted values
        flops += 6 * c.per_text_token_params * text_len / seq_len  # text-side weights, spread over tokens
    return flops


def training_flops_per_sample(cfg: DiTConfig, seq_len: int, text_len: int = 0, frames: int = 1) -> float:
    return training_flops_per_token(cfg, seq_len, text_len, frames) * seq_len


def batch_flops(cfg: DiTConfig, batch) -> float:
    """Training FLOPs of a packed batch (ditcore.data.packing.PackedBatch): every sample at its own token and
    text length, as if it had been run alone; padding costs nothing.

    training_flops_per_sample is a polynomial in a sample's token count n, frame count f and text length t, so the
    batch's total needs only Σn, Σn·attended(n, f), Σn·t and Σt over its samples: a few tensor reductions on the
    host, no loop.
    """
    B, S = batch.per_sample_shape

    def per_sample(seg: torch.Tensor) -> torch.Tensor:  # (B, S) counts of each sample's tokens in seg (B, ·)
        real = seg >= 0
        flat = (torch.arange(B)[:, None] * S + seg)[real]
        return torch.bincount(flat, minlength=B * S).double()

    n, t = per_sample(batch.seg), per_sample(batch.text_seg)
    real = batch.seg >= 0
    last = torch.zeros(B * S, dtype=torch.long).scatter_reduce(  # each sample's last frame
        0, (torch.arange(B)[:, None] * S + batch.seg)[real], batch.pos[..., 0][real], "amax")
    f = (last + 1).double()
    c = count_params(cfg)
    d, L = cfg.hidden_size, cfg.depth
    total = 6 * c.per_token_params * n.sum() + 12 * L * d * (n * cfg.attended(n, f)).sum()
    if cfg.text_dim:
        total = total + 12 * L * d * (n * t).sum() + 6 * c.per_text_token_params * t.sum()
    return float(total)


def forward_macs(cfg: DiTConfig, seq_len: int, text_len: int = 0, per_sample_weights: bool = True,
                 frames: int = 1) -> float:
    """Multiply-accumulates of one forward pass of one sample: what the DiT paper's table calls Gflops.

    With per_sample_weights (as the paper's counter does) the adaLN and embedder matmuls are included.
    """
    c = count_params(cfg)
    d, L = cfg.hidden_size, cfg.depth
    macs = c.per_token_params * seq_len + 2 * L * d * seq_len * cfg.attended(seq_len, frames)  # + QKᵀ and AV
    if cfg.text_dim and text_len:
        macs += c.per_text_token_params * text_len + 2 * L * d * seq_len * text_len
    if per_sample_weights:
        macs += c.per_sample_params
    return macs


# Dense bf16 peaks for MFU (FLOP/s per GPU). On CPU, dit-train measures a matmul peak at start-up instead.
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def gpu_peak_flops(device_name: str) -> float | None:
    """Peak for a CUDA device name such as 'NVIDIA H100 80GB HBM3'; None when the table does not know it."""
    return next((peak for key, peak in PEAK_FLOPS.items() if key in device_name), None)


def measure_cpu_peak_flops(size: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of an fp32 (size x size) matmul on this machine: the CPU 'peak' that CPU MFU is measured against."""
    import time

    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best
