"""FLOP accounting for DiT training (MFU) and for comparing with the DiT paper's forward Gflops.

Training FLOPs per latent token (the usual 6N + attention rule, as in the reference benchmarks):

    6 · N_tok  +  12 · L · d · S  [ + 12 · L · d · S_text  with cross-attention ]

where S is the number of keys a query attends over: the sample's tokens, or for ST-DiT's factorised attention the
mean of a frame's tokens and a time-line's (`DiTConfig.attended`).

N_tok counts only weights applied to every token (patch embedding, attention and MLP projections,
cross-attention queries/outputs, output projection); of a mixture-of-experts MLP, the active ones: the router, the
top_k experts a token goes to and the shared experts (ditcore.models.moe). Weights applied once per sample (adaLN
modulation, timestep/class/fps embedders) are excluded; text-side weights (the caption projection and
the cross-attention key/value projections) run once per text token and are charged per sample.

The weights are read from the model itself (`count_params`): its meter watches the probe that the memory plan and the
traffic model watch too (ditcore.probe), run at a one-rank layout of its own whose rows tell tokens, text tokens and
samples apart.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from ditcore.job import Layout
from ditcore.memory import planned_batch
from ditcore.models.dit import DiTConfig
from ditcore.models.moe import GroupedExperts
from ditcore.probe import Hooks, Rank, RankShapes, block_period, meta_model, run


@dataclass(frozen=True)
class FlopCount:
    per_token_params: int  # N_tok: weights applied to every latent token
    per_text_token_params: int  # weights applied to every text token
    per_sample_params: int  # weights applied once per sample (adaLN, embedders)


# The probe's run of `count_params` (ditcore.probe): one rank's row of 6 latent tokens and 5 text tokens, one sample
# unpacked, in fp32 on the CPU's kernels, so that a linear applied to every token sees 6 rows, to every text token
# 5, once per sample 1.
_PROBE = Layout(seq_length=6, text_len=5, packed=False, precision="fp32", device="cpu", attention="sdpa")


@functools.lru_cache(maxsize=64)
def count_params(cfg: DiTConfig) -> FlopCount:
    """The model's linear weights by what they are applied to, read from the model itself: the probe's training
    forward (ditcore.probe, shapes only, nothing allocated) of a one-rank layout (`_PROBE`), in which every nn.Linear
    reports the rows it multiplies: the sample's tokens, its text tokens or the sample once. The blocks repeat every
    `period` blocks, so the model is probed with one period and with two: the second period's weights are every later
    one's."""
    period = block_period(meta_model(cfg))
    key = RankShapes.of(_PROBE, "none")
    one, two = (run(cfg, key.replace(periods=k), _Meter, planned_batch) for k in (1, 2))
    repeats = cfg.depth // period - 1
    return FlopCount(*(a + repeats * (b - a) for a, b in zip(one, two, strict=True)))


class _Meter(Hooks):
    """The FLOP count's meter of the probe's run: (per-token, per-text-token, per-sample) weights of the model's
    linears, by the rows each multiplies, and of its MoE experts: per token, the k experts it is sent to."""

    def __init__(self, cfg: DiTConfig, key: RankShapes, rank: Rank):
        self.model, self.n, self.text = type(rank.model).__name__, key.seq_length, key.text_len
        self.rows = {self.n: 0, self.text: 0, 1: 0}  # rows a linear multiplies → its weights' total
        for m in rank.model.modules():
            if isinstance(m, nn.Linear):
                m.register_forward_hook(lambda linear, args, out: self.count(
                    args[0].numel() // linear.in_features, linear.weight.numel()))
            elif isinstance(m, GroupedExperts):  # forward(x (T, D), chosen (T, k), ...): one expert's weights k times
                m.register_forward_hook(lambda experts, args, out: self.count(
                    args[0].shape[0], args[1].shape[1] * (experts.w_in[0].numel() + experts.w_out[0].numel())))

    def count(self, applied: int, weights: int) -> None:
        """`weights` weights applied to each of `applied` rows."""
        if applied not in self.rows:
            raise RuntimeError(f"{self.model}: a linear multiplied {applied} rows in the FLOP probe, neither its "
                               f"{self.n} tokens, its {self.text} text tokens nor its one sample")
        self.rows[applied] += weights

    def read(self) -> tuple[int, int, int]:
        return self.rows[self.n], self.rows[self.text], self.rows[1]


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
