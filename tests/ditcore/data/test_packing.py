import random

import pytest
import torch

from ditcore.data.packing import PackedRow, TokenSample, collate, first_fit_decreasing
from ditcore.inputs import Inputs
from ditcore.layout import grid_positions, grid_rows
from ditcore.models import preset


@pytest.mark.parametrize("seed", range(20))
def test_first_fit_decreasing_never_overflows_and_places_everything(seed):
    rng = random.Random(seed)
    capacity = rng.choice([16, 64, 256])
    lengths = [rng.randint(1, capacity) for _ in range(rng.randint(1, 60))]
    bins = first_fit_decreasing(lengths, capacity)
    placed = sorted(i for b in bins for i in b)
    assert placed == list(range(len(lengths)))  # every sample that fits is placed, exactly once
    assert all(sum(lengths[i] for i in b) <= capacity for b in bins)
    # FFD uses at most 11/9·OPT + 6/9 bins; OPT >= total/capacity
    assert len(bins) <= 11 / 9 * -(-sum(lengths) // capacity) + 1


def test_first_fit_decreasing_example_and_too_long():
    assert first_fit_decreasing([5, 3, 8, 2, 6], 10) == [[2, 3], [4, 1], [0]]
    with pytest.raises(ValueError, match="item 1 has 12 tokens, more than the row capacity 10"):
        first_fit_decreasing([3, 12], 10)


META = {"label": 1, "fps": 8.0}  # a sample's metadata: its per-sample conditions


def _tok(key, grid, text_len, label=-1):
    n = grid[0] * grid[1] * grid[2]
    return TokenSample(key=key, tokens=torch.randn(n, 8), pos=grid_positions(grid), grid=grid,
                       text=torch.randn(text_len, 4), meta={"fps": 8.0} | ({"label": label} if label >= 0 else {}),
                       caption=key)


def test_collate_lays_out_samples_and_padding():
    rows = [PackedRow([_tok("a", (1, 2, 3), 2, 1), _tok("b", (2, 2, 2), 0)]), PackedRow([_tok("c", (1, 4, 4), 3)])]
    b = collate(rows, seq_length=20)
    assert b.seg[0].tolist() == [0] * 6 + [1] * 8 + [-1] * 6
    assert b.seg[1].tolist() == [0] * 16 + [-1] * 4
    assert torch.equal(b.x[0, :6], rows[0].samples[0].tokens) and torch.equal(b.x[0, 6:14], rows[0].samples[1].tokens)
    assert b.x[0, 14:].abs().sum() == 0
    assert torch.equal(b.pos[0, 6:14], grid_positions((2, 2, 2)))
    assert b.text_seg.tolist() == [[0, 0, -1], [0, 0, 0]]  # sample b has no text: no text tokens at all
    assert b.class_labels.tolist() == [[1, -1], [-1, -1]] and b.num_samples.tolist() == [2, 1]
    assert b.mask.sum().item() == 6 + 8 + 16
    assert b.grids == [[(1, 2, 3), (2, 2, 2)], [(1, 4, 4)]]
    seg, pos = grid_rows(b.grids, 20)  # the grids, on the host, say what seg and pos hold (ST-DiT reads them)
    assert torch.equal(seg, b.seg) and torch.equal(pos, b.pos)


def test_inputs_carry_the_batch():
    grid = (1, 2, 2)
    smp = TokenSample("k", torch.randn(4, 6), grid_positions(grid), grid, torch.randn(3, 8), META, "")
    b = collate([PackedRow([smp, smp])], seq_length=8)
    inputs = b.inputs()
    assert type(inputs) is Inputs and inputs.seg is b.seg and inputs.class_labels is b.class_labels
    assert inputs.class_labels.tolist() == [[1, 1]] and inputs.fps.tolist() == [[8.0, 8.0]]
    assert inputs.grids == [[grid, grid]]  # the rows' layout on the host, for ST-DiT


def test_rows_of_one_whole_sample_need_no_masks():
    grid = (1, 2, 2)
    smp = TokenSample("k", torch.randn(4, 6), grid_positions(grid), grid, torch.randn(3, 8), META, "")
    whole = collate([PackedRow([smp]), PackedRow([smp])], seq_length=4)
    inputs = whole.inputs()
    assert whole.whole_rows and inputs.seg is None and inputs.text_seg is None
    # CFG dropout emptied row 1's text: the text mask is made for it
    dropped = inputs.dropped(torch.tensor([[False], [True]]), preset("DiT-Tiny"))
    assert dropped.text_seg.tolist() == [[0, 0, 0], [-1, -1, -1]]
    moved = whole.to("cpu")
    assert moved.whole_rows and moved.inputs().seg is None and torch.equal(moved.x, whole.x)
    padded = collate([PackedRow([smp])], seq_length=8)  # padding: masked as before
    assert not padded.whole_rows and padded.inputs().seg is padded.seg
    two = collate([PackedRow([smp, smp])], seq_length=8)
    assert not two.whole_rows and two.inputs().seg is two.seg


def test_text_length_is_padded_to_the_multiple_asked():
    grid = (1, 2, 2)
    smp = TokenSample("k", torch.randn(4, 6), grid_positions(grid), grid, torch.randn(3, 8), META, "")
    b = collate([PackedRow([smp, smp])], seq_length=8, text_multiple=4)
    assert b.text.shape == (1, 8, 8) and b.text_seg.tolist() == [[0, 0, 0, 1, 1, 1, -1, -1]]
    assert not b.whole_text and collate([PackedRow([smp])], seq_length=4, text_multiple=4).text.shape[1] == 4
