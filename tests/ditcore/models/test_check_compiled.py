"""dit-train never compiles silently into nothing: after the first step, check_compiled finds graphs of the blocks'
code in dynamo's records, or stops the run with one line; graph breaks are reported."""

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import clear_compilation_metrics, counters

from ditcore.inputs import Inputs
from ditcore.layout import grid_positions
from ditcore.models import DiT, NotCompiled, apply_compile, check_compiled, preset

CFG = preset("DiT-Tiny")


def step(model: DiT) -> None:
    x = torch.randn(2, 16, CFG.patch_dim)
    model(x, torch.randn(2, 1), Inputs(grid_positions((1, 4, 4)))).square().mean().backward()


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    clear_compilation_metrics()  # as in a fresh dit-train process
    yield
    torch._dynamo.reset()


def test_compiled_blocks_pass():
    model = apply_compile(DiT(CFG), backend="aot_eager")
    step(model)
    assert check_compiled(model) == []


def test_blocks_dynamo_skipped_stop_the_run():
    model = DiT(CFG)
    for block in model.blocks:  # what dynamo did to TP + checkpointed blocks with Megatron's layers: run them eagerly
        block.forward = torch._dynamo.disable(block.forward)
    apply_compile(model, backend="aot_eager")
    step(model)
    with pytest.raises(NotCompiled, match=r"^model.compile=true, but torch.compile made no graph of the 2 blocks in "
                                          r"the first step: they ran uncompiled — set model.compile=false"):
        check_compiled(model)


def test_graph_breaks_are_reported():
    model = DiT(CFG)
    forward = type(model.blocks[0]).forward

    def breaking(self, *args):
        torch._dynamo.graph_break()
        return forward(self, *args)

    for block in model.blocks:
        block.forward = breaking.__get__(block)
    apply_compile(model, backend="aot_eager")
    step(model)
    breaks = check_compiled(model)
    assert len(breaks) == 1 and "graph_break" in breaks[0]
