"""ditcore.runs: finding complete checkpoints and loading their EMA weights, consolidated and verified."""

import pytest
import torch

from ditcore import durable, runs
from ditcore.models import DiT, preset
from ditcore.parallel.plan import DIT_PLAN


def write_checkpoint(run_dir, step, full: dict, tp: int):
    """A checkpoint as dit-train writes it under TP=tp: each shard file holds its piece of the weights."""
    ckpt = runs.step_dir(run_dir, step)
    ckpt.mkdir(parents=True)
    files = {}
    for rank in range(tp):
        piece = {}
        for k, v in full.items():
            dim = DIT_PLAN.partition_dim(k)
            piece[k] = v if dim is None else v.chunk(tp, dim=dim)[rank].clone()
        name = runs.shard_file(rank)
        torch.save({runs.MODEL: piece, runs.EMA: {k: v * 2 for k, v in piece.items()}}, ckpt / name)
        files[name] = durable.digest(ckpt / name)
    runs.write_manifest(ckpt, step, tp, files)
    return ckpt


@pytest.fixture
def full():
    return DiT(preset("DiT-Tiny", text_dim=8)).state_dict()


@pytest.mark.parametrize("tp", [1, 2])
def test_load_weights_consolidates_the_ema_of_any_tp(tmp_path, full, tp):
    ckpt = write_checkpoint(tmp_path, 3, full, tp)
    ema = runs.load_weights(ckpt)
    assert ema.keys() == full.keys()
    assert all(torch.equal(ema[k], full[k] * 2) for k in full)
    assert all(torch.equal(v, full[k]) for k, v in runs.load_weights(ckpt, runs.MODEL).items())


def test_complete_checkpoints_are_found_oldest_first_and_unfinished_ones_ignored(tmp_path, full):
    for step in (10, 2):
        write_checkpoint(tmp_path, step, full, 1)
    unfinished = runs.step_dir(tmp_path, 20)
    unfinished.mkdir()
    runs.tmp_dir(runs.step_dir(tmp_path, 30)).mkdir()
    assert [runs.step_of(p) for p in runs.complete_checkpoints(tmp_path)] == [2, 10]
    with pytest.raises(runs.CheckpointError, match="not a complete checkpoint"):
        runs.load_weights(unfinished)


def test_a_damaged_shard_is_named_before_it_is_loaded(tmp_path, full):
    ckpt = write_checkpoint(tmp_path, 3, full, 2)
    shard = ckpt / runs.shard_file(1)
    shard.write_bytes(shard.read_bytes()[:100])  # truncated after the manifest was written
    with pytest.raises(runs.CheckpointError, match=rf"damaged: .*{runs.shard_file(1)}"):
        runs.load_weights(ckpt)


def test_find_export_takes_an_export_or_a_run_directory(tmp_path):
    export = runs.export_dir(tmp_path)
    export.mkdir()
    with pytest.raises(FileNotFoundError, match="neither an export"):
        runs.find_export(tmp_path)
    (export / "model.safetensors").write_bytes(b"")
    assert runs.find_export(tmp_path) == runs.find_export(export) == export
    with pytest.raises(FileNotFoundError, match="does not exist"):
        runs.find_export(tmp_path / "nope")


def test_a_lost_shard_is_named_not_consolidated_to_half_width(tmp_path, full):
    ckpt = write_checkpoint(tmp_path, 3, full, 2)
    (ckpt / runs.shard_file(1)).unlink()
    with pytest.raises(runs.CheckpointError, match=rf"has lost {runs.shard_file(1)}"):
        runs.load_weights(ckpt)

