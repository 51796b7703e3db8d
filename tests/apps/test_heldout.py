"""dit_train.heldout: which held-out sets a run scores (its own, or each of a blend's datasets'), their losses, and
the refusals a user sees (one line each)."""

import contextlib
from types import SimpleNamespace

import pytest
import torch

from dit_train.cli import find_config
from dit_train.config import load_config
from dit_train.heldout import HeldOutLoss, read_heldout
from dit_train.plots import plot_heldout
from dit_train.recipe import resolve
from ditcore.data.blend import write_blend
from ditcore.data.schema import HELDOUT_DIR, DatasetError, DatasetInfo, read_info
from ditcore.data.writer import ShardWriter
from ditcore.errors import ConfigError
from ditcore.eval.heldout import bucket_weights, sigma_buckets
from ditcore.layout import patchify
from ditcore.models import DiT


def info(std: float = 0.5, mean=0.0) -> DatasetInfo:
    means = mean if isinstance(mean, list) else [mean] * 12
    return DatasetInfo(codec={"kind": "pixel", "factor": 2}, latent_stats={"mean": means, "std": [std] * 12},
                       text_encoder={"name": "null", "dim": 0}, latent_channels=12, spatial_factor=2,
                       temporal_factor=1)


def dataset(root, std: float = 0.5):
    (root / ".nv-meta").mkdir(parents=True)
    info(std).write(root)
    return root


def setup_of(tmp_path, *overrides):
    """What HeldOutLoss.build reads of dit_train.train.Setup, with what it prints."""
    printed = []
    cfg = load_config(find_config("demo"), [f"data.path={tmp_path / 'data'}", *overrides])
    run = SimpleNamespace(cfg=cfg, info=info(), fabric=SimpleNamespace(print=printed.append),
                          groups=SimpleNamespace(dp_rank=0, dims=SimpleNamespace(dp=1)))
    return run, printed


def test_without_a_heldout_set_the_default_is_one_note_and_a_named_one_is_an_error(tmp_path):
    run, printed = setup_of(tmp_path)
    assert HeldOutLoss.build(run) is None
    assert printed == [f"note: no held-out set at {tmp_path / 'data' / 'val'} (dit-prepare --val-samples N writes one; "
                       "or set data.val_path): no held-out loss"]
    run, printed = setup_of(tmp_path, "validation.heldout.samples=0")
    assert HeldOutLoss.build(run) is None and printed == []  # asked for none: nothing to say
    run, _ = setup_of(tmp_path, f"data.val_path={tmp_path / 'nope'}")
    with pytest.raises(ConfigError, match=r"^data.val_path='.*nope' is invalid: expected a held-out dataset written "
                                          r"by dit-prepare \(dataset path '.*nope' does not exist"):
        HeldOutLoss.build(run)


def test_a_heldout_set_in_other_latent_units_is_refused(tmp_path):
    run, _ = setup_of(tmp_path, f"data.val_path={dataset(tmp_path / 'other', std=0.7)}")
    with pytest.raises(ConfigError, match="expected a held-out set with the training set's latent_stats"):
        HeldOutLoss.build(run)


def test_the_heldout_samples_are_the_first_by_key_whatever_shard_holds_them(tmp_path):
    """Written by two ranks in any order, over several shards: the first n keys, and only their members are read."""
    g = torch.Generator().manual_seed(0)
    latents = {f"{i:08d}": torch.randn(4, 1 + i % 2, 4, 4, generator=g).bfloat16() for i in range(9)}
    for rank, keys in enumerate([["00000007", "00000002", "00000005", "00000000"],
                                 ["00000008", "00000003", "00000001", "00000006", "00000004"]]):
        with ShardWriter(tmp_path, rank=rank, max_count=2) as writer:
            for key in keys:
                writer.write(key, latents[key], torch.zeros(2, 3), {"caption": key, "label": int(key) % 3})
    samples = read_heldout(tmp_path, 4, patch_size=2, patch_size_t=1, seq_length=8)
    assert [s.key for s in samples] == ["00000000", "00000001", "00000002", "00000003"]
    for s in samples:
        assert torch.equal(s.tokens, patchify(latents[s.key][None].float(), 2, 1)[0])
        assert s.meta["label"] == int(s.key) % 3
    with pytest.raises(DatasetError, match=r"held-out sample 00000001 of .* \(latent 2x4x4\) does not fit patch "
                                           r"1x2x2 and data.seq_length=4"):
        read_heldout(tmp_path, 4, patch_size=2, patch_size_t=1, seq_length=4)


# A blend's held-out sets. Latents are multiples of 1/32 that bf16 holds exactly, so a dataset's latents stored in
# other units (mean M, std 1: x = (r - M)/2) map back to the blend's (mean 0, std 0.5: x = r) without rounding.
M = [(c % 4) / 4 for c in range(12)]
SIGMAS, LEVELS = ("validation.heldout.buckets=4", "validation.heldout.samples=5"), 4
levels = [f"sigma_{k:02d}={s:.3g}" for k, s in enumerate(sigma_buckets(LEVELS, 0.002, 80).tolist())]


def raw_latents(n: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"{i:08d}": torch.randint(-32, 33, (12, 1, 4, 4), generator=g) / 16 for i in range(n)}


def member(root, latents: dict, other_units: bool = False):
    """A dataset (no training shards: the held-out loss reads none) with `latents` as its held-out split (none: no
    split), stored in the blend's units or in other ones."""
    stats = info(std=1.0, mean=M) if other_units else info()
    (root / ".nv-meta").mkdir(parents=True)
    (root / ".nv-meta" / "dataset_crude.yaml").touch()  # what a blend's loader would open
    stats.write(root)
    if latents:
        (root / HELDOUT_DIR / ".nv-meta").mkdir(parents=True)
        with ShardWriter(root / HELDOUT_DIR) as writer:
            for key, r in latents.items():
                x = (r - torch.tensor(M)[:, None, None, None]) / 2 if other_units else r
                writer.write(key, x.bfloat16(), torch.zeros(0, 0), {"caption": ""})
        stats.write(root / HELDOUT_DIR)
    return root


def blend(tmp_path, *datasets, name="blend"):
    write_blend(tmp_path / name, [(d, 1.0, {}, d.name) for d in datasets])
    return tmp_path / name


def run_of(data, *overrides):
    """What HeldOutLoss.build and run_on read of dit_train.train.Setup, for DiT-Tiny on `data`."""
    printed = []
    cfg = load_config(find_config("demo"), [f"data.path={data}", "model.preset=DiT-Tiny", "model.patch_size=2",
                                            *SIGMAS, *overrides])
    recipe = resolve(cfg, read_info(data))
    run = SimpleNamespace(cfg=recipe.cfg, info=read_info(data), recipe=recipe, model_cfg=recipe.model_cfg,
                          on_gpu=False, fabric=SimpleNamespace(print=printed.append, device="cpu",
                                                               autocast=contextlib.nullcontext),
                          groups=SimpleNamespace(dp_rank=0, dims=SimpleNamespace(dp=1, ep=1, pp=1), dp_group=None))
    return run, printed


def models(run) -> dict[str, torch.nn.Module]:
    """Two DiTs that denoise (their zero-initialised outputs perturbed), the same at every call: the EMA and the raw
    weights."""
    out = {}
    for seed, which in enumerate(("ema", "raw")):
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model = DiT(run.model_cfg).eval()
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
        out[which] = model
    return out


def per_level(values: dict, prefix: str) -> torch.Tensor:
    return torch.tensor([values[f"{prefix}/{level}"] for level in levels], dtype=torch.float64)


def close(actual, expected) -> None:
    """Equal but for float32 rounding (the sums are float64: far closer)."""
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float64), expected,
                               rtol=4 * torch.finfo(torch.float32).eps, atol=0)


def scored(data, *overrides) -> tuple[dict, list]:
    run, printed = run_of(data, *overrides)
    heldout = HeldOutLoss.build(run)
    state = {}
    values = heldout.run_on(models(run), 7, state)
    assert state == {"heldout": [[7, values]]}
    return values, printed


def test_each_dataset_of_a_blend_is_scored_as_alone_and_all_together_by_their_samples(tmp_path):
    a = member(tmp_path / "a", raw_latents(6, 0))  # 5 of its 6 held-out samples scored (validation.heldout.samples)
    b = member(tmp_path / "b", raw_latents(2, 1))
    values, printed = scored(blend(tmp_path, a, b))
    assert printed == [f"held-out loss: 5 samples of dataset a, 2 samples of dataset b at {LEVELS} noise levels "
                       "(0.002 to 80), EMA and raw weights"]
    assert list(values) == [f"heldout/{name}{which}/{level}" for name in ("", "a/", "b/") for which in ("ema", "raw")
                            for level in ("total", *levels)]
    for name, data in (("a", a), ("b", b)):  # the same samples, noise and batches as a run on that dataset alone
        assert {k: v for k, v in values.items() if k.startswith(f"heldout/{name}/")} == {
            k.replace("heldout/", f"heldout/{name}/"): v for k, v in scored(data)[0].items()}
    for which in ("ema", "raw"):
        # every sample has 4 tokens: all held-out samples together weigh each dataset by its samples, 5 to 2
        together = per_level(values, f"heldout/{which}")
        close(together, (5 * per_level(values, f"heldout/a/{which}") + 2 * per_level(values, f"heldout/b/{which}")) / 7)
        close(values[f"heldout/{which}/total"], (together * bucket_weights(sigma_buckets(LEVELS), -0.6, 1.4)).sum())
    plot_heldout([[7, values], [9, values]], tmp_path / "heldout.png")  # the curve of all held-out samples
    assert (tmp_path / "heldout.png").stat().st_size > 0


def test_a_dataset_in_other_latent_units_is_scored_in_the_blends(tmp_path):
    """Its samples mapped as read: the same losses as its latents prepared in the blend's units."""
    a = member(tmp_path / "a", raw_latents(3, 0))
    b = member(tmp_path / "b", raw_latents(3, 1), other_units=True)
    values, _ = scored(blend(tmp_path, a, b))
    same = scored(member(tmp_path / "same", raw_latents(3, 1)))[0]
    assert {k: v for k, v in values.items() if k.startswith("heldout/b/")} == {
        k.replace("heldout/", "heldout/b/"): v for k, v in same.items()}
    unmapped = scored(b)[0]  # b alone, in its own units: other inputs, other losses
    assert unmapped["heldout/ema/total"] != same["heldout/ema/total"]


def test_a_blends_datasets_without_heldout_sets_are_named_once_and_none_is_the_note(tmp_path):
    a = member(tmp_path / "a", raw_latents(2, 0))
    b, c = member(tmp_path / "b", {}), member(tmp_path / "c", {})
    values, printed = scored(blend(tmp_path, a, b, c))
    assert printed[0] == f"note: datasets b, c of blend {tmp_path / 'blend'} have no held-out set (dit-prepare " \
                         "--val-samples N writes one): not scored"
    assert {k.split("/")[1] for k in values} == {"ema", "raw", "a"}
    run, printed = run_of(blend(tmp_path, b, c, name="none"))
    assert HeldOutLoss.build(run) is None
    assert printed == [f"note: no dataset of blend {tmp_path / 'none'} has a held-out set (dit-prepare --val-samples "
                       "N writes one; or set data.val_path): no held-out loss"]


def test_a_blends_heldout_set_is_checked_against_its_own_dataset(tmp_path):
    a = member(tmp_path / "a", raw_latents(2, 0))
    b = member(tmp_path / "b", raw_latents(2, 1), other_units=True)
    info().write(b / HELDOUT_DIR)  # the blend's units, where b's training samples have others
    run, _ = run_of(blend(tmp_path, a, b))
    with pytest.raises(ConfigError, match=r"^data.path='.*b/val' is invalid: expected a held-out set with the "
                                          r"training set's latent_stats \(this one differs\)"):
        HeldOutLoss.build(run)
