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



def test_the_owner_alone_writes_the_files_dit_train_writes_and_every_reader_takes_them(tmp_path):
    """dit_train.checkpoint's save sequence, on one process and with no process group: ditcore.runs names, writes,
    seals and publishes every file. The names and keys are those of checkpoints already on disk (they must never
    change: old run dirs resume and sample), and sampling's, resume's and lineage's readers take them."""
    weights = {"blocks.0.w": torch.randn(4, 3), "final.b": torch.randn(3)}
    final = runs.begin_step(tmp_path, 7)
    tmp = runs.tmp_dir(final)
    moments = {"final.b.exp_avg": weights["final.b"] / 3}
    tensors = runs.checkpoint_tensors(weights, {k: 2 * v for k, v in weights.items()}, moments)
    runs.save_tensors(tmp, tensors, {"step": 7})
    rng = torch.get_rng_state()
    files = runs.seal(tmp, [*runs.files_of_rank(tmp, 0), runs.write_rng(tmp, 0)])
    files |= runs.seal(tmp, [runs.write_config(tmp, "train:\n  steps: 7\n")])
    after = runs.publish(tmp, final, 7, {"world_size": 1}, files, None)

    assert final.name == "step-0000007" and not tmp.exists()
    assert sorted(p.name for p in final.iterdir()) == [".metadata", "COMPLETE", "__0_0.distcp", "config.yaml",
                                                       "rng-00000.pt"]
    assert sorted(runs.read_manifest(final)["files"]) == [".metadata", "__0_0.distcp", "config.yaml", "rng-00000.pt"]
    assert sorted(runs.stored_shapes(final)) == ["ema.blocks.0.w", "ema.final.b", "model.blocks.0.w", "model.final.b",
                                                 "optim.final.b.exp_avg", "values"]
    assert all(torch.equal(v, 2 * weights[k]) for k, v in runs.load_weights(final).items())
    assert runs.read_values(final) == {"step": 7} and runs.read_config(final) == {"train": {"steps": 7}}
    torch.rand(5)
    runs.restore_rng(final, 0)
    assert torch.equal(torch.get_rng_state(), rng)
    assert runs.newest(tmp_path) == final and runs.lineage(final)["seq"] == 1
    assert after["run"] == runs.lineage(final)["run"] and after["parent"]["name"] == final.name

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



# ---------------------------------------------------------------- lineage: the newest checkpoint and its trajectory


def fake_checkpoint(run_dir, name: str, run: str | None = None, seq: int | None = None, parent=None):
    """A complete checkpoint folder as far as ordering goes: its manifest, with a lineage (seq given) or without one,
    as an older dit-train wrote it. parent: the folder it continued from."""
    ckpt = runs.step_dir(run_dir, 0).with_name(name)
    ckpt.mkdir(parents=True)
    lineage = {"run": run, "seq": seq, "parent": runs.parent_ref(parent) if parent else None} if seq else None
    runs.write_manifest(ckpt, runs.step_of(ckpt), {"world_size": 1}, {}, lineage)
    return ckpt


def names(paths):
    return [p.name for p in paths]


def test_the_newest_checkpoint_is_the_last_written_and_its_trajectory_is_its_ancestors(tmp_path):
    """Run A wrote steps 5, 10, 20; then a run resumed from A's step 10 (a branch) wrote 15 and another 20. Step numbers
    would pick A's step 20 and rotate the branch away; the lineage picks the branch's newest and its ancestors."""
    a5 = fake_checkpoint(tmp_path, "step-0000005", "A", 1)
    a10 = fake_checkpoint(tmp_path, "step-0000010", "A", 2, a5)
    a20 = fake_checkpoint(tmp_path, "step-0000020", "A", 3, a10)
    b15 = fake_checkpoint(tmp_path, "step-0000015", "A", 4, a10)
    assert runs.free_step_dir(tmp_path, 20).name == "step-0000020-2"  # A's step 20 is never replaced
    assert runs.free_step_dir(tmp_path, 25) == runs.step_dir(tmp_path, 25)
    fake_checkpoint(tmp_path, "step-0000020-2", "A", runs.next_seq(tmp_path), b15)
    assert runs.step_of(runs.newest(tmp_path)) == 20 and runs.lineage(runs.newest(tmp_path))["seq"] == 5
    assert names(runs.by_write_order(tmp_path)) == ["step-0000005", "step-0000010", "step-0000020", "step-0000015",
                                                    "step-0000020-2"]
    assert names(runs.complete_checkpoints(tmp_path)) == ["step-0000005", "step-0000010", "step-0000015",
                                                          "step-0000020", "step-0000020-2"]
    assert names(runs.trajectory(tmp_path, runs.newest(tmp_path))) == ["step-0000020-2", "step-0000015",
                                                                       "step-0000010", "step-0000005"]
    assert names(runs.trajectory(tmp_path, a20)) == ["step-0000020", "step-0000010", "step-0000005"]


def test_checkpoints_of_an_older_dit_train_are_one_trajectory_in_step_order(tmp_path):
    for step in (3, 6, 9):
        fake_checkpoint(tmp_path, f"step-{step:07d}")
    assert names(runs.trajectory(tmp_path, runs.newest(tmp_path))) == ["step-0000009", "step-0000006", "step-0000003"]
    # a run resumed from the older dit-train's step 6: written after all of them, continuing 6 and 3
    fake_checkpoint(tmp_path, "step-0000008", "B", runs.next_seq(tmp_path), runs.step_dir(tmp_path, 6))
    assert names(runs.by_write_order(tmp_path))[-1] == "step-0000008"
    assert names(runs.trajectory(tmp_path, runs.newest(tmp_path))) == ["step-0000008", "step-0000006", "step-0000003"]


def test_a_parent_of_the_same_name_but_another_identity_ends_the_trajectory(tmp_path):
    """A checkpoint resumed from another run dir's step 10 does not continue this folder's step 10."""
    mine = fake_checkpoint(tmp_path, "step-0000010", "A", 1)
    elsewhere = fake_checkpoint(tmp_path / "other", "step-0000010", "C", 7)
    child = fake_checkpoint(tmp_path, "step-0000012", "C", 2, elsewhere)
    assert runs.trajectory(tmp_path, child) == [child]
    assert runs.trajectory(tmp_path, mine) == [mine]


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
