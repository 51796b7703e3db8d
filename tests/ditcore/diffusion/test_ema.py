import pytest
import torch
from torch import nn

from ditcore.diffusion import EMA
from ditcore.testing import assert_close_fp32, fp32_tolerance


def test_ema_update_is_the_exponential_average():
    model = nn.Linear(4, 3)
    ema = EMA(model, decay=0.9)
    w0 = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    # lerp and the formula each round ≤ 4 times per update, values up to 1 + max|w0| (twice that for two updates)
    atol = fp32_tolerance(4, scale=1 + w0.abs().max().item())
    ema.update(model)
    torch.testing.assert_close(ema.module.weight, 0.9 * w0 + 0.1 * (w0 + 1.0), rtol=0, atol=atol)
    ema.update(model)
    torch.testing.assert_close(ema.module.weight, 0.81 * w0 + 0.19 * (w0 + 1.0), rtol=0, atol=2 * atol)
    assert not ema.module.weight.requires_grad


def test_ema_is_independent_of_the_model_and_decay_zero_copies():
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    ema = EMA(model, decay=0.0)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3)
    model.train()(torch.randn(8, 2))  # changes BatchNorm running stats (buffers)
    ema.update(model)
    for a, b in zip(ema.module.state_dict().values(), model.state_dict().values(), strict=True):
        # lerp(start, end, 1): ≤ 3 roundings of values up to |start| + |end| = 4/3·|end|; buffers are copied
        assert_close_fp32(a, b, work=3)
    with torch.no_grad():
        model[0].weight.zero_()
    assert ema.module[0].weight.abs().sum() > 0


def test_bad_decay():
    with pytest.raises(ValueError, match=r"decay=1\.0 is invalid"):
        EMA(nn.Linear(1, 1), decay=1.0)
