"""The export as someone else may hand it to us: damaged, edited, diverged, or written to a full disk. Each is one
message that names the file and what to do; nothing is allocated for weights that do not fit, and nothing
half-written is left to pass for an export."""

import errno
import json
import os
import resource

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ditcore import disk, export, tensorfile
from ditcore.codecs import PatchPCACodec
from ditcore.data.schema import DatasetInfo
from ditcore.data.writer import ShardWriter, start_dataset
from ditcore.export import CONFIG, WEIGHTS, export_model, load_export
from ditcore.models import DiT, preset


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    data = tmp_path_factory.mktemp("data")
    DatasetInfo(codec={"kind": "pixel", "factor": 4}, latent_stats={"mean": [0.0] * 48, "std": [0.5] * 48},
                text_encoder={"name": "null", "dim": 0}, latent_channels=48, spatial_factor=4, temporal_factor=1,
                num_classes=4).write(data)
    return data


@pytest.fixture(scope="module")
def model():
    return DiT(preset("DiT-Tiny", in_channels=48, num_classes=4, patch_size=2, max_grid=(1, 8, 8)))


@pytest.fixture
def exported(tmp_path, dataset, model):
    return export_model(tmp_path / "export", model.state_dict(), model.cfg, dataset)


def edit_config(path, **changes):
    meta = json.loads((path / CONFIG).read_text())
    meta["model"] |= changes
    (path / CONFIG).write_text(json.dumps(meta))


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@pytest.mark.parametrize("mask", [0o022, 0o027])
def test_every_file_of_a_dataset_and_an_export_has_the_mode_the_umask_says(tmp_path, model, mask):
    """Before: the export's weights and the PCA codec (safetensors' save_file, by way of a temporary file) were
    written 0600 whatever the umask, everything else 0644: another user or a serving container could not read them.
    (A whole dit-train run is checked under the test's umask in tests/apps/test_train.py.)"""
    before = os.umask(mask)
    try:
        data = tmp_path / "data"
        start_dataset(data, overwrite=False)
        with ShardWriter(data) as w:
            for i in range(2):
                w.write(f"{i:08d}", torch.randn(16, 1, 4, 4), torch.randn(3, 8), {"caption": "c"})
        codec = PatchPCACodec(torch.zeros(48), torch.eye(16, 48), torch.ones(16))  # 4x4 RGB patches, 16 components
        # ditcore.json as finish_dataset writes it, without Energon's index (a subprocess: seconds; the dit-train
        # run's check covers it)
        DatasetInfo(codec=codec.save(data), latent_stats={}, text_encoder={"name": "t", "dim": 8}, latent_channels=16,
                    spatial_factor=4, temporal_factor=1, counts={"samples": 2}).write(data)
        export_model(tmp_path / "run" / "export", model.state_dict(), model.cfg, data)
    finally:
        os.umask(before)
    modes = {p.relative_to(tmp_path).as_posix(): p.stat().st_mode & 0o777 for p in tmp_path.rglob("*")}
    assert {"data/codec_pca.safetensors", "data/ditcore.json", "data/rank0-000000.tar", "run/export/model.safetensors",
            "run/export/codec_pca.safetensors"} <= modes.keys()
    wrong = {name: oct(mode) for name, mode in modes.items()
             if mode != (0o777 if (tmp_path / name).is_dir() else 0o666) & ~mask}
    assert not wrong, wrong


def test_an_export_loads_with_the_weights_written(exported, model):
    loaded = load_export(exported).model.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())


def test_a_model_json_that_promises_a_huge_model_is_refused_before_anything_is_allocated(exported):
    """A width of 10^6 made dit-sample ask for ~4 TB before it compared the weights; a depth of 10^6 would build a
    million layers. Both are refused from the file's header, naming the first tensor and both shapes."""
    edit_config(exported, hidden_size=1_000_000, num_heads=10_000)
    before = peak_rss()
    with pytest.raises(ValueError) as caught:
        load_export(exported)
    assert str(caught.value) == (
        f"'{exported}' does not fit its {CONFIG}: x_embedder.weight is (64, 192) in {WEIGHTS}, the model it describes "
        f"needs (1000000, 192) — the files come from different models; {export.REDO}")
    assert peak_rss() - before < 64 * 2**20  # the real model's first layer alone would be 768 MB
    edit_config(exported, hidden_size=64, num_heads=4, depth=1_000_000)
    with pytest.raises(ValueError, match=r"says depth=1000000, but model.safetensors holds only \d+ tensors"):
        load_export(exported)


def test_other_layer_names_are_another_architecture(exported):
    edit_config(exported, depth=3)
    with pytest.raises(ValueError, match=r"holds weights of another architecture: missing \['blocks.2"):
        load_export(exported)


@pytest.mark.parametrize("keep", [0, 5, 100, 0.5])  # empty, no header length, a cut header, cut weights
def test_a_truncated_weights_file_is_named_as_damaged(exported, keep):
    data = (exported / WEIGHTS).read_bytes()
    (exported / WEIGHTS).write_bytes(data[:int(keep * len(data)) if isinstance(keep, float) else keep])
    with pytest.raises(ValueError, match=rf"^'{exported / WEIGHTS}' is truncated or damaged \(Error while "
                                         r"deserializing header: .*\) — export the run again"):
        load_export(exported)


def test_a_damaged_model_json_is_named(exported):
    (exported / CONFIG).write_text('{"model": {"hidden_size": 6')
    with pytest.raises(ValueError, match=rf"^'{exported / CONFIG}' is truncated or damaged"):
        load_export(exported)


def test_non_finite_weights_are_refused_with_their_count_and_a_name(exported):
    """A diverged export sampled an all-black picture and said nothing."""
    weights = load_file(exported / WEIGHTS)
    weights["blocks.0.attn.qkv.weight"][3, 4] = float("nan")
    weights["final.linear.bias"][0] = float("inf")
    save_file(weights, exported / WEIGHTS)
    with pytest.raises(ValueError) as caught:
        load_export(exported)
    assert str(caught.value).startswith(f"export '{exported}' holds non-finite weights in 2 tensors, e.g. "
                                        "blocks.0.attn.qkv.weight: the run diverged before it was exported — sample "
                                        "an earlier checkpoint")


def test_a_full_disk_during_the_export_keeps_the_old_one_and_leaves_no_partial_one(exported, dataset, model,
                                                                                    monkeypatch):
    """safetensors reports ENOSPC only in the text of its own exception; the writer half-wrote its file first."""
    def fills_the_disk(tensors, filename):
        with open(filename, "wb") as f:
            f.write(b"\0" * 1000)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(tensorfile, "save_file", fills_the_disk)  # what tensorfile.save calls
    changed = {k: v + 1 for k, v in model.state_dict().items()}
    with pytest.raises(disk.DiskFull) as caught:
        export_model(exported, changed, model.cfg, dataset)
    assert caught.value.errno == errno.ENOSPC
    assert str(caught.value).startswith(f"could not write the export {exported}: the disk is full (")
    assert f" free in {exported.parent}) — free some space there" in str(caught.value)
    assert sorted(p.name for p in exported.parent.iterdir()) == ["export"]  # no .export.tmp holding the space
    kept = load_export(exported).model.state_dict()  # the export written before, whole
    assert all(torch.equal(kept[k], v) for k, v in model.state_dict().items())


def test_an_export_that_cannot_fit_is_refused_before_writing(full_disk, dataset, model):
    out = full_disk / "export"
    with pytest.raises(disk.DiskFull, match=rf"^could not write the export {out}: the disk is full \(\d+ bytes free "
                                            rf"in {full_disk}, [\d.]+ KiB needed\)"):
        export_model(out, model.state_dict(), model.cfg, dataset)
    assert sorted(p.name for p in full_disk.iterdir()) == ["filler"]
