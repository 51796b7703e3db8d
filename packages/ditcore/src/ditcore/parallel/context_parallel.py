"""Context and sequence parallelism: each rank computes a slice of every token row.

Context parallelism (CP) gives each rank a contiguous slice of every row. For the DiT and MovieGen attention
all-gathers the keys and values of the whole row (`SplitRows`; its backward reduce-scatters: every rank's queries
contributed to the gradient of every key). For ST-DiT, whose attention is factorised, a rank's slice holds whole
frames and one all-to-all per temporal block moves it to whole time-lines and back (`SwapRows`): no attention
gathers keys. Sequence parallelism (SP, with TP) splits that slice again over the tensor-parallel ranks outside
attention. The model's output is gathered back into whole rows, so the loss runs alike on every rank.
"""

from __future__ import annotations

import torch

from ditcore.models.dit import RowSplit
from ditcore.models.stdit import Factorised, HostRows, Orders, reorder
from ditcore.parallel.comm import all_to_all, gather_seq
from ditcore.parallel.dims import ParallelGroups


class SplitRows(RowSplit):
    """A model's `rows` under CP and/or SP (see ditcore.models.dit.RowSplit for the one-process version)."""

    def __init__(self, groups: ParallelGroups, sequence_parallel: bool):
        dims = groups.dims
        self.cp_group, self.cp_rank, self.cp_size = groups.cp_group, groups.cp_rank, dims.cp
        sp = sequence_parallel and dims.tp > 1
        self.sp_group = groups.tp_group
        self.sp_rank, self.sp_size = (groups.tp_rank, dims.tp) if sp else (0, 1)

    def __deepcopy__(self, memo):  # holds process groups, which cannot be copied: model copies (EMA) share it
        return self

    def spans(self, n: int) -> tuple[slice, slice]:
        parts = self.cp_size * self.sp_size
        if n % parts:
            raise ValueError(
                f"a row of {n} tokens cannot be split evenly over {self.cp_size} context-parallel x "
                f"{self.sp_size} sequence-parallel ranks: pad or pack rows to a multiple of {parts} tokens")
        seq, n_local = n // self.cp_size, n // parts
        a0 = self.cp_rank * seq
        l0 = a0 + self.sp_rank * n_local
        return slice(a0, a0 + seq), slice(l0, l0 + n_local)

    def keys_values(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cp_size == 1:
            return k, v
        kv = torch.stack([k, v]).permute(3, 0, 1, 2, 4)  # (n, 2, B, H, hd): sequence first
        kv = gather_seq(kv, self.cp_group, "reduce_scatter", self.cp_rank, self.cp_size)  # (N, 2, B, H, hd)
        k, v = kv.permute(1, 2, 3, 0, 4).unbind(0)
        return k, v

    def gather(self, out: torch.Tensor) -> torch.Tensor:
        # What follows (the loss) runs on every rank alike, so backward hands each rank its own tokens' gradient.
        if self.sp_size > 1:
            out = gather_seq(out, self.sp_group, "split", self.sp_rank, self.sp_size)
        if self.cp_size > 1:
            out = gather_seq(out, self.cp_group, "split", self.cp_rank, self.cp_size)
        return out


class SwapRows(SplitRows):
    """ST-DiT's rows under CP and/or SP (one process: ditcore.models.stdit.LineRows).

    Each CP rank holds a contiguous 1/cp of every row in frames order (whole frames), on which spatial attention
    runs locally; a temporal block's input is moved by one all-to-all to the rank's 1/cp of the row in lines order
    (whole time-lines), and back after it. Under SP the TP ranks' pieces are gathered first and each keeps its own
    piece of the result. (Rows whose slices would cut a frame or a line are gathered instead: `Swap`.)

    Communication per block and rank, forward (the backward sends as much again), for B rows of N tokens of width D
    over cp ranks: all-gather CP receives the keys and values of the rest of the row in every block,
    2·(cp−1)/cp·N·B·D values; all-to-all CP nothing in a spatial block and 2·(cp−1)/cp²·N·B·D in a temporal one (two
    swaps of the (cp−1)/cp of its N/cp tokens that change rank), per (spatial, temporal) pair 2·cp times less. For
    32 frames × 32×32 tokens (N = 32768), ST-DiT-XL/2's D = 1152, bf16 and one row, per pair: cp=2, 151 MB
    (all-gather) vs 37.7 MB (all-to-all); cp=8, 264 MB vs 16.5 MB.
    """

    def keys_values(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return k, v  # whole frames and whole lines are local: every key a query needs is here

    def orders(self, f: Factorised, host: HostRows) -> Orders:
        return Swap(self, f, host)


class Swap(Orders):
    """The all-to-all between frames and lines order for one forward: who sends what to whom is computed once.

    Rows whose 1/cp slices would cut a frame or a time-line (a 2x2-token image over 2 ranks, a packed row whose
    sample straddles a slice boundary oddly) take the way of the other architectures instead: each move gathers the
    whole rows and keeps this rank's slice, and attention gathers the keys of the whole row (`local` False). Slower,
    never wrong.

    Whether a slice cuts a frame and how many tokens go to each rank are read from the rows on the host (`host`):
    no device value, so nothing waits for the device's queue. The token orders are computed on the device.
    """

    def __init__(self, rows: SwapRows, f: Factorised, host: HostRows):
        super().__init__(f, host)
        self.rows = rows
        N = f.to_lines.shape[1]
        self.n = n = N // rows.cp_size
        self.local = True
        if rows.cp_size > 1:
            self.local = not host.cut(n)
        self.plans = {}  # by direction, made at its first move (when the number of rows is known)

    def keys_values(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (k, v) if self.local else SplitRows.keys_values(self.rows, k, v)

    def _plan(self, dest: torch.Tensor, src: torch.Tensor, B: int):
        """Send and arrival orders (each with its inverse) and counts for moving this rank's tokens to the target
        order: token i of row b goes to target index dest[b, i]; this rank's target token j of row b comes from
        src[b, j] (row indices, (B or 1, N)). The counts come from the grids, on the host (HostRows.moves)."""
        cp, n, N = self.rows.cp_size, self.n, dest.shape[1]
        ours = slice(self.rows.cp_rank * n, (self.rows.cp_rank + 1) * n)
        dest, src = dest[:, ours].expand(B, -1), src[:, ours].expand(B, -1)
        rows = torch.arange(B, device=dest.device)[:, None] * N
        to_rank, from_rank = dest // n, src // n
        # each rank sends in (receiving rank, row, target index) order, so a receiver gets, from each sender, its
        # tokens in (row, target index) order; `arrive` sorts the receive buffer into this rank's (row, index) order
        send_order = (to_rank * (B * N) + rows + dest).flatten().argsort()
        mine = torch.arange(n, device=dest.device) + self.rows.cp_rank * n
        received = (from_rank * (B * N) + rows + mine).flatten().argsort()
        arrive = received.argsort()
        moves, rank = self.host.moves(n), self.rows.cp_rank  # moves[r][q]: from frames slice r to lines slice q
        counts = [moves[rank], [moves[q][rank] for q in range(cp)]]  # (send, receive), to lines order
        if src is self.f.to_frames:  # back to frames order: the same tokens the other way
            counts.reverse()
        # each permutation with its inverse, which moves its gradient back (reorder)
        return (send_order, send_order.argsort()), (arrive, received), counts[0], counts[1]

    def _move(self, x: torch.Tensor, dest: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """x (n, B, D) in one order → the other; dest: where each token goes, src: where each comes from."""
        rows = self.rows
        if rows.sp_size > 1:  # every TP rank's piece of the CP slice; each keeps its own piece of the result below
            x = gather_seq(x, rows.sp_group, grad="reduce_scatter")
        if rows.cp_size > 1 and not self.local:  # the whole rows, reordered; this rank keeps its slice
            ours = slice(rows.cp_rank * self.n, (rows.cp_rank + 1) * self.n)
            x = reorder(gather_seq(x, rows.cp_group, grad="reduce_scatter"), src, dest)[ours]
        elif rows.cp_size > 1:
            n, B, D = x.shape
            key = (src is self.f.to_lines, B)  # the direction
            if key not in self.plans:
                self.plans[key] = self._plan(dest, src, B)
            send_order, arrive, send, recv = self.plans[key]
            flat = reorder(x.transpose(0, 1).reshape(B * n, D), *send_order)
            flat = reorder(all_to_all(flat, send, recv, rows.cp_group), *arrive)
            x = flat.view(B, n, D).transpose(0, 1)
        else:
            x = reorder(x, src, dest)
        if rows.sp_size > 1:
            x = x.chunk(rows.sp_size)[rows.sp_rank]
        return x.contiguous()

    def to_lines(self, x: torch.Tensor) -> torch.Tensor:
        return self._move(x, self.f.to_frames, self.f.to_lines)

    def to_frames(self, x: torch.Tensor) -> torch.Tensor:
        return self._move(x, self.f.to_lines, self.f.to_frames)
