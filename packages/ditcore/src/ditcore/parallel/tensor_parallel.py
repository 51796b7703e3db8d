"""Tensor (and sequence) parallelism: swap a model's linears for Megatron-Core parallel ones, as its plan says.

Column-parallel layers split output features (heads, MLP columns), row-parallel ones input features. With
sequence parallelism Megatron's layers all-gather the tokens before a column-parallel matmul and
reduce-scatter after a row-parallel one. Parameter names are unchanged, so a consolidated state dict has
exactly the one-device keys.
"""

from __future__ import annotations

import fnmatch
import functools

import torch
from torch import nn

from ditcore.parallel.dims import ParallelGroups
from ditcore.parallel.plan import ColumnParallel, Plan, RowParallel


@functools.cache
def _parallel_linear_classes():
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    # Megatron returns (output, bias), and adds an fp32 bias to a bf16 matmul under autocast, which promotes the
    # output (and all that follows) to fp32. Like nn.Linear: return the output, the bias added in its dtype.
    def with_bias(output, bias):
        return output if bias is None else output + bias.to(output.dtype)

    class Column(ColumnParallelLinear):
        def forward(self, x):
            return with_bias(*super().forward(x))

    class Row(RowParallelLinear):
        def forward(self, x):
            return with_bias(*super().forward(x))

    return Column, Row


def is_tp_sharded(p: torch.Tensor) -> bool:
    return bool(getattr(p, "tensor_model_parallel", False))


def shard(full: torch.Tensor, local: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This rank's piece of a full tensor, for a parameter Megatron split along `partition_dim`."""
    if not is_tp_sharded(local):
        return full
    return full.chunk(size, dim=local.partition_dim)[rank]


def full_shape(local: torch.Tensor, size: int) -> torch.Size:
    """The one-device shape of a parameter of which this rank holds `local` (the inverse of `shard`)."""
    if not is_tp_sharded(local):
        return local.shape
    if getattr(local, "partition_stride", 1) != 1:
        raise NotImplementedError(f"a parameter split with partition_stride={local.partition_stride}; "
                                  "ditcore's plans split contiguously (stride 1)")
    shape = list(local.shape)
    shape[local.partition_dim] *= size
    return torch.Size(shape)


def _megatron_linear(style: ColumnParallel | RowParallel, linear: nn.Linear, groups: ParallelGroups,
                     sequence_parallel: bool) -> nn.Module:
    from megatron.core import ModelParallelConfig
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    Column, Row = _parallel_linear_classes()
    config = ModelParallelConfig(
        tensor_model_parallel_size=groups.dims.tp,
        sequence_parallel=sequence_parallel,
        use_cpu_initialization=True,  # allocate where torch's default device says (below), not on a CUDA device
        # Megatron's CPU initialisation would build the whole weight on the host for every layer; the values come
        # from `linear` here, or from ditcore.parallel.materialize for a model built on the meta device.
        perform_initialization=False,
        params_dtype=linear.weight.dtype,
        gradient_accumulation_fusion=False,
    )
    out_f, in_f = linear.weight.shape
    kw = dict(config=config, init_method=nn.init.zeros_, bias=linear.bias is not None, skip_bias_add=True,
              tp_group=groups.tp_group)
    with torch.device(linear.weight.device):  # only this rank's shard is allocated, where the linear lives
        if isinstance(style, ColumnParallel):
            layer = Column(in_f, out_f, gather_output=False, **kw)  # tags its bias as split along dim 0 itself
        else:
            layer = Row(in_f, out_f, input_is_parallel=True, **kw)
    # Megatron tags the weight only when it initialises it: tag it as it would (grads.py, consolidate.py read these)
    set_tensor_model_parallel_attributes(layer.weight, True, 0 if isinstance(style, ColumnParallel) else 1, 1)
    if not linear.weight.is_meta:
        with torch.no_grad():
            full = {"weight": linear.weight, "bias": linear.bias}
            for name, p in layer.named_parameters(recurse=False):
                p.copy_(shard(full[name], p, groups.tp_rank, groups.dims.tp))
    return layer


def apply_tensor_parallel(model: nn.Module, plan: Plan, groups: ParallelGroups, sequence_parallel: bool) -> None:
    """Replace the plan's column/row-parallel linears in place and give attention modules their share of heads."""
    tp = groups.dims.tp
    for name, module in list(model.named_modules()):
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in plan.heads):
            module.num_heads //= tp
            if hasattr(module, "num_kv_heads"):  # grouped-query attention: whole groups per rank
                module.num_kv_heads //= tp
        style = plan.module_style(name)
        if isinstance(style, ColumnParallel | RowParallel):
            if not isinstance(module, nn.Linear):
                raise TypeError(f"the plan makes {name} {type(style).__name__}, but it is a "
                                f"{type(module).__name__}, not an nn.Linear")
            parent_name, _, child = name.rpartition(".")
            sp = sequence_parallel and not (isinstance(style, ColumnParallel) and not style.sequence_parallel)
            model.get_submodule(parent_name).register_module(child, _megatron_linear(style, module, groups, sp))
