"""ST-DiT (ditcore.models.stdit): frames and time-lines of packed rows, and which tokens each block lets a token see.

Identity at init, zero output, packed == alone: tests/ditcore/models/test_dit.py (parametrised by architecture);
CP by all-to-all == one process: tests/ditcore/parallel/test_equivalence.py (cases stdit:*).
"""

import pytest
import torch

from ditcore.errors import ConfigError
from ditcore.layout import grid_positions
from ditcore.models import build, preset
from ditcore.models.dit import DiTBlock
from ditcore.models.stdit import TemporalBlock, factorise, reorder
from ditcore.parallel.context_parallel import SwapRows
from ditcore.testing import NoLowPrecisionScatter

from .test_dit import randomize

# a row of an image (1 x 2 x 3), a clip (3 x 2 x 2), an image with a single token and 4 padding tokens: N = 23
GRIDS = [(1, 2, 3), (3, 2, 2), (1, 1, 1)]


def packed_row(grids=GRIDS, padding=4):
    pos = torch.cat([grid_positions(g) for g in grids] + [torch.zeros(padding, 3, dtype=torch.long)])
    seg = torch.cat([torch.full((g[0] * g[1] * g[2],), s) for s, g in enumerate(grids)] + [torch.full((padding,), -1)])
    return pos[None], seg[None]


def test_lines_order_keeps_each_sample_in_place_and_makes_every_time_line_contiguous():
    pos, seg = packed_row()
    f = factorise(seg, pos, (64, 256, 256))
    assert torch.equal(f.to_lines.gather(-1, f.to_frames), torch.arange(pos.shape[1])[None])  # inverse orders
    assert torch.equal(f.seg, seg)  # every sample keeps its place in the row
    t, h, w = f.pos[0].unbind(-1)
    clip = slice(6, 18)
    # the clip's 4 time-lines one after another, each its 3 frames in order: (h, w, t) row-major
    assert [(int(a), int(b), int(c)) for a, b, c in zip(h[clip], w[clip], t[clip], strict=True)] == [
        (hh, ww, tt) for hh in range(2) for ww in range(2) for tt in range(3)]
    lines = f.lines[0, clip].tolist()
    assert lines == sorted(lines) and len(set(lines)) == 4  # contiguous runs of one id per line
    assert (f.lines[0, -4:] == -1).all() and (f.frames[0, -4:] == -1).all()  # padding is no frame or line


@pytest.mark.parametrize("rows", [1, 2])  # one order for every row (an index_select), or one per row (a gather)
def test_reordering_moves_gradients_back_by_the_inverse_order_without_scattering(rows):
    """Frames → lines order is a permutation: its backward is the gather of the gradient by the inverse order,
    exactly what a gather's own backward (a scatter_add) computes, but with no scatter into bf16."""
    pos, seg = packed_row()
    if rows == 2:  # the second row: the same samples, the clip first
        pos2, seg2 = packed_row([GRIDS[1], GRIDS[0], GRIDS[2]])
        pos, seg = torch.cat([pos, pos2]), torch.cat([seg, seg2])
    f = factorise(seg, pos, (64, 256, 256))
    x = torch.randn(pos.shape[1], rows, 8, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(pos.shape[1], rows, 8, dtype=torch.bfloat16)
    with NoLowPrecisionScatter():
        lines = reorder(x, f.to_lines, f.to_frames)
        lines.backward(grad)
    index = f.to_lines.T[:, :, None].expand(-1, -1, 8)
    assert torch.equal(lines, x.detach().gather(0, index))
    x_ref = x.detach().float().requires_grad_()
    x_ref.gather(0, index).backward(grad.float())  # the scatter_add, in fp32: each sum has one term
    assert torch.equal(x.grad, x_ref.grad.to(torch.bfloat16))


def test_each_block_lets_a_token_see_only_its_own_frame_or_its_own_time_line():
    """Perturb one token of the clip; a spatial block changes exactly the outputs of its frame, a temporal block
    exactly those of its time-line (of its sample), whatever else the row holds."""
    cfg = preset("ST-DiT-Tiny", text_dim=8)
    model = randomize(build(cfg)).eval()
    pos, seg = packed_row()
    N, D = pos.shape[1], cfg.hidden_size
    text, text_seg = torch.randn(1, 6, 8), torch.tensor([[0, 0, 1, 1, 2, -1]])
    a = model.attention_inputs("sdpa", 1, pos, seg, text, text_seg, slice(0, N), torch.float32)
    spatial, temporal = model.blocks[0], model.blocks[1]
    assert type(spatial) is DiTBlock and isinstance(temporal, TemporalBlock)
    x, c = torch.randn(N, 1, D), torch.randn(1, 3, D)
    k = 6 + 5  # the clip's token at t=0, h=1, w=1
    y = x.clone()
    y[k] += 1.0
    t, h, w = pos[0].unbind(-1)
    in_clip = seg[0] == 1
    same_frame = in_clip & (t == t[k])
    same_line = in_clip & (h == h[k]) & (w == w[k])
    with torch.no_grad():
        for block, expected in ((spatial, same_frame), (temporal, same_line)):
            changed = (block(y, c, seg, a) - block(x, c, seg, a)).abs().amax(-1)[:, 0] > 0
            assert torch.equal(changed, expected), block


def test_depth_counts_spatial_and_temporal_blocks():
    cfg = preset("ST-DiT-XL/2")
    assert (cfg.hidden_size, cfg.num_heads, cfg.depth, cfg.patch_size) == (1152, 16, 56, 2)  # 28 pairs
    with torch.device("meta"):
        kinds = [type(b) for b in build(cfg).blocks]
    assert kinds == [DiTBlock, TemporalBlock] * 28
    with pytest.raises(ConfigError, match="even number of blocks"):
        preset("ST-DiT-Tiny", depth=3)


def test_context_parallelism_keeps_whole_frames_and_lines_local_or_gathers():
    """A rank's slice holding whole frames (and, in lines order, whole time-lines) attends locally after the
    all-to-all; one that would cut a frame gathers the row's keys instead (tests/ditcore/parallel: both equal one
    process)."""
    rows = SwapRows.__new__(SwapRows)  # the split of rank 0 of CP=2, no process group needed to plan it
    rows.cp_size, rows.cp_rank, rows.sp_size = 2, 0, 1
    pos, seg = packed_row([(2, 2, 4), (1, 2, 4)], padding=8)  # the clip's 2 frames, one per rank: whole
    assert rows.orders(factorise(seg, pos, (64, 256, 256))).local
    pos, seg = packed_row([(1, 2, 4), (2, 2, 4)], padding=0)  # 24 tokens: rank 0 holds 0..11, half the clip's frame 0
    assert not rows.orders(factorise(seg, pos, (64, 256, 256))).local
    pos, seg = packed_row([(4, 1, 3)], padding=0)  # 4 frames of 3 tokens: whole frames, but lines of 4 cut in half
    assert not rows.orders(factorise(seg, pos, (64, 256, 256))).local
