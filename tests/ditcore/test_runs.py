"""ditcore.runs: finding complete checkpoints and loading their EMA weights, consolidated and verified."""

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ditcore import durable, runs
from ditcore.models import DiT, preset


def write_checkpoint(run_dir, step, full: dict):
    """A checkpoint as dit-train writes it, from one process: DCP's files and the manifest."""
    ckpt = runs.step_dir(run_dir, step)
    state = {f"{runs.MODEL}.{k}": v for k, v in full.items()} | {f"{runs.EMA}.{k}": v * 2 for k, v in full.items()}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(ckpt), single_file_per_rank=True), no_dist=True)
    files = {name: durable.digest(ckpt / name) for name in ["__0_0.distcp", ".metadata"]}
    runs.write_manifest(ckpt, step, {"world_size": 1}, files)
    return ckpt


@pytest.fixture
def full():
    return DiT(preset("DiT-Tiny", text_dim=8)).state_dict()


def test_load_weights_reads_the_ema_or_the_model(tmp_path, full):
    ckpt = write_checkpoint(tmp_path, 3, full)  # pieces of other layouts: tests/ditcore/parallel/test_fabric_checkpoint
    ema = runs.load_weights(ckpt)
    assert ema.keys() == full.keys()
    assert all(torch.equal(ema[k], full[k] * 2) for k in full)
    assert all(torch.equal(v, full[k]) for k, v in runs.load_weights(ckpt, runs.MODEL).items())


def test_complete_checkpoints_are_found_oldest_first_and_unfinished_ones_ignored(tmp_path, full):
    for step in (10, 2):
        write_checkpoint(tmp_path, step, full)
    unfinished = runs.step_dir(tmp_path, 20)
    unfinished.mkdir()
    runs.tmp_dir(runs.step_dir(tmp_path, 30)).mkdir()
    assert [runs.step_of(p) for p in runs.complete_checkpoints(tmp_path)] == [2, 10]
    with pytest.raises(runs.CheckpointError, match="not a complete checkpoint"):
        runs.load_weights(unfinished)


def test_a_damaged_file_is_named_before_it_is_loaded(tmp_path, full):
    ckpt = write_checkpoint(tmp_path, 3, full)
    data = ckpt / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:100])  # truncated after the manifest was written
    with pytest.raises(runs.CheckpointError, match=r"damaged: .*__0_0.distcp"):
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


def test_a_lost_file_is_named(tmp_path, full):
    ckpt = write_checkpoint(tmp_path, 3, full)
    (ckpt / "__0_0.distcp").unlink()
    with pytest.raises(runs.CheckpointError, match=r"has lost __0_0.distcp"):
        runs.load_weights(ckpt)



def test_leftovers_are_removed_but_a_planted_link_is_not_followed(tmp_path):
    """A .tmp-step-* link planted in checkpoints/ goes itself; the folder it points to, outside the run, stays.
    Before: rmtree refused the link (silently), which stayed, and the next save failed with FileExistsError."""
    from ditcore import durable

    outside, folder = tmp_path / "outside", tmp_path / "checkpoints"
    outside.mkdir()
    (outside / "keep.txt").write_text("not ours")
    folder.mkdir()
    (folder / ".tmp-step-0000003").symlink_to(outside, target_is_directory=True)
    (folder / ".tmp-step-0000002").mkdir()  # an interrupted save's folder
    (folder / ".tmp-step-0000002" / "__0_0.distcp").write_bytes(b"partial")
    (folder / "step-0000001").mkdir()
    durable.remove_leftovers(folder, (".tmp-", durable.TRASH_PREFIX))
    assert [p.name for p in folder.iterdir()] == ["step-0000001"]
    assert (outside / "keep.txt").read_text() == "not ours"
