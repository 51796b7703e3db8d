"""An architecture with a conditioning input of its own, defined outside ditcore: the DiT conditioned on each sample's
motion score (how much a clip moves, as Open-Sora conditions on one), embedded like the noise level and added to the
conditioning vector.

Everything about the new input is in this file: its field of the model's inputs (`MotionInputs.motion`, read from the
`motion` key of a dataset sample's JSON metadata, -1 where a sample has none, replaced by -1 under CFG dropout), its
embedder and the line of `condition` that adds it, and the embedder's entry in the tensor-parallel plan. The loader,
CFG dropout, the memory/FLOP/traffic probes and the sampler handle it from that declaration (ditcore.inputs);
tests/ditcore/test_inputs.py shows it reaching each. Importing this module registers nothing: the test registers
`ARCH` for its length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ditcore.inputs import Inputs, per_sample
from ditcore.models import Architecture, DiT
from ditcore.models.dit import DIT_PLAN, DiTConfig
from ditcore.models.layers import ScalarEmbedder
from ditcore.models.plan import Plan, Replicated

NO_SCORE = -1.0  # a sample without a motion score, and the null score of CFG dropout


@dataclass(frozen=True)
class MotionConfig(DiTConfig):
    """No fields of its own: its type is what says which architecture a config is."""


@dataclass
class MotionInputs(Inputs):
    motion: torch.Tensor | None = per_sample(  # noqa: RUF009 (a dataclasses.field)
        "motion", torch.float32, NO_SCORE, lambda cfg: True, null=lambda cfg: NO_SCORE)


class MotionDiT(DiT):
    inputs_class = MotionInputs

    def __init__(self, cfg: MotionConfig, attention: str = "auto"):
        super().__init__(cfg, attention)
        self.motion_embedder = ScalarEmbedder(cfg.hidden_size)
        self.init_weights()  # again, now that the embedder exists: every parameter from DiT's rules

    def condition(self, c_noise: torch.Tensor, inputs: MotionInputs) -> torch.Tensor:
        if inputs.motion is None:
            raise ValueError("this model is conditioned on motion scores: pass motion (B, S)")
        return super().condition(c_noise, inputs) + self.motion_embedder(inputs.motion)


# The embedder feeds only the adaLN linears, which sum its gradient over TP, as the DiT's own embedders.
PLAN = Plan(modules=DIT_PLAN.modules | {"motion_embedder.*": Replicated(partial_grad="never")},
            heads=DIT_PLAN.heads, pipeline=DIT_PLAN.pipeline)

PRESETS = {"Motion-DiT-Tiny": MotionConfig(hidden_size=64, depth=2, num_heads=4)}

ARCH = Architecture("motion", MotionConfig, MotionDiT, PRESETS, tiny="Motion-DiT-Tiny", plan=PLAN,
                    summary="the DiT conditioned on a motion score (a test's architecture)")
