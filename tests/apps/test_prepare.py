"""dit-prepare as a user runs it: every source gives a dataset that Energon accepts and ditcore can load."""

import csv
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from ditcore.codecs import LatentStats, load_codec, psnr
from ditcore.data.loader import build_loader
from ditcore.data.schema import read_info, read_sample
from ditcore.data.synthetic import generate
from ditcore.data.writer import TYPED_CONFIG, start_dataset

BIN = Path(sys.executable).parent


def run(*args, env=None, timeout=300):
    env = {**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})}
    return subprocess.run([str(BIN / "dit-prepare"), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env)


def energon_accepts(root: Path) -> None:
    from click.testing import CliRunner
    from megatron.energon.cli.main import main as energon  # `energon`, in this process: ~4 s of imports less a call

    for cmd in ("info", "lint"):
        result = CliRunner().invoke(energon, [cmd, str(root), "--dataset-config", TYPED_CONFIG])
        assert result.exit_code == 0, f"energon {cmd}: {result.output[-1500:]} {result.exception!r}"


def decoded(root: Path, key: str):
    """Decode one prepared sample back to pixels (1, 3, T, H, W) with the dataset's own codec and statistics."""
    import tarfile

    info = read_info(root)
    codec = load_codec(info.codec, root)
    stats = LatentStats.from_dict(info.latent_stats)
    for shard in sorted(root.glob("*.tar")):
        with tarfile.open(shard) as tar:
            members = {m.name.split(".", 1)[1]: tar.extractfile(m).read() for m in tar if m.name.startswith(key + ".")}
        if members:
            latent = read_sample({"__key__": key, **members})[0]  # the loader's own decoding
            return codec.decode(stats.denormalize(latent.float()[None]))
    raise KeyError(key)


@pytest.fixture(scope="module")
def synthetic(cli_in_process, tmp_path_factory):
    out = tmp_path_factory.mktemp("prep") / "synthetic"
    proc = cli_in_process("prepare", "synthetic", "--out", out, "--num", 24, "--size", 32, "--frames", 4,
                          "--fit-samples", 24, "--shard-size", 10)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc.stdout


def test_synthetic_dataset_is_complete_and_accepted_by_energon(synthetic):
    out, stdout = synthetic
    info = read_info(out)
    assert info.counts["samples"] == 24 and info.counts["images"] + info.counts["videos"] == 24
    assert info.counts["shards"] == 3 and info.codec["kind"] == "patch_pca" and info.latent_channels == 16
    assert info.text_encoder == {"name": "minilm", "dim": 384}
    assert "24 (" in stdout and "samples/s" in stdout and "skipped   none" in stdout
    energon_accepts(out)


def test_worker_processes_write_the_same_dataset(synthetic, cli_in_process, tmp_path):
    """--workers 2 (an executor of spawned processes, stopped and joined at the end: dit_prepare.pipeline.iterate)
    writes the samples of one process, in the same order, byte for byte."""
    from ditcore.data.schema import shard_samples

    out, _ = synthetic
    pooled = tmp_path / "pooled"
    proc = cli_in_process("prepare", "synthetic", "--out", pooled, "--num", 24, "--size", 32, "--frames", 4,
                          "--fit-samples", 24, "--shard-size", 10, "--workers", 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    shards = sorted(p.name for p in out.glob("rank0-*.tar"))
    assert shards == sorted(p.name for p in pooled.glob("rank0-*.tar")) and len(shards) == 3
    for name in shards:
        assert list(shard_samples(out / name)) == list(shard_samples(pooled / name))


def test_prepared_samples_decode_back_close_to_the_inputs(synthetic):
    out, _ = synthetic
    for i in (0, 1, 2, 3):
        pixels, _, _ = generate(i, 0, 32, 4, 0.5)
        original = torch.from_numpy(pixels).permute(3, 0, 1, 2)[None].float() / 127.5 - 1
        # bf16 latents + a 16-channel PCA of 8x8 patches: measured ~24 dB on these 32 px butterflies
        assert psnr(decoded(out, f"{i:08d}"), original) > 20.0


@pytest.mark.slow
def test_synthetic_dataset_loads_with_packing(synthetic):
    out, _ = synthetic
    b = next(iter(build_loader(out, patch_size=1, patch_size_t=1, seq_length=64, batch_size=2)))
    assert b.x.shape == (2, 64, 16) and b.text.shape[-1] == 384
    assert abs(b.x[b.mask].std().item() - 0.5) < 0.2  # latents are normalised to sigma_data
    assert all(c.startswith("a ") and "butterfly" in c for row in b.captions for c in row)


def write_butterfly_parquet(path: Path, n: int = 6) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    rows = []
    for i in range(n):
        img = Image.fromarray(generate(i, 3, 48 + 8 * i, 1, 0.0)[0][0])
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        rows.append({"image": {"bytes": buf.getvalue(), "path": f"{i}.png"}, "name": f"butterfly species {i}"})
    rows.append({"image": {"bytes": b"not an image", "path": "bad.png"}, "name": "broken"})
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_butterfly_from_a_local_parquet_copy(cli_in_process, tmp_path):
    src = write_butterfly_parquet(tmp_path / "train.parquet")
    out = tmp_path / "butterfly"
    proc = cli_in_process("prepare", "butterfly", "--from", src, "--out", out, "--size", 40, "--text-encoder", "null",
                          "--codec", "pixel", "--pixel-factor", 4)
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = read_info(out)
    assert info.counts["samples"] == 6 and info.counts["skipped"] == {"unreadable image (UnidentifiedImageError)": 1}
    assert "1 unreadable image" in proc.stdout
    energon_accepts(out)
    b = next(iter(build_loader(out, patch_size=2, patch_size_t=1, seq_length=100, batch_size=1)))
    for (t, h, w) in b.grids[0]:  # short side 40 px → 10 latent cells → 5 tokens; the long side varies
        assert t == 1 and min(h, w) == 5


def test_butterfly_without_network_fails_fast_with_the_alternatives(tmp_path):
    start = time.monotonic()
    proc = run("butterfly", "--out", tmp_path / "x", env={"HF_ENDPOINT": "http://127.0.0.1:9"}, timeout=120)
    assert proc.returncode == 2 and time.monotonic() - start < 60
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "--from PATH" in err[0] and "dit-prepare synthetic" in err[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height RGB pixels, with a few bytes of data: a decompression bomb."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))


def test_folder_with_images_videos_captions_buckets_and_odd_files(tmp_path):
    """--fit buckets on square, wide and tall pictures and a clip; a file without caption, an unreadable one, a
    non-UTF-8 caption, a decompression bomb (15000x15000 claimed) and a FIFO named zz.png are each skipped, counted
    and named, without a hang or a traceback; the loader packs the buckets' different shapes, skipping nothing."""
    import imageio.v3 as iio

    src = tmp_path / "media"
    (src / "sub").mkdir(parents=True)
    for i in range(3):
        iio.imwrite(src / f"img{i}.png", generate(i, 5, 32, 1, 0.0)[0][0])
        (src / f"img{i}.txt").write_text(f"picture {i}\n")
    for name, (h, w) in {"wide": (30, 64), "tall": (70, 33)}.items():
        iio.imwrite(src / f"{name}.png", generate(7, 5, 72, 1, 0.0)[0][0][:h, :w])
        (src / f"{name}.txt").write_text(f"a {name} picture")
    clip = generate(0, 5, 32, 6, 1.0)[0]
    iio.imwrite(src / "sub" / "clip.gif", clip, duration=125, loop=0)
    (src / "captions.jsonl").write_text(json.dumps({"file": "sub/clip.gif", "caption": "a flapping butterfly"}) + "\n")
    (src / "nocaption.png").write_bytes((src / "img0.png").read_bytes())
    (src / "broken.png").write_bytes(b"garbage")
    (src / "broken.txt").write_text("a broken file")
    (src / "latin.png").write_bytes((src / "img0.png").read_bytes())
    (src / "latin.txt").write_bytes("un papillon bleu, café".encode("latin-1"))
    (src / "bomb.png").write_bytes(png_claiming(15000, 15000))
    (src / "bomb.txt").write_text("too big")
    os.mkfifo(src / "zz.png")  # sorted last: nothing after it would be read if it blocked
    out = tmp_path / "folder"
    proc = run("folder", src, "--out", out, "--size", 32, "--fit", "buckets", "--frames", 4, "--codec", "pixel",
               "--text-encoder", "null", timeout=120)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    info = read_info(out)
    assert info.counts["images"] == 5 and info.counts["videos"] == 1
    from PIL import Image

    assert info.counts["skipped"] == {"no caption (no sidecar .txt and not in captions.jsonl)": 1,
                                      "unreadable image (UnidentifiedImageError)": 1,
                                      "caption is not UTF-8 text": 1,
                                      f"image over Pillow's limit of {Image.MAX_IMAGE_PIXELS} pixels": 1,
                                      "not a regular file": 1}
    for named in ("nocaption.png", "broken.png", "latin.txt", "bomb.png", "zz.png"):
        assert named in proc.stdout, proc.stdout
    # buckets of about 32² pixels, sides multiples of 8 (pixel codec factor 2 x patch 4, demo's): 24x48 and 48x24
    # for the tall and wide pictures, 32x32 for the rest (in latent cells of 2 px)
    assert info.counts["latent_shapes"] == {"12x1x16x16": 3, "12x1x24x12": 1, "12x1x12x24": 1, "12x4x16x16": 1}
    energon_accepts(out)
    grids, skipped = set(), {}
    batches = build_loader(out, patch_size=4, patch_size_t=1, seq_length=64, batch_size=2)
    for _, b in zip(range(8), batches, strict=False):  # the loader repeats the dataset: 8 batches of it
        grids.update(g for row in b.grids for g in row)
        skipped.update(b.skipped)
    assert grids == {(1, 3, 6), (1, 4, 4), (1, 6, 3), (4, 4, 4)} and not skipped


@pytest.mark.slow  # the default run prepares synthetic and folder datasets through the same writer
def test_mock_dataset_for_throughput(tmp_path):
    out = tmp_path / "mock"
    proc = run("mock", "--out", out, "--num", 30, "--latent-shape", "4,1,8,8", "--video-latent-shape", "4,2,4,4",
               "--text-len", 5, "--text-dim", 16)
    assert proc.returncode == 0, proc.stderr[-3000:]
    energon_accepts(out)
    b = next(iter(build_loader(out, patch_size=2, patch_size_t=1, seq_length=16, batch_size=4)))
    assert b.x.shape == (4, 16, 16) and b.text.shape[-1] == 16


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["folder", "/no/such/folder", "--out", "{tmp}/o"], "input folder '/no/such/folder' does not exist"),
        (["butterfly", "--from", "/no/such.parquet", "--out", "{tmp}/o"], "no parquet file there"),
        (["synthetic", "--out", "{tmp}/o", "--codec", "jpeg"], "'jpeg' is not one of 'pca', 'pixel', 'vae'"),
        (["mock", "--out", "{tmp}/o", "--latent-shape", "4,1,8"], "expected four positive integers"),
        (["synthetic", "--out", "{tmp}/o", "--pca-patch", "2", "--pca-channels", "16"],
         "--pca-channels 16 is more than a 2x2 patch holds (3·2² = 12)"),
        (["synthetic", "--out", "{tmp}/o", "--size", "36", "--pca-patch", "8"], "must be a multiple of --pca-patch 8"),
        # 4-pixel PCA cells (folder's default) x the demo's patch 4
        (["folder", "{tmp}", "--out", "{tmp}/o", "--size", "72"], "--size 72 is not a multiple of 16"),
        (["blend", "{tmp}/o", "--dataset", "/no/such", "--dataset", "{tmp}"], "dataset path '/no/such' does not exist"),
        (["blend", "{tmp}/o", "-d", "{tmp}:0", "-d", "{tmp}"], "weight 0 must be a positive number"),
        (["blend", "{tmp}/o", "-d", "{tmp}:1:colour=red", "-d", "{tmp}"], "unknown key 'colour'"),
        (["blend", "{tmp}/o", "-d", "{tmp}"], "a blend needs at least two datasets"),
    ],
)
def test_bad_inputs_give_one_clear_line(cli_in_process, tmp_path, args, message):
    proc = cli_in_process("prepare", *[a.format(tmp=tmp_path) for a in args])
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert len([ln for ln in proc.stderr.splitlines() if ln.strip()]) == 1


def test_existing_output_is_refused_without_overwrite(cli_in_process, synthetic):
    out, _ = synthetic
    proc = cli_in_process("prepare", "mock", "--out", out, "--num", 2)
    assert proc.returncode == 2 and "already exists and is not empty" in proc.stderr
    assert read_info(out).counts["samples"] == 24  # untouched


def test_blend_of_two_prepared_datasets(cli_in_process, tmp_path):
    """`dit-prepare blend OUT --dataset ...` on two synthetic datasets (pixel codec, no text encoder: nothing to fit)
    whose latent statistics differ: the summary has a line per dataset, the second's latents mapped into the first's
    units; both pass Energon's own checks. A dataset with another codec is refused in one line naming it, and an
    existing blend is replaced only with --overwrite (OUT given as --out, as the other commands take it)."""
    from ditcore.data.blend import BLEND_FILE, members

    a, b, m, out = tmp_path / "a", tmp_path / "b", tmp_path / "m", tmp_path / "mix"
    for root, seed in ((a, 1), (b, 2)):
        proc = cli_in_process("prepare", "synthetic", "--out", root, "--num", 6, "--size", 16, "--frames", 2,
                              "--codec", "pixel", "--text-encoder", "null", "--fit-samples", 6, "--seed", seed)
        assert proc.returncode == 0, proc.stderr[-3000:]
        energon_accepts(root)
    proc = cli_in_process("prepare", "blend", out, "--dataset", f"{a}:3:name=day", "--dataset", f"{b}:1:cfg_drop=0.25")
    assert proc.returncode == 0 and not proc.stderr, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == f"blend     {out}: 2 datasets, 12 samples (dit-train data.path={out})"
    assert [line.split() for line in lines[1:4]] == [
        ["dataset", "weight", "samples", "latents", "subflavors", "path"],
        ["day", "0.750", "6", "same", "-", str(a)],
        ["b", "0.250", "6", "mapped", "cfg_drop=0.25", str(b)]]
    assert lines[4].startswith("latents   in day's units; mapped: ") and len(lines) == 5
    info = read_info(out)
    assert info.latent_stats == read_info(a).latent_stats != read_info(b).latent_stats
    assert [(e["name"], e["path"], e["weight"], e["subflavors"]) for e in info.blend] == [
        ("day", "../a", 0.75, {}), ("b", "../b", 0.25, {"cfg_drop": 0.25})]
    assert [mb.latent_map(info.latent_stats) is None for mb in members(out)] == [True, False]
    assert sorted(p.name for p in out.iterdir()) == [BLEND_FILE, "ditcore.json"]  # the pixel codec has no file

    proc = cli_in_process("prepare", "mock", "--out", m, "--num", 2, "--text-dim", 0)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = cli_in_process("prepare", "blend", tmp_path / "other", "-d", a, "-d", m)
    assert proc.returncode == 2 and not (tmp_path / "other").exists()
    assert proc.stderr.startswith("error: dataset 'm' has codec {") and "dataset 'a' {\"factor\": 2" in proc.stderr
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    proc = cli_in_process("prepare", "blend", "--out", out, "-d", a, "-d", b)
    assert proc.returncode == 2 and proc.stderr == f"error: output '{out}' already exists and is not empty — choose " \
                                                   "another path or pass --overwrite\n"
    assert read_info(out) == info
    proc = cli_in_process("prepare", "blend", "--out", out, "-d", a, "-d", b, "--overwrite")
    assert proc.returncode == 0 and [e["weight"] for e in read_info(out).blend] == [0.5, 0.5], proc.stderr


def test_every_source_has_help_and_the_shared_options_declared_once():
    """Each source command takes its option groups (dit_prepare.cli.option_groups) with their defaults; folder's
    codec defaults differ on purpose (the demo's recipe); mock encodes nothing, so it takes only the writer's."""
    import dataclasses

    from typer.main import get_command
    from typer.testing import CliRunner

    from dit_prepare.cli import EncodeOptions, WriteOptions, app

    def defaults(group) -> dict:
        return {f.name: f.metadata["option"].default for f in dataclasses.fields(group)}

    encode, write = defaults(EncodeOptions), defaults(WriteOptions)
    expected = {"synthetic": encode | write, "butterfly": encode | write, "mock": write,
                "folder": encode | {"pca_patch": 4, "latent_norm": "global"} | write}
    commands = get_command(app).commands
    assert set(commands) == set(expected) | {"blend"}  # blend writes no samples: none of the groups'
    assert {p.name for p in commands["blend"].params} == {"out", "datasets", "out_option", "overwrite"}
    for name, options in expected.items():
        taken = {p.name: p.default for p in commands[name].params}
        assert {k: taken.get(k) for k in options} == options, name
        assert not (name == "mock" and set(encode) & set(taken))
        shown = CliRunner().invoke(app, [name, "--help"], env={"COLUMNS": "200"})
        assert shown.exit_code == 0 and "--out" in shown.output and "--shard-size" in shown.output, shown.output


def test_mock_is_a_source_its_samples_the_same_in_any_reading_order():
    """dit-prepare mock writes through the pipeline like the other sources (no writer of its own in the CLI); its
    stream of samples reads the same forwards, backwards and from a fresh copy (a rank or a worker)."""
    import copy

    import dit_prepare.cli
    from dit_prepare.sources import MockSource

    assert "ShardWriter" not in Path(dit_prepare.cli.__file__).read_text()
    source = MockSource(8, (4, 1, 8, 8), (4, 2, 4, 4), 0.5, 3, 16, seed=1)
    forwards = [source.load(i) for i in range(8)]
    backwards = [source.load(i) for i in reversed(range(8))][::-1]
    again = [copy.deepcopy(source).load(i) for i in range(8)]
    for a, b, c in zip(forwards, backwards, again, strict=True):
        assert a.key == b.key == c.key and a.meta == b.meta == c.meta and a.video == b.video == c.video
        assert torch.equal(a.latent, b.latent) and torch.equal(a.latent, c.latent) and torch.equal(a.text, c.text)
        assert a.latent.shape == ((4, 2, 4, 4) if a.video else (4, 1, 8, 8)) and a.text.shape == (3, 16)
        assert a.meta["frames"] == a.latent.shape[1] and a.meta["fps"] == (8.0 if a.video else 0.0)
    assert {s.video for s in forwards} == {True, False}


@pytest.mark.parametrize(("fit", "width", "height", "expected"), [
    ("crop", 451, 300, (64, 64)), ("crop", 40, 90, (64, 64)),
    ("resize", 451, 300, (96, 64)),  # short side 64, long side 96.2 cropped to 96
    ("resize", 300, 1000, (64, 208)),  # 213.3 → 208
    ("buckets", 451, 300, (80, 48)),  # 1.50 → the 5:3 bucket (4:3, 3:2 and 16:9 round to it at unit 16)
    ("buckets", 300, 640, (48, 96)),  # 0.47 → 1:2
    ("buckets", 500, 520, (64, 64)),
])
def test_framing_gives_sides_that_every_shipped_patch_divides(fit, width, height, expected):
    from PIL import Image

    from dit_prepare.sources import Framing

    framing = Framing(fit, 64, 16)
    assert framing.target(width, height) == expected
    pixels = framing(Image.new("RGB", (width, height)))
    assert pixels.shape == (expected[1], expected[0], 3)
    if fit == "buckets":
        assert all(w % 16 == 0 and h % 16 == 0 and abs(w * h - 64**2) <= 0.25 * 64**2 for w, h in framing.buckets())


def test_folder_source_reads_each_sample_once_without_numpy_warnings(tmp_path, monkeypatch):
    """The codec's fitting samples are reused for writing (each file decoded once), and PIL's read-only pixels
    reach torch without the "NumPy array is not writable" warning (warnings are errors here)."""
    import warnings

    import imageio.v3 as iio

    from dit_prepare.pipeline import CodecChoice, prepare
    from dit_prepare.sources import FolderSource, Framing
    from ditcore.codecs.text import load_text_encoder

    for i in range(4):
        iio.imwrite(tmp_path / f"{i}.png", generate(i, 1, 40, 1, 0.0)[0][0])
        (tmp_path / f"{i}.txt").write_text(f"picture {i}")
    source = FolderSource(tmp_path, Framing("crop", 32, 8), 1, 0.0)
    loads = []
    monkeypatch.setattr(source, "load", lambda i, load=source.load: loads.append(i) or load(i))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        summary = prepare(source, tmp_path / "out", codec=CodecChoice("pixel", pixel_factor=2),
                          text_encoder=load_text_encoder("null"), fit_samples=3, progress=False)
    assert summary.samples == 4 and sorted(loads) == [0, 1, 2, 3]


MAXRSS = """
import resource, sys
from pathlib import Path
from dit_prepare.sources import FolderSource, Framing
item = FolderSource(Path(sys.argv[1]), Framing("crop", 32, 8), 4, 0.0).load(0)
assert item.pixels.shape == (4, 32, 32, 3), item.pixels.shape
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def test_a_long_video_costs_the_memory_of_a_short_one(tmp_path):
    """A 2-minute clip's peak memory is within 20% of a 4-second clip's when a sample takes its first 4 frames.

    Peak resident memory (ru_maxrss) of a fresh process that only loads the clip: it counts every allocation of the
    process, the decoder's C buffers included (tracemalloc sees only Python's allocator, so a decoder holding frames
    in C would pass unseen). ffmpeg itself runs as a child process and streams; its memory does not grow with the
    video. 64x64 frames at 25 fps: decoding all 3000 frames of the long clip held 37 MB more than the short one."""
    from ditcore.media import write_sample

    x = np.arange(64)
    for name, seconds in (("short", 4), ("long", 120)):
        (tmp_path / name).mkdir()
        t = np.arange(25 * seconds)[:, None, None, None]
        frames = ((x[None, None, :, None] + x[None, :, None, None] + 2 * t) % 256).astype(np.uint8).repeat(3, -1)
        write_sample(frames, tmp_path / name / "clip.mp4", fps=25)
        (tmp_path / name / "clip.txt").write_text("a gradient drifting")
    peak = {}
    for name in ("short", "long"):
        proc = subprocess.run([sys.executable, "-c", MAXRSS, str(tmp_path / name)], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        peak[name] = int(proc.stdout.split()[-1])
    assert peak["long"] <= 1.2 * peak["short"], peak


# Photographs bundled with scikit-image (skimage/data: no download), captioned here by what they show.
PHOTOGRAPHS = {
    "astronaut.png": "an astronaut in a white spacesuit in front of a flag", "brick.png": "a grey brick wall",
    "camera.png": "a man with a camera on a tripod", "chelsea.png": "a ginger tabby cat",
    "coffee.png": "a cup of coffee on a saucer", "coins.png": "old coins on a dark background",
    "grass.png": "a close-up of green grass", "gravel.png": "a close-up of grey gravel",
    "hubble_deep_field.jpg": "galaxies in deep space", "ihc.png": "a stained tissue sample under a microscope",
    "moon.png": "the surface of the moon", "retina.jpg": "a photograph of a human retina",
    "rocket.jpg": "a rocket on a launch pad", "motorcycle_left.png": "a motorcycle in a garage",
    "clock_motion.png": "a clock on a wall, blurred by motion", "page.png": "a page of printed text",
    "cell.png": "a cell under a microscope", "microaneurysms.png": "blood vessels of an eye",
}


@pytest.mark.slow  # 72 s on 2 cores: make test-slow, which CI runs
def test_own_photographs_with_default_settings_train_the_demo_model(tmp_path):
    """Photographs nobody here made, of many sizes and aspect ratios, grey and colour → `dit-prepare folder` with
    its defaults → `dit-train --config demo`: every photograph is used (nothing skipped by either), the summary says
    how many tokens a photograph makes at the demo's patch, and the loss falls to under half the untrained model's.

    Overrides of the demo, for a ~30-step run on 2 cores: 30 steps, 4 rows a step (8), a 10-step warm-up (50: the
    run would end before the demo's learning rate), one validation prompt, one seed, 2 sampler steps, no clip.
    The threshold: half the untrained model's loss, measured in the same run as the mean of steps 1-5 (a mean: each
    step draws its own noise levels, so single losses scatter by ±40%). Measured (seeded, repeatable): 3.08 → 1.08
    over steps 26-30 (0.35x); with train.seed=1 and 2: 0.39x and 0.30x.
    """
    skimage = pytest.importorskip("skimage")
    from dit_train.cli import find_config
    from dit_train.config import load_config

    photos = tmp_path / "photos"
    photos.mkdir()
    bundled = Path(skimage.__file__).parent / "data"
    for name, caption in PHOTOGRAPHS.items():
        (photos / name).write_bytes((bundled / name).read_bytes())
        (photos / name).with_suffix(".txt").write_text(caption)
    data = tmp_path / "data"
    proc = run("folder", photos, "--out", data, env={"PYTHONWARNINGS": "default"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "not writable" not in proc.stderr, proc.stderr[-3000:]  # torch's warning on read-only PIL pixels
    info = read_info(data)
    assert info.counts["samples"] == len(PHOTOGRAPHS) and info.counts["skipped"] == {}
    # the demo's code (make demo's DEMO_PREPARE): 4x4-pixel cells, 16 channels, one scale for every channel
    assert info.codec["patch"] == 4 and info.spatial_factor == 4 and info.latent_channels == 16
    assert len(set(info.latent_stats["std"])) == 1 and len(set(info.latent_stats["mean"])) == 16
    from PIL import Image

    from dit_prepare.sources import Framing

    with Image.open(photos / "astronaut.png") as img:  # the first file: key 00000000
        original = torch.from_numpy(Framing("crop", 64, 16)(img).astype(np.float32)).permute(2, 0, 1)[None, :, None]
    # bf16 latents of a 16-channel PCA of 4x4 patches: measured 30.0 dB (28.7 to 54.2 dB over the photographs)
    assert psnr(decoded(data, "00000000"), original / 127.5 - 1) > 27.0
    demo = load_config(find_config("demo"))
    tokens = (64 // info.spatial_factor // demo.model.patch_size) ** 2  # default --size 64, centre-cropped
    assert info.counts["latent_shapes"] == {
        f"16x1x{64 // info.spatial_factor}x{64 // info.spatial_factor}": len(PHOTOGRAPHS)}
    demo_line = next(ln for ln in proc.stdout.splitlines() if ln.split()[:1] == ["demo"])
    assert f"{tokens} tokens ({demo.data.seq_length}: {demo.data.seq_length // tokens} per row)" in demo_line

    run_dir = tmp_path / "run"
    train = subprocess.run(
        [str(BIN / "dit-train"), "--config", "demo", f"data.path={data}", f"train.run_dir={run_dir}",
         "train.steps=30", "checkpoint.every=30", "train.global_batch=4", "train.micro_batch=4",
         "optim.warmup_steps=10", "data.num_workers=0", "logging.every=1", "logging.tensorboard=false",
         "validation.prompts=[a cup of coffee on a saucer]", "validation.seeds=1", "validation.clip_frames=0",
         "validation.steps=2"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore",
                                                          "OMP_NUM_THREADS": "1"})
    assert train.returncode == 0, train.stderr[-3000:]

    rows = list(csv.DictReader(next((run_dir / "csv").glob("*/metrics.csv")).open()))
    losses = [float(r["loss"]) for r in rows]
    assert len(losses) == 30 and sum(int(r["skipped"]) for r in rows) == 0
    untrained = sum(losses[:5]) / 5
    assert sum(losses[-5:]) / 5 < 0.5 * untrained, losses


@pytest.mark.slow  # two processes under torchrun; the summary's code path is otherwise the one-process one
def test_one_summary_under_torchrun(tmp_path):
    """Every rank writes its own shards; rank 0 alone prints the summary, with every rank's samples counted."""
    import imageio.v3 as iio

    src = tmp_path / "media"
    src.mkdir()
    for i in range(5):
        iio.imwrite(src / f"img{i}.png", generate(i, 5, 32, 1, 0.0)[0][0])
        (src / f"img{i}.txt").write_text(f"picture {i}")
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={port}",
                           str(BIN / "dit-prepare"), "folder", str(src), "--out", str(tmp_path / "out"), "--size", "32",
                           "--codec", "pixel", "--text-encoder", "null"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    summaries = [ln for ln in proc.stdout.splitlines() if ln.startswith("samples ")]
    assert summaries == ["samples   5 (5 images, 0 clips) in 2 shards, " + summaries[0].split(" shards, ")[1]]
    assert proc.stdout.count("dataset ") == 1


def write_classes(root: Path) -> dict[str, int]:
    """ImageNet's layout: ROOT/CLASS/*.png, 3 classes made in reverse name order (the label is the sorted index, not
    the order of creation), one image without a caption, and a captioned file directly in ROOT. → caption: label."""
    import imageio.v3 as iio

    expected = {}
    for label, name, count in ((2, "n03", 2), (1, "n02", 3), (0, "n01", 2)):
        (root / name).mkdir(parents=True)
        for j in range(count):
            iio.imwrite(root / name / f"{j}.JPEG", generate(3 * label + j, 5, 32, 1, 0.0)[0][0], extension=".jpeg")
            if (name, j) != ("n02", 2):
                (root / name / f"{j}.txt").write_text(f"{name} picture {j}")
                expected[f"{name} picture {j}"] = label
    expected["n02"] = 1  # 2.JPEG has no caption: its class's name stands in
    iio.imwrite(root / "stray.png", generate(0, 5, 32, 1, 0.0)[0][0])
    (root / "stray.txt").write_text("a stray picture")
    return expected


def test_folder_labels_from_subfolders_reach_the_loader(tmp_path):
    """`dit-prepare folder ROOT --labels subfolders` (in process): each sample's label is its folder's index among
    ROOT's folders sorted by name, ditcore.json records 3 classes and their names, the file in ROOT is skipped by
    name, and ditcore's loader yields every caption with its label."""
    import tarfile

    from typer.testing import CliRunner

    from dit_prepare.cli import app

    expected = write_classes(tmp_path / "imagenet")
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["folder", str(tmp_path / "imagenet"), "--out", str(out), "--labels",
                                      "subfolders", "--size", "32", "--codec", "pixel", "--text-encoder", "null"])
    assert result.exit_code == 0, result.output
    info = read_info(out)
    assert info.num_classes == 3 and info.class_names == ["n01", "n02", "n03"]
    assert info.counts["samples"] == 7 and info.counts["skipped"] == {
        "not in a class subfolder (--labels subfolders)": 1}
    assert "stray.png" in result.stdout
    written = {}
    for shard in out.glob("*.tar"):
        with tarfile.open(shard) as tar:
            for m in tar:
                if m.name.endswith(".json"):
                    meta = json.loads(tar.extractfile(m).read())
                    written[meta["caption"]] = meta["label"]
                    assert meta["source"].split("/")[0] == info.class_names[meta["label"]]
    assert written == expected

    seen = {}
    batches = build_loader(out, patch_size=4, patch_size_t=1, seq_length=64, batch_size=2)  # 16 tokens a sample
    for _, b in zip(range(4), batches, strict=False):  # 16 samples: the loader repeats the 7
        for row, captions in enumerate(b.captions):
            for slot, caption in enumerate(captions):
                seen.setdefault(caption, set()).add(int(b.class_labels[row, slot]))
    assert seen == {caption: {label} for caption, label in expected.items()}


def test_folder_labels_class_count_and_refusals(tmp_path):
    """--num-classes declares a larger model's count (names stay the folders'); fewer than the folders, or labels
    with no file in a subfolder, is one line naming the value and what to do; without --labels nothing changes."""
    from typer.testing import CliRunner

    from dit_prepare.cli import app
    from dit_prepare.sources import FolderSource, Framing, SourceError

    root = tmp_path / "imagenet"
    write_classes(root)
    framing = Framing("crop", 32, 8)
    labelled = FolderSource(root, framing, 1, 0.0, labels="subfolders", num_classes=1000)
    assert labelled.num_classes == 1000 and labelled.classes == ["n01", "n02", "n03"]
    assert [labelled.load(i).meta.get("label") for i in (0, 2, 4)] == [0, 1, 1]  # n01/0, n02/0, n02/2
    plain = FolderSource(root, framing, 1, 0.0)  # today's behaviour: no labels, a caption per file
    assert plain.num_classes == 0 and "label" not in plain.load(0).meta
    with pytest.raises(Exception, match="no caption"):
        plain.load(4)  # n02/2.JPEG
    with pytest.raises(SourceError, match="has no images or videos in subfolders"):
        FolderSource(root / "n01", framing, 1, 0.0, labels="subfolders")

    result = CliRunner().invoke(app, ["folder", str(root), "--out", str(tmp_path / "out"), "--labels", "subfolders",
                                      "--num-classes", "2", "--size", "32", "--codec", "pixel"])
    assert result.exit_code == 2 and len(result.stderr.splitlines()) == 1, result.output
    assert result.stderr.startswith("error: --num-classes 2 is fewer than the 3 class subfolders of ")
    assert "(n01, n02, n03): give at least 3" in result.stderr and not (tmp_path / "out").exists()


def test_class_names_in_ditcore_json_keep_unlabelled_datasets_as_before(tmp_path):
    """An unlabelled dataset's ditcore.json has exactly the keys it had before class_names (so an older ditcore,
    which refuses unknown keys, still reads it) and reads back with no names; a labelled one keeps its names; names
    that are not strings or outnumber num_classes are refused in one line."""
    from ditcore.data.schema import DatasetError, DatasetInfo, parse_info

    base = dict(codec={"kind": "none"}, latent_stats={}, text_encoder={"name": "null", "dim": 0}, latent_channels=4,
                spatial_factor=1, temporal_factor=1)
    DatasetInfo(**base).write(tmp_path)
    before = {"codec", "latent_stats", "text_encoder", "latent_channels", "spatial_factor", "temporal_factor",
              "counts", "num_classes", "format"}
    assert set(json.loads((tmp_path / "ditcore.json").read_text())) == before
    assert parse_info(tmp_path / "ditcore.json").class_names == []
    DatasetInfo(**base, num_classes=1000, class_names=["n01", "n02"]).write(tmp_path)
    assert parse_info(tmp_path / "ditcore.json").class_names == ["n01", "n02"]
    for names, classes in ((["a", "b"], 1), ([1, 2], 2), ("ab", 2)):
        (tmp_path / "ditcore.json").write_text(json.dumps({**base, "num_classes": classes, "class_names": names,
                                                           "format": "ditcore-dataset/1"}))
        with pytest.raises(DatasetError, match=f"has class_names .* for num_classes {classes}: expected at most"):
            parse_info(tmp_path / "ditcore.json")


@pytest.mark.slow  # importing diffusers costs 5.6 s of CPU (measured); test_bad_inputs has the error for synthetic
def test_folder_with_a_vae_that_does_not_load_is_one_line(tmp_path):
    """`folder --codec vae` loads the VAE to learn its pixels per latent cell before --size is checked: a VAE folder
    that does not exist (or a hub id offline) is one line, not a traceback."""
    from typer.testing import CliRunner

    from dit_prepare.cli import app

    result = CliRunner().invoke(app, ["folder", str(tmp_path), "--out", str(tmp_path / "out"), "--codec", "vae",
                                      "--vae", str(tmp_path / "no-vae")])
    assert result.exit_code == 2, result.output
    assert result.stderr == f"error: VAE folder '{tmp_path / 'no-vae'}' does not exist — pass an existing folder " \
                            "or a hub id\n", result.output


def _keys(root: Path) -> list[str]:
    import tarfile

    return sorted({m.name.split(".", 1)[0] for shard in root.glob("rank*-*.tar") for m in tarfile.open(shard)})


def test_val_samples_hold_out_a_complete_dataset_that_training_never_reads(cli_in_process, tmp_path):
    """--val-samples N: the evenly spread samples (2k+1)·M // 2N go to OUT/val, a dataset of its own with the same
    latent description, and out of the training set, its Energon index included (which would find val/'s shards);
    ditcore.json says so on both sides. --overwrite takes the old val/ away with its training set."""
    out = tmp_path / "mock"
    proc = cli_in_process("prepare", "mock", "--out", out, "--num", 12, "--latent-shape", "4,1,4,4",
                          "--video-latent-shape", "4,2,4,4", "--text-len", 3, "--text-dim", 8, "--val-samples", 3)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "held out  3 samples at val/" in proc.stdout
    train, val = read_info(out), read_info(out / "val")
    assert _keys(out / "val") == ["00000002", "00000006", "00000010"]  # (2k+1)·12 // 6
    assert _keys(out) == [f"{i:08d}" for i in range(12) if i not in (2, 6, 10)]
    indexed = json.loads((out / ".nv-meta" / ".info.json").read_text())["shard_counts"]
    assert sum(indexed.values()) == 9 and all("/" not in name for name in indexed)
    assert train.split["heldout"] == "val" and train.split["samples"] == 3 and train.counts["samples"] == 9
    assert val.split["heldout_of"] == ".." and val.counts["samples"] == 3
    assert (val.latent_stats, val.text_encoder, val.codec) == (train.latent_stats, train.text_encoder, train.codec)

    start_dataset(out, overwrite=True)  # what --overwrite does first
    assert list(out.iterdir()) == []
    proc = cli_in_process("prepare", "mock", "--out", tmp_path / "o", "--num", 4, "--val-samples", 4)
    assert proc.returncode == 2 and "--val-samples 4 leaves no training samples of the source's 4" in proc.stderr
    assert not (tmp_path / "o").exists()


def test_an_interrupted_prepare_leaves_no_val_that_passes_for_complete(tmp_path, monkeypatch):
    """The held-out set is finished first; a failure finishing the training set removes both."""
    from dit_prepare import pipeline
    from dit_prepare.sources import MockSource

    finish = pipeline.finish_dataset

    def finish_val_then_fail(root, info):
        if Path(root).name != "val":
            assert read_info(Path(root) / "val").counts["samples"] == 2  # complete at this moment
            raise KeyboardInterrupt
        finish(root, info)

    monkeypatch.setattr(pipeline, "finish_dataset", finish_val_then_fail)
    with pytest.raises(KeyboardInterrupt):
        pipeline.prepare(MockSource(8, (4, 1, 4, 4), (4, 2, 4, 4), 0.5, 3, 8, 0), tmp_path / "o", progress=False,
                         val_samples=2)
    assert not (tmp_path / "o").exists()


def test_a_wan_ready_dataset_with_the_wan_vae_and_umt5(cli_in_process, tmp_path):
    """`synthetic --codec vae --vae-class AutoencoderKLWan --text-encoder umt5:DIR` on tiny random models saved as their
    hub repositories are: ditcore.json records both, a sample's text states are UMT5's for its caption (stored in
    float16), and a 5-frame clip is 3 latent frames (Wan's causal 1 + 4/2)."""
    diffusers = pytest.importorskip("diffusers")
    transformers = pytest.importorskip("transformers")
    from ditcore.codecs.text import load_text_encoder
    from ditcore.data.schema import shard_samples
    from ditcore.testing import fp32_tolerance

    torch.manual_seed(0)
    diffusers.AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[True],
                               latents_mean=[0.0] * 4, latents_std=[1.0] * 4).save_pretrained(tmp_path / "wan-vae")
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]  # a real (Unigram) T5 tokenizer, as UMT5's
    vocab += [(c, -3.0) for c in "abcdefghijklmnopqrstuvwxyz"] + [("▁" + w, -1.0) for w in ("a", "butterfly", "with")]
    transformers.T5Tokenizer(vocab=vocab, extra_ids=0).save_pretrained(tmp_path / "umt5")
    config = transformers.UMT5Config(vocab_size=len(vocab), d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=2)
    transformers.UMT5EncoderModel(config).save_pretrained(tmp_path / "umt5")
    out = tmp_path / "wan"
    proc = cli_in_process("prepare", "synthetic", "--out", out, "--num", 4, "--size", 16, "--frames", 5,
                          "--fit-samples", 4, "--codec", "vae", "--vae", tmp_path / "wan-vae", "--vae-class",
                          "AutoencoderKLWan", "--text-encoder", f"umt5:{tmp_path / 'umt5'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = read_info(out)
    assert info.codec == {"kind": "diffusers", "class": "AutoencoderKLWan", "source": str(tmp_path / "wan-vae"),
                          "subfolder": None, "dtype": "float32"}
    assert info.text_encoder == {"name": f"umt5:{tmp_path / 'umt5'}", "dim": config.d_model}
    assert (info.latent_channels, info.spatial_factor, info.temporal_factor) == (4, 2, 2)
    encoder = load_text_encoder(info.text_encoder["name"])
    samples = [read_sample(s) for shard in sorted(out.glob("*.tar")) for s in shard_samples(shard)]
    assert len(samples) == 4 and {s[0].shape[1] for s in samples} == {1, 3}  # images and 5-frame clips: 1 + 4/2
    for _, text, meta in samples:
        expected = encoder.encode([meta["caption"]])[0]
        assert text.dtype == torch.float16 and text.shape == expected.shape
        # float32 rounding (the caption was encoded in a batch, padded: work as tests/ditcore/codecs'
        # encoder_work counts it) and the float16 of storage, which rounds to within half its ε
        D, tokens = config.d_model, max(len(s[1]) for s in samples)
        work = D + config.num_layers * (4 * D + 2 * tokens + config.d_kv * (1 + config.num_heads) + config.d_ff)
        atol = 2 * fp32_tolerance(work, expected.abs().max().item())
        torch.testing.assert_close(text.float(), expected, rtol=torch.finfo(torch.float16).eps / 2, atol=atol)
