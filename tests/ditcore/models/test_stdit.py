"""ST-DiT (ditcore.models.stdit): frames and time-lines of packed rows, and which tokens each block lets a token see.

Identity at init, zero output, packed == alone: tests/ditcore/models/test_dit.py (parametrised by architecture);
CP by all-to-all == one process: tests/ditcore/parallel/test_equivalence.py (cases stdit:*).
"""

import random

import pytest
import torch

from ditcore.errors import ConfigError
from ditcore.inputs import Inputs
from ditcore.layout import grid_positions, grid_rows, reorder
from ditcore.models import build, preset
from ditcore.models.dit import DiTBlock
from ditcore.models.stdit import HostRows, Orders, TemporalBlock, factorise, grids_of
from ditcore.parallel.context_parallel import SplitRows
from ditcore.testing import NoLowPrecisionScatter

from .test_dit import randomize

# a row of an image (1 x 2 x 3), a clip (3 x 2 x 2), an image with a single token and 4 padding tokens: N = 23
GRIDS = [(1, 2, 3), (3, 2, 2), (1, 1, 1)]
MAX_GRID = (64, 256, 256)


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
            changed = (model.run_block(block, y, c, seg, a) - model.run_block(block, x, c, seg, a)).abs()
            changed = changed.amax(-1)[:, 0] > 0
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
    rows = SplitRows.__new__(SplitRows)  # the split of rank 0 of CP=2, no process group needed to plan it
    rows.cp_size, rows.cp_rank, rows.sp_size, rows.sp_rank = 2, 0, 1, 0

    def orders(grids, padding):
        pos, seg = packed_row(grids, padding)
        return Orders(rows, factorise(seg, pos, MAX_GRID), HostRows.of(seg, pos, None, 1))

    assert orders([(2, 2, 4), (1, 2, 4)], padding=8).local  # the clip's 2 frames, one per rank: whole
    assert not orders([(1, 2, 4), (2, 2, 4)], padding=0).local  # 24 tokens: rank 0 holds 0..11, half of frame 0
    assert not orders([(4, 1, 3)], padding=0).local  # 4 frames of 3 tokens: whole frames, but lines of 4 cut in half


@pytest.mark.parametrize("packed", [False, True], ids=["whole_rows", "packed"])
def test_what_is_decided_per_forward_reads_no_device_value_given_the_grids(packed):
    """On the meta device a tensor has no values: any read (.tolist(), int(), a data-dependent branch) raises. What
    ST-DiT decides once per forward (attention_inputs: are the rows alike, their masks and orders) and the moves
    around a temporal block run there, so on a GPU they never wait for the device's queue. (The blocks are DiT blocks,
    which compile without a graph break: tests/ditcore/parallel/test_compile_stdit.py.) Whole rows batch the frames
    and lines (the same grid in every row), packed rows mask them."""
    cfg = preset("ST-DiT-Tiny", text_dim=8)
    if packed:
        grids = [GRIDS, [(2, 2, 3), (1, 3, 3)]]
        seg, pos = grid_rows(grids, 23)
    else:
        grids, seg, pos = [[(3, 2, 2)]] * 2, None, grid_positions((3, 2, 2))
    N, D = pos.shape[-2], cfg.hidden_size
    with torch.device("meta"):
        model = build(cfg)
        text, h = torch.randn(2, 5, 8), torch.randn(N, 2, D)
    pos, seg = pos.to("meta"), None if seg is None else seg.to("meta")
    a = model.attention_inputs("sdpa", 2, pos, seg, text, None, slice(0, N), torch.float32, grids=grids)
    assert (a.mask.run, a.lines.mask.run) == ((0, 0) if packed else (4, 3))  # whole rows: frames of 4, lines of 3
    assert a.orders.to_frames(a.orders.to_lines(h)).shape == (N, 2, D)
    with pytest.raises(ValueError, match=r"reads on the host, not from the meta device: pass grids"):
        model.attention_inputs("sdpa", 2, pos, seg, text, None, slice(0, N), torch.float32)


def test_grids_that_are_not_the_rows_are_refused_where_that_is_free():
    cfg = preset("ST-DiT-Tiny")
    model = build(cfg)
    pos, seg = packed_row()
    x = torch.randn(1, pos.shape[1], cfg.patch_dim)
    model(x, torch.zeros(1, 3), Inputs(pos, seg=seg, grids=[GRIDS]))
    with pytest.raises(ValueError, match="not the layout of the rows' samples and positions"):
        model(x, torch.zeros(1, 3), Inputs(pos, seg=seg, grids=[[(3, 2, 2), (1, 2, 3), (1, 1, 1)]]))
    with pytest.raises(ValueError, match=r"not the layout of 1 rows of 23 tokens, each one sample without padding"):
        model(x, torch.zeros(1, 1), Inputs(pos, grids=[GRIDS]))


def test_context_parallel_decisions_and_counts_come_from_the_host():
    """Under CP=2 (rank 0, planned without a process group) on the meta device: whether the slices cut a frame and
    how many tokens the all-to-all sends to and receives from each rank are read from the grids. Two rows of one
    (2, 2, 4) clip: rank 0 holds frame 0 of each; in lines order (lines of 2 tokens) the lines of h = 0. Half of its
    frame goes to rank 1, half of its lines come from rank 1."""
    rows = SplitRows.__new__(SplitRows)
    rows.cp_size, rows.cp_rank, rows.sp_size, rows.sp_rank = 2, 0, 1, 0
    with torch.device("meta"):
        model = build(preset("ST-DiT-Tiny"))
    model.rows = rows
    pos = grid_positions((2, 2, 4)).to("meta")
    a = model.attention_inputs("sdpa", 2, pos, None, None, None, rows.spans(16)[0], torch.float32,
                               grids=[[(2, 2, 4)]] * 2)
    assert a.orders.local
    for move in (a.orders.to_lines, a.orders.to_frames):  # to lines, back to frames
        send_order, arrive, send, recv = move._plan(2)  # orders: (permutation, inverse) each
        assert (send, recv) == ([8, 8], [8, 8]) and all(t.is_meta for t in (*send_order, *arrive))


@pytest.mark.parametrize("seed", range(6))
def test_what_the_host_computes_from_the_grids_is_what_the_device_orders_do(seed):
    """HostRows' cut decision and token counts per pair of slices, computed from the grids in Python, against the
    frames and lines orders that factorise computes on the device (here the CPU), for random packings over 2, 3 and
    4 slices; and grids_of, which recovers the grids from CPU seg and pos."""
    rng = random.Random(seed)
    shapes = [(1, 2, 2), (1, 3, 4), (2, 2, 3), (3, 2, 2), (4, 1, 3), (2, 3, 3), (1, 1, 1), (5, 1, 2)]
    N, grids = 48, []
    for _ in range(3):
        row = []  # up to 4 samples that fit, or none (padding only)
        for grid in rng.choices(shapes, k=rng.randint(0, 4)):
            if sum(g[0] * g[1] * g[2] for g in [*row, grid]) <= N:
                row.append(grid)
        grids.append(row)
    seg, pos = grid_rows(grids, N)
    assert grids_of(seg, pos, 3) == grids
    f = factorise(seg, pos, MAX_GRID)
    host = HostRows.of(seg, pos, grids, 3)
    for parts in (2, 3, 4):
        n = N // parts
        frames_slice = torch.arange(N).expand(3, -1) // n  # slice of each token in frames order
        lines_slice = f.to_frames // n  # ... and of the same token in lines order
        expected = [[int(((frames_slice == r) & (lines_slice == q)).sum()) for q in range(parts)] for r in range(parts)]
        assert host.moves(n) == expected
        cut = any(((ids[:, n::n] == ids[:, n - 1:N - 1:n]) & (ids[:, n::n] >= 0)).any() for ids in (f.frames, f.lines))
        assert host.cut(n) == bool(cut)


@pytest.mark.parametrize("packed", [False, True], ids=["whole_rows", "packed"])
def test_a_training_step_reads_no_value_back_given_the_grids(monkeypatch, packed):
    """HostReads treats the CPU as the device (ditcore.testing): the forward and backward of ST-DiT's EDM loss read
    no value back, but in the two checks that read CPU inputs by design (on a GPU dit-train checks the batch's
    positions before the copy, and grids are not checked against device tensors). Without grids the rows' layout is
    read from seg and pos: the watch catches it."""
    from ditcore.diffusion import EDMLoss, EDMPrecond
    from ditcore.models import dit, stdit
    from ditcore.testing import HostReads

    cfg = preset("ST-DiT-Tiny", text_dim=8)
    model = randomize(build(cfg, attention="sdpa"))
    if packed:
        grids = [GRIDS, [(2, 2, 3), (1, 3, 3)]]
        seg, pos = grid_rows(grids, 23)
    else:
        grids, seg, pos = [[(3, 2, 2)]] * 2, None, grid_positions((3, 2, 2))
    N = pos.shape[-2]
    x, noise = torch.randn(2, N, cfg.patch_dim), torch.randn(2, N, cfg.patch_dim)
    cond = dict(pos=pos, text=torch.randn(2, 5, 8), text_seg=torch.tensor([[0, 0, 1, 2, -1], [0, 1, 1, 1, -1]]))
    if not packed:
        cond["text_seg"] = None
    sigma = torch.rand(2, 3 if packed else 1) + 0.5
    watch = HostReads("cpu")
    monkeypatch.setattr(dit, "check_positions", watch.unwatched(dit.check_positions))
    monkeypatch.setattr(stdit, "check_grids", watch.unwatched(stdit.check_grids))
    with watch:
        loss = EDMLoss()(EDMPrecond(model), x, Inputs(seg=seg, grids=grids, **cond), sigma=sigma, noise=noise)
        loss.backward()
    assert loss.isfinite() and all(p.grad is not None for p in model.parameters())
    with pytest.raises(RuntimeError, match="makes the host wait"), watch:
        EDMLoss()(EDMPrecond(model), x, Inputs(seg=seg, **cond), sigma=sigma, noise=noise)
