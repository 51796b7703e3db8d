"""Wrong input as a hostile user gives it: every case is one `error:` line, exit code 2, no traceback, and nothing
half-written left behind. (The Gradio app under abuse: test_sample_abuse.py.)

Errors found before a command starts processes run its console script's function in this process (`cli_in_process`:
seconds of start-up less a case); test_cli_shells.py checks that the console script prints the same lines."""

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

BIN = Path(sys.executable).parent
READ_ONLY = Path("/sys/ditcore-test")  # not writable even for root (chmod is not enough when CI runs as root)
SLOW = pytest.mark.slow  # the same kind of error as a case kept in the default run: `make test-slow` runs it


def cli(app: str, *args, timeout=180, cwd=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    return subprocess.run([str(BIN / f"dit-{app}"), *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=cwd)


def assert_one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    noise = ("Initializing distributed", "distributed_backend", "All distributed processes", "----------")
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and not ln.startswith(noise)]
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


# ---------------------------------------------------------------- dit-train


@pytest.fixture(scope="module")
def mock_data(cli_in_process, tmp_path_factory):
    out = tmp_path_factory.mktemp("bad") / "mock"
    proc = cli_in_process("prepare", "mock", "--out", out, "--num", "16", "--latent-shape", "4,1,8,8",
                          "--video-latent-shape", "4,2,4,4", "--text-dim", "16", "--text-len", "3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    d = tmp_path_factory.mktemp("configs")
    (d / "empty.yaml").write_text("")
    (d / "corrupt.yaml").write_text("model: [unclosed\n")
    (d / "list.yaml").write_text("- model\n- train\n")
    (d / "binary.yaml").write_bytes(bytes(range(128, 256)))
    (d / "section.yaml").write_text("train: 5\n")
    (d / "tagged.yaml").write_text(f'model: !!python/object/apply:os.system ["touch {d / "ran"}"]\n')
    return d


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--config", "{cfg}/empty.yaml"], ["the file is empty", "--config demo"]),
        (["--config", "{cfg}/corrupt.yaml"], ["expected valid YAML"]),
        (["--config", "{cfg}/list.yaml"], ["a YAML mapping of sections"]),
        (["--config", "{cfg}/binary.yaml"], ["this one is binary"]),
        (["--config", "{cfg}/section.yaml"], ["train=5 is invalid: expected a mapping of keys"]),
        (["--config", "{cfg}/tagged.yaml"], ["expected valid YAML", "constructor for the tag",
                                              "python/object/apply:os.system"]),
        (["--config", "{cfg}"], ["expected an existing YAML file"]),
        (["--config", "demo", "train.steps=abc"], ["train.steps='abc' is invalid: expected an integer"]),
        (["--config", "demo", "train.steps=1.5"], ["train.steps=1.5 is invalid: expected an integer"]),
        (["--config", "demo", "train.steps=0"], ["train.steps=0 is invalid: expected an integer >= 1"]),
        (["--config", "demo", "optim.lr=-1"], ["optim.lr=-1.0 is invalid: expected a learning rate > 0"]),
        (["--config", "demo", "optim.lr=inf"], ["optim.lr=inf is invalid: expected a finite number"]),
        (["--config", "demo", "optim.lr=.nan"], ["optim.lr=nan is invalid: expected a finite number"]),
        (["--config", "demo", "edm.cfg_dropout=1.5"], ["edm.cfg_dropout=1.5 is invalid: expected a probability"]),
        (["--config", "demo", "parallel.tp=0"], ["parallel.tp=0 is invalid: expected an integer >= 1"]),
        (["--config", "demo", "train.micro_batch=3"], ["train.global_batch=8 is invalid: expected a multiple of"]),
        (["--config", "demo", "train.stop_at=0"], ["train.stop_at=0 is invalid"]),
        (["--config", "demo", "validation.prompts=[]"], ["validation.prompts=[] is invalid: expected a non-empty"]),
        (["--config", "demo", "validation.prompts=a red butterfly"], ["expected a list of str"]),
        (["--config", "demo", "model.pos_embed=learned"], ["model.pos_embed='learned' is invalid: expected one of"]),
        (["--config", "demo", "model.arch=moviegen"], ["model.preset='DiT-Demo' is invalid: expected a size of "
                                                       "model.arch=moviegen: one of MovieGen-1B"]),
        (["--config", "demo", "train"], ["override='train' is invalid: expected key.sub=value"]),
        (["--config", "demo", "=3"], ["override='=3' is invalid"]),
        (["--config", "demo", "train.steps.x=3"], ["'steps' is not a section"]),
        (["--config", "demo", "--resume"], ["Option '--resume' requires an argument"]),
        (["--config", "demo", "--bogus"], ["No such option: --bogus"]),
    ],
)
def test_bad_config_is_one_line(cli_in_process, configs, args, fragments):
    proc = cli_in_process("train", "--print-config", *(a.format(cfg=configs) for a in args))
    assert_one_line_error(proc, *fragments)
    assert not (configs / "ran").exists()  # a YAML tag that names a Python call is refused, never run


def test_a_bad_config_under_torchrun_is_one_line_from_the_job(configs):
    """Every process reads the config and finds the same problem: the node's first one says it in one line, and
    each ends with exit code 2, without a traceback of its own. torchrun then reports its failed processes (its own
    traceback and summary, exit code 1), as it does whenever one of them fails."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-port=0",
           str(BIN / "dit-train"), "--config", str(configs / "tagged.yaml")]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    ours = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.startswith("error: ")]
    assert len(ours) == 1 and "python/object/apply:os.system" in ours[0], proc.stderr[-3000:]
    # the first process to end ended with 2 (torchrun then stops the other with SIGTERM, if it has not ended yet)
    assert "failed (exitcode: 2)" in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.count("Traceback") == 1 and "ChildFailedError" in proc.stderr, proc.stderr[-3000:]
    assert not (configs / "ran").exists()


def train_args(data, run, *extra):
    return ["--config", "demo", "model.preset=DiT-Tiny", "model.patch_size=2", "data.seq_length=32",
            "data.num_workers=0", "train.micro_batch=2", "train.global_batch=2", "train.steps=2",
            "logging.tensorboard=false", f"data.path={data}", f"train.run_dir={run}", *extra]


def damaged_copy(data: Path, tmp: Path, how: str) -> Path:
    copy = tmp / how
    shutil.copytree(data, copy)
    shard = next(copy.glob("rank*-*.tar"))
    if how == "truncated_shard":
        with shard.open("r+b") as f:
            f.truncate(1000)
    elif how == "deleted_idx":
        Path(f"{shard}.idx").unlink()
    elif how == "unfinished":
        (copy / "ditcore.json").unlink()
    elif how == "corrupt_info":
        (copy / "ditcore.json").write_text("{not json")
    return copy


DATASET_PROBLEMS = {"data_is_a_file", "missing_data", "unfinished", "corrupt_info"}


@pytest.mark.parametrize(
    ("case", "fragments"),
    [
        pytest.param("layout", ["parallel", "expected a divisor of the world size 1"], marks=SLOW),
        pytest.param("data_is_a_file", ["is a file; expected the folder dit-prepare wrote"], marks=SLOW),
        ("missing_data", ["does not exist — run dit-prepare first"]),
        pytest.param("unfinished", ["is not a finished ditcore dataset", "--overwrite"], marks=SLOW),
        pytest.param("corrupt_info", ["unreadable ditcore.json"], marks=SLOW),
        ("truncated_shard", ["every shard of dataset", "is broken", "--overwrite"]),
        pytest.param("deleted_idx", ["every shard of dataset", ".idx is missing"], marks=SLOW),
        pytest.param("seq_too_short", ["fits a packed row of data.seq_length=2 tokens", "at least 8"], marks=SLOW),
        pytest.param("patch_does_not_divide", ["is divisible by the patch 1x3x3"], marks=SLOW),
        pytest.param("run_dir_is_a_file", ["train.run_dir=", "this is a file"], marks=SLOW),
        pytest.param("run_dir_read_only", ["train.run_dir=", "a folder this user can write"], marks=SLOW),
        pytest.param("resume_not_a_checkpoint", ["not a complete checkpoint"], marks=SLOW),
        pytest.param("lock_is_a_fifo", ["train.run_dir=", "a folder whose .lock is a regular file",
                                        "is not one: remove it"], marks=SLOW),  # test_run_dir.py has it in process
    ],
)
def test_bad_training_setup_is_one_line(cli_in_process, mock_data, tmp_path, case, fragments):
    data, run, extra = mock_data, tmp_path / "run", []
    if case == "layout":
        extra = ["parallel.tp=2"]
    elif case == "data_is_a_file":
        data = tmp_path / "file"
        data.write_text("x")
    elif case == "missing_data":
        data = tmp_path / "nope"
    elif case in ("unfinished", "corrupt_info", "truncated_shard", "deleted_idx"):
        data = damaged_copy(mock_data, tmp_path, case)
    elif case == "seq_too_short":
        extra = ["data.seq_length=2"]  # the smallest sample (a 2×4×4 clip latent) has 2·2·2 = 8 tokens at patch 2
    elif case == "patch_does_not_divide":
        extra = ["model.patch_size=3"]
    elif case == "run_dir_is_a_file":
        run.write_text("x")
    elif case == "run_dir_read_only":
        run = READ_ONLY
    elif case == "lock_is_a_fifo":  # opened for writing alone, a FIFO waits for a reader: the test would time out
        run.mkdir()
        os.mkfifo(run / ".lock")
    resume = ["--resume", str(tmp_path)] if case == "resume_not_a_checkpoint" else []
    # the dataset's problems are the first thing dit-train checks, before it starts processes: in this one
    proc = (cli_in_process if case in DATASET_PROBLEMS else cli)("train", *train_args(data, run, *extra), *resume)
    assert_one_line_error(proc, *fragments)
    assert not (run / "checkpoints").exists() if run.is_dir() else True  # nothing was written


# ---------------------------------------------------------------- dit-prepare


class Planted:
    """A pickle that runs a shell command when unpickled (what a hostile .bin holds): it touches `marker`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    import imageio.v3 as iio

    root = tmp_path_factory.mktemp("media")
    (root / "empty").mkdir()
    (root / "empty" / "notes.md").write_text("no media here")
    bad = root / "bad"
    bad.mkdir()
    (bad / "a.png").write_text("not a png")
    (bad / "a.txt").write_text("a caption")
    (bad / "b.mp4").write_bytes(b"")
    (bad / "b.txt").write_text("a zero-byte video")
    mixed = root / "mixed"
    mixed.mkdir()
    g = np.random.default_rng(0)
    captions = ["ein Schmetterling über Blüten 🦋", "蝴蝶在花上", "бабочка", "a red butterfly"]
    for i, caption in enumerate(captions):
        iio.imwrite(mixed / f"img{i}.png", (g.random((40, 40, 3)) * 255).astype(np.uint8))
        (mixed / f"img{i}.txt").write_text(caption, encoding="utf-8")
    (mixed / "corrupt.png").write_text("garbage")
    (mixed / "corrupt.txt").write_text("corrupt image")
    (mixed / "empty.mp4").write_bytes(b"")
    (mixed / "empty.txt").write_text("zero-byte video")
    (mixed / "nocaption.png").write_bytes((mixed / "img0.png").read_bytes())
    for name in (b"cls_a", b"cls_\xff"):  # ImageNet's layout with one class folder whose name is not UTF-8
        (root / "classes" / os.fsdecode(name)).mkdir(parents=True)
        (root / "classes" / os.fsdecode(name) / "img.png").write_bytes((mixed / "img0.png").read_bytes())
    vae = root / "pickled_vae"  # a diffusers VAE folder whose only weights are a planted pickle
    vae.mkdir()
    (vae / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKL", "latent_channels": 4}))
    (vae / "diffusion_pytorch_model.bin").write_bytes(pickle.dumps(Planted(root / "ran"), protocol=2))
    return root


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["folder", "{media}/empty", "--out", "{tmp}/o"], ["has no images", "or videos"]),
        (["folder", "{media}/bad", "--out", "{tmp}/o"], ["none of the first 2 samples could be read",
                                                         "removed the partial output"]),
        (["folder", "{media}/empty/notes.md", "--out", "{tmp}/o"], ["does not exist or is not a folder"]),
        (["folder", "{media}/nope", "--out", "{tmp}/o"], ["does not exist or is not a folder"]),
        (["folder", "{media}/classes", "--out", "{tmp}/o", "--labels", "subfolders"],
         ["the class folder b'cls_\\xff' of", "not named in UTF-8 text", "rename it"]),
        (["synthetic", "--out", "{media}/empty/notes.md", "--num", "4"], ["is a file — choose a folder"]),
        (["synthetic", "--out", "{media}/mixed", "--num", "4"], ["already exists and is not empty", "--overwrite"]),
        (["synthetic", "--out", str(READ_ONLY), "--num", "4"], ["cannot be written"]),
        (["synthetic", "--out", "{tmp}/o", "--num", "0"], ["'--num'", "'0'", "dit-prepare synthetic --help"]),
        (["synthetic", "--out", "{tmp}/o", "--num", "many"], ["'--num'", "'many'"]),
        (["synthetic", "--out", "{tmp}/o", "--codec", "jpeg"], ["'jpeg' is not one of 'pca', 'pixel', 'vae'"]),
        (["synthetic", "--out", "{tmp}/o", "--size", "20"], ["--size 20 must be a multiple of --pca-patch 8"]),
        (["synthetic", "--out", "{tmp}/o", "--video-ratio", "2"], ["'--video-ratio'", "'2'"]),
        (["synthetic", "--out", "{tmp}/o", "--text-encoder", "clip"], ["text encoder 'clip' is unknown"]),
        (["synthetic", "--out", "{tmp}/o", "--codec", "vae"], ["--codec vae needs --vae"]),
        (["synthetic", "--out", "{tmp}/o", "--codec", "vae", "--vae", "{tmp}/novae"], ["does not exist"]),
        (["synthetic", "--out", "{tmp}/o", "--codec", "vae", "--vae", "{media}/pickled_vae"],
         ["VAE weights", "pickled_vae/diffusion_pytorch_model.bin' does not load as tensors",
          "unsupported GLOBAL posix.system", "save the weights as safetensors"]),
        (["mock", "--out", "{tmp}/o", "--latent-shape", "4,1,8"], ["expected four positive integers"]),
        (["folder", "--out", "{tmp}/o"], ["Missing argument 'path'", "dit-prepare folder --help"]),
    ],
)
def test_bad_prepare_input_is_one_line_and_leaves_nothing(cli_in_process, media, tmp_path, args, fragments):
    before = sorted(p.relative_to(media) for p in media.rglob("*"))
    proc = cli_in_process("prepare", *(a.format(media=media, tmp=tmp_path) for a in args))
    assert_one_line_error(proc, *fragments)
    assert not (tmp_path / "o").exists()  # no partial output
    assert sorted(p.relative_to(media) for p in media.rglob("*")) == before  # nothing of the user's touched


@pytest.mark.slow  # the default run keeps test_prepare's folder source
def test_folder_skips_what_it_cannot_read_and_keeps_unicode_captions(media, tmp_path):
    out = tmp_path / "o"
    proc = cli("prepare", "folder", media / "mixed", "--out", out, "--size", "32", "--fit-samples", "8",
               "--pca-channels", "4", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "samples   4 (4 images, 0 clips)" in proc.stdout
    assert "1 unreadable image" in proc.stdout and "1 unreadable video" in proc.stdout and "1 no caption" in proc.stdout
    info = json.loads((out / "ditcore.json").read_text())
    assert info["counts"]["samples"] == 4 and sum(info["counts"]["skipped"].values()) == 3
    import tarfile

    with tarfile.open(next(out.glob("rank*-*.tar"))) as tar:
        captions = {json.loads(tar.extractfile(m).read())["caption"] for m in tar if m.name.endswith(".json")}
    assert captions == {"ein Schmetterling über Blüten 🦋", "蝴蝶在花上", "бабочка", "a red butterfly"}


STOP_S = 20  # the most seconds from a signal to the exit of a command that checks for it between samples


@pytest.mark.parametrize(("sig", "keep"), [(signal.SIGINT, False), pytest.param(signal.SIGTERM, False, marks=SLOW),
                                           pytest.param(signal.SIGINT, True, marks=SLOW)])
def test_ctrl_c_during_prepare_removes_the_partial_output_unless_kept(signalled, tmp_path, sig, keep):
    """Ctrl-C (to the process) or SIGTERM (to its whole process group, loader pool included, as `timeout` and
    `docker stop` send it) stops it at the next sample, every time. Before: a KeyboardInterrupt raised wherever the
    main thread was could be dropped on the way, and under load it went on to encode all 4,000 samples."""
    out = tmp_path / "o"
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    workers = 2 if sig == signal.SIGTERM else 0
    cmd = [BIN / "dit-prepare", "synthetic", "--out", out, "--num", "4000", "--size", "32", "--shard-size", "50",
           "--fit-samples", "16", "--workers", workers, *(["--keep-partial"] if keep else [])]
    # the second shard is open: the first is full, we are in the middle of encoding
    proc = signalled(cmd, sig, lambda err: (out / "rank0-000001.tar").exists(), group=workers > 0, env=env)
    lines = [ln for ln in proc.err.replace("\r", "\n").splitlines() if ln.startswith("error")]  # past the bars
    assert proc.returncode == 128 + sig and "Traceback" not in proc.err, proc.err[-3000:]
    said = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}[sig]
    assert len(lines) == 1 and lines[0].startswith(f"error: interrupted by {said} — "), lines
    assert proc.seconds < STOP_S
    if keep:
        assert "kept the partial output" in lines[0] and list(out.glob("rank0-*.tar"))
        assert not (out / "ditcore.json").exists()  # incomplete: dit-train refuses it
        again = cli("prepare", "synthetic", "--out", out, "--num", "4")
        assert_one_line_error(again, "already exists and is not empty", "--overwrite")
    else:
        assert "removed the partial output" in lines[0] and not out.exists()


# ---------------------------------------------------------------- dit-sample generate


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--steps", "0"], ["steps=0 is out of range"]),
        pytest.param(["--steps", "-3"], ["steps=-3 is out of range"], marks=SLOW),
        (["--guidance", "-1"], ["guidance=-1.0 is out of range"]),
        pytest.param(["--guidance", "nan"], ["guidance=nan is out of range"], marks=SLOW),
        (["--frames", "0"], ["frames=0 is out of range"]),
        (["--height", "30"], ["multiples of 8"]),
        pytest.param(["--width", "36"], ["multiples of 8"], marks=SLOW),
        pytest.param(["--height", "100000"], ["height=100000 is out of range"], marks=SLOW),
        (["--prompt", ""], ["the prompt is empty"]),
        (["--fps", "0"], ["'--fps'", "'0'"]),
        pytest.param(["--fps", "-5"], ["'--fps'", "'-5'"], marks=SLOW),
        (["--seed", str(2**80)], [f"seed={2**80} is out of range: expected 0..18446744073709551615"]),
        (["--solver", "dpm"], ["'dpm' is not one of 'heun', 'euler'"]),
        pytest.param(["--seed", "x"], ["'--seed'", "'x'"], marks=SLOW),
        (["--checkpoint", "{data}"], ["is neither an export"]),
        pytest.param(["--checkpoint", "{tmp}"], ["is neither an export"], marks=SLOW),
        (["--checkpoint", "{tmp}/nope"], ["does not exist"]),
        (["--out", "{tmp}/missing/x.png"], ["the folder", "does not exist"]),
        pytest.param(["--out", str(READ_ONLY / "x.png")], ["does not exist"], marks=SLOW),
        (["--out", "/proc/self/x.png"], ["is not writable"]),
        pytest.param(["--out", "{tmp}"], ["is a directory"], marks=SLOW),
    ],
)
def test_bad_generate_request_is_one_line(cli_in_process, checkpoint, mock_data, tmp_path, args, fragments):
    base = {"--checkpoint": str(checkpoint), "--prompt": "a red butterfly", "--steps": "2", "--height": "32",
            "--width": "32", "--out": str(tmp_path / "s.png")}
    for k, v in zip(args[::2], args[1::2], strict=True):
        base[k] = v.format(tmp=tmp_path, data=mock_data)
    proc = cli_in_process("sample", "generate", *[x for kv in base.items() for x in kv])
    assert_one_line_error(proc, *fragments)
    assert not list(tmp_path.glob("*.png")) and not list(tmp_path.glob(".*partial*"))


def test_generate_onto_a_full_disk_is_one_line_and_leaves_no_file(checkpoint, full_disk):
    """ffmpeg could not write the mp4, imageio did not look: a 0-byte file, "wrote …", exit code 0."""
    proc = cli("sample", "generate", "--checkpoint", checkpoint, "--prompt", "a red butterfly", "--steps", 1,
               "--frames", 2, "--height", 16, "--width", 16, "--out", full_disk / "clip.mp4")
    proc.stderr = without_progress_bars(proc.stderr)
    assert_one_line_error(proc, f"could not write {full_disk / 'clip.mp4'}: the disk is full (0 bytes free in "
                                f"{full_disk})")
    assert "wrote" not in proc.stdout and sorted(p.name for p in full_disk.iterdir()) == ["filler"]


def without_progress_bars(stderr: str) -> str:
    """transformers draws a progress bar while the text encoder loads, and the sampler one over its steps: not
    error lines."""
    return "\n".join(ln for ln in stderr.splitlines() if not ln.startswith(("Loading weights", "sampling: ")))


def generate_in_process(*args) -> tuple[int, list[str]]:
    """`dit-sample generate ARGS` in this process (no interpreter to start): exit code, non-empty stderr lines."""
    from typer.testing import CliRunner

    from dit_sample.cli import app

    result = CliRunner().invoke(app, ["generate", *map(str, args)])
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, [ln for ln in without_progress_bars(result.stderr).splitlines() if ln.strip()]


def test_exports_that_are_damaged_edited_or_diverged_are_one_line(checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    def broken(name: str, damage) -> Path:
        export = shutil.copytree(checkpoint / "export", tmp_path / name)
        damage(export)
        return export

    def cut(export):
        weights = export / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:-1000])

    def nan(export):
        weights = load_file(export / "model.safetensors")
        weights["blocks.1.mlp.0.weight"][0, 0] = float("nan")
        save_file(weights, export / "model.safetensors")

    def wide(export):
        meta = json.loads((export / "model.json").read_text())
        meta["model"] |= {"hidden_size": 1_000_000, "num_heads": 10_000}  # 4 TB, were it allocated
        (export / "model.json").write_text(json.dumps(meta))

    cases = {"truncated": (cut, "model.safetensors' is truncated or damaged (Error while deserializing header: "
                                "incomplete metadata, file not fully covered) — export the run again"),
             "diverged": (nan, "holds non-finite weights in 1 tensors, e.g. blocks.1.mlp.0.weight: the run diverged"),
             "edited": (wide, "x_embedder.weight is (64, 192) in model.safetensors, the model it describes needs "
                              "(1000000, 192)")}
    for name, (damage, fragment) in cases.items():
        code, lines = generate_in_process("--checkpoint", broken(name, damage), "--prompt", "a red butterfly",
                                          "--out", tmp_path / "s.png")
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], (name, lines)
    assert not list(tmp_path.glob("*.png"))


def test_a_prompt_that_is_not_unicode_is_one_line(checkpoint, tmp_path):
    """Python decodes the byte 0xff in argv as the lone surrogate U+DCFF, which the tokenizer rejected with a
    TypeError traceback."""
    code, lines = generate_in_process("--checkpoint", checkpoint, "--prompt", "a \udcff butterfly", "--steps", 1,
                                      "--out", tmp_path / "s.png")
    assert code == 2 and lines == ["error: the prompt is not valid text: character 3 ('\\udcff') is not a Unicode "
                                   "character — retype it (a terminal whose encoding is not UTF-8 can cause this)"]
