"""Numerics of a bf16 training step on packed rows, which a CPU cannot show by comparing results alone.

CUDA sums a scatter into a bf16 tensor (the backward of a gather, an index_select, an advanced index) one rounding
per added term; a CPU sums the same ops in fp32. So: no op of a training step may scatter into bf16, as
ditcore.testing.NoLowPrecisionScatter sees on any device; and a packed sample's adaLN gradient, which sums its
tokens' gradients, must be as accurate as a whole row's, against float64.
"""

import pytest
import torch

from ditcore.diffusion import EDMLoss, EDMPrecond
from ditcore.inputs import Inputs
from ditcore.layout import grid_positions, per_token
from ditcore.models import ARCHS, build, dit, preset
from ditcore.testing import NoLowPrecisionScatter

from .test_dit import randomize

TINY = [arch.tiny for arch in ARCHS.values()]  # every registered architecture


def packed_batch(cfg, rows: list[list[tuple[int, int, int]]], N: int, g: torch.Generator) -> dict:
    """Rows of N tokens packing samples of the given (T, H, W) grids, padding after them; 2 text tokens a sample."""
    B, S, L = len(rows), max(len(r) for r in rows), 2 * max(len(r) for r in rows)
    pos, seg, text_seg = torch.zeros(B, N, 3, dtype=torch.long), torch.full((B, N), -1), torch.full((B, L), -1)
    for b, row in enumerate(rows):
        n = 0
        for s, grid in enumerate(row):
            k = grid[0] * grid[1] * grid[2]
            pos[b, n:n + k], seg[b, n:n + k], text_seg[b, 2 * s:2 * s + 2] = grid_positions(grid), s, s
            n += k
    return dict(x=torch.randn(B, N, cfg.patch_dim, generator=g), noise=torch.randn(B, N, cfg.patch_dim, generator=g),
                sigma=torch.rand(B, S, generator=g) + 0.3, seg=seg, mask=seg >= 0, pos=pos,
                class_labels=torch.randint(0, cfg.num_classes, (B, S), generator=g),
                text=torch.randn(B, L, cfg.text_dim, generator=g), text_seg=text_seg)


def bf16_training_step(model, b: dict) -> None:
    """dit-train's loss under bf16 autocast (EDM preconditioning around the model), and its backward."""
    with torch.autocast("cpu", torch.bfloat16):
        inputs = Inputs(b["pos"], seg=b["seg"], text=b["text"], text_seg=b["text_seg"], class_labels=b["class_labels"])
        loss = EDMLoss()(EDMPrecond(model), b["x"], inputs, mask=b["mask"], sigma=b["sigma"], noise=b["noise"])
    loss.backward()


# Images and clips (ST-DiT's temporal blocks regroup them) in two rows, one padded; and in one row (ST-DiT then
# reorders every row alike: an index_select where two rows take a gather)
ROWS = [[(2, 4, 4), (1, 2, 4)], [(1, 4, 4), (3, 2, 2), (1, 2, 2)]]
ONE_ROW = [[(2, 4, 4), (1, 2, 4)]]


@pytest.mark.parametrize("rows", [ROWS, ONE_ROW], ids=["two_rows", "one_row"])
@pytest.mark.parametrize("name", TINY)
def test_a_bf16_training_step_on_packed_rows_never_scatters_into_bf16(name, rows):
    cfg = preset(name, text_dim=16, num_classes=5)
    model = randomize(build(cfg, attention="sdpa"))
    with NoLowPrecisionScatter():  # fails on leaving if any op, forward or backward, scattered into bf16
        bf16_training_step(model, packed_batch(cfg, rows, 48, torch.Generator().manual_seed(0)))
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())  # all of it ran


def test_the_check_finds_the_gather_that_per_token_was(monkeypatch):
    """Not vacuous: with the modulations gathered as before (a gather's backward is a scatter_add into bf16), the
    same step fails."""
    def gathered(values, seg):
        idx = seg.clamp(min=0)[..., None].expand(-1, -1, values.shape[-1])
        return torch.gather(values, 1, idx)

    monkeypatch.setattr(dit, "per_token", gathered)
    cfg = preset("DiT-Tiny", text_dim=16, num_classes=5)
    with pytest.raises(AssertionError, match=r"scatter_add.* in GatherBackward0: into torch\.bfloat16"), \
            NoLowPrecisionScatter():
        bf16_training_step(randomize(build(cfg, attention="sdpa")),
                           packed_batch(cfg, ROWS, 48, torch.Generator().manual_seed(0)))


# --------------------------------------------------------------------------------------------------
# Accuracy of a sample's adaLN gradient


def adaln_gradients(model, x, c_noise, pos, seg, weights, precision: str) -> list[torch.Tensor]:
    """Gradient of each adaLN's output (block 0's, the final layer's) for sample 0 of row 0, (6D + 2D,) in float64, of
    Σ weights · model output: run in bf16 autocast (fp32 weights, as dit-train) or all in float64."""
    outputs = []
    hooks = [layer.register_forward_hook(lambda _m, _i, out: (out.retain_grad(), outputs.append(out))[1])
             for layer in (model.blocks[0].adaLN, model.final.adaLN)]
    if precision == "fp64":
        out = model.double()(x.double(), c_noise.double(), Inputs(pos, seg=seg))
    else:
        with torch.autocast("cpu", torch.bfloat16):
            out = model(x, c_noise, Inputs(pos, seg=seg))
    (out.double() * weights.double()).sum().backward()
    for hook in hooks:
        hook.remove()
    model.float().zero_grad()
    return torch.cat([o.grad[0, 0].double() for o in outputs])


def test_a_packed_samples_adaln_gradient_is_as_accurate_as_a_whole_rows(monkeypatch):
    """A 4096-token sample's adaLN gradient, packed with another sample and in a row of its own, against float64.

    The gradient of a sample's modulations sums its tokens' gradients δ_i. In a row of its own the modulations
    broadcast over the tokens and the backward of the broadcast sums δ with fp32 accumulation; packed, per_token's
    one-hot matmul does, accumulating in fp32 too. Each is rounded once to bf16. So both errors have the same terms:
    the δ_i's own bf16 errors (the same ops on the same values: the mask adds exact zeros for the other sample's
    keys), the fp32 sum's, at most n·ε₃₂ = 4096·1.2e-7 = 4.9e-4 of Σ|δ_i| (Higham, §4.2), and one bf16 rounding, at
    most 2⁻⁹ = 2e-3 of each value: the packed error must be the whole row's, up to independent roundings of the
    same size, for which 2x leaves room. Measured: both 9.6e-3, equal (0.8e-2 to 1.3e-2 over other seeds; the δ_i's
    own errors dominate).

    CUDA's scatter_add into bf16 (the backward of the gather that per_token was) rounds after every add: its error
    grows with the tokens of the sample. A CPU sums that scatter in fp32, so it is emulated here on the bf16 δ_i of
    the packed run (one rounding per add, in token order): 1.6e-1 against float64 at 4096 tokens, 17x the whole row's
    (9x to 28x over other seeds).
    """
    token_grads = []

    def recording(values, seg):  # per_token itself, recording the gradient of its output (the δ_i) in backward
        out = per_token(values, seg)
        if seg is not None and out.requires_grad:
            out.register_hook(token_grads.append)
        return out

    monkeypatch.setattr(dit, "per_token", recording)
    cfg = preset("DiT-Tiny", depth=1, hidden_size=16, num_heads=1)  # tiny width: fast; the sums are what matters
    model = randomize(build(cfg, attention="sdpa"))
    g = torch.Generator().manual_seed(0)
    n, m = 4096, 64  # the sample's tokens (64 x 64), the other sample's (8 x 8)
    x, weights = (torch.randn(1, n + m, cfg.patch_dim, generator=g) for _ in range(2))
    c_noise = torch.randn(1, 2, generator=g)
    pos = torch.cat([grid_positions((1, 64, 64)), grid_positions((1, 8, 8))])[None]
    seg = torch.tensor([0] * n + [1] * m)[None]
    alone = (x[:, :n], c_noise[:, :1], pos[:, :n], None, weights[:, :n])

    # Exact arithmetic gives the sample the same gradient packed or alone; float64 computes it to 1e-15.
    exact = adaln_gradients(model, *alone, "fp64")
    whole = adaln_gradients(model, *alone, "bf16")
    packed = adaln_gradients(model, x, c_noise, pos, seg, weights, "bf16")

    def error(grad: torch.Tensor) -> float:
        return float((grad - exact).norm() / exact.norm())

    # CUDA's bf16 scatter_add, one rounding per added token: block 0's δ (6D wide), then the final layer's (2D)
    deltas = sorted(token_grads, key=lambda d: -d.shape[-1])
    scattered = []
    for delta in deltas:
        acc = torch.zeros(delta.shape[-1], dtype=torch.bfloat16)
        for i in range(n):
            acc = acc + delta[0, i]
        scattered.append(acc.double())
    scattered = torch.cat(scattered)

    print(f"\nadaLN gradient of a {n}-token sample vs float64: whole row {error(whole):.2e}, packed {error(packed):.2e}"
          f", packed with CUDA's bf16 scatter (emulated) {error(scattered):.2e}")
    assert error(whole) < 5e-2  # bf16 accuracy: the reference is right
    assert error(packed) <= 2 * error(whole)
    assert error(scattered) > 4 * error(whole)  # the bound tells the old way apart
