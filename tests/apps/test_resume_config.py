"""Resuming with a changed config: what applies (optimizer hyper-parameters, the data loader's settings, another
dataset) and what is refused in one line (the model, the batch, a damaged dataset); the model's tensors are checked
strictly against the checkpoint's.

The runs are dit-train's own `train()` in this process (a tiny DiT on a mock dataset with nothing to decode, so no
validation sampling): one run stopped at step 3, copied for each resume variant."""

import contextlib
import importlib.util
import io
import shutil
import traceback
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from dit_train import resume_config, train
from dit_train.cli import find_config
from dit_train.config import load_config
from ditcore import runs
from ditcore.data.loader import compare_fingerprints, dataset_fingerprint
from ditcore.data.schema import DatasetInfo
from ditcore.data.writer import ShardWriter, finish_dataset, start_dataset
from ditcore.models import DiT, preset
from ditcore.runs import CheckpointError

_spec = importlib.util.spec_from_file_location("inprocess", Path(__file__).with_name("inprocess.py"))
inprocess = importlib.util.module_from_spec(_spec)  # tests are no package: loaded by path
_spec.loader.exec_module(inprocess)

TINY = ["model.preset=DiT-Tiny", "model.patch_size=2", "data.seq_length=32", "data.num_workers=0",
        "train.micro_batch=2", "train.global_batch=4", "optim.lr=3e-3", "optim.warmup_steps=0", "checkpoint.every=3",
        "logging.every=1", "logging.csv=false", "logging.tensorboard=false"]


def write_mock(root: Path, seed: int = 0, num: int = 24, text_dim: int = 8) -> Path:
    """`num` random 4x1x8x8 latents (16 tokens at patch 2) with 3 text tokens of width text_dim, 8 per shard."""
    start_dataset(root, overwrite=False)
    g = torch.Generator().manual_seed(seed)
    with ShardWriter(root, max_count=8) as w:
        for i in range(num):
            w.write(f"s{i:05d}", torch.randn(4, 1, 8, 8, generator=g) * 0.5, torch.randn(3, text_dim, generator=g),
                    {"caption": f"mock {i}", "fps": 0.0})
    finish_dataset(root, DatasetInfo(codec={"kind": "none"}, latent_stats={}, text_encoder={"name": "mock",
                                     "dim": text_dim}, latent_channels=4, spatial_factor=1, temporal_factor=1,
                                     counts={"samples": num, "latent_shapes": {"4x1x8x8": num}}))
    return root


def train_here(data: Path, run: Path, *overrides: str) -> dict:
    """dit-train's train() with --resume auto in this process; afterwards the process group, the environment
    (Fabric's MASTER_PORT & co.) and the signal handlers are as they were."""
    cfg = load_config(find_config("demo"), [*TINY, f"data.path={data}", f"train.run_dir={run}", *overrides])
    with inprocess.process_restored():
        return train.train(cfg, resume="auto")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_mock(tmp_path_factory.mktemp("resume") / "data")


@pytest.fixture(scope="module")
def base(data, tmp_path_factory) -> Path:
    """A run of 6 steps stopped at step 3: its checkpoint step-0000003."""
    run = tmp_path_factory.mktemp("base") / "run"
    assert train_here(data, run, "train.steps=6", "train.stop_at=3")["step"] == 3
    return run


def resume(base: Path, tmp_path: Path, data: Path, *overrides: str, steps: int = 5) -> dict:
    """A copy of the base run resumed to `steps` with `overrides` (stopping there with a checkpoint)."""
    run = tmp_path / "run"
    shutil.copytree(base, run)
    return train_here(data, run, f"train.steps={steps}", f"train.stop_at={steps}", *overrides)


def one_line(text: str, *fragments: str) -> None:
    assert "\n" not in text.strip(), text
    for fragment in fragments:
        assert fragment in text, (fragment, text)


# ---------------------------------------------------------------- the rules


def test_every_config_key_has_a_resume_rule():
    """A new config key must be classified in resume_config.RULES (applied on resume, or refused), not left to
    chance."""
    keys = resume_config.config_keys()
    assert len(keys) == len(set(keys)) > 40
    assert set(keys) - resume_config.RULES.keys() == set(), "classify these keys in dit_train/resume_config.RULES"
    assert resume_config.RULES.keys() - set(keys) == set(), "RULES names keys the config no longer has"
    kinds = {resume_config.APPLY, resume_config.LOADER, resume_config.DATA, resume_config.MODEL, resume_config.RUN,
             resume_config.PLACE}
    assert set(resume_config.RULES.values()) <= kinds


@pytest.mark.parametrize(("override", "was", "now"), [
    ("model.depth=1", "model.depth=null", "model.depth=1"),
    ("model.qk_norm=false", "model.qk_norm=true", "model.qk_norm=false"),
    ("model.pos_embed=rope", "model.pos_embed=sincos", "model.pos_embed=rope"),
    ("model.preset=DiT-S/2", "model.preset=DiT-Tiny", "model.preset=DiT-S/2"),
    ("edm.prediction=edm", "edm.prediction=x", "edm.prediction=edm"),
    ("train.global_batch=8", "train.global_batch=4", "train.global_batch=8"),
])
def test_a_change_of_model_or_batch_is_refused_in_one_line(override, was, now):
    saved = load_config(find_config("demo"), TINY).to_dict()
    changes = resume_config.compare(saved, load_config(find_config("demo"), [*TINY, override]), Path("ckpt"))
    refusal = changes.refusal()
    one_line(refusal, f"was trained with {was}", f"this config has {now}", f"set {was} to continue this run",
             "another train.run_dir")
    assert changes.applied == [] and changes.summary() is None


def test_applied_changes_are_named_in_one_line_and_the_run_directory_is_not_a_change():
    saved = load_config(find_config("demo"), [*TINY, "train.run_dir=a"]).to_dict()
    del saved["validation"]["seeds"]  # a checkpoint of an older dit-train, without this key: not compared
    cfg = load_config(find_config("demo"), [*TINY, "train.run_dir=b", "optim.lr=1e-3", "optim.betas=[0.8,0.99]",
                                            "data.num_workers=1", "validation.seeds=4", "data.path=other"])
    changes = resume_config.compare(saved, cfg, Path("run/checkpoints/step-0000003"))
    assert changes.refusal() is None
    assert [c.key for c in changes.loader_changes] == ["data.num_workers"]
    one_line(changes.summary(), "resuming step-0000003 with changed settings", "optim.lr 0.003 → 0.001",
             "optim.betas [0.9, 0.999] → [0.8, 0.99]", "data.num_workers 0 → 1", "data.path data/butterflies → other")
    assert "run_dir" not in changes.summary() and "seeds" not in changes.summary()
    assert resume_config.compare(cfg.to_dict(), cfg, Path("x")).changes == ()


# ---------------------------------------------------------------- resumes that apply a change


@pytest.mark.parametrize("override", ["data.num_workers=1", "train.micro_batch=1", "data.packing_buffer=3"])
def test_a_changed_loader_setting_resumes_with_a_fresh_pass_over_the_data(base, data, tmp_path, capsys, override):
    """Today's checkpoints did not load after these changes (Energon refuses the saved position: AssertionError), or
    resumed and then died in the loader (packing_buffer). Now the weights resume and the loader starts over."""
    result = resume(base, tmp_path, data, override)
    assert result["step"] == 5 and [s for s, _ in result["history"]] == [1, 2, 3, 4, 5]
    said = capsys.readouterr().err
    key, value = override.split("=")
    note = next(line for line in said.splitlines() if line.startswith("note: "))
    one_line(note, f"{key} ", f"→ {value}", "starts a fresh pass over the data")
    assert f"{key} " in next(line for line in said.splitlines() if line.startswith("resuming step-0000003"))


def test_new_optimizer_hyperparameters_win_over_the_checkpoint_s(base, data, tmp_path, capsys):
    """Today the checkpoint's lr, weight decay, betas and eps silently replaced the new ones (and the schedule's base
    rate stayed the old lr) while config.yaml recorded the new values."""
    new = ["optim.lr=1e-3", "optim.weight_decay=0.05", "optim.betas=[0.8,0.99]", "optim.eps=1e-6"]
    result = resume(base, tmp_path, data, *new)
    assert result["step"] == 5
    values = runs.read_values(runs.step_dir(tmp_path / "run", 5))
    (group,) = values["optim_groups"]
    cfg = load_config(find_config("demo"), [*TINY, "train.steps=5", *new])
    assert group["lr"] == 1e-3 * train.lr_lambda(cfg)(5)  # the schedule at step 5 from the new base rate, exactly
    assert values["scheduler"]["base_lrs"] == [1e-3] and group["initial_lr"] == 1e-3
    assert (group["weight_decay"], tuple(group["betas"]), group["eps"]) == (0.05, (0.8, 0.99), 1e-6)
    assert "optim.lr 0.003 → 0.001, optim.weight_decay 0.0 → 0.05" in capsys.readouterr().err


# ---------------------------------------------------------------- resumes that are refused


def test_a_smaller_model_is_refused_before_anything_loads(base, data, tmp_path):
    """Today model.depth=1 loaded the first block of a 2-block checkpoint, dropped the other and trained on, rc 0."""
    with pytest.raises(CheckpointError) as e:
        resume(base, tmp_path, data, "model.depth=1")
    one_line(str(e.value), "was trained with model.depth=null, this config has model.depth=1",
             f"or train the new model in a new run (another train.run_dir) with model.init_from="
             f"{runs.step_dir(tmp_path / 'run', 3)} to start from its weights")
    assert runs.complete_checkpoints(tmp_path / "run") == [runs.step_dir(tmp_path / "run", 3)]  # nothing written


def test_a_dataset_that_changes_the_model_s_shapes_is_refused_in_one_line(base, tmp_path):
    """Text states 16 wide instead of 8: the same config builds wider text projections. Today DCP's size mismatch
    escaped as a ~70-line traceback (its CheckpointException is a BaseException)."""
    wide = write_mock(tmp_path / "wide", text_dim=16)
    with pytest.raises(CheckpointError) as e:
        resume(base, tmp_path, wide)
    one_line(str(e.value), "holds another model than this config and dataset build", "differ in shape",
             "checkpoint [64, 8], this model [64, 16]",
             f"another train.run_dir with model.init_from={runs.step_dir(tmp_path / 'run', 3)}")


def test_strict_shapes_name_the_difference():
    """DCP alone loads only what the new model asks for: every stored model/EMA tensor must be wanted, alike."""
    def shapes(**changes):
        model = DiT(preset("DiT-Tiny", in_channels=4, text_dim=8, patch_size=2, **changes))
        return {f"{p}.{k}": tuple(v.shape) for p in ("model", "ema") for k, v in model.state_dict().items()}

    two = shapes()
    assert runs.model_mismatch(two, two) is None
    assert runs.model_mismatch(two, shapes(depth=1)) == ("the checkpoint's model has 2 blocks, this one 1 "
                                                        "(model.depth, model.preset)")
    no_norm = runs.model_mismatch(two, shapes(qk_norm=False))
    one_line(no_norm, "the checkpoint has", "tensors this model lacks (e.g. ema.blocks.0.")
    assert "norm" in no_norm


def test_stored_shapes_read_the_checkpoint_s_index(base):
    stored = runs.stored_shapes(runs.step_dir(base, 3))
    model, ema = ({k.split(".", 1)[1]: v for k, v in stored.items() if k.startswith(f"{p}.")} for p in ("model", "ema"))
    assert model == ema and model["blocks.1.attn.qkv.weight"] == (3 * 64, 64)  # DiT-Tiny: 64 wide, 2 blocks
    assert stored["optim.blocks.1.attn.qkv.weight.exp_avg"] == (3 * 64, 64)


def test_dcp_s_checkpoint_exception_becomes_its_first_error():
    error = ValueError("Size mismatch between saved torch.Size([384]) and current: torch.Size([2304])\nsecond line")
    wrapped = CheckpointException("failed", {0: (error, traceback.StackSummary())})
    assert runs.checkpoint_error(wrapped) == ("ValueError: Size mismatch between saved torch.Size([384]) and current: "
                                             "torch.Size([2304])")


# ---------------------------------------------------------------- another model: a new run with model.init_from


@pytest.fixture(scope="module")
def deeper(base, data, tmp_path_factory) -> tuple[Path, str]:
    """A new run of a 3-block model started from the base run's step-3 checkpoint (2 blocks), with another seed and a
    learning rate so small that one step moves no weight by more than 1e-6 (AdamW's first step: at most lr); the
    run directory and what it printed."""
    run = tmp_path_factory.mktemp("deeper") / "run"
    with contextlib.redirect_stdout(io.StringIO()) as out:
        result = train_here(data, run, "model.depth=3", f"model.init_from={runs.step_dir(base, 3)}", "train.seed=5",
                            "optim.lr=1e-6", "train.steps=2", "train.stop_at=1")
    assert result["step"] == 1 and [s for s, _ in result["history"]] == [1]  # step and schedule start fresh
    return run, out.getvalue()


def test_init_from_starts_a_new_run_from_a_checkpoint_s_weights(base, deeper):
    """Today a model change had no way forward but fresh weights. The new run's model and EMA start from the
    checkpoint's EMA weights wherever names and shapes match; block 2 starts from the fresh init."""
    source = runs.load_weights(runs.step_dir(base, 3))
    ckpt = runs.step_dir(deeper[0], 1)
    fresh = DiT(preset("DiT-Tiny", in_channels=4, text_dim=8, patch_size=2, depth=3))
    fresh.init_weights(5)
    fresh = fresh.state_dict()
    for which in (runs.MODEL, runs.EMA):
        got = runs.read_full(ckpt, which)
        assert got.keys() == fresh.keys()
        for k, v in got.items():
            start = source[k] if k.startswith(("blocks.0.", "blocks.1.")) or not k.startswith("blocks.") else fresh[k]
            assert (v - start).abs().max() <= 1.1e-6, (which, k)  # lr, and the rounding of weights < 1
    k = "blocks.0.attn.qkv.weight"
    assert (source[k] - fresh[k]).abs().max() > 1e-2  # the fresh init is far from the source: the check means it
    assert float(runs.read_full(ckpt, runs.OPTIM)[f"{k}.step"]) == 1  # the optimizer state starts fresh
    assert runs.read_values(ckpt)["step"] == 1


def test_init_from_names_what_it_took_in_one_line(base, deeper):
    line = next(line for line in deeper[1].splitlines() if line.startswith("init_from"))
    assert line == (f"init_from {runs.step_dir(base, 3)}: 58 of 80 tensors (x_embedder, t_embedder, text_embedder, "
                    "blocks 0-1 of 3, final); fresh: blocks 2 of 3 (not in the source)")


def test_a_resumed_run_ignores_init_from_with_a_note(base, deeper, data, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(deeper[0], run)
    result = train_here(data, run, "model.depth=3", f"model.init_from={base}", "train.seed=5", "optim.lr=1e-6",
                        "train.steps=2", "train.stop_at=2")
    assert [s for s, _ in result["history"]] == [1, 2]
    out = capsys.readouterr().out
    one_line(next(line for line in out.splitlines() if line.startswith("note: model.init_from")),
             f"model.init_from={base} is ignored: the run continues from its own checkpoint")
    assert "init_from " + str(base) not in out


# ---------------------------------------------------------------- another dataset, a damaged one


def test_another_dataset_resumes_with_a_fresh_pass_and_a_note(base, tmp_path, capsys):
    """The dataset prepared again (other samples, as many): today the loader resumed at the old position in the new
    data, silently (or crashed with IndexError where the index no longer fit)."""
    again = write_mock(tmp_path / "again", seed=1)
    result = resume(base, tmp_path, again)
    assert result["step"] == 5
    one_line(next(line for line in capsys.readouterr().err.splitlines() if line.startswith("note: ")),
             f"dataset '{again}' is not the one the checkpoint was trained on (it was prepared again)",
             "starts a fresh pass")


def test_a_shard_damaged_since_the_checkpoint_is_refused_in_one_line(base, data, tmp_path):
    """Today a missing shard crashed every resume (IndexError: Index out of bounds)."""
    damaged = tmp_path / "damaged"
    shutil.copytree(data, damaged)
    (damaged / "rank0-000001.tar").unlink()
    with pytest.raises(CheckpointError) as e:
        resume(base, tmp_path, damaged)
    one_line(str(e.value), "shard rank0-000001.tar of dataset", "is damaged", "restore the dataset from a copy")


def test_fingerprints_tell_more_samples_from_the_same_data(data):
    same = dataset_fingerprint(data, {})
    assert compare_fingerprints(same, dataset_fingerprint(data, {}), data) == (None, None)
    assert compare_fingerprints(None, same, data) == (None, None)  # a checkpoint of an older dit-train
    more = {**same, "digest": "other", "shards": {**same["shards"], "rank0-000003.tar": [8, 9000]}}
    _, note = compare_fingerprints(same, more, data)
    assert note.endswith("(it now has 32 samples in 4 shards, then 24 samples in 3 shards)")

