"""Context and sequence parallelism: each rank computes a slice of every token row.

Context parallelism (CP) gives each rank a contiguous slice of every row; attention all-gathers the keys and
values of the whole row (its backward reduce-scatters: every rank's queries contributed to the gradient of
every key). Sequence parallelism (SP, with TP) splits that slice again over the tensor-parallel ranks outside
attention. The model's output is gathered back into whole rows, so the loss runs alike on every rank.
"""

from __future__ import annotations

import torch

from ditcore.models.dit import RowSplit
from ditcore.parallel.comm import gather_seq
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
        kv = gather_seq(kv, self.cp_group, grad="reduce_scatter")  # (N, 2, B, H, hd)
        k, v = kv.permute(1, 2, 3, 0, 4).unbind(0)
        return k, v

    def gather(self, out: torch.Tensor) -> torch.Tensor:
        # What follows (the loss) runs on every rank alike, so backward hands each rank its own tokens' gradient.
        if self.sp_size > 1:
            out = gather_seq(out, self.sp_group, grad="split")
        if self.cp_size > 1:
            out = gather_seq(out, self.cp_group, grad="split")
        return out
