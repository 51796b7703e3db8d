"""A mixture-of-experts feed-forward (token-choice top-k routing; Shazeer et al. 2017, GShard, Switch Transformer),
the MLP of some of a DiT's or MovieGen's blocks when their config's `moe` is set (`MoEConfig`).

Each token's router probabilities p = softmax(W_r x) (in float32, also under autocast) pick its top_k experts; the
token's output is Σ_j w_j · expert_j(x), w_j the chosen experts' probabilities (Switch's and DeepSeek-V2's rule: not
renormalised to sum to 1 unless `normalize`, so that with top_k = 1 the router still learns from the main loss), plus
the always-on shared experts' output (DeepSeek-MoE) where `shared_experts` > 0.

Dropless on one process: every token reaches all of its top_k experts, however many tokens pick the same one. No
expert has a capacity, so a token's output depends on that token alone: a packed row gives each sample what it gives
alone (up to float rounding), and padding tokens change nothing. (A capacity limit would drop tokens by what else is
in the row, and packed == alone would then not hold: there is none on one process. Expert parallelism, whose dispatch
has a static capacity, `moe.capacity_factor`, can drop: ditcore.parallel.expert_parallel.)

The experts run as one grouped matmul (`grouped_mm`, torch._grouped_mm) over the N·k (token, choice) rows sorted by
expert, with the expert boundaries a device tensor: shapes are static whatever the routing, nothing is read back to
the host, and a compiled block stays one graph. Rows move by permutations whose backward is the inverse permutation
(ditcore.layout.reorder), and the k choices of a token are summed by a batched matmul: no scatter-add anywhere, so
nothing is summed in bf16 one term at a time.

Losses, over the real tokens only (padding does not count), each with its coefficient:
- load balance (Switch, eq. 4; GShard): E · Σ_e f_e P_e, f_e the share of the (token, choice) assignments that went to
  expert e, P_e the mean router probability of e. 1 when routing is uniform, E when every token picks one expert.
- router z-loss (ST-MoE, eq. 5): the mean over tokens of logsumexp(logits)², which keeps the logits small.
A block returns them with its output (`routing_stats`); the model gathers every MoE block's into `Routing`, which
dit-train adds to the objective and logs.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ditcore.errors import ConfigError
from ditcore.layout import reorder

# --------------------------------------------------------------------------------------------------
# Config


@dataclass(frozen=True)
class MoEConfig:
    """The mixture-of-experts feed-forward of a model config (DiTConfig.moe); None there: dense MLPs everywhere."""

    experts: int = 8
    top_k: int = 2
    every: int = 1  # blocks i with (i + 1) % every == 0 are MoE: 1 all of them, 2 every other one (the 2nd, 4th, ...)
    expert_hidden: int = 0  # each expert's hidden width; 0: the dense MLP's (DiTConfig.ffn)
    shared_experts: int = 0  # always-on experts of the same width, one dense MLP of shared_experts x that width
    balance_loss: float = 0.01  # coefficient of the load-balancing loss (Switch's 0.01)
    z_loss: float = 0.001  # coefficient of the router z-loss (ST-MoE's 0.001)
    normalize: bool = False  # renormalise the top_k weights of a token to sum to 1 (Mixtral's rule)
    # under expert parallelism only (ditcore.parallel.expert_parallel): the rows a rank sends each EP peer, as a
    # multiple of an even share T·k/ep; >= ep drops nothing
    capacity_factor: float = 1.25

    def __post_init__(self) -> None:
        def need(ok: bool, field: str, allowed: str) -> None:
            if not ok:
                raise ConfigError(f"moe.{field}", getattr(self, field), allowed)

        integer = lambda v: isinstance(v, int) and not isinstance(v, bool)
        need(integer(self.experts) and self.experts >= 2, "experts", "an integer >= 2")
        need(integer(self.top_k) and 1 <= self.top_k <= self.experts, "top_k",
             f"an integer from 1 to experts={self.experts}")
        need(integer(self.every) and self.every >= 1, "every", "an integer >= 1 (1: every block, 2: every other)")
        need(integer(self.expert_hidden) and self.expert_hidden >= 0, "expert_hidden",
             "an integer >= 1, or 0 for the dense MLP's width")
        need(integer(self.shared_experts) and self.shared_experts >= 0, "shared_experts", "an integer >= 0")
        need(self.balance_loss >= 0, "balance_loss", "a coefficient >= 0")
        need(self.z_loss >= 0, "z_loss", "a coefficient >= 0")
        need(self.capacity_factor > 0, "capacity_factor", "a number > 0 (>= ep: no token is dropped under EP)")

    def places(self, i: int) -> bool:
        """Is block i (counted from 0) a mixture-of-experts block?"""
        return (i + 1) % self.every == 0

    def hidden(self, ffn: int) -> int:
        """An expert's hidden width, in a model whose dense MLP is `ffn` wide."""
        return self.expert_hidden or ffn


# --------------------------------------------------------------------------------------------------
# The grouped matmul


@torch.library.custom_op("ditcore::grouped_mm", mutates_args=())
def grouped_mm(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm(a, b, offs=ends) as an op of our own, for two reasons (torch 2.13): its meta kernel, which
    fake tensors and torch.compile trace with, accepts bf16 only, where the CPU kernel computes in float32 too; and its
    autograd fails on an expanded gradient ("Invalid strides/sizes"), which `_backward` makes contiguous.

    a (R, K) rows grouped by expert, b (E, K, N): (R, N), the rows ends[e-1]:ends[e] times b[e]. a (K, R) and
    b (R, N), both 2-D: (E, K, N), the e-th the product of a's and b's columns / rows of group e (the weights' grads).
    """
    return torch._grouped_mm(a, b, offs=ends)


@grouped_mm.register_fake
def _(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    if b.dim() == 3:
        return a.new_empty(a.shape[0], b.shape[-1])
    return a.new_empty(ends.shape[0], a.shape[0], b.shape[1])


def _setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad: torch.Tensor):
    a, b, ends = ctx.saved_tensors
    grad = grad.contiguous()  # e.g. the expanded gradient of a sum
    return grouped_mm(grad, b.transpose(-2, -1), ends), grouped_mm(a.t(), grad, ends), None


grouped_mm.register_autograd(_backward, setup_context=_setup)


def autocasting(device: torch.device) -> bool:
    """Is autocast on for `device`'s type? (The meta device has no autocast to ask.)"""
    return torch.amp.is_autocast_available(device.type) and torch.is_autocast_enabled(device.type)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matmul on x runs in: autocast's where it is on (grouped_mm is no autocast op), else x's."""
    return torch.get_autocast_dtype(x.device.type) if autocasting(x.device) else x.dtype


# --------------------------------------------------------------------------------------------------
# Experts, router, the MoE feed-forward


class GroupedExperts(nn.Module):
    """`experts` MLPs (dim → hidden → dim, no biases, as torchtitan's and DeepSeek's), as stacked weights (E, in, out):
    GELU(tanh) MLPs like the DiT's, or with `glu` SwiGLU ones like MovieGen's, whose w_in output features are laid out
    (hidden, [gate, up]) as ditcore.models.moviegen.SwiGLU's."""

    dispatch = None  # set by ditcore.parallel.expert_parallel: the experts are split over ranks

    def __init__(self, dim: int, hidden: int, experts: int, glu: bool):
        super().__init__()
        self.glu = glu
        self.w_in = nn.Parameter(torch.empty(experts, dim, hidden * (2 if glu else 1)))
        self.w_out = nn.Parameter(torch.empty(experts, hidden, dim))

    def mlps(self, rows: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """rows (R, D) in the compute dtype, grouped by expert (ends: each group's last row + 1) → (R, D)."""
        dtype = rows.dtype
        h = grouped_mm(rows, self.w_in.to(dtype), ends)  # (R, H or 2H)
        if self.glu:
            gate, up = h.unflatten(-1, (-1, 2)).unbind(-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate="tanh")
        return grouped_mm(h, self.w_out.to(dtype), ends)

    def forward(self, x: torch.Tensor, chosen: torch.Tensor,
                weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, D) tokens, chosen (T, k) each token's experts, weights (T, k) fp32 → (Σ_j weights_j · expert_j(x),
        the share of (token, choice) rows dropped: 0 here, dropless)."""
        if self.dispatch is not None:
            return self.dispatch(self, x, chosen, weights)
        T, k = chosen.shape
        E = self.w_in.shape[0]
        flat = chosen.reshape(-1)  # (T·k,) the expert of (token t, choice j) at t·k + j
        order = flat.argsort(stable=True)  # those rows by expert
        inverse = order.argsort()
        # each expert's last row + 1 in the sorted rows: static shape (E,), on the device, never read by the host
        ends = torch.searchsorted(flat[order], torch.arange(E, device=flat.device), right=True).to(torch.int32)
        dtype = compute_dtype(x)
        rows = x.to(dtype)[:, None].expand(T, k, -1).reshape(T * k, -1)  # its backward sums the k choices: no scatter
        y = reorder(self.mlps(reorder(rows, order, inverse), ends), inverse, order)  # (T·k, D) back in (t, j) order
        return combine(y, weights), torch.zeros((), device=x.device)


def combine(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """y (T·k, D) the experts' outputs in (token, choice) order, weights (T, k) → (T, D): Σ_j weights_j · y_j, by a
    batched matmul (fp32 accumulation, no scatter-add)."""
    T, k = weights.shape
    return torch.bmm(weights.to(y.dtype)[:, None], y.view(T, k, -1)).squeeze(1)


class MoE(nn.Module):
    """The feed-forward of a mixture-of-experts block: router, routed experts, shared experts (module docstring).

    forward(x (n, B, D) sequence-first, real (B, n) bool or None: the tokens that are not padding) →
    (y (n, B, D), stats): `routing_stats`, of the real tokens.
    """

    def __init__(self, dim: int, ffn: int, moe: MoEConfig, glu: bool, shared: nn.Module | None):
        super().__init__()
        self.top_k, self.normalize = moe.top_k, moe.normalize
        self.router = nn.Linear(dim, moe.experts, bias=False)
        self.experts = GroupedExperts(dim, moe.hidden(ffn), moe.experts, glu)
        self.shared = shared

    def forward(self, x: torch.Tensor, real: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        n, B, D = x.shape
        tokens = x.reshape(n * B, D)  # (T, D)
        # in fp32, autocast or not: bf16 logits would tie and reorder experts of close probability
        with torch.autocast(x.device.type, enabled=False) if autocasting(x.device) else contextlib.nullcontext():
            logits = self.router(tokens.float())  # (T, E)
        probs = logits.softmax(-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)  # (T, k) each, most probable first
        if self.normalize:
            weights = weights / weights.sum(-1, keepdim=True)
        y, dropped = self.experts(tokens, chosen, weights)
        if self.shared is not None:
            y = y + self.shared(tokens)
        mask = None if real is None else real.T.reshape(n * B)  # (T,) in the tokens' (n, B) order
        return y.view(n, B, D), torch.cat([routing_stats(logits, probs, chosen, mask), dropped.float()[None]])


def routing_stats(logits: torch.Tensor, probs: torch.Tensor, chosen: torch.Tensor,
                  real: torch.Tensor | None) -> torch.Tensor:
    """(2 + E,) fp32: [load-balancing loss, z-loss, each expert's share of the assignments] over the real tokens
    (real (T,) bool; None: all). One tensor, so that a compiled, checkpointed block returns it as plainly as x."""
    E = probs.shape[-1]
    weight = torch.ones_like(logits[:, 0]) if real is None else real.to(logits.dtype)  # (T,)
    tokens = weight.sum().clamp(min=1)
    picks = (chosen[..., None] == torch.arange(E, device=chosen.device)).sum(1).to(logits.dtype)  # (T, E) 0/1
    # sums over tokens, not `weight @ picks`: matmul squeezes a vector product's mm output in place, which selective
    # checkpointing, keeping that output, refuses
    share = (weight[:, None] * picks).sum(0) / (tokens * chosen.shape[1])  # f_e: sums to 1
    mean_prob = (weight[:, None] * probs).sum(0) / tokens  # P_e
    balance = E * (share * mean_prob).sum()
    z = (weight * logits.logsumexp(-1).square()).sum() / tokens
    return torch.cat([balance[None], z[None], share])


@dataclass
class Routing:
    """What a forward's MoE blocks report (`routing_stats` and the share of (token, choice) rows the expert-parallel
    dispatch dropped, stacked): (blocks, 2 + E + 1)."""

    stats: torch.Tensor
    moe: MoEConfig

    @property
    def balance(self) -> torch.Tensor:  # (blocks,) each block's load-balancing loss
        return self.stats[:, 0]

    @property
    def z(self) -> torch.Tensor:  # (blocks,) each block's router z-loss
        return self.stats[:, 1]

    @property
    def share(self) -> torch.Tensor:  # (blocks, E) each block's share of assignments per expert (no gradient)
        return self.stats[:, 2:-1].detach()

    @property
    def dropped(self) -> torch.Tensor:  # (blocks,) each block's share of (token, choice) rows dropped (EP's capacity)
        return self.stats[:, -1].detach()

    @property
    def aux_loss(self) -> torch.Tensor:
        """What the training objective adds: the blocks' losses summed (as Switch and ST-MoE add them up over the
        layers), each times its coefficient."""
        return self.moe.balance_loss * self.balance.sum() + self.moe.z_loss * self.z.sum()

    def metrics(self) -> dict[str, torch.Tensor]:
        """0-d values to log (nothing read back): `routing_metrics` of these blocks."""
        stats = self.stats.detach()
        return routing_metrics(stats.sum(0), stats.new_tensor(float(len(stats))), self.moe)


def routing_metrics(total: torch.Tensor, blocks: torch.Tensor, moe: MoEConfig) -> dict[str, torch.Tensor]:
    """0-d values to log from the routing statistics summed over `blocks` MoE blocks (a 0-d tensor: pipeline stages
    add theirs up on the device): the aux loss, the blocks' mean balance and z-losses and dropped share (expert
    parallelism's capacity; 0 without), and each expert's share of the assignments, averaged over the blocks (1/E
    each when balanced)."""
    share = total[2:-1] / blocks
    return {"moe_aux_loss": moe.balance_loss * total[0] + moe.z_loss * total[1], "moe_balance": total[0] / blocks,
            "moe_z": total[1] / blocks, "moe_dropped": total[-1] / blocks,
            **{f"expert_share_{e}": share[e] for e in range(share.shape[0])}}
