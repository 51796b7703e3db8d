"""The loader on a blend (ditcore.data.blend): draws by the weights, each sample's dataset known, its latents in the
blend's units, its dataset's CFG dropout rate, and exact resume, also when the blend grows."""
import math
from collections import Counter
from pathlib import Path

import pytest
import torch

from ditcore.data.blend import parse_spec, write_blend
from ditcore.data.loader import build_loader, next_batch
from ditcore.data.packing import PackedBatch
from ditcore.data.schema import DatasetInfo
from ditcore.data.writer import ShardWriter, finish_dataset, start_dataset
from ditcore.layout import SIGMA_DATA, patchify
from ditcore.models import DiTConfig
from ditcore.testing import fp32_tolerance
from ditcore.training import drop_conditions

C, SEQ, BATCH = 4, 32, 8


def stats(shift: float, scale: float) -> dict:
    return {"mean": [shift + 0.1 * c for c in range(C)], "std": [scale + 0.05 * c for c in range(C)]}


def write(root: Path, n: int, frames: int, latent_stats: dict, seed: int) -> Path:
    """n samples of 4x4 latents with `frames` frames (4 tokens a frame at patch 2), keys s00000...; the raw latents
    r are kept normalised by `latent_stats`, (r − mean)/std·σ_d, as dit-prepare stores them."""
    start_dataset(root, overwrite=False)
    g = torch.Generator().manual_seed(seed)
    with ShardWriter(root, max_count=25) as w:
        for i in range(n):
            w.write(f"s{i:05d}", torch.randn(C, frames, 4, 4, generator=g), torch.randn(1 + i % 3, 8, generator=g),
                    {"caption": f"c{i}", "fps": 8.0})
    finish_dataset(root, DatasetInfo(codec={"kind": "pixel", "factor": 1}, latent_stats=latent_stats,
                                     text_encoder={"name": "test", "dim": 8}, latent_channels=C, spatial_factor=1,
                                     temporal_factor=1, counts={"samples": n}))
    return root


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("blend")
    write(root / "images", 50, 1, stats(0.0, 1.0), 0)
    write(root / "clips", 50, 2, stats(0.5, 2.0), 1)  # other statistics: mapped into the images' units
    write(root / "more", 30, 1, stats(0.0, 1.0), 2)
    write_blend(root / "blend", [parse_spec(f"{root / 'images'}:0.7"),
                                 parse_spec(f"{root / 'clips'}:0.3:cfg_drop=1")])
    return root


def loader(root, **kw):
    return build_loader(root, **{"patch_size": 2, "patch_size_t": 1, "seq_length": SEQ, "batch_size": BATCH, **kw})


def draws(it, ld, n: int) -> list[PackedBatch]:
    batches, seen = [], 0
    while seen < n:
        batches.append(next_batch(it, ld))
        seen += int(batches[-1].num_samples.sum())
    return batches


def test_samples_are_drawn_by_the_weights(data):
    ld = loader(data / "blend")
    counts = Counter()
    for b in draws(iter(ld), ld, 2000):
        counts.update(s for row in b.sources for s in row)
    n = counts.total()
    for name, weight in (("images", 0.7), ("clips", 0.3)):
        sd = math.sqrt(n * weight * (1 - weight))  # binomial: each sample's dataset drawn alone
        assert abs(counts[name] - n * weight) < 3 * sd, (counts, n)
    assert set(counts) == {"images", "clips"}


def test_each_sample_carries_its_dataset_and_its_datasets_cfg_drop(data):
    ld = loader(data / "blend")
    b = next_batch(iter(ld), ld)
    for r, row in enumerate(b.sources):
        for s, source in enumerate(row):
            frames = b.grids[r][s][0]
            assert source == ("clips" if frames == 2 else "images")
            rate = float(b.drop_rate[r, s])
            assert rate == 1.0 if source == "clips" else math.isnan(rate)
        assert all(math.isnan(v) for v in b.drop_rate[r, len(row):].tolist())  # empty slots: the run's rate
    # rate 1: each of its samples trained unconditioned; the others by the run's rate (0 here): never
    cfg = DiTConfig(hidden_size=64, depth=2, num_heads=2, text_dim=8)
    dropped = drop_conditions(b, 0.0, cfg, torch.Generator().manual_seed(0))
    text_left = {(r, s): bool((dropped.text_seg[r] == s).any()) for r, row in enumerate(b.sources)
                 for s in range(len(row)) if (b.text_seg[r] == s).any()}
    assert text_left and all(kept == (b.sources[r][s] == "images") for (r, s), kept in text_left.items())


def test_a_datasets_latents_reach_the_model_in_the_blends_units(data):
    """A clip stored with its own statistics (mean' + 0.5, std' × 2) comes out as the same raw latent normalised with
    the blend's (the images'): x' = x·std/std' + (mean − mean')/std'·σ_d per channel."""
    from ditcore.data.schema import read_sample, shard_samples

    stored = {}
    for shard in sorted((data / "clips").glob("*.tar")):
        for sample in shard_samples(shard):
            stored[sample["__key__"]] = read_sample(sample)[0].double()
    mine, blend = stats(0.5, 2.0), stats(0.0, 1.0)
    ld = loader(data / "blend")
    b = next_batch(iter(ld), ld)
    checked = 0
    for r, row in enumerate(b.keys):
        start = 0
        for s, key in enumerate(row):
            t, h, w = b.grids[r][s]
            tokens = b.x[r, start:start + t * h * w]
            start += t * h * w
            if b.sources[r][s] != "clips":
                continue
            x = stored[key]
            scale = torch.tensor(mine["std"], dtype=torch.double) / torch.tensor(blend["std"], dtype=torch.double)
            shift = (torch.tensor(mine["mean"]) - torch.tensor(blend["mean"])).double() / torch.tensor(
                blend["std"], dtype=torch.double) * SIGMA_DATA
            expected = patchify((x * scale[:, None, None, None] + shift[:, None, None, None])[None].float(), 2, 1)[0]
            tol = fp32_tolerance(2, float(expected.abs().max()))  # one multiply and one add in float32
            assert (tokens - expected).abs().max() <= tol, key
            checked += 1
    assert checked


@pytest.mark.parametrize("workers", [0, 2])
def test_a_blend_resumes_exactly_and_keeps_each_position_when_it_grows(data, tmp_path, workers):
    a = loader(data / "blend", num_workers=workers)
    it = iter(a)
    draws(it, a, 100)
    state = a.save_state_rank()
    expected = [next_batch(it, a).keys for _ in range(4)]
    b = loader(data / "blend", num_workers=workers)
    b.restore_state_rank(state)
    it_b = iter(b)
    assert [next_batch(it_b, b).keys for _ in range(4)] == expected
    # the blend rewritten with a third dataset first and other weights: the checkpoint's datasets keep their places
    grown = tmp_path / "grown"
    write_blend(grown, [parse_spec(f"{data / 'more'}:0.5"), parse_spec(f"{data / 'clips'}:0.25:cfg_drop=1"),
                        parse_spec(f"{data / 'images'}:0.25")])
    c = loader(grown, num_workers=workers, first=("images", "clips"))
    assert [m.name for m in c.blend] == ["images", "clips", "more"]
    c.restore_state_rank(state)
    it_c = iter(c)
    counts = Counter()
    for batch in draws(it_c, c, 300):
        counts.update(s for row in batch.sources for s in row)
    assert counts["more"] > 0 and counts["images"] > 0 and counts["clips"] > 0
    # a dataset dropped from the blend cannot restore the state (dit-train refuses it before: dit_train.checkpoint)
    fewer = loader(data / "images", num_workers=workers)
    with pytest.raises(Exception):  # noqa: B017 (Energon's own assertion on a tree of another shape)
        fewer.restore_state_rank(state)
        next(iter(fewer))


def test_a_checkpoints_blend_against_the_blend_now(data):
    """What a resume does with the loader's saved position (ditcore.data.loader.compare_fingerprints, blend_note):
    kept, with one note, for changed weights and added datasets; a dataset gone is refused; a dataset prepared again
    or another order means a fresh pass, naming the dataset."""
    from ditcore.data.loader import blend_note, compare_fingerprints, dataset_fingerprint

    fp = {name: dataset_fingerprint(data / name, {}) for name in ("images", "clips", "more")}
    blend = lambda *members: {"blend": [{"name": n, "weight": w, "data": fp[n]} for n, w in members]}
    saved, root = blend(("images", 0.7), ("clips", 0.3)), data / "blend"
    assert compare_fingerprints(saved, saved, root) == (None, None) and blend_note(saved, saved) is None
    grown = blend(("images", 0.25), ("clips", 0.25), ("more", 0.5))
    assert compare_fingerprints(saved, grown, root) == (None, None)
    assert blend_note(saved, grown).startswith("note: the blend changed since the checkpoint: dataset more added; "
                                               "weights changed (images 0.7 → 0.25, clips 0.3 → 0.25) — every dataset")
    refusal, _ = compare_fingerprints(saved, blend(("images", 0.5), ("more", 0.5)), root)
    assert refusal.startswith("dataset 'clips', which the checkpoint's loader read, is not in blend")
    _, fresh = compare_fingerprints(saved, blend(("clips", 0.3), ("images", 0.7)), root)
    assert fresh == f"the datasets of blend '{root}' are in another order than the checkpoint's"
    again = {"blend": [saved["blend"][0], {**saved["blend"][1], "data": {**fp["clips"], "digest": "prepared again"}}]}
    _, fresh = compare_fingerprints(saved, again, root)
    assert fresh.startswith(f"dataset 'clips' of blend '{root}' is not the one the checkpoint was trained on")
    _, fresh = compare_fingerprints(fp["images"], saved, root)
    assert fresh == f"data.path '{root}' is a blend, the checkpoint's loader read a dataset"
