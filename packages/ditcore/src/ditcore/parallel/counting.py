"""Communication of a training step, per process group: what a rank sends, in which collective, how often.

The types here are shared by the counter (below: what a step really issues, on any backend) and the model
(ditcore.traffic: what a layout will issue, before any process starts); the step-time model (ditcore.speed) turns
them into seconds.

Bytes are what one rank sends over its links, by the ring algorithms NCCL uses for large messages, for a collective
over n ranks whose full buffer is S bytes: all-gather and reduce-scatter (n-1)/n·S, all-reduce 2(n-1)/n·S,
all-to-all the part of its input that goes to other ranks, send the tensor sent.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

Group = Literal["tp", "cp", "pp", "fsdp", "replicate", "dp", "ep", "edp"]
Op = Literal["all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send", "broadcast"]
When = Literal["micro_batch", "step"]


@dataclass(frozen=True)
class Collective:
    """All collectives of one kind, in one group, issued at one frequency by one rank."""

    group: Group  # tp; cp; pp (stage to stage); fsdp (the shard group); replicate (HSDP's replicas); dp (DDP, dp x cp);
    # ep (expert parallelism's dispatch), edp (the ranks holding the same experts)
    op: Op
    when: When  # every micro-batch, or once per optimizer step
    count: int  # collectives issued
    bytes: int  # bytes this rank sends in them, in all


@dataclass(frozen=True)
class Traffic:
    collectives: tuple[Collective, ...]

    def bytes(self, group: Group | None = None, when: When | None = None) -> int:
        return sum(c.bytes for c in self.collectives
                   if (group is None or c.group == group) and (when is None or c.when == when))


# --------------------------------------------------------------------------------------------------
# The counter: what this process really issues


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _all_bytes(tensors) -> int:
    return sum(_nbytes(t) for t in tree_leaves(tensors) if isinstance(t, torch.Tensor))


_fc, _c10d = torch.ops._c10d_functional, torch.ops.c10d

# Every collective that reaches the dispatcher, functional (tensor, sequence and context parallelism; DTensor) or
# c10d (FSDP2's gathers and reduce-scatters, DDP's bucket all-reduces, dist.all_reduce, the pipeline's sends): its
# kind, the bytes of its full buffer (gathered output, scattered input, reduced tensor, sent tensor) and its group
# (a group name for functional collectives, a ProcessGroup for c10d's). Receives send nothing; a barrier carries no
# data.
_OPS = {
    _fc.all_gather_into_tensor.default: ("all_gather", lambda a: _nbytes(a[0]) * a[1], 2),
    _fc.all_gather_into_tensor_coalesced.default: ("all_gather", lambda a: _all_bytes(a[0]) * a[1], 2),
    _fc.reduce_scatter_tensor.default: ("reduce_scatter", lambda a: _nbytes(a[0]), 3),
    _fc.reduce_scatter_tensor_coalesced.default: ("reduce_scatter", lambda a: _all_bytes(a[0]), 3),
    _fc.all_reduce.default: ("all_reduce", lambda a: _nbytes(a[0]), 2),
    _fc.all_reduce_coalesced.default: ("all_reduce", lambda a: _all_bytes(a[0]), 2),
    _fc.broadcast.default: ("broadcast", lambda a: _nbytes(a[0]), 2),
    _c10d._allgather_base_.default: ("all_gather", lambda a: _nbytes(a[0]), 2),
    _c10d.allgather_.default: ("all_gather", lambda a: _all_bytes(a[0]), 2),
    _c10d.allgather_into_tensor_coalesced_.default: ("all_gather", lambda a: _all_bytes(a[0]), 2),
    _c10d._reduce_scatter_base_.default: ("reduce_scatter", lambda a: _nbytes(a[1]), 2),
    _c10d.reduce_scatter_.default: ("reduce_scatter", lambda a: _all_bytes(a[1]), 2),
    _c10d.reduce_scatter_tensor_coalesced_.default: ("reduce_scatter", lambda a: _all_bytes(a[1]), 2),
    _c10d.allreduce_.default: ("all_reduce", lambda a: _all_bytes(a[0]), 1),
    _c10d.allreduce_coalesced_.default: ("all_reduce", lambda a: _all_bytes(a[0]), 1),
    _c10d.broadcast_.default: ("broadcast", lambda a: _all_bytes(a[0]), 1),
    _c10d.send.default: ("send", lambda a: _all_bytes(a[0]), 1),
}
# all-to-alls: what leaves this rank is its input less the part it keeps (split sizes in rows of dim 0; none: equal)
_ALL_TO_ALL = {_fc.all_to_all_single.default: (0, 2, 3), _c10d.alltoall_base_.default: (1, 4, 2)}  # input, splits,
# group


def sent_bytes(op: Op, full: int, n: int) -> int:
    """Bytes one rank sends in a collective over n ranks whose full buffer is `full` bytes (the module docstring's
    ring convention; a broadcast as a pipelined ring: each rank forwards the buffer once, all but the last)."""
    if op in ("all_gather", "reduce_scatter", "broadcast"):
        return full * (n - 1) // n
    if op == "all_reduce":
        return 2 * full * (n - 1) // n
    return full  # send; an all-to-all's bytes are counted as sent already


class CollectiveCounter(TorchDispatchMode):
    """Counts every collective this process issues while it is entered, by group role and op (`traffic()`).

        with CollectiveCounter(groups) as counter:          # around a micro-batch's forward and backward
            loss.backward()
            with counter.during("step"):                   # what runs once per optimizer step
                finalize_grads(model, groups)
        counter.traffic()

    It sees what reaches the dispatcher, on gloo and NCCL alike: functional collectives (TP/SP/CP), and FSDP2's and
    DDP's c10d collectives, dist.all_reduce and the pipeline's sends, which c10d's ProcessGroup issues as dispatcher
    ops even from DDP's reducer and FSDP2's hooks (tests/ditcore/parallel/test_equivalence.py counts each kind).
    Compiled blocks are not checked: their graphs call the same functional ops, but no test counts one yet. The
    tensors' sizes are read from their metadata: nothing waits for a device. Entered, it is a dispatch mode (every op
    passes through it, so it slows a step a little); not entered, it does nothing.

    groups: the layout's process groups, which name each collective's group: tp, cp, pp, and the DP x CP group as
    `fsdp` when the model is sharded (fsdp=True) or `dp` (DDP, the pipeline's gradient all-reduce) otherwise.
    `extra` names more groups, a role → a group or a list of them (FSDP2's mesh groups, HSDP's shard and replicate
    groups). A group it was not given but whose ranks are those of one it was is counted as that one, `extra`'s
    first: DeviceMesh can hand FSDP2 a copy of a group it was built from (seen with HSDP meshes made again for new
    groups of the same ranks). Collectives in groups of one rank send nothing and are left out; one in a group it
    cannot name is an error.
    """

    def __init__(self, groups, fsdp: bool = False, extra: dict | None = None):
        super().__init__()
        named = [("tp", groups.tp_group), ("cp", groups.cp_group), ("pp", groups.pp_group),
                 ("fsdp" if fsdp else "dp", groups.dp_cp_group)]
        for role, more in (extra or {}).items():
            named += [(role, g) for g in (more if isinstance(more, list | tuple) else [more])]
        self.roles: dict[str, tuple[Group, int, int]] = {}  # group name → (role, size, this rank's place)
        for role, group in reversed(named):  # the first role named wins a group that two share
            if group is not None:
                self.roles[group.group_name] = (role, dist.get_world_size(group), dist.get_rank(group))
        # by their ranks, for copies: extra's roles first (copies come from meshes)
        self.by_ranks: dict[tuple[int, ...], tuple[Group, int, int]] = {}
        for _role, group in reversed(named[4:] + named[:4]):
            if group is not None:
                self.by_ranks[tuple(dist.get_process_group_ranks(group))] = self.roles[group.group_name]
        self.when: When = "micro_batch"
        self.seen: dict[tuple[Group, Op, When], list[int]] = {}  # → [count, bytes]

    @contextlib.contextmanager
    def during(self, when: When):
        """Mark what is issued inside as issued `when` (the counter's default: every micro-batch)."""
        before, self.when = self.when, when
        try:
            yield self
        finally:
            self.when = before

    def traffic(self) -> Traffic:
        return Traffic(tuple(Collective(g, op, when, count, size)
                             for (g, op, when), (count, size) in sorted(self.seen.items())))

    def _record(self, group, op: Op, sent) -> None:
        name = group if isinstance(group, str) else dist.ProcessGroup.unbox(group).group_name
        if name not in self.roles:
            ranks = tuple(dist.get_process_group_ranks(_resolve_process_group(name)))
            if ranks in self.by_ranks:
                self.roles[name] = self.by_ranks[ranks]
        if name not in self.roles:
            raise RuntimeError(f"a {op} over process group {name!r}, which is none of the groups the counter was "
                               f"given ({', '.join(role for role, _, _ in self.roles.values())}): pass it in `extra`")
        role, n, rank = self.roles[name]
        if n > 1:
            counted = self.seen.setdefault((role, op, self.when), [0, 0])
            counted[0] += 1
            counted[1] += sent(n, rank)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _OPS:
            op, full, group = _OPS[func]
            size = full(args)
            self._record(args[group], op, lambda n, _: sent_bytes(op, size, n))
        elif func in _ALL_TO_ALL:
            x, splits, group = _ALL_TO_ALL[func]
            x, splits = args[x], args[splits]

            def sent(n: int, rank: int) -> int:
                row = _nbytes(x) // max(1, x.shape[0]) if x.ndim else _nbytes(x)
                kept = splits[rank] if splits else x.shape[0] // n
                return _nbytes(x) - kept * row

            self._record(args[group], "all_to_all", sent)
        return func(*args, **kwargs)
