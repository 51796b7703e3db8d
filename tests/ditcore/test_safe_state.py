"""Nothing ditcore reads can run code: a planted pickle payload in each kind of file is refused, never executed,
while the files ditcore writes today, and those it wrote before (pickled), read back exactly."""

import io
import json
import math
import pickle

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from megatron.energon.flavors.webdataset.sample_loader import SliceState
from megatron.energon.rng import SystemRngState
from megatron.energon.savable_loader import SavableDataLoaderState, SavableDatasetCheckpoint, SavableDatasetState
from megatron.energon.state import FlexState

from ditcore import durable, runs
from ditcore.data import loader_state
from ditcore.data.schema import LATENT, META, TEXT, read_sample, to_record
from ditcore.safe_state import UnsafeFileError, from_json, restricted_loads, to_json
from ditcore.testing import Payload


@pytest.fixture
def marker(tmp_path):
    return tmp_path / "MARKER"


def test_the_payload_runs_when_unpickled_plainly(marker):
    pickle.loads(pickle.dumps(Payload(marker)))  # what main did with a loader state or a values entry
    assert marker.exists()  # so the marker's absence below means the payload was refused, not that it is broken


def energon_state() -> SavableDataLoaderState:
    """A loader state with every kind Energon puts in one (a worker's RNG states: tensor, numpy array, tuples)."""
    rng = SystemRngState(torch=torch.arange(7, dtype=torch.uint8), numpy=("MT19937", np.arange(5, dtype=np.uint32),
                                                                          624, 0, 0.0),
                         random=(3, tuple(range(5)), None))
    dataset = FlexState({"__class__": "WebdatasetSampleLoaderDataset", "_worker_rng": FlexState({"rng": b"\x00\xff"}),
                         "_active_slice_state": [SliceState(index=0, current=19), None],
                         "_restore_keys": [("MapDataset", 1, "MapDataset", 2)], "_sample_count": 114})
    worker = SavableDatasetCheckpoint(state=SavableDatasetState(rng=rng, dataset_state=dataset, sample_index=3),
                                      offset=1)
    return SavableDataLoaderState(worker_states=[worker], next_worker_id=1, micro_batch_size=3)


def same(a, b) -> bool:
    """Equal values of identical types, all the way down (a tuple that came back a list is a difference)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if hasattr(a, "__dataclass_fields__"):
        return all(same(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__)
    return a == b


def test_loader_state_round_trips_through_json_and_old_pickles_still_read():
    state = energon_state()
    data = loader_state.state_to_json(state)
    json.loads(data)  # plain JSON: nothing in it names a function
    assert same(loader_state.state_from_json(data), state)
    assert same(loader_state.state_from_pickle(pickle.dumps(state)), state)  # loader-dpXXXXX.pkl as main wrote it


def test_json_state_refuses_kinds_outside_the_allow_list():
    with pytest.raises(TypeError, match=r"cannot write a .*SliceState as JSON state"):
        to_json({"s": SliceState(index=0, current=1)})  # not admitted here: found when writing, not when reading
    planted = json.dumps({"__type__": "os.system", "fields": {}}).encode()
    with pytest.raises(UnsafeFileError, match=r"holds a value of kind 'os.system', which ditcore does not load"):
        loader_state.state_from_json(planted)
    values = {"step": 3, "betas": (0.9, 0.99), "history": [[1, 0.1 + 0.2], [2, float("inf")]], "foreach": None,
              1: b"\x00"}
    assert same(from_json(to_json(values)), values)  # floats exactly, tuples as tuples, non-string keys
    assert math.isnan(from_json(to_json([float("nan")]))[0])  # a diverged loss in the history


def test_a_planted_pickle_is_refused_in_one_line_and_never_runs(marker):
    with pytest.raises(UnsafeFileError, match=r"^loader state names posix.system, which ditcore never loads from a "
                                              r"file \(it could run code\) — ") as caught:
        loader_state.state_from_pickle(pickle.dumps(Payload(marker)))
    assert "\n" not in str(caught.value)
    with pytest.raises(UnsafeFileError, match=r"names posix\.system"):
        restricted_loads(pickle.dumps({"step": Payload(marker)}), what="values", fix="x")
    assert not marker.exists()


# ---------------------------------------------------------------- checkpoints


def write_checkpoint(ckpt, values_entry) -> dict:
    """A one-process checkpoint with a given `values` entry (a uint8 JSON tensor today, pickled bytes before)."""
    tensors = {"model.w": torch.randn(3, 4), "ema.w": torch.randn(3, 4)}
    dcp.save({**tensors, runs.VALUES: values_entry},
             storage_writer=dcp.FileSystemWriter(str(ckpt), single_file_per_rank=True), no_dist=True)
    files = {name: durable.digest(ckpt / name) for name in ["__0_0.distcp", runs.METADATA]}
    runs.write_manifest(ckpt, runs.step_of(ckpt), {"world_size": 1}, files)  # a planted file gets a fresh manifest
    return tensors


VALUES = {"step": 3, "history": [[1, 0.5]], "optim_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "foreach": None}]}


def test_new_checkpoints_hold_json_values_and_no_byte_entries(tmp_path):
    ckpt = tmp_path / "checkpoints" / "step-0000003"
    tensors = {"model.w": torch.randn(3, 4)}
    runs.save_tensors(ckpt, tensors, VALUES)  # one process here; dit-train's tests cover the collective save
    meta = runs.SafeReader(ckpt).read_metadata().state_dict_metadata
    assert not any(isinstance(m, dcp.metadata.BytesStorageMetadata) for m in meta.values())
    assert same(runs.read_values(ckpt), VALUES)
    loaded = {"model.w": torch.zeros(3, 4)}
    assert same(runs.load_tensors(ckpt, loaded), VALUES) and torch.equal(loaded["model.w"], tensors["model.w"])


def test_old_checkpoints_with_pickled_values_still_read(tmp_path):
    ckpt = tmp_path / "checkpoints" / "step-0000003"
    tensors = write_checkpoint(ckpt, pickle.dumps(VALUES))  # as main's dist_checkpoint.save wrote them
    assert same(runs.read_values(ckpt), VALUES)
    assert torch.equal(runs.load_weights(ckpt)["w"], tensors["ema.w"])


@pytest.mark.parametrize("where", ["metadata", "values_pickle", "values_object"])
def test_a_payload_in_a_checkpoint_never_runs(tmp_path, marker, where):
    ckpt = tmp_path / "checkpoints" / "step-0000003"
    if where == "values_pickle":  # the values entry of an old checkpoint: pickled bytes
        write_checkpoint(ckpt, pickle.dumps(Payload(marker)))
    elif where == "values_object":  # a byte entry that DCP's own planner would torch.load with weights_only=False
        write_checkpoint(ckpt, Payload(marker))
    else:
        write_checkpoint(ckpt, torch.frombuffer(bytearray(to_json(VALUES)), dtype=torch.uint8))
        (ckpt / runs.METADATA).write_bytes(pickle.dumps(Payload(marker)))
    files = {p.name: durable.digest(p) for p in ckpt.iterdir() if p.name != runs.MARKER}
    runs.write_manifest(ckpt, 3, {"world_size": 1}, files)  # the manifest's CRC is no defence: it is rewritten too
    with pytest.raises(UnsafeFileError, match=r"names posix\.system|GLOBAL posix\.system"):
        runs.read_values(ckpt)
    if where == "metadata":  # what dit-sample serve reads when a web user picks the checkpoint (not the values)
        with pytest.raises(runs.CheckpointError, match=f"checkpoint {ckpt} does not load") as caught:
            runs.load_weights(ckpt)
        assert "\n" not in str(caught.value) and "names posix.system" in str(caught.value)
    assert not marker.exists()


def test_an_index_pointing_outside_the_checkpoint_is_refused(tmp_path):
    ckpt = tmp_path / "checkpoints" / "step-0000003"
    write_checkpoint(ckpt, torch.frombuffer(bytearray(to_json(VALUES)), dtype=torch.uint8))
    meta = runs.SafeReader(ckpt).read_metadata()
    next(iter(meta.storage_data.values())).relative_path = "../../../etc/passwd"
    (ckpt / runs.METADATA).write_bytes(pickle.dumps(meta))
    with pytest.raises(UnsafeFileError, match=r"points outside its folder \('../../../etc/passwd'\)"):
        runs.read_values(ckpt)


# ---------------------------------------------------------------- dataset samples


def test_samples_are_safetensors_and_old_pth_samples_still_read():
    latent, text = torch.randn(4, 1, 2, 2), torch.randn(0, 8)  # text may be empty
    record = to_record("k", latent, text, {"caption": "c"})
    assert set(record) == {"__key__", LATENT, TEXT, META}
    got = read_sample(record)
    assert torch.equal(got[0], latent.bfloat16()) and got[1].shape == (0, 8) and got[2] == {"caption": "c"}
    old = {"__key__": "k", META: record[META]}
    for name, t in (("latent.pth", latent.bfloat16()), ("text.pth", text.half())):  # as main's to_record wrote them
        buf = io.BytesIO()
        torch.save(t, buf)
        old[name] = buf.getvalue()
    assert torch.equal(read_sample(old)[0], latent.bfloat16())


def test_a_payload_in_a_sample_never_runs(marker):
    good = to_record("k", torch.randn(4, 1, 2, 2), torch.randn(2, 8), {"caption": "c"})
    buf = io.BytesIO()
    torch.save(Payload(marker), buf)
    planted_pth = {**{k: v for k, v in good.items() if k != LATENT}, "latent.pth": buf.getvalue()}
    with pytest.raises(UnsafeFileError, match=r"^sample k: latent.pth does not load as tensors \(Trying to load "
                                              r"unsupported GLOBAL posix.system whose module posix is blocked.\) — "):
        read_sample(planted_pth)  # torch's weights-only unpickler refuses it
    planted_pyd = {**{k: v for k, v in good.items() if k != LATENT}, "latent.pyd": pickle.dumps(Payload(marker))}
    with pytest.raises(ValueError, match=r"has no latent.safetensors \(or latent.pth\) member; it has \['json', "
                                         r"'latent.pyd', 'text.safetensors'\]"):
        read_sample(planted_pyd)
    extra = {**good, "extra.pkl": pickle.dumps(Payload(marker))}  # members ditcore does not read are never decoded
    assert read_sample(extra)[2] == {"caption": "c"}
    assert not marker.exists()
