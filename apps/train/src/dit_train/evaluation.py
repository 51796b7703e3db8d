"""validation.fid: at every validation (and at the end) the FID, or FD_DINOv2, of validation.fid.num samples of the
EMA weights against data.path's images (a blend's: its datasets' mixed by their weights, each decoded with its own
latent statistics), logged as fid/<features> to every logger (CSV, TensorBoard, W&B).

The reference statistics are computed once, by the first rank, and cached in DATA/eval/ (a blend's: in each of its
datasets' folders; ditcore.eval.reference);
the samples are drawn at the reference's image size with the validation settings (steps, guidance, solver, seed),
split over the data-parallel ranks, and their sums reduced over them. The model-parallel peers of a rank (TP, CP,
pipeline stages) sample the same images and compute the same figure. Text-conditioned models sample
validation.prompts, cycled; class-conditional ones classes drawn uniformly with validation.seed.
"""

from __future__ import annotations

from pathlib import Path

from tqdm import tqdm

from dit_train.config import TrainConfig
from ditcore.codecs import LatentStats, load_codec
from ditcore.codecs.text import load_text_encoder
from ditcore.errors import ConfigError
from ditcore.eval import (
    FIGURE,
    FeatureError,
    FrechetDistance,
    ReferenceError,
    SamplePlan,
    dataset_reference,
    feature_net,
)
from ditcore.parallel import ParallelGroups
from ditcore.parallel.pipeline import PipelinedModel
from ditcore.sampling import step_bar, token_grid

BATCH = 16  # samples per sampler call on each rank


class FIDScorer:
    """Built before the first step (the reference statistics and the feature network load once); `run` at every
    validation and at the end."""

    def __init__(self, cfg: TrainConfig, info, model_cfg, fabric, groups: ParallelGroups,
                 network: dict | None = None, stats: LatentStats | None = None):
        f = cfg.validation.fid
        self.enabled = f.num > 0
        if not self.enabled:
            return
        if info.codec.get("kind") == "none":
            raise ConfigError("validation.fid.num", f.num, "0 for a dataset of random latents (dit-prepare mock): it "
                                                           "has no images to score against")
        self.cfg, self.fabric, self.groups, self.network = cfg, fabric, groups, network or {}
        self.codec = load_codec(info.codec, Path(cfg.data.path))
        self.stats = stats or LatentStats.from_dict(info.latent_stats)
        self.key = f"fid/{f.features}"
        try:
            self.net = feature_net(f.features, f.weights)
        except FeatureError as e:
            raise ConfigError("validation.fid.features", f.features, f"features this machine can compute: {e}"
                              ) from None
        try:
            self.reference = self._reference()
        except ReferenceError as e:
            raise ConfigError("validation.fid.num", f.num, f"0, or a data.path with images to score against: {e}"
                              ) from None
        v = cfg.validation
        self.plan = SamplePlan(f.num, self.reference.height, self.reference.width, steps=v.steps, guidance=v.guidance,
                               seed=v.seed, batch=BATCH, solver=v.solver)
        try:
            token_grid(model_cfg, self.codec, 1, self.plan.height, self.plan.width)
        except ValueError as e:
            size = f"{self.plan.height}x{self.plan.width}"
            raise ConfigError("validation.fid.num", f.num, f"0, or a model that samples the dataset's {size} "
                                                           f"images: {e}") from None
        self.distance = FrechetDistance(self.net, self.reference, process_group=groups.dp_group, device=fabric.device,
                                        holds_reference=groups.dp_rank == 0)  # its network loads once
        self.states = load_text_encoder(info.text_encoder["name"]).encode(list(v.prompts)) if model_cfg.text_dim \
            else None

    def _reference(self):
        """The first rank computes the statistics (or reads its cache) while the others wait, then read the cache."""
        kwargs = {"net": self.net, "device": self.fabric.device}
        first, reference = self.fabric.global_rank == 0, None
        if first:
            with tqdm(desc="FID reference images", unit="image", dynamic_ncols=True, leave=False) as bar:
                reference = dataset_reference(self.cfg.data.path, progress=bar.update, **kwargs)
        self.fabric.barrier()
        return reference if first else dataset_reference(self.cfg.data.path, **kwargs)

    def run(self, model, step: int) -> dict[str, float]:
        """Sample and score; collective over all ranks. Returns {fid/<features>: value} to log (empty when off)."""
        if not self.enabled:
            return {}
        from ditcore.eval import score_samples

        g = self.groups
        if g.dims.pp > 1:  # every stage runs the sampler; the hidden states go through the stages
            model = PipelinedModel(model, g)
        self.distance.reset()
        batches = len(self.plan.batches(g.dp_rank, g.dims.dp))
        with step_bar(batches * self.plan.steps, f"{FIGURE[self.cfg.validation.fid.features]} samples, step {step}",
                      disable=self.fabric.global_rank != 0, leave=False) as bar:
            value = score_samples(model, self.codec, self.stats, self.distance, self.plan, text_states=self.states,
                                  rank=g.dp_rank, world=g.dims.dp, callback=bar, **self.network)
        self.fabric.print(f"step {step}: {FIGURE[self.cfg.validation.fid.features]} {value:.4f} of {self.plan.num} "
                          f"samples against {self.reference.n} images of {self.cfg.data.path}")
        return {self.key: value}
