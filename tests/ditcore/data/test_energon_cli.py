"""Energon's own CLI reads a ditcore dataset with no flags (dataset.yaml is the typed view); the loader reads
the crude config, and datasets written before that split still load, batch for batch the same."""

import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
import yaml
from megatron.energon import WorkerConfig, get_loader, get_val_dataset

from ditcore.data.loader import build_loader
from ditcore.data.schema import CRUDE_CONFIG, TYPED_CONFIG, DatasetInfo
from ditcore.data.writer import ShardWriter, finish_dataset, start_dataset

ENERGON = Path(sys.executable).parent / "energon"
N = 15


def written_samples() -> dict:
    """key → (latent [C, T, H, W], text [L, D], meta): images and 2-frame clips, text of varying length."""
    g = torch.Generator().manual_seed(0)
    samples = {}
    for i in range(N):
        T = 2 if i % 3 == 0 else 1
        meta = {"caption": f"c{i}", "fps": 8.0, "label": i % 4}
        samples[f"s{i:05d}"] = (torch.randn(4, T, 4, 4, generator=g), torch.randn(1 + i % 3, 8, generator=g), meta)
    return samples


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ds") / "data"
    start_dataset(root, overwrite=False)
    with ShardWriter(root, max_count=5) as w:
        for key, (latent, text, meta) in written_samples().items():
            w.write(key, latent, text, meta)
    finish_dataset(root, DatasetInfo(codec={"kind": "pixel", "factor": 1}, latent_stats={},
                                     text_encoder={"name": "test", "dim": 8}, latent_channels=4, spatial_factor=1,
                                     temporal_factor=1, counts={"samples": N}))
    return root


def energon(*args):
    return subprocess.run([str(ENERGON), *map(str, args)], capture_output=True, text=True)


@pytest.mark.slow  # test_loader's energon info/lint test stays in the default run
def test_energon_info_and_lint_need_no_flags(dataset):
    info = energon("info", dataset)
    assert info.returncode == 0, info.stderr[-2000:]
    assert f"({N} samples," in info.stdout and "in 3 shards)" in info.stdout
    assert f"`train`: 100%, {N} samples in 3 shards" in info.stdout
    assert "LatentSample <ditcore.data.loader.LatentSample>" in info.stdout
    lint = energon("lint", dataset)
    # Energon 7.4's lint exits 0 even when a sample fails to decode (it drops its own error handler) and only
    # logs the traceback, so the log is checked too.
    assert lint.returncode == 0 and "Traceback" not in lint.stderr, lint.stderr[-2000:]
    assert f"{N}/{N}" in lint.stderr  # its progress bar: every sample read


def test_typed_view_reads_back_exactly_what_was_written(dataset):
    ds = get_val_dataset(dataset, split_part="train", worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0),
                         batch_size=None)
    got = {s.__key__: s for s in get_loader(ds)}
    want = written_samples()
    assert got.keys() == want.keys()
    for key, (latent, text, meta) in want.items():
        # Energon has no safetensors decoder: the typed view hands over the members' bytes, which hold exactly the
        # written tensors in the stored dtypes (schema.py); its json member it decodes itself
        assert torch.equal(safetensors.torch.load(got[key].latent)["latent"], latent.to(torch.bfloat16))
        assert torch.equal(safetensors.torch.load(got[key].text)["text"], text.to(torch.float16))
        assert got[key].meta == meta


def test_loader_opens_the_crude_config_not_dataset_yaml(dataset, tmp_path):
    meta = dataset / ".nv-meta"
    assert yaml.safe_load((meta / CRUDE_CONFIG).read_text()) == {"__module__": "megatron.energon",
                                                                 "__class__": "CrudeWebdataset"}
    assert "sample_type" in yaml.safe_load((meta / TYPED_CONFIG).read_text())
    root = shutil.copytree(dataset, tmp_path / "data")
    (root / ".nv-meta" / TYPED_CONFIG).write_text("not: [a dataset config\n")  # unreadable: the loader must not open it
    assert batches(root) == batches(dataset)


def old_layout(root: Path) -> Path:
    """The layout dit-prepare wrote before: the crude config as dataset.yaml, the typed one as dataset-typed.yaml."""
    meta = root / ".nv-meta"
    (meta / TYPED_CONFIG).rename(meta / "dataset-typed.yaml")
    (meta / CRUDE_CONFIG).rename(meta / "dataset.yaml")
    return root


def test_dataset_from_before_the_typed_view_loads_the_same_batches(dataset, tmp_path, caplog):
    root = old_layout(shutil.copytree(dataset, tmp_path / "old"))
    with caplog.at_level(logging.WARNING, logger="ditcore.data.schema"):
        old = batches(root)
    assert old == batches(dataset)
    assert "prepared by an older ditcore: it loads as before" in caplog.text
    assert "--dataset-config dataset-typed.yaml" in caplog.text
    info = energon("info", root, "--dataset-config", "dataset-typed.yaml")  # what the warning tells the user
    assert info.returncode == 0 and f"({N} samples," in info.stdout, info.stderr[-2000:]


def batches(root: Path, n: int = 8) -> list:
    """The first n batches as plain values (tensors as bytes with dtype and shape): equal means bitwise equal."""
    it = iter(build_loader(root, patch_size=2, patch_size_t=1, seq_length=16, batch_size=2))
    return [{k: plain(v) for k, v in vars(next(it)).items()} for _ in range(n)]


def plain(v):
    if torch.is_tensor(v):
        return str(v.dtype), tuple(v.shape), v.contiguous().view(-1).view(torch.uint8).tolist() if v.numel() else []
    if isinstance(v, dict):  # the per-sample conditions
        return {k: plain(t) for k, t in v.items()}
    return v
