"""An unfinished run samples and scores from the CLI: `dit-sample generate|eval --checkpoint RUN/checkpoints/step-N`
reads that checkpoint's EMA weights, `--checkpoint RUN` for a run without an export its newest complete checkpoint, and
the samples are those of the export dit-train writes from the same step, bit for bit. Damaged or incomplete checkpoints
are one line naming them and what to sample instead; dit-train's stop message names the command."""

import importlib.util
import json
import shlex
import shutil
import subprocess
from functools import partial
from pathlib import Path

import pytest
import torch

from dit_sample.app import Checkpoints
from dit_sample.generate import Sampler, load_checkpoint
from dit_train.preemption import Preempted, sample_command
from ditcore import runs
from ditcore.eval import FrechetDistance, ReferenceStats, feature_net

_spec = importlib.util.spec_from_file_location("inprocess", Path(__file__).with_name("inprocess.py"))
inprocess = importlib.util.module_from_spec(_spec)  # tests are no package: loaded by path
_spec.loader.exec_module(inprocess)

PROMPT = "a red butterfly"
# test_train.py's tiny run, stopped at step 3 (train.stop_at) with checkpoints at steps 2 and 3, not validated
TINY = ["--config", "demo", "model.preset=DiT-Tiny", "model.patch_size=2", "data.seq_length=32", "data.num_workers=0",
        "train.micro_batch=2", "train.global_batch=4", "optim.lr=3e-3", "optim.warmup_steps=0", "logging.every=1",
        "validation.steps=2", "validation.size=32", f"validation.prompts=[{PROMPT}]", "logging.tensorboard=false",
        "train.steps=3", "train.stop_at=3", "checkpoint.every=2", "validation.every=0", "validation.seeds=1"]
SAMPLE = ["--prompt", PROMPT, "--steps", 2, "--seed", 1]


def dit_train(cli_in_process, *args) -> subprocess.CompletedProcess:
    """`dit-train TINY ARGS` in this process (a subprocess spends seconds importing torch); afterwards the process
    group, the environment (Fabric's MASTER_PORT & co.) and the signal handlers are as they were."""
    with inprocess.process_restored():
        proc = cli_in_process("train", *TINY, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def runs_of(cli_in_process, tmp_path_factory):
    """(the run stopped at step 3 and then exported by `--resume auto`, a copy of it from before the export, what
    the stopped run printed)."""
    tmp = tmp_path_factory.mktemp("unfinished")
    data, run, unexported = tmp / "data", tmp / "run", tmp / "unexported"
    proc = cli_in_process("prepare", "synthetic", "--out", data, "--num", 16, "--size", 32, "--frames", 2,
                          "--fit-samples", 16)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stopped = dit_train(cli_in_process, f"data.path={data}", f"train.run_dir={run}")
    assert not runs.export_dir(run).exists()
    shutil.copytree(run, unexported, ignore=shutil.ignore_patterns(runs.LOCK_FILE))
    # step 3 is train.steps: resumed, the run exports the EMA weights of step 3
    dit_train(cli_in_process, f"data.path={data}", f"train.run_dir={run}", "--resume", "auto")
    assert runs.is_complete(runs.export_dir(run).parent / runs.CHECKPOINTS / "step-0000003")
    return run, unexported, stopped.stdout + stopped.stderr


def generate(cli_in_process, checkpoint: Path, out: Path, *args) -> subprocess.CompletedProcess:
    return cli_in_process("sample", "generate", "--checkpoint", checkpoint, *SAMPLE, "--out", out, *args)


def test_the_stop_message_names_a_sampling_command_that_runs_as_written(cli_in_process, runs_of, tmp_path):
    run, unexported, said = runs_of
    ckpt = runs.step_dir(run, 3)
    command = f"dit-sample generate --checkpoint {ckpt} --prompt '{PROMPT}'"
    assert (f"stopped at train.stop_at at step 3; checkpoint saved — continue with --resume auto, or sample it: "
            f"{command}") in said
    _, verb, *args = shlex.split(command)
    proc = cli_in_process("sample", verb, *args, "--steps", 2, "--out", tmp_path / "copied.png")
    assert proc.returncode == 0 and (tmp_path / "copied.png").stat().st_size > 0, proc.stderr[-2000:]
    # a second Ctrl-C (exit at once) names the newest complete checkpoint and the same command
    preempted = Preempted(1, False, run_dir=unexported, sample=partial(sample_command, prompts=[PROMPT]))
    try:
        assert preempted.interrupted_line() == (
            "interrupted by a second Ctrl-C: nothing half-written was published; the newest complete checkpoint, "
            f"{runs.step_dir(unexported, 3)}, is kept for --resume auto, or sample it: dit-sample generate "
            f"--checkpoint {runs.step_dir(unexported, 3)} --prompt '{PROMPT}'")
    finally:
        preempted.close()
    assert sample_command(ckpt, [], num_classes=4) == f"dit-sample generate --checkpoint {ckpt} --class 0"


def test_a_checkpoint_samples_what_the_export_of_its_step_samples(cli_in_process, runs_of, tmp_path):
    """The export is the EMA of step 3 as dit-train consolidated it after resuming; sampled on this CPU in one
    process, the same weights give the same latents bit for bit (no tolerance is needed: same ops, same order)."""
    run, unexported, _ = runs_of
    outs = {name: tmp_path / f"{name}.png" for name in ("export", "step3", "newest")}
    for name, checkpoint in [("export", run), ("step3", runs.step_dir(run, 3)), ("newest", unexported)]:
        proc = generate(cli_in_process, checkpoint, outs[name])
        assert proc.returncode == 0, proc.stderr[-2000:]
        chosen = [ln for ln in proc.stdout.splitlines() if ln.startswith("sampling ")]
        assert chosen == ([f"sampling {runs.step_dir(unexported, 3)} (step 3): the newest complete checkpoint of "
                           f"{unexported}, which has no export/ yet"] if name == "newest" else [])
    png = {name: out.read_bytes() for name, out in outs.items()}
    assert png["step3"] == png["export"] == png["newest"]

    exported = Sampler.load(run)
    exported.load_text()
    ckpt, step2 = (Sampler(load_checkpoint(runs.step_dir(run, step)), exported.text, runs.step_dir(run, step))
                   for step in (3, 2))  # one text encoder loaded for the three
    assert Sampler.load(runs.step_dir(run, 3)).path == runs.step_dir(run, 3)
    assert exported.path == runs.export_dir(run)
    assert ckpt.exported.extra == exported.exported.extra  # step, guidance, solver, prompts, size: model.json's
    a, b = exported.exported.model.state_dict(), ckpt.exported.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    request = dict(prompts=[PROMPT], steps=3, guidance=2.0, seed=5, height=32, width=32)
    latents = exported.run(**request)[0].latents
    assert torch.equal(latents, ckpt.run(**request)[0].latents)
    assert not torch.equal(latents, step2.run(**request)[0].latents)  # each checkpoint samples its own weights


def test_eval_scores_a_checkpoint_as_it_scores_the_export(cli_in_process, runs_of, tmp_path):
    from transformers import Dinov2Config, Dinov2Model

    run, unexported, _ = runs_of
    torch.manual_seed(0)
    Dinov2Model(Dinov2Config(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                             patch_size=28)).save_pretrained(tmp_path / "dino")
    net = feature_net("dinov2", tmp_path / "dino")
    real = FrechetDistance(net)
    real.add(torch.randint(0, 256, (6, 32, 32, 3), dtype=torch.uint8), real=True)
    ReferenceStats.of_sums(*real.sums(real=True), features=net.name, height=32, width=32,
                           source="random").write(tmp_path / "ref.safetensors")
    lines = {}
    for name, checkpoint in [("export", run), ("step3", runs.step_dir(run, 3)), ("newest", unexported)]:
        proc = cli_in_process("sample", "eval", "--checkpoint", checkpoint, "--reference", tmp_path / "ref.safetensors",
                              "--num", 3, "--features", "dinov2", "--weights", tmp_path / "dino", "--steps", 2,
                              "--batch", 3)
        assert proc.returncode == 0, proc.stderr[-2000:]
        lines[name] = proc.stdout.strip().splitlines()
    figure = lines["export"][-1].split(" of ")[0]  # "FD_DINOv2 <value>"
    assert float(figure.split()[1]) > 0
    for name in ("step3", "newest"):  # the same figure, written beside the checkpoints, not inside one
        assert lines[name][-1].split(" of ")[0] == figure
    assert lines["newest"][0].startswith(f"sampling {runs.step_dir(unexported, 3)} (step 3)")
    assert (run / "eval" / "fd_dinov2-dinov2-dino-step3-n3.json").is_file()
    assert (unexported / "eval" / "fd_dinov2-dinov2-dino-step3-n3.json").is_file()


def test_serve_offers_a_run_without_export_by_its_checkpoints_newest_first(runs_of):
    _, unexported, _ = runs_of
    models = Checkpoints(unexported)
    assert list(models.folders) == ["step-0000003", "step-0000002"] and models.default == "step-0000003"
    assert models.get("step-0000003") is models.base
    saved = runs.load_weights(runs.step_dir(unexported, 2))
    state = models.get("step-0000002").exported.model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in saved.items())
    assert models.get("step-0000002").text is models.base.text  # one text encoder for all


def error_of(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    return line


def test_damaged_or_incomplete_checkpoints_are_one_line_naming_them_and_what_to_sample(cli_in_process, runs_of,
                                                                                         tmp_path):
    _, unexported, _ = runs_of
    run = shutil.copytree(unexported, tmp_path / "run")
    step2, step3 = runs.step_dir(run, 2), runs.step_dir(run, 3)
    out = tmp_path / "x.png"
    shard = step3 / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-100])  # truncated
    for given in (step3, run):  # named, or the newest of a run without export
        line = error_of(generate(cli_in_process, given, out))
        assert line.startswith(f"error: checkpoint {step3} is damaged: ") and "__0_0.distcp" in line, line
        assert line.endswith(f" — sample an earlier checkpoint: --checkpoint {step2}"), line
    line = error_of(cli_in_process("sample", "eval", "--checkpoint", step3, "--reference", tmp_path, "--num", 2,
                                   "--features", "dinov2"))
    assert line.startswith(f"error: checkpoint {step3} is damaged: ")

    (step3 / runs.MARKER).unlink()  # unpublished: never sampled, even by name
    assert error_of(generate(cli_in_process, step3, out)) == (
        f"error: checkpoint '{step3}' is incomplete (no COMPLETE manifest: its save was interrupted or is still under "
        f"way) — sample a complete one: --checkpoint {step2} (or --checkpoint {run}, the newest)")
    assert error_of(generate(cli_in_process, runs.step_dir(run, 7), out)) == \
        f"error: checkpoint '{runs.step_dir(run, 7)}' does not exist"
    shutil.rmtree(step2)
    assert error_of(generate(cli_in_process, run, out)) == (
        f"error: run directory '{run}' has no export/ and no complete checkpoint yet — dit-train writes one every "
        "checkpoint.every steps (and when stopped), and export/ at the end")
    assert not out.exists()


def test_a_checkpoint_of_an_older_dit_train_takes_the_model_from_the_runs_export(cli_in_process, runs_of, tmp_path):
    """Checkpoints written before they recorded model.json sample with the model of their run's export, as serve
    sampled them; without an export, one line says how to get one."""
    run, unexported, _ = runs_of
    old = shutil.copytree(unexported, tmp_path / "old")
    ckpt = runs.step_dir(old, 3)
    manifest = json.loads((ckpt / runs.MARKER).read_text())
    for name in ("model.json", "ditcore.json", "codec_pca.safetensors"):
        (ckpt / name).unlink()
        del manifest["files"][name]
    (ckpt / runs.MARKER).write_text(json.dumps(manifest))
    assert error_of(generate(cli_in_process, ckpt, tmp_path / "x.png")) == (
        f"error: checkpoint {ckpt} was written by an older dit-train, which recorded no model.json beside its weights, "
        f"and {old} has no export/ to take the model from — resume the run (dit-train --resume {ckpt}) to the end, "
        "which exports it")
    shutil.copytree(runs.export_dir(run), runs.export_dir(old))  # the export of step 3, as the run would write it
    proc = generate(cli_in_process, ckpt, tmp_path / "old.png")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert generate(cli_in_process, run, tmp_path / "export.png").returncode == 0
    assert (tmp_path / "old.png").read_bytes() == (tmp_path / "export.png").read_bytes()
