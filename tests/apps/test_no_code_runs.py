"""Nothing dit-train or dit-sample loads runs code: a pickle payload planted in a dataset, a checkpoint or an export
never runs (train, resume, serve's checkpoint pick, generate's export), while datasets and checkpoints written the
way main wrote them (torch.save'd members, pickled values and loader state) still train and resume exactly.

Each planted file gets a rewritten manifest: whoever can plant a file can rewrite its CRC too.
"""

import io
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import webdataset as wds

from ditcore import durable, runs
from ditcore.data import loader_state
from ditcore.data.schema import LATENT, TEXT, DatasetInfo, to_record
from ditcore.data.writer import SHARD_PATTERN, finish_dataset, start_dataset
from ditcore.testing import Payload

BIN = Path(sys.executable).parent
SAMPLES, STEPS = 16, 4
PAYLOAD_PTH, PAYLOAD_PYD = "00000002", "00000003"  # samples whose latent member is a payload


def torch_saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def write_dataset(root: Path, marker: Path) -> Path:
    """Mock-like latents: new-format samples, samples as main wrote them (torch.save'd .pth members), a payload as a
    .pth member, one as a .pyd member in place of the latent, and one good sample with an extra payload member."""
    start_dataset(root, overwrite=False)
    g = torch.Generator().manual_seed(0)
    writer = wds.ShardWriter(str(root / SHARD_PATTERN.format(rank=0)), maxcount=100, verbose=0)
    for i in range(SAMPLES):
        key = f"{i:08d}"
        latent, text = torch.randn(4, 1, 8, 8, generator=g), torch.randn(3, 16, generator=g)
        record = to_record(key, latent, text, {"caption": f"sample {i}", "frames": 1, "fps": 0.0})
        if i % 4 == 1:  # as main's to_record wrote it
            del record[LATENT], record[TEXT]
            record |= {"latent.pth": torch_saved(latent.bfloat16()), "text.pth": torch_saved(text.half())}
        if key == PAYLOAD_PTH:
            del record[LATENT]
            record["latent.pth"] = torch_saved(Payload(marker))
        if key == PAYLOAD_PYD:
            del record[LATENT]
            record["latent.pyd"] = pickle.dumps(Payload(marker))
        if i == 6:
            record["extra.pkl"] = pickle.dumps(Payload(marker))
        writer.write(record)
    writer.close()
    finish_dataset(root, DatasetInfo(codec={"kind": "none"}, latent_stats={"mean": [0.0] * 4, "std": [1.0] * 4},
                                     text_encoder={"name": "mock", "dim": 16}, latent_channels=4, spatial_factor=1,
                                     temporal_factor=1, counts={"samples": SAMPLES, "latent_shapes": {"4x1x8x8": 16}}))
    return root


def dit_train(data: Path, run: Path, *extra) -> subprocess.CompletedProcess:
    args = ["--config", "demo", "model.preset=DiT-Tiny", "model.patch_size=2", "data.seq_length=32",
            "data.num_workers=1", "train.micro_batch=2", "train.global_batch=2", f"train.steps={STEPS}",
            "checkpoint.every=1", "checkpoint.keep=10", "logging.tensorboard=false", f"data.path={data}",
            f"train.run_dir={run}", *extra]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    return subprocess.run([str(BIN / "dit-train"), *args], capture_output=True, text=True, timeout=300, env=env)


@pytest.fixture(scope="module")
def marker(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("payload") / "MARKER"


@pytest.fixture(scope="module")
def trained(tmp_path_factory, marker):
    """dit-train on the planted dataset, one checkpoint per step (one loader worker: its state holds tensors)."""
    root = tmp_path_factory.mktemp("nocode")
    data = write_dataset(root / "data", marker)
    proc = dit_train(data, root / "run")
    return data, root / "run", proc


def test_training_on_a_planted_dataset_skips_the_payloads_without_running_them(trained, marker):
    _, run, proc = trained
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not marker.exists()
    out = proc.stdout + proc.stderr
    assert "unreadable sample" in out and "posix.system" in out  # the payload samples: skipped, counted, named
    ckpt = runs.step_dir(run, STEPS)
    assert (ckpt / runs.loader_file(0)).name == "loader-dp00000.json" and not list(ckpt.glob("*.pkl"))
    meta = runs.SafeReader(ckpt).read_metadata().state_dict_metadata
    assert not any(isinstance(m, dcp.metadata.BytesStorageMetadata) for m in meta.values())  # nothing DCP unpickles


def as_main_wrote_it(ckpt: Path, values_pickle: bytes | None = None, loader_pickle: bytes | None = None) -> None:
    """Rewrite a checkpoint in main's format: one-device tensors and pickled values in DCP, the loader state pickled
    in loader-dp00000.pkl (or the given pickles in their place); the manifest rewritten."""
    tensors = {f"{p}.{k}": v for p in (runs.MODEL, runs.EMA, runs.OPTIM)
               for k, v in runs.read_full(ckpt, p).items()}
    values = runs.read_values(ckpt)
    state = loader_state.state_from_json((ckpt / runs.loader_file(0)).read_bytes())
    for p in ckpt.glob("*distcp"):
        p.unlink()
    (ckpt / runs.loader_file(0)).unlink()
    dcp.save({**tensors, runs.VALUES: values_pickle or pickle.dumps(values)}, no_dist=True,
             storage_writer=dcp.FileSystemWriter(str(ckpt), single_file_per_rank=True))
    (ckpt / "loader-dp00000.pkl").write_bytes(loader_pickle or pickle.dumps(state))
    rewrite_manifest(ckpt)


def rewrite_manifest(ckpt: Path) -> None:
    manifest = runs.read_manifest(ckpt)
    files = {p.name: durable.digest(p) for p in ckpt.iterdir() if p.name != runs.MARKER}
    runs.write_manifest(ckpt, manifest["step"], manifest["layout"], files)


def test_resume_refuses_each_planted_checkpoint_and_continues_exactly_from_one_main_wrote(trained, marker, tmp_path):
    data, original, first = trained
    assert first.returncode == 0, first.stderr[-3000:]
    run = shutil.copytree(original, tmp_path / "run")

    def step(n: int) -> Path:
        return runs.step_dir(run, n)

    (step(4) / runs.METADATA).write_bytes(pickle.dumps(Payload(marker)))  # DCP's index
    rewrite_manifest(step(4))
    as_main_wrote_it(step(3), values_pickle=pickle.dumps(Payload(marker)))  # the values entry
    as_main_wrote_it(step(2), loader_pickle=pickle.dumps(Payload(marker)))  # the loader state
    as_main_wrote_it(step(1))  # a clean checkpoint as main wrote it
    proc = dit_train(data, run, "--resume", "auto")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not marker.exists()
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning: checkpoint")]
    assert len(warnings) == 3 and all("posix.system" in w for w in warnings), proc.stderr[-3000:]
    assert f"resumed from {step(1)} at step 1" in proc.stdout + proc.stderr
    # the old-format loader state (with a worker's tensor and array RNG states) resumed the data exactly
    # the resumed run's step 4 is a second checkpoint of that step (lineage: the planted one is never replaced)
    newest = runs.newest(run)
    assert runs.step_of(newest) == 4 and newest != step(4)
    resumed, straight = runs.read_values(newest), runs.read_values(runs.step_dir(original, 4))
    assert resumed["history"] == straight["history"]
    a, b = (runs.read_full(d, runs.EMA) for d in (newest, runs.step_dir(original, 4)))
    assert all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------- dit-sample


def test_serve_refuses_a_planted_checkpoint_index_and_loads_a_clean_one(checkpoint, marker, tmp_path):
    from safetensors.torch import load_file

    from dit_sample.app import Checkpoints
    from dit_sample.generate import RequestError

    run = shutil.copytree(checkpoint, tmp_path / "run", ignore=shutil.ignore_patterns("samples"))
    ema = {k: v + 1.0 for k, v in load_file(run / "export" / "model.safetensors").items()}
    for step in (2, 3):
        ckpt = runs.step_dir(run, step)
        runs.save_tensors(ckpt, {f"{runs.EMA}.{k}": v for k, v in ema.items()}, {"step": step})
        runs.write_manifest(ckpt, step, {"world_size": 1}, {})  # rewritten with every file's CRC below
        rewrite_manifest(ckpt)
    (runs.step_dir(run, 3) / runs.METADATA).write_bytes(pickle.dumps(Payload(marker)))
    rewrite_manifest(runs.step_dir(run, 3))
    models = Checkpoints(run)
    with pytest.raises(RequestError, match=r"names posix\.system, which ditcore never loads .* pick another"):
        models.get("step-0000003")  # what the dropdown calls when a web user picks it
    state = models.get("step-0000002").exported.model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in ema.items())
    assert not marker.exists()


@pytest.mark.parametrize("name", ["model.safetensors", "model.json", "ditcore.json"])
def test_generate_refuses_a_planted_export_file(checkpoint, marker, tmp_path, name):
    from dit_sample.generate import Sampler

    export = shutil.copytree(checkpoint / "export", tmp_path / "export")
    (export / name).write_bytes(pickle.dumps(Payload(marker)))  # exports are safetensors and JSON only
    with pytest.raises(Exception):  # noqa: B017 — whichever reader refuses it, the point is the marker
        Sampler.load(export)
    assert not marker.exists()
