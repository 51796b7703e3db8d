"""A fourth architecture, defined outside ditcore: the DiT with a ReGLU MLP, down(relu(gate(x)) · up(x)) (Shazeer,
"GLU Variants Improve Transformer", 2020), as two separate input matrices with biases.

Its MLP has three matrices where the DiT's has two, under names no shipped plan knows (`mlp.gate`, `mlp.up`,
`mlp.down`), so it needs its own tensor-parallel plan, and an estimate or FLOP count that assumed a DiT would be
wrong. It is what a new model file plus its registration look like; nothing in ditcore names it. Importing this
module registers nothing: tests/ditcore/parallel/test_registry.py registers `ARCH` for the length of a test, and the
equivalence worker registers it in its processes (equivalence_worker.main, the cases `reglu:*` of
test_equivalence.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ditcore.models import Architecture, DiT
from ditcore.models.dit import DIT_PLAN, DiTBlock, DiTConfig
from ditcore.models.plan import ColumnParallel, Plan, RowParallel


@dataclass(frozen=True)
class ReGLUConfig(DiTConfig):
    """No fields of its own: its type is what says which architecture a config is."""


class ReGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(dim, hidden)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.relu(self.gate(x)) * self.up(x))


class ReGLUBlock(DiTBlock):
    def __init__(self, cfg: ReGLUConfig, **options):  # DiTBlock's options (own_embedders: block_embedders)
        super().__init__(cfg, **options)
        self.mlp = ReGLU(cfg.hidden_size, cfg.ffn)


class ReGLUDiT(DiT):
    block_class = ReGLUBlock


# Gate and up split by hidden units alike (contiguous column splits), so each rank multiplies matching halves.
PLAN = Plan(
    # the DiT's MLP entries (its dense MLP's and its mixture of experts') are not this block's
    modules={k: v for k, v in DIT_PLAN.modules.items() if not (k.startswith("blocks.") and ".mlp." in k)} | {
        "blocks.*.mlp.gate": ColumnParallel(),
        "blocks.*.mlp.up": ColumnParallel(),
        "blocks.*.mlp.down": RowParallel(),
    },
    heads=DIT_PLAN.heads,
    pipeline=DIT_PLAN.pipeline,
)

PRESETS = {"ReGLU-DiT-Tiny": ReGLUConfig(hidden_size=64, depth=2, num_heads=4)}

ARCH = Architecture("reglu", ReGLUConfig, ReGLUDiT, PRESETS, tiny="ReGLU-DiT-Tiny", plan=PLAN,
                    summary="the DiT with a ReGLU MLP (a test's architecture)")
