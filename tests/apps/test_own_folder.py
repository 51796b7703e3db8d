"""Your own folder to a model that draws it: `dit-prepare folder` then `dit-train --config folder` on captioned
pictures of coloured shapes that the test draws. Validation prompts come from the dataset's captions (or its
classes, named as its class folders are), a prompt list that shares no word with the captions is warned about, and
(slow) a few minutes of CPU training draw each prompt's colour."""

import colorsys
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dit_train import validation
from dit_train.config import CONFIGS, load_config
from dit_train.validation import (
    MAX_CLASSES,
    class_labels,
    class_prompts,
    read_captions,
    resolve_validation,
    unshared_words,
)
from ditcore.data.schema import read_info, shard_metas
from ditcore.models import preset

BIN = Path(sys.executable).parent
COLOURS = {"red": (215, 40, 35), "yellow": (230, 195, 25), "green": (35, 165, 60), "blue": (40, 75, 215)}
SHAPES = ("circle", "square")
BACKGROUND = 238  # light grey: no hue, so the checker's coloured pixels are the shape's
# a tiny model for the fast runs (seconds on 2 cores); the folder config's other choices stay
TINY = ["model.preset=DiT-Tiny", "data.seq_length=32", "data.num_workers=0", "train.micro_batch=2",
        "train.global_batch=2", "train.steps=2", "checkpoint.every=2", "validation.every=0", "validation.steps=2",
        "validation.seeds=1", "logging.tensorboard=false", "model.patch_size=2"]


def draw_shapes(root: Path, per_caption: int, size: int = 64, seed: int = 0, classes: bool = False) -> list[str]:
    """Pictures of a coloured circle or square, `per_caption` of each colour and shape, on a plain light-grey
    background: the shape's size and place jitter. Written as dit-prepare folder reads them: PNG + caption .txt, or
    (classes) in a folder per colour without captions (the class's name stands in). Returns the captions."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[:size, :size]
    captions = []
    for colour, rgb in COLOURS.items():
        for shape in SHAPES:
            for k in range(per_caption):
                cx, cy = size / 2 + rng.uniform(-size / 10, size / 10, 2)
                r = size * rng.uniform(0.2, 0.28)
                inside = ((xx - cx) ** 2 + (yy - cy) ** 2 <= r * r if shape == "circle"
                          else (abs(xx - cx) <= 0.85 * r) & (abs(yy - cy) <= 0.85 * r))
                pixels = np.full((size, size, 3), BACKGROUND, np.uint8)
                pixels[inside] = np.clip(np.array(rgb) + rng.integers(-12, 13, 3), 0, 255)
                folder = root / colour if classes else root
                folder.mkdir(parents=True, exist_ok=True)
                name = f"{colour}-{shape}-{k:02d}"
                Image.fromarray(pixels).save(folder / f"{name}.png")
                if not classes:
                    caption = f"a {colour} {shape}"
                    (folder / f"{name}.txt").write_text(caption)
                    captions.append(caption)
    return captions


def hue_of(rgb) -> float:
    return colorsys.rgb_to_hsv(*(c / 255 for c in rgb))[0]


def dominant_colour(pixels: np.ndarray, min_share: float = 0.02) -> str | None:
    """The colour of COLOURS whose hue most of the picture's coloured pixels (saturation > 0.35, not dark) are
    nearest to; None when under `min_share` of the picture is coloured (no shape drawn)."""
    rgb = pixels[..., :3].astype(np.float64) / 255
    top, low = rgb.max(-1), rgb.min(-1)
    coloured = (top > 0.25) & ((top - low) / np.maximum(top, 1e-6) > 0.35)
    if coloured.mean() < min_share:
        return None
    hues = np.array([colorsys.rgb_to_hsv(*p)[0] for p in rgb[coloured]])
    names = list(COLOURS)
    targets = np.array([hue_of(COLOURS[n]) for n in names])
    distance = np.abs(hues[:, None] - targets[None])
    nearest = np.minimum(distance, 1 - distance).argmin(1)  # hue is an angle: 0.98 is near 0.02
    return names[np.bincount(nearest, minlength=len(names)).argmax()]


def test_the_checker_names_each_drawn_colour_and_no_colour_on_a_blank(tmp_path):
    draw_shapes(tmp_path, 1)
    for path in sorted(tmp_path.glob("*.png")):
        assert dominant_colour(np.asarray(Image.open(path))) == path.name.split("-")[0], path.name
    assert dominant_colour(np.full((64, 64, 3), BACKGROUND, np.uint8)) is None


def env() -> dict:
    # one thread: on a busy 2-core machine two OpenMP threads wait on each other (the folder config's step measured
    # 6 s with two, 0.55 s with one, both beside other tests)
    return {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}


def dit(app: str, *args, timeout: float = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(BIN / f"dit-{app}"), *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env=env())
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return proc


def prepare(cli_in_process, pictures: Path, out: Path, *extra) -> Path:
    proc = cli_in_process("prepare", "folder", pictures, "--out", out, *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def captioned(cli_in_process, tmp_path_factory):
    """16 captioned 32-px pictures (8 captions x 2), prepared with the text encoder the folder config expects."""
    root = tmp_path_factory.mktemp("own")
    captions = draw_shapes(root / "pictures", 2, size=32)
    return prepare(cli_in_process, root / "pictures", root / "data", "--size", 32, "--fit-samples", 16), captions


@pytest.fixture(scope="module")
def classes(cli_in_process, tmp_path_factory):
    """16 pictures in a folder per colour, no captions and no text encoder: classes blue, green, red, yellow."""
    root = tmp_path_factory.mktemp("own-classes")
    draw_shapes(root / "pictures", 2, size=32, classes=True)
    return prepare(cli_in_process, root / "pictures", root / "data", "--size", 32, "--fit-samples", 16,
                   "--labels", "subfolders", "--text-encoder", "null")


def resolved(data: Path, *overrides):
    cfg = load_config(CONFIGS / "folder.yaml", [f"data.path={data}", *overrides])
    info = read_info(data)
    model_cfg = preset("DiT-Tiny", in_channels=info.latent_channels, text_dim=info.text_encoder["dim"],
                       num_classes=info.num_classes)
    return resolve_validation(cfg, info, model_cfg)


def test_the_folder_config_draws_its_prompts_from_the_captions_at_the_dataset_size(captioned):
    data, captions = captioned
    assert load_config(CONFIGS / "folder.yaml").validation.prompts == "from_dataset"
    assert sorted(read_captions(str(data), read_info(data))) == sorted(captions)
    cfg = resolved(data)
    prompts = cfg.validation.prompts
    assert cfg.validation.size == 32  # the pictures' size, not the config's 64
    assert len(prompts) == len(set(prompts)) == 8 and set(prompts) == set(captions)  # all 8 distinct captions
    few = resolved(data, "validation.dataset_prompts=3")
    again = resolved(data, "validation.dataset_prompts=3")
    other = resolved(data, "validation.dataset_prompts=3", "validation.seed=1")
    assert few.validation.prompts == again.validation.prompts and set(few.validation.prompts) < set(captions)
    assert other.validation.prompts != few.validation.prompts  # the seed draws them


def test_captions_are_read_once_per_process_and_again_when_a_shard_changes(captioned, tmp_path, monkeypatch):
    """resolve_validation draws the prompts from the captions and the Validator checks them against the captions:
    one read of the shards' json members; a shard rewritten since is read again."""
    data = tmp_path / "data"
    shutil.copytree(captioned[0], data)
    reads = []
    monkeypatch.setattr(validation, "shard_metas", lambda path: reads.append(path) or shard_metas(path))
    first = read_captions(str(data), read_info(data))
    assert read_captions(str(data), read_info(data)) == first and len(reads) == len(list(data.glob("rank*-*.tar")))
    shard = sorted(data.glob("rank*-*.tar"))[0]
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))  # as a rewrite leaves it
    reads.clear()
    assert read_captions(str(data), read_info(data)) == first and len(reads) == len(list(data.glob("rank*-*.tar")))


def test_prompts_that_share_no_word_with_the_captions_are_warned_about_in_one_line(captioned):
    data, _ = captioned
    captions = read_captions(str(data), read_info(data))
    assert unshared_words(["a red butterfly", "a pink butterfly"], captions, str(data)) is None  # "red" is shared
    assert unshared_words(["A Circle"], captions, str(data)) is None  # words, whatever their case
    warning = unshared_words(["an orange butterfly", "a pink butterfly"], captions, str(data))
    assert warning.startswith("warning: validation.prompts ('an orange butterfly', 'a pink butterfly') share no "
                              f"word with the captions of {data} (e.g. 'a ") and "\n" not in warning
    assert "validation.prompts=from_dataset" in warning


def test_a_class_conditional_run_validates_every_class_named_by_its_folder(classes, tmp_path):
    """The demo's text prompts on a class-labelled dataset: every class is sampled and named by its folder, and the
    export records the names (dit-sample's examples); no word warning (the model reads no text)."""
    run = tmp_path / "run"
    proc = dit("train", "--config", "folder", *TINY, f"data.path={classes}", f"train.run_dir={run}",
               "validation.prompts=[a red butterfly, a blue butterfly]")
    assert "warning: validation.prompts" not in proc.stdout + proc.stderr
    names = ["blue", "green", "red", "yellow"]  # the class folders, by name: labels 0..3
    assert read_info(classes).class_names == names
    step = run / "samples" / "step-0000002"
    assert sorted(p.name for p in step.glob("0*.png")) == [f"{i:02d}-{n}.png" for i, n in enumerate(names)]
    assert json.loads((run / "export" / "model.json").read_text())["prompts"] == names


@pytest.mark.slow  # ~20 s on 2 cores; the message itself is tested above
def test_a_text_run_with_unrelated_prompts_says_so_before_training(captioned, tmp_path):
    data, _ = captioned
    proc = dit("train", "--config", "folder", *TINY, f"data.path={data}", f"train.run_dir={tmp_path / 'run'}",
               "train.steps=1", "checkpoint.every=1", "validation.prompts=[an orange butterfly]")
    lines = [ln for ln in proc.stdout.splitlines() if "share no word" in ln]
    assert len(lines) == 1 and lines[0].startswith("warning: validation.prompts ('an orange butterfly') share no")


def test_classes_are_chosen_by_name_or_the_first_up_to_the_bound():
    names = ["blue", "green", "red", "yellow"]
    assert class_prompts("from_dataset", names, 4) == names
    assert class_prompts(["red", "blue"], names, 4) == ["red", "blue"]  # the prompts name classes: those
    assert class_labels(["red", "blue"], names, 4) == [2, 0]
    many = class_prompts(["a red butterfly"], names, 1000)  # an ImageNet-sized model on four named classes
    assert len(many) == MAX_CLASSES == 16 and many[:5] == [*names, "class 4"] and many[-1] == "class 15"
    assert class_labels(many, names, 1000) == list(range(16))


# ---------------------------------------------------------------- the CPU-scale proof

PICTURES = 8  # of each caption: 64 pictures of 8 captions
STEPS = 400  # colours come by step 300 (one seed of each caption measured: 0/8 right at 100, 4/8 at 200, 8/8 at 300)
SEEDS = 4  # samples of each caption: 32 in all, 8 of each colour


@pytest.mark.slow  # ~5 min on 2 cores
def test_a_few_minutes_on_a_cpu_draw_each_prompted_colour(cli_in_process, tmp_path):
    """The README's quick start as it stands: dit-prepare folder, dit-train --config folder (its steps cut to STEPS),
    then every caption sampled from the export with SEEDS seeds; the checker finds the prompted colour in most."""
    from dit_sample.generate import Sampler

    captions = sorted(set(draw_shapes(tmp_path / "pictures", PICTURES)))
    data = prepare(cli_in_process, tmp_path / "pictures", tmp_path / "data")
    run = tmp_path / "run"
    t0 = time.perf_counter()
    # no loader processes: 64 pictures of 16 tokens cost the loader little, and processes would share the 2 cores
    dit("train", "--config", "folder", f"data.path={data}", f"train.run_dir={run}", f"train.steps={STEPS}",
        "data.num_workers=0", "validation.seeds=1", timeout=3000)
    seconds = time.perf_counter() - t0
    sampler = Sampler.load(run)
    drawn = {}
    for seed in range(SEEDS):
        result, _ = sampler.run(prompts=captions, steps=18, guidance=1.0, seed=100 + seed, height=64, width=64)
        for caption, pixels in zip(captions, result.pixels[:, 0].numpy(), strict=True):
            drawn[caption, seed] = dominant_colour(pixels)
    right = sum(colour == caption.split()[1] for (caption, _), colour in drawn.items())
    print(f"\n{len(captions) * PICTURES} pictures, {STEPS} steps in {seconds:.0f} s: the prompted colour in "
          f"{right}/{len(drawn)} samples; {drawn}")
    # measured: 32/32 (64 pictures, 400 steps, 267 s of training on 2 cores shared with other tests)
    assert right >= 0.75 * len(drawn), drawn
