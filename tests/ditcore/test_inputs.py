"""One inputs object (ditcore.inputs): a conditioning input added by an architecture registered outside ditcore
reaches training, the planner and sampling with no edit to ditcore.

motion_arch.py is the whole change: a field of its model's inputs declared with `per_sample` (read from the `motion`
key of a sample's JSON metadata), its embedder, and its plan entry; the dataset's samples carry the key. Registered
for the length of each test here.
"""

from __future__ import annotations

from pathlib import Path
from unittest.mock import patch

import pytest
import torch

from ditcore.codecs import LatentStats
from ditcore.codecs.pixel import PixelCodec
from ditcore.data.loader import build_loader, next_batch
from ditcore.data.schema import DatasetInfo
from ditcore.data.writer import ShardWriter, finish_dataset, start_dataset
from ditcore.diffusion import EDMLoss, EDMPrecond
from ditcore.flops import count_params
from ditcore.inputs import Inputs
from ditcore.job import Layout
from ditcore.memory import plan_from
from ditcore.models import ARCHS, build, inputs_of, preset, register
from ditcore.sampling import sample
from ditcore.traffic import traffic
from ditcore.training import draw, step_generator

from .motion_arch import ARCH, NO_SCORE, MotionInputs

SCORES = {f"s{i:03d}": float(i % 4) for i in range(12) if i % 3}  # every third sample has no motion score


@pytest.fixture
def motion():
    with patch.dict(ARCHS):  # registered for this test only
        yield register(ARCH)


def cfg_of(**changes):
    return preset(ARCH.tiny, in_channels=4, num_classes=3, **changes)


def randomized(cfg):
    """The model of cfg with every weight random (adaLN-Zero's zeros would hide what the conditioning does)."""
    torch.manual_seed(0)
    model = build(cfg, attention="sdpa")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model


def write_dataset(root: Path, bad_key: str | None = None) -> Path:
    start_dataset(root, overwrite=False)
    g = torch.Generator().manual_seed(0)
    with ShardWriter(root, max_count=20) as w:
        for i in range(12):
            key = f"s{i:03d}"
            meta = {"caption": key, "fps": 0.0, "label": i % 3}
            meta |= {"motion": "fast" if key == bad_key else SCORES[key]} if key in SCORES else {}
            w.write(key, torch.randn(4, 1, 4, 4, generator=g), torch.zeros(0, 8), meta)
    finish_dataset(root, DatasetInfo(codec={"kind": "pixel", "factor": 1}, latent_stats={},
                                     text_encoder={"name": "test", "dim": 8}, latent_channels=4, spatial_factor=1,
                                     temporal_factor=1, counts={"samples": 12}, num_classes=3))
    return root


def loader_of(root: Path, cfg):
    return build_loader(root, patch_size=2, patch_size_t=1, seq_length=8, batch_size=3, inputs=inputs_of(cfg))


def first_batch(root: Path, cfg):
    loader = loader_of(root, cfg)
    return next_batch(iter(loader), loader)


def test_the_loader_reads_it_from_each_sample_s_metadata(motion, tmp_path):
    cfg = cfg_of()
    assert inputs_of(cfg) is MotionInputs and "motion" in MotionInputs.per_sample_fields()
    batch = first_batch(write_dataset(tmp_path / "data"), cfg)
    inputs = batch.inputs()
    assert type(inputs) is MotionInputs and inputs.motion.shape == batch.per_sample_shape
    for row, keys in enumerate(batch.keys):
        for slot, key in enumerate(keys):
            assert inputs.motion[row, slot].item() == SCORES.get(key, NO_SCORE), key
    # a score that is not a number is one skipped sample, named, not a crash in the middle of a batch
    root = write_dataset(tmp_path / "bad", bad_key="s001")
    loader = loader_of(root, cfg)
    it, keys, skipped = iter(loader), [], []
    while not skipped:  # until the shuffle reaches it
        b = next_batch(it, loader)
        keys, skipped = keys + [k for row in b.keys for k in row], skipped + b.skipped_samples
    assert "s001" not in keys and len(set(keys)) > 1
    assert skipped == [("s001", "bad_metadata", "motion='fast', expected a finite number")]


def test_training_drops_it_under_cfg_and_learns_from_it(motion, tmp_path):
    cfg = cfg_of()
    batch = first_batch(write_dataset(tmp_path / "data"), cfg)
    model = randomized(cfg)
    everything = draw(batch, step_generator(0, 1, 0, 0), EDMLoss(), 1.0, cfg)  # CFG dropout of every sample
    assert (everything.inputs.motion == NO_SCORE).all() and (everything.inputs.class_labels == cfg.num_classes).all()
    d = draw(batch, step_generator(0, 1, 0, 0), EDMLoss(), 0.0, cfg)
    assert torch.equal(d.inputs.motion, batch.inputs().motion)  # kept

    def loss(inputs: Inputs) -> torch.Tensor:  # dit-train's loss of the micro-batch
        return EDMLoss()(EDMPrecond(model), batch.x, inputs, mask=batch.mask, sigma=d.sigma, noise=d.noise)

    loss(d.inputs).backward()
    grads = [p.grad for p in model.motion_embedder.parameters()]
    assert all(g is not None and g.abs().sum() > 0 for g in grads)  # the score reached the loss
    with torch.no_grad():
        assert loss(d.inputs) != loss(d.inputs.replace(motion=d.inputs.motion + 1))


def test_the_planner_probes_its_model_with_it(motion):
    cfg = cfg_of(text_dim=8)
    model = build(cfg)
    layout = Layout(tp=2, sequence_parallel=True, world_size=2, seq_length=64, text_len=8)
    plan = plan_from(cfg, layout)  # its probe forward raises if the score is missing (MotionDiT.condition)
    assert plan.params == sum(p.numel() for p in model.parameters())
    embedder = sum(m.weight.numel() for m in model.motion_embedder.mlp if hasattr(m, "weight"))
    plain = count_params(preset("DiT-Tiny", in_channels=4, num_classes=3, text_dim=8))
    ours = count_params(cfg)  # the embedder's weights are applied once per sample
    assert ours.per_sample_params - plain.per_sample_params == embedder
    assert ours.per_token_params == plain.per_token_params
    assert traffic(cfg, layout).bytes() == traffic(preset("DiT-Tiny", in_channels=4, num_classes=3, text_dim=8),
                                                   layout).bytes()  # replicated: it sends nothing more


def test_sampling_gives_each_sample_its_score_and_the_unconditional_rows_none(motion):
    cfg = preset(ARCH.tiny, in_channels=3, num_classes=3)  # the pixel codec's 3 channels
    model = randomized(cfg).eval()
    seen = []
    model.motion_embedder.register_forward_hook(lambda m, args, out: seen.append(args[0].flatten().tolist()))
    codec, stats = PixelCodec(1), LatentStats(torch.zeros(3), torch.ones(3))

    def latents(scores):
        return sample(model, codec, stats, class_labels=[0, 1], height=8, width=8, steps=2, guidance=2.0,
                      conditions={"motion": scores}).latents

    a, b = latents([0.5, 0.5]), latents([0.5, 3.0])
    assert seen[0] == [0.5, 0.5, NO_SCORE, NO_SCORE]  # guidance: the unconditional rows get the null score
    assert torch.equal(a[0], b[0]) and not torch.equal(a[1], b[1])
    default = sample(model, codec, stats, class_labels=[0], height=8, width=8, steps=1, guidance=1.0).latents
    assert seen[-1] == [NO_SCORE] and default.shape == a[:1].shape  # not asked for: its default (no score)
    with pytest.raises(ValueError, match="motion: 3 values for 2 samples"):
        latents([1.0, 2.0, 3.0])
