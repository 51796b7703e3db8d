"""Sample N images of a model and add them to a Fréchet distance, split over ranks: dit-sample eval and dit-train's
validation.fid share it.

The N samples are cut into batches of `batch`; batch b is sampled with seed `seed + b` by rank b mod world. Which
images are drawn therefore depends on N, batch and seed, not on how many ranks draw them: the figure of 2 ranks is
the figure of 1, up to the order of the float64 sums. Class-conditional models get classes drawn uniformly with
the seed; text-conditioned ones the prompts given (cycled), encoded once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ditcore.sampling import sample


@dataclass
class SamplePlan:
    num: int  # images over all ranks
    height: int
    width: int
    steps: int = 18
    guidance: float = 1.0
    seed: int = 0
    batch: int = 16
    solver: str = "heun"

    def batches(self, rank: int = 0, world: int = 1) -> list[tuple[int, range]]:
        """(seed, sample indices) of this rank's batches."""
        starts = range(0, self.num, self.batch)
        return [(self.seed + b, range(s, min(s + self.batch, self.num)))
                for b, s in enumerate(starts) if b % world == rank]

    def classes(self, num_classes: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed)
        return torch.randint(num_classes, (self.num,), generator=g).tolist()


def score_samples(model, codec, stats, distance, plan: SamplePlan, *, text_states: list[torch.Tensor] | None = None,
                  rank: int = 0, world: int = 1, callback: Callable[[int, int], None] | None = None,
                  **network) -> float:
    """Sample this rank's share of plan.num images, add them to `distance` (a FrechetDistance) and return the
    distance over all ranks (collective: every rank of the distance's group calls it). network: what
    ditcore.sampling.sample needs to know of the network (objective, prediction, vp, shift: Exported.sampling)."""
    cfg = model.cfg
    labels = plan.classes(cfg.num_classes) if cfg.num_classes else None
    for seed, items in plan.batches(rank, world):
        kwargs = {"num": len(items)}
        if labels is not None:
            kwargs = {"class_labels": [labels[i] for i in items]}
        elif cfg.text_dim and text_states:
            kwargs = {"text_states": [text_states[i % len(text_states)] for i in items]}
        result = sample(model, codec, stats, frames=1, height=plan.height, width=plan.width, steps=plan.steps,
                        guidance=plan.guidance, solver=plan.solver, seed=seed, callback=callback, **network,
                        **kwargs)
        distance.add(result.pixels[:, 0])  # (B, H, W, 3) uint8
    return distance.compute()
