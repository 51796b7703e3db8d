"""ditcore.training: a step's random draws are reproducible, and CFG dropout drops what it should."""

import pytest
import torch

from ditcore.data.packing import PackedRow, TokenSample, collate
from ditcore.diffusion import EDMLoss
from ditcore.layout import grid_positions
from ditcore.training import draw, drop_conditions, step_generator


def batch():
    def smp(n_text, label):
        grid = (1, 2, 2)
        return TokenSample("k", torch.randn(4, 6), grid_positions(grid), grid, torch.randn(n_text, 8), label, 8.0, "")

    return collate([PackedRow([smp(3, 1), smp(2, -1)]), PackedRow([smp(0, 2)])], seq_length=8)


def test_same_seed_step_micro_and_rank_draw_the_same_values():
    b, loss = batch(), EDMLoss()
    a1, a2 = (draw(b, step_generator(0, 5, 1, 0), loss, 0.5, 9) for _ in range(2))
    other = draw(b, step_generator(0, 5, 1, 1), loss, 0.5, 9)  # another data-parallel rank
    for f in ("text_seg", "class_labels", "sigma", "noise"):
        assert torch.equal(getattr(a1, f), getattr(a2, f)), f
    assert not torch.equal(a1.noise, other.noise)
    assert a1.sigma.shape == (2, 2) and a1.noise.shape == b.x.shape


def test_dropout_empties_text_and_nulls_labels_per_sample():
    b = batch()
    keep_seg, keep_labels = drop_conditions(b, 0.0, null_class=9, g=torch.Generator().manual_seed(0))
    assert torch.equal(keep_seg, b.text_seg)
    assert keep_labels.tolist() == [[1, 9], [2, 9]]  # unlabelled samples and unused slots get the null class
    all_seg, all_labels = drop_conditions(b, 1.0, null_class=9, g=torch.Generator().manual_seed(0))
    assert (all_seg == -1).all() and (all_labels == 9).all()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_draws_are_made_on_the_batch_s_device_and_repeat(device):
    b, loss = batch().to(device), EDMLoss()
    a1, a2 = (draw(b, step_generator(0, 5, 1, 0, device), loss, 0.5, 9) for _ in range(2))
    for f in ("text_seg", "class_labels", "sigma", "noise"):
        assert getattr(a1, f).device.type == device and torch.equal(getattr(a1, f), getattr(a2, f)), f
