"""ST-DiT: a spatio-temporal DiT (Open-Sora's STDiT; Zheng et al., "Open-Sora: Democratizing Efficient Video
Production for All", 2024), whose attention is factorised: blocks alternate between spatial self-attention over
the H'×W' tokens of each frame and temporal self-attention over the T' tokens at each spatial position.

Every block is a DiT block (adaLN-Zero, self-attention, cross-attention to the text, MLP): the even ones attend
within frames, the odd ones within time-lines, as in Open-Sora 1.2's STDiT3 (a spatial and a temporal block per
depth step). Tokens are stored in frames order, (t, h, w) row-major per sample (ditcore.layout), where each
frame is a contiguous run. The model really regroups them around each temporal block: it moves every sample's
tokens into lines order, (h, w, t), where each time-line is a contiguous run, the block attends, and the model moves
them back. A temporal block is a plain DiT block on lines order, so a compiled one holds no move. Attention masks
then only separate runs: a token sees its own frame (or its own line) of its own sample, so packed rows of mixed
images and clips work as for the DiT; an image is a one-frame clip, whose time-lines are single tokens.

On one process the regrouping is a gather. Under context parallelism each rank holds whole frames and, after one
all-to-all, whole time-lines: no attention needs another rank's keys. The model moves them by its rows'
`permutation` (`Orders`; ditcore.models.attention.RowSplit), which ditcore.parallel implements over ranks, and on one
process at a rank's shapes, for every architecture alike; what the one-process stand-in cannot show, the tokens each
all-to-all sends, the registration gives the traffic model (`token_moves`). No other module needs this file.

What is decided once per forward from the layout of the rows (are all rows alike, does a rank's slice cut a frame,
how many tokens go to each rank) is read on the host, never from the device, whose queue would have to drain
first: from `grids` (ditcore.layout), which dit-train, validation and dit-sample pass, or from CPU tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import torch
from torch import nn

from ditcore.errors import ConfigError
from ditcore.layout import grid_rows, on_host
from ditcore.models.attention import Mask, RowSplit, segments
from ditcore.models.dit import DIT_PLAN, AttentionInputs, DiT, DiTBlock, DiTConfig
from ditcore.models.registry import Architecture, register


@dataclass(frozen=True)
class STDiTConfig(DiTConfig):
    """`depth` counts blocks, spatial and temporal alike: depth 56 is 28 (spatial, temporal) pairs."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.depth % 2:
            raise ConfigError("depth", self.depth, "an even number of blocks: spatial and temporal ones alternate")

    def attended(self, tokens: float, frames: float) -> float:
        # half the blocks attend over a frame's tokens, the other half over a time-line's
        return (tokens / frames + frames) / 2


# --------------------------------------------------------------------------------------------------
# Frames and lines of packed rows


@dataclass
class Factorised:
    """A row's frames and time-lines. Ids are -1 on padding; `to_lines[b, j]` is the frames-order index of the token
    at lines-order index j, `to_frames` the inverse. Shapes (B or 1, N); `pos` (B or 1, N, 3) in lines order."""

    frames: torch.Tensor  # frame id of each token, frames order
    lines: torch.Tensor  # line id of each token, lines order
    to_lines: torch.Tensor
    to_frames: torch.Tensor
    pos: torch.Tensor
    seg: torch.Tensor | None  # sample of each token, lines order


def factorise(seg: torch.Tensor | None, pos: torch.Tensor, max_grid: tuple[int, int, int]) -> Factorised:
    """Frames and lines of rows whose samples `seg` (B, N) (None: one per row) are contiguous runs, each in frames
    order, at positions `pos` (B or -, N, 3). A sample keeps its place in the row; only its tokens are reordered."""
    if pos.ndim == 2:
        pos = pos[None]
    if seg is not None and pos.shape[0] != seg.shape[0]:
        pos = pos.expand(seg.shape[0], -1, -1)
    Tm, Hm, Wm = max_grid
    t, h, w = pos.unbind(-1)
    if seg is None:
        sample = start = torch.zeros_like(t)
    else:
        sample = seg
        index = torch.arange(seg.shape[1], device=seg.device).expand_as(seg)
        first = torch.ones_like(seg, dtype=torch.bool)
        first[:, 1:] = seg[:, 1:] != seg[:, :-1]
        start = torch.where(first, index, 0).cummax(-1).values  # where each token's sample begins in the row
    real = sample >= 0
    frames = torch.where(real, sample * Tm + t, -1)
    line = torch.where(real, sample * (Hm * Wm) + h * Wm + w, -1)
    to_lines = (start * (Tm * Hm * Wm) + (h * Wm + w) * Tm + t).argsort(dim=-1, stable=True)
    seg_lines = None if seg is None else seg.gather(-1, to_lines)
    return Factorised(frames=frames, lines=line.gather(-1, to_lines), to_lines=to_lines,
                      to_frames=to_lines.argsort(-1), pos=pos.gather(-2, to_lines[..., None].expand(-1, -1, 3)),
                      seg=seg_lines)


def grids_of(seg: torch.Tensor | None, pos: torch.Tensor, B: int) -> list[list[tuple[int, int, int]]]:
    """The grids (ditcore.layout) of B rows whose seg and pos are CPU tensors: a sample's last token, in frames order,
    is at the far corner of its grid."""
    pos = pos.expand(B, -1, -1)  # (B, N, 3)
    if seg is None:
        return [[tuple((row[-1] + 1).tolist())] for row in pos]
    last = seg >= 0
    last[:, :-1] &= seg[:, 1:] != seg[:, :-1]
    return [[tuple(g) for g in (pos[b][last[b]] + 1).tolist()] for b in range(B)]


def check_grids(grids: list[list[tuple[int, int, int]]], seg: torch.Tensor | None, pos: torch.Tensor) -> None:
    """Refuse grids that are not the layout of the rows seg and pos (CPU tensors: reading them is free), which would
    regroup the tokens wrongly; and rows whose samples are not whole grids in frames order."""
    host_seg, host_pos = grid_rows(grids, pos.shape[-2])
    same = pos.shape[:-2] in ((), (1,), (len(grids),)) and torch.equal(host_pos, pos.expand_as(host_pos))
    if not (same and torch.equal(host_seg, host_seg if seg is None else seg)):
        raise ValueError(f"grids {grids} are not the layout of the rows' samples and positions: each row holds "
                         "samples of these (T, H, W) token grids one after another, each in (t, h, w) order")


@dataclass(frozen=True)
class HostRows:
    """The layout of the rows on the host: per row, the (T, H, W) token grids of its samples in order, then padding,
    in rows of N tokens (ditcore.layout). What ST-DiT decides once per forward is computed from it in Python: no
    tensor is read, on the device or the host."""

    grids: list[list[tuple[int, int, int]]]
    N: int

    @classmethod
    def of(cls, seg: torch.Tensor | None, pos: torch.Tensor, grids, B: int) -> HostRows:
        """From `grids`, or without them from seg and pos when they are CPU tensors. Rows on another device without
        grids are refused: reading them would make the host wait for the device."""
        N = pos.shape[-2]
        host = on_host(pos) and (seg is None or on_host(seg))
        if grids is None:
            if not host:
                raise ValueError(
                    f"ST-DiT regroups tokens by frames and time-lines, which it reads on the host, not from the "
                    f"{pos.device.type} device: pass grids (per row, the (T, H, W) token grids of its samples in "
                    "order, as PackedBatch.grids; [[grid]] * B for rows of one sample each)")
            grids = grids_of(seg, pos, B)
        if len(grids) != B or (seg is None and any(len(r) != 1 or r[0][0] * r[0][1] * r[0][2] != N for r in grids)):
            raise ValueError(f"grids {grids} are not the layout of {B} rows of {N} tokens"
                             + (", each one sample without padding (seg is None)" if seg is None else ""))
        if host:
            check_grids(grids, seg, pos)
        return cls(grids, N)

    def uniform_runs(self) -> tuple[int, int] | None:
        """(tokens per frame, frames) of rows of one sample each, when every row has the same; else None. Saves a
        mask and, on a GPU, keeps the flash kernel."""
        frames = {H * W for row in self.grids for _, H, W in row}
        if len(frames) != 1 or any(len(row) != 1 for row in self.grids):
            return None
        frame = frames.pop()
        return frame, self.N // frame

    def cut(self, n: int) -> bool:
        """Does a boundary between slices of n tokens fall inside a frame (frames order) or a time-line (lines
        order) of a sample?"""
        for row in self.grids:
            start = 0
            for T, H, W in row:
                for boundary in range(n * (start // n + 1), start + T * H * W, n):
                    if (boundary - start) % (H * W) or (boundary - start) % T:
                        return True
                start += T * H * W
        return False

    def moves(self, n: int) -> list[list[int]]:
        """M[r][q]: the tokens of all rows whose index in frames order is in slice r (tokens r·n to r·n + n − 1)
        and in lines order in slice q. A sample starting at s with grid (T, H, W) has its token (t, i), i = h·W + w,
        at s + t·H·W + i in frames order and s + i·T + t in lines order (factorise); padding stays in place. For
        each frame t both indices grow with i: count the runs of i between the slice boundaries."""
        parts = self.N // n
        M = [[0] * parts for _ in range(parts)]
        for row in self.grids:
            s = 0
            for T, H, W in row:
                HW = H * W
                for t in range(T):
                    steps = {0, HW}
                    for k in range(1, parts):  # the first i in slice k of frames order, of lines order
                        steps |= {k * n - s - t * HW, -((s + t - k * n) // T)}
                    steps = sorted(i for i in steps if 0 <= i <= HW)
                    for a, b in pairwise(steps):
                        M[(s + t * HW + a) // n][(s + t + a * T) // n] += b - a
                s += T * HW
            for r in range(parts):  # padding
                M[r][r] += max(0, (r + 1) * n - max(s, r * n))
        return M


class Orders:
    """Moves the tokens a process holds between frames and lines order, around each temporal block, by its rows'
    `permutation` (ditcore.models.attention.RowSplit): a gather on one process, an all-to-all under context parallelism
    (ditcore.parallel.context_parallel), at a rank's shapes on one process its stand-in (ditcore.parallel.standins).

    `local`: the rank's 1/cp slice of the rows cuts no frame (frames order) and no time-line (lines order), so its
    attention needs no other rank's keys (`keys_values` passes its own through) and each move sends every rank the
    tokens it holds in the other order, as many as `HostRows.moves` counts. Rows whose slices would cut one (a
    2x2-token image over 2 ranks, a packed row whose sample straddles a slice boundary oddly) take the way of the
    other architectures instead: each move gathers the whole rows and keeps this rank's slice, and attention gathers
    the keys of the whole row. Slower, never wrong. Both are read from the rows on the host (`host`): no device value,
    so nothing waits for the device's queue. Always local on one process.

    Communication per block and rank, forward (the backward sends as much again), for B rows of N tokens of width D
    over cp ranks: all-gather CP receives the keys and values of the rest of the row in every block,
    2·(cp−1)/cp·N·B·D values; these moves nothing in a spatial block and 2·(cp−1)/cp²·N·B·D in a temporal one (two
    all-to-alls of the (cp−1)/cp of its N/cp tokens that change rank), per (spatial, temporal) pair 2·cp times less.
    For 32 frames × 32×32 tokens (N = 32768), ST-DiT-XL/2's D = 1152, bf16 and one row, per pair: cp=2, 151 MB
    (all-gather) vs 37.7 MB (all-to-all); cp=8, 264 MB vs 16.5 MB.
    """

    def __init__(self, rows: RowSplit, f: Factorised, host: HostRows):
        self.rows, self.f, self.host = rows, f, host
        span = rows.spans(host.N)[0]  # this rank's slice of every row: all of it on one process
        self.local = not host.cut(span.stop - span.start)
        to_lines = host.moves if self.local else None  # counts per pair of slices, from the grids, when planned

        def to_frames(n: int) -> list[list[int]]:  # the same tokens back
            return [list(column) for column in zip(*host.moves(n), strict=True)]

        self.to_lines = rows.permutation(f.to_lines, f.to_frames, to_lines)
        self.to_frames = rows.permutation(f.to_frames, f.to_lines, to_frames if self.local else None)

    def keys_values(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (k, v) if self.local else self.rows.keys_values(k, v)


# --------------------------------------------------------------------------------------------------
# Blocks and model


@dataclass
class STInputs(AttentionInputs):
    """The spatial blocks' attention inputs (frames order), with what the temporal blocks need."""

    lines: AttentionInputs | None = None  # the same for the temporal blocks: lines order
    lines_seg: torch.Tensor | None = None  # sample of each token this rank holds, lines order
    orders: Orders | None = None

    def text_masks(self) -> list[Mask]:
        return [self.text_mask, self.lines.text_mask]


class TemporalBlock(DiTBlock):
    """A DiT block over time-lines: STDiT.run_block gives it its tokens in lines order and takes them back to frames
    order, outside the block, so that a compiled one holds no move (an all-to-all under context parallelism, whose
    counts change with every packing)."""


class STDiT(DiT):
    """The DiT with factorised attention (see the module's docstring); same inputs, outputs and initialisation."""

    context_parallel = "all_to_all"  # a rank holds whole frames, then whole lines (Orders); ditcore.memory plans so

    def new_block(self, i: int) -> nn.Module:
        moe = self.cfg.moe is not None and self.cfg.moe.places(i)
        return (TemporalBlock if i % 2 else DiTBlock)(self.cfg, own_embedders=self.cfg.block_embedders and i > 0,
                                                       moe=moe)

    def run_block(self, block: nn.Module, h: torch.Tensor, c: torch.Tensor, seg: torch.Tensor | None, a: STInputs):
        if not isinstance(block, TemporalBlock):  # a spatial block, or one another pipeline stage holds
            return block(h, c, seg, a)
        a.lines.conditioning = a.conditioning  # what a block with its own embedders embeds (block_embedders)
        out = block(a.orders.to_lines(h), c, a.lines_seg, a.lines)
        if isinstance(out, tuple):  # a MoE block's routing stats (of its tokens, in whatever order) go with it
            return a.orders.to_frames(out[0]), out[1]
        return a.orders.to_frames(out)

    def attention_inputs(self, backend: str, B: int, pos, seg, text, text_seg, span: slice, dtype,
                         grids=None) -> STInputs:
        host = HostRows.of(seg, pos, grids, B)
        f = factorise(seg, pos, self.cfg.max_grid)
        orders = Orders(self.rows, f, host)  # under context parallelism: are this rank's frames and lines whole here?
        N = pos.shape[-2]
        local = self.rows.spans(N)[1]
        seq = span.stop - span.start
        runs = host.uniform_runs() if seg is None and orders.local else None  # (frame size, frames) in every row

        def view(ids: torch.Tensor, positions: torch.Tensor, run: int, cls=AttentionInputs, **more):
            if run:
                mask = Mask(None, run=run)  # frames (lines) of every row are equal runs: batched, no mask at all
            else:  # this rank's queries over the keys of its own frame (line): here, or gathered from the whole row
                mask = segments(backend, ids[:, span], ids[:, span] if orders.local else ids)
                mask.has_keys = None  # every query is a key of its own frame or line
            return cls(batch=B, seq=seq, rope=self.rope(positions[..., span, :], dtype), mask=mask, rows=orders,
                       **more)

        lines = view(f.lines, f.pos, runs[1] if runs else 0)
        frames = view(f.frames, pos, runs[0] if runs else 0, STInputs, lines=lines, orders=orders,
                      lines_seg=None if f.seg is None else f.seg[:, local])
        if self.cfg.text_dim:
            frames.text = lines.text = self.embed_text(text)
            frames.text_mask = self.text_mask(backend, None if seg is None else seg[:, span], text_seg, seq, text)
            lines.text_mask = self.text_mask(backend, None if f.seg is None else f.seg[:, span], text_seg, seq, text)
        return frames


def token_moves(model: nn.Module, grids: list[list[tuple[int, int, int]]], N: int,
                parts: int) -> list[tuple[int, list[list[int]]]]:
    """The registration's answer for ditcore.traffic, which cannot see an all-to-all on one process: each move of
    `model`'s blocks (to lines order before a temporal block and back after it) with the tokens it takes from each
    of `parts` slices of rows of N tokens (`grids`: their layout) to each (`HostRows.moves`)."""
    to_lines = HostRows(grids, N).moves(N // parts)
    back = [list(column) for column in zip(*to_lines, strict=True)]
    temporal = [i for i, block in enumerate(model.blocks) if isinstance(block, TemporalBlock)]
    return [(i, counts) for i in temporal for counts in (to_lines, back)]


# Open-Sora's STDiT-XL/2 width and depth: 1152 wide, 16 heads, 28 depth steps of a spatial and a temporal block (as
# STDiT3-XL/2), patch 1 x 2 x 2. Its blocks share one adaLN projection of the timestep; here each block has its own,
# as the DiT's do (0.45 B parameters more). A tiny one for tests.
PRESETS: dict[str, STDiTConfig] = {
    "ST-DiT-XL/2": STDiTConfig(hidden_size=1152, depth=56, num_heads=16, patch_size=2),
    "ST-DiT-Tiny": STDiTConfig(hidden_size=64, depth=4, num_heads=4),
}

# DiT blocks throughout, so the DiT's tensor-parallel plan; its token_moves, for the traffic model
register(Architecture("stdit", STDiTConfig, STDiT, PRESETS, tiny="ST-DiT-Tiny", plan=DIT_PLAN,
                      summary="the spatio-temporal DiT (blocks alternate attention within frames and within "
                              "time-lines)", token_moves=token_moves))

__all__ = ["PRESETS", "HostRows", "Orders", "STDiT", "STDiTConfig", "TemporalBlock", "check_grids", "factorise",
           "token_moves"]
