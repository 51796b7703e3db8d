"""Optional techniques applied to a built model, each a small function (as torchtitan's parallelize).

Order, when several are used: activation checkpointing → compile → data-parallel wrapping, because
compile must see the checkpointed blocks and the wrapper must see the compiled ones.
"""

from __future__ import annotations

import os
import types

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ditcore.choices import ACTIVATION_CHECKPOINTING
from ditcore.errors import ConfigError

_aten = torch.ops.aten
# What `selective` keeps: the outputs of the matmuls (linears reach the dispatcher as mm or addmm) and of the
# attention kernels, the work that is costly to redo. bmm is left out: in a DiT block it comes only from SDPA's
# math path, where its output is the (B·H, N, N) score matrix, the largest activation there is.
SAVED_OPS = frozenset({
    _aten.mm.default,
    _aten.addmm.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,  # CUDA with a dense mask (packed rows under sdpa)
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    # Seen when the blocks are compiled (or flex runs uncompiled). In eager blocks on CUDA, ditcore.models.attention
    # calls a separately compiled flex kernel, which this policy cannot see: it is recomputed.
    torch.ops.higher_order.flex_attention,
})


def _save_matmuls_and_attention(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """The selective policy: keep SAVED_OPS' outputs, recompute the rest.

    Everything else runs again in backward, collectives included: the functional collectives of tensor, sequence and
    context parallelism (ditcore.parallel) return fresh tensors, so replaying one from the kept matmul output it
    reduces gives the same sum again, on every rank in the same order.
    """
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(_save_matmuls_and_attention)


def apply_activation_checkpointing(model: nn.Module, mode: str) -> nn.Module:
    """Recompute activations of each transformer block in backward rather than keep them from the forward.

    none: keep everything. block: keep only each block's inputs and rerun its whole forward in backward.
    selective: keep the outputs of its matmuls and attention kernels too (SAVED_OPS) and recompute only the
    elementwise work between them (norms, modulation, RoPE, GELU, gates, head-major copies): cheap to redo, but
    most of the tensors a block's backward reads.

    Each block's forward is replaced in place rather than wrapped in a module, so parameter names and state dict
    keys are unchanged. Apply it after tensor parallelism, whose linears (and collectives) it then recomputes,
    and before apply_compile, which traces the checkpointed forward.
    """
    if mode not in ACTIVATION_CHECKPOINTING:
        raise ConfigError("model.activation_checkpointing", mode,
                          "one of " + ", ".join(map(repr, ACTIVATION_CHECKPOINTING)) + " (block: recompute each "
                          "block in backward; selective: all of it but its matmuls and attention)")
    if mode == "none":
        return model
    forward = _checkpointed if mode == "block" else _checkpointed_selectively
    for block in held_blocks(model):
        # A method bound to the block: a deepcopy of the model (EMA's) binds it to the copied block. (In torch 2.13
        # a compiled block with a functools.partial of checkpoint as its forward silently ran uncompiled.)
        block.forward = types.MethodType(forward, block)
    return model


def held_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's blocks that hold weights: a pipeline stage keeps the others' as parameterless pass-throughs
    (ditcore.parallel.pipeline.Elsewhere)."""
    return [block for block in model.blocks if next(block.parameters(), None) is not None]


def _checkpointed(block: nn.Module, *args, **kwargs):
    return checkpoint(type(block).forward, block, *args, use_reentrant=False, **kwargs)


def _checkpointed_selectively(block: nn.Module, *args, **kwargs):
    return checkpoint(type(block).forward, block, *args, use_reentrant=False, context_fn=_selective_contexts, **kwargs)


def apply_compile(model: nn.Module, **compile_kwargs) -> nn.Module:
    """torch.compile each transformer block in place.

    Blocks share one code path, so the first block's compilation is reused by the others; compiling
    blocks rather than the whole model keeps compile time flat in depth. Fuses the elementwise work
    (norms, modulation, RoPE, gates, GELU) around the matmuls. On a shared 2-core CPU the DiT-S/2 step
    measured from 1.29x faster to 0.94x (bench/model_step.py --compile): matmuls dominate there; the
    fusion is meant for GPUs, where the elementwise work is a larger share.
    """
    for block in held_blocks(model):
        block.compile(**compile_kwargs)  # in place: parameter names (and so checkpoints) are unchanged
    return model


class NotCompiled(RuntimeError):
    """model.compile is on, but dynamo compiled no graph of the blocks."""


def check_compiled(model: nn.Module) -> list[str]:
    """After a compiled model's first training step: raise NotCompiled unless dynamo made graphs of the blocks' code;
    return the graph breaks it met (the first line of each reason), which cost speed but not correctness. Dynamo can
    give up on a frame without an error (it once skipped every block of a tensor-parallel, checkpointed model, which
    then trained eagerly at a fraction of the speed): this says so.

    Reads dynamo's compilation records (one per compiled frame, with its source file) and its graph-break counter;
    frames of torch's own code do not count, so FlexAttention's compiled kernels cannot hide a failure.
    """
    from torch._dynamo.utils import counters, get_compilation_metrics

    torch_code = os.path.dirname(torch.__file__)
    graphs = sum(1 for m in get_compilation_metrics()
                 if not (m.co_filename or torch_code).startswith(torch_code) and not m.fail_type
                 and (m.graph_op_count or 0) > 0)
    breaks = [reason.strip().splitlines()[0] for reason in counters["graph_break"]]
    if not graphs:
        raise NotCompiled(f"model.compile=true, but torch.compile made no graph of the {len(held_blocks(model))} "
                          "blocks in the first step: they ran uncompiled"
                          + (f" (first graph break: {breaks[0]})" if breaks else "") +
                          " — set model.compile=false, or run with TORCH_LOGS=graph_breaks,recompiles to see why")
    return breaks
