"""Context and sequence parallelism: each rank computes a slice of every token row.

Context parallelism (CP) gives each rank a contiguous slice of every row. For the DiT and MovieGen attention
all-gathers the keys and values of the whole row (`SplitRows`; its backward reduce-scatters: every rank's queries
contributed to the gradient of every key). A model that regroups tokens between blocks (ST-DiT, whose attention is
factorised: a rank's slice holds whole frames) moves the rank's tokens into another order of the rows by one
all-to-all (`SplitRows.permutation`, `Exchange`): it says how many tokens go from each slice to each, so no other
module knows its orders. Sequence parallelism (SP, with TP) splits that slice again over the tensor-parallel ranks
outside attention. The model's output is gathered back into whole rows, so the loss runs alike on every rank.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ditcore.layout import reorder
from ditcore.models.attention import RowSplit
from ditcore.parallel.comm import all_to_all, gather_seq
from ditcore.parallel.dims import ParallelGroups


class SplitRows(RowSplit):
    """A model's `rows` under CP and/or SP (see ditcore.models.attention.RowSplit for the one-process version)."""

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

    def permutation(self, index: torch.Tensor, inverse: torch.Tensor, counts: Callable | None) -> Exchange:
        return Exchange(self, index, inverse, counts)


class Exchange:
    """A move of the rank's tokens into another order of the rows (ditcore.models.attention.RowSplit.permutation): who
    sends what to whom is computed at its first move (when the number of rows is known), from the device's orders
    and the host's counts, so nothing waits for the device's queue. Under SP the TP ranks' pieces are gathered first
    and each keeps its own piece of the result.

    With counts, one all-to-all over CP sends each token to the rank whose slice of the new order holds it; without
    (rows whose slices would cut what the model attends over, ST-DiT's Orders), the whole rows are gathered, reordered,
    and this rank keeps its slice.
    """

    def __init__(self, rows: SplitRows, index: torch.Tensor, inverse: torch.Tensor, counts: Callable | None):
        self.rows, self.index, self.inverse, self.counts = rows, index, inverse, counts
        self.n = index.shape[1] // rows.cp_size  # tokens of a row per CP rank
        self.plans = {}  # by the number of rows

    def _plan(self, B: int):
        """Send and arrival orders (each with its inverse) and counts for moving this rank's tokens to the target
        order: token i of row b goes to target index dest[b, i]; this rank's target token j of row b comes from
        src[b, j] (row indices, (B or 1, N)). counts(n)[r][q]: from slice r to slice q, on the host."""
        cp, n, rank = self.rows.cp_size, self.n, self.rows.cp_rank
        N = self.index.shape[1]
        ours = slice(rank * n, (rank + 1) * n)
        dest, src = self.inverse[:, ours].expand(B, -1), self.index[:, ours].expand(B, -1)
        rows = torch.arange(B, device=dest.device)[:, None] * N
        to_rank, from_rank = dest // n, src // n
        # each rank sends in (receiving rank, row, target index) order, so a receiver gets, from each sender, its
        # tokens in (row, target index) order; `arrive` sorts the receive buffer into this rank's (row, index) order
        send_order = (to_rank * (B * N) + rows + dest).flatten().argsort()
        mine = torch.arange(n, device=dest.device) + rank * n
        received = (from_rank * (B * N) + rows + mine).flatten().argsort()
        arrive = received.argsort()
        counts = self.counts(n)
        send, recv = counts[rank], [counts[q][rank] for q in range(cp)]
        # each permutation with its inverse, which moves its gradient back (reorder)
        return (send_order, send_order.argsort()), (arrive, received), send, recv

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (n, B, D), the rank's tokens in one order → in the other."""
        rows = self.rows
        if rows.sp_size > 1:  # every TP rank's piece of the CP slice; each keeps its own piece of the result below
            x = gather_seq(x, rows.sp_group, grad="reduce_scatter")
        if rows.cp_size > 1 and self.counts is None:  # the whole rows, reordered; this rank keeps its slice
            ours = slice(rows.cp_rank * self.n, (rows.cp_rank + 1) * self.n)
            x = reorder(gather_seq(x, rows.cp_group, grad="reduce_scatter"), self.index, self.inverse)[ours]
        elif rows.cp_size > 1:
            n, B, D = x.shape
            if B not in self.plans:
                self.plans[B] = self._plan(B)
            send_order, arrive, send, recv = self.plans[B]
            flat = reorder(x.transpose(0, 1).reshape(B * n, D), *send_order)
            flat = reorder(all_to_all(flat, send, recv, rows.cp_group), *arrive)
            x = flat.view(B, n, D).transpose(0, 1)
        else:
            x = reorder(x, self.index, self.inverse)
        if rows.sp_size > 1:
            x = x.chunk(rows.sp_size)[rows.sp_rank]
        return x.contiguous()
