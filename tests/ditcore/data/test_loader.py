import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ditcore.data.loader import LATENT_BOUND, LOGGED_PER_REASON, build_loader, next_batch
from ditcore.data.schema import DatasetError, DatasetInfo, read_info
from ditcore.data.writer import TYPED_CONFIG, ShardWriter, finish_dataset, start_dataset

N_SAMPLES, NAN_KEY, HUGE_KEY, SEQ = 60, "s00005", "s00007", 32


def write_dataset(root: Path, bad=lambda i: None) -> Path:
    """60 samples: images (T=1) of 4x4 / 8x4 latents and 2-frame 8x8 clips (32 tokens), text of varying length.
    One latent holds a NaN, one a finite but absurd value (1e38); bad(i): another such value for sample i, or None."""
    start_dataset(root, overwrite=False)
    g = torch.Generator().manual_seed(0)
    with ShardWriter(root, max_count=20) as w:
        for i in range(N_SAMPLES):
            T, (H, W) = (2, (8, 8)) if i % 3 == 0 else (1, [(4, 4), (8, 4)][i % 2])
            latent = torch.randn(4, T, H, W, generator=g)
            value = {NAN_KEY: float("nan"), HUGE_KEY: 1e38}.get(f"s{i:05d}", bad(i))
            if value is not None:
                latent[0, 0, 0, 0] = value
            w.write(f"s{i:05d}", latent, torch.randn(2 + i % 5, 8, generator=g), {"caption": f"c{i}", "fps": 8.0})
    finish_dataset(root, DatasetInfo(codec={"kind": "pixel", "factor": 1}, latent_stats={},
                                     text_encoder={"name": "test", "dim": 8}, latent_channels=4, spatial_factor=1,
                                     temporal_factor=1, counts={"samples": N_SAMPLES}))
    return root


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("ds") / "data")


def loader(root, **kw):
    kw = {"patch_size": 2, "patch_size_t": 1, "seq_length": SEQ, "batch_size": 3, **kw}
    return build_loader(root, **kw)


def energon(*args):
    """Energon's command line (`energon ARGS`) in this process: ~4 s of imports less a call."""
    from click.testing import CliRunner
    from megatron.energon.cli.main import main

    return CliRunner().invoke(main, [str(a) for a in args])


def test_energon_info_and_lint_accept_the_dataset(dataset):
    info = energon("info", dataset, "--dataset-config", TYPED_CONFIG)
    assert info.exit_code == 0 and f"{N_SAMPLES} samples in 3 shards" in info.stdout, info.output[-2000:]
    lint = energon("lint", dataset, "--dataset-config", TYPED_CONFIG)
    assert lint.exit_code == 0, (lint.output[-2000:], lint.exception)
    assert read_info(dataset).counts == {"samples": N_SAMPLES, "shards": 3}


def test_batches_are_packed_within_seq_length_and_cover_the_data(dataset):
    it = iter(loader(dataset))
    seen = set()
    for _ in range(60):
        b = next(it)
        assert b.x.shape == (3, SEQ, 16) and b.seg.shape == (3, SEQ)
        for r in range(3):
            lengths = [int((b.seg[r] == s).sum()) for s in range(int(b.num_samples[r]))]
            assert sum(lengths) <= SEQ
            assert lengths == [t * h * w for t, h, w in b.grids[r]]  # each sample keeps all its tokens
        seen |= {k for row in b.keys for k in row}
    assert seen == {f"s{i:05d}" for i in range(N_SAMPLES)} - {NAN_KEY, HUGE_KEY}
    assert (b.num_samples > 1).any()  # rows really hold several samples


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_resumes_exactly(dataset, workers):
    a = loader(dataset, num_workers=workers)
    it = iter(a)
    for _ in range(4):
        next(it)
    state = a.save_state_rank()
    expected = [next(it) for _ in range(6)]
    b = loader(dataset, num_workers=workers)
    b.restore_state_rank(state)  # before iterating
    it_b = iter(b)
    for want in expected:
        got = next(it_b)
        assert got.keys == want.keys
        assert torch.equal(got.x, want.x) and torch.equal(got.seg, want.seg) and torch.equal(got.text, want.text)


def test_workers_start_whatever_garbage_the_trainer_holds(dataset):
    """A process group dropped in a reference cycle (an earlier run, test or fabric in the process) is garbage
    that a forked worker would collect, joining gloo threads that exist only in the trainer: it aborted."""
    import gc

    import torch.distributed as dist

    class Cycle:
        pass

    store = dist.TCPStore("127.0.0.1", 0, 1, True)
    garbage = Cycle()
    garbage.self, garbage.store, garbage.group = garbage, store, dist.ProcessGroupGloo(store, 0, 1)
    garbage.group.allreduce([torch.ones(2)]).wait()  # its threads have run
    del garbage, store
    gc.disable()  # the cycle stays until the workers fork, as it may in a trainer
    try:
        batches = [next(it) for it in [iter(loader(dataset, num_workers=2))] for _ in range(2)]
    finally:
        gc.enable()
    assert all(b.x.shape == (3, SEQ, 16) for b in batches)


def test_data_parallel_ranks_get_disjoint_samples(dataset):
    keys = []
    for rank in (0, 1):
        it = iter(loader(dataset, dp_rank=rank, dp_size=2, shuffle_buffer_size=1))
        keys.append({k for _ in range(3) for row in next(it).keys for k in row})
    assert keys[0] and keys[1] and not keys[0] & keys[1]


def skipped_in(ld, batches=40):
    it, total = iter(ld), dict(ld.skipped_at_start)
    for _ in range(batches):
        for reason, n in next(it).skipped.items():
            total[reason] = total.get(reason, 0) + n
    return total


def test_nan_and_absurd_latents_are_skipped_and_counted(dataset):
    """A finite 1e38 would make the loss overflow, and the divergence be blamed on the learning rate."""
    counts = skipped_in(loader(dataset))
    assert counts.get("non_finite_latent", 0) >= 1 and counts.get("latent_out_of_range", 0) >= 1


@pytest.fixture(scope="module")
def unusable(tmp_path_factory) -> Path:
    """Every latent NaN, or finite beyond LATENT_BOUND."""
    return write_dataset(tmp_path_factory.mktemp("ds") / "unusable",
                         bad=lambda i: float("inf") if i % 2 else 2 * LATENT_BOUND)


@pytest.mark.parametrize("workers", [0, 1])
def test_a_dataset_with_no_usable_sample_stops_after_a_bounded_run_of_skips(unusable, workers, caplog):
    """Before: the loader skipped forever (no step, a log line per sample, deaf to SIGTERM). Now a run of
    max_skipped_in_a_row skips ends in one DatasetError naming the reasons (from a worker process too), and at
    most LOGGED_PER_REASON lines per reason are logged."""
    data = loader(unusable, num_workers=workers, max_skipped_in_a_row=50)
    it = iter(data)
    with pytest.raises(DatasetError) as e:
        next_batch(it, data)
    message = str(e.value)
    assert message.startswith(f"no usable sample in the last 50 samples of dataset '{unusable}' (")
    assert "\n" not in message
    assert "non finite latent" in message and "latent out of range" in message and "max_skipped_in_a_row" in message
    assert len([r for r in caplog.records if r.getMessage().startswith("skipping sample")]) <= 2 * LOGGED_PER_REASON


LOGGED_ONCE = """
import json, logging, sys
from ditcore.data.loader import build_loader, next_batch
logging.basicConfig(level=logging.WARNING, format="%(message)s")
data = build_loader(sys.argv[1], patch_size=2, patch_size_t=1, seq_length=int(sys.argv[3]), batch_size=3,
                    num_workers=2)
it, arrived = iter(data), 0
for _ in range(60):  # 60 samples, 3 to 12 per batch: every sample comes round in several epochs
    arrived += sum(key == sys.argv[2] for key, _, _ in next_batch(it, data).skipped_samples)
print(json.dumps({"arrived": arrived}))
"""


def test_a_bad_sample_is_logged_once_across_workers_and_epochs(dataset):
    """Before: each loader worker logged the samples it skipped, again in every epoch (3157 lines in a 300-step run).
    Now the batches carry their skips to this process, which names each (key, reason) once and then only counts.
    Energon's "Filling reading buffer" bars (every worker, every epoch) are gone too (ditcore.quiet). In a process
    of its own, as dit-train's: workers forked from this test process, after other tests left their threads in it,
    once crashed (a segfault in a forked worker)."""
    proc = subprocess.run([sys.executable, "-c", LOGGED_ONCE, str(dataset), NAN_KEY, str(SEQ)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    arrived = json.loads(proc.stdout.splitlines()[-1])["arrived"]
    lines = [line for line in proc.stderr.splitlines() if NAN_KEY in line]
    assert arrived >= 3, arrived  # skipped in several epochs (and by both workers)
    assert lines == [f"skipping sample {NAN_KEY}: non finite latent"], lines
    assert "Filling reading buffer" not in proc.stderr


@pytest.mark.parametrize("workers", [0, 1])
def test_a_dataset_rewritten_under_the_loader_is_one_clear_error(dataset, tmp_path, workers):
    """Before: `ValueError: Unexpected end of tar file` from Energon's reader, with a traceback (from a worker
    process: two)."""
    root = shutil.copytree(dataset, tmp_path / "data")
    data = loader(root, num_workers=workers)
    it = iter(data)
    next_batch(it, data)
    for shard in root.glob("*.tar"):  # dit-prepare --overwrite writing new shards over the ones being read
        with shard.open("r+b") as f:
            f.truncate(3000)
    with pytest.raises(DatasetError, match=f"the dataset changed while training: 3 files of '{root}' differ"):
        for _ in range(100):
            next_batch(it, data)


@pytest.mark.slow  # ~40 s; the default run keeps dit-train on a truncated shard (test_bad_inputs)
def test_broken_shard_is_left_out_and_counted(dataset, tmp_path):
    root = shutil.copytree(dataset, tmp_path / "data")
    shard = root / "rank0-000001.tar"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2:len(data) // 2 + 600] = b"\x00garbage" * 75  # overwrites tar headers and payloads
    shard.write_bytes(bytes(data))
    counts = skipped_in(loader(root))
    assert counts["broken_shard"] == 20


def test_unreadable_sample_is_skipped_and_counted(dataset, tmp_path):
    root = shutil.copytree(dataset, tmp_path / "data")
    shard = root / "rank0-000000.tar"
    data = bytearray(shard.read_bytes())
    start = data.index(b"s00001.latent.safetensors") + 512  # the payload right after that member's header
    data[start:start + 64] = b"\xff" * 64  # a safetensors blob that no longer loads; tar structure intact
    shard.write_bytes(bytes(data))
    counts = skipped_in(loader(root))
    assert counts.get("unreadable_sample", 0) >= 1 and "broken_shard" not in counts


def test_missing_or_unfinished_dataset_is_a_clear_error(dataset, tmp_path):
    with pytest.raises(DatasetError, match="does not exist — run dit-prepare first"):
        read_info(tmp_path / "nope")
    root = shutil.copytree(dataset, tmp_path / "unfinished")
    (root / "ditcore.json").unlink()
    with pytest.raises(DatasetError, match=r"no ditcore.json / .nv-meta/: it is not a finished ditcore dataset"):
        loader(root)


def test_existing_output_is_not_overwritten_by_accident(dataset):
    with pytest.raises(FileExistsError, match="already exists and is not empty — choose another path or pass"):
        start_dataset(dataset, overwrite=False)
