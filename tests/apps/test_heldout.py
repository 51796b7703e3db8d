"""dit_train.heldout: which held-out set a run scores, and the refusals a user sees (one line each)."""

from types import SimpleNamespace

import pytest
import torch

from dit_train.cli import find_config
from dit_train.config import load_config
from dit_train.heldout import HeldOutLoss, read_heldout
from ditcore.data.schema import DatasetError, DatasetInfo
from ditcore.data.writer import ShardWriter
from ditcore.errors import ConfigError
from ditcore.layout import patchify


def info(std: float = 0.5) -> DatasetInfo:
    return DatasetInfo(codec={"kind": "pixel", "factor": 2}, latent_stats={"mean": [0.0] * 12, "std": [std] * 12},
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
