"""dit-prepare as a user runs it: every source gives a dataset that Energon accepts and ditcore can load."""

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ditcore.codecs import LatentStats, load_codec, psnr
from ditcore.data.loader import build_loader
from ditcore.data.schema import read_info, read_sample
from ditcore.data.synthetic import generate
from ditcore.data.writer import TYPED_CONFIG

BIN = Path(sys.executable).parent


def run(*args, env=None, timeout=300):
    env = {**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})}
    return subprocess.run([str(BIN / "dit-prepare"), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env)


def energon_accepts(root: Path) -> None:
    for cmd in ("info", "lint"):
        proc = subprocess.run([sys.executable, "-m", "megatron.energon.cli.main", cmd, str(root), "--dataset-config",
                               TYPED_CONFIG], capture_output=True, text=True)
        assert proc.returncode == 0, f"energon {cmd}: {proc.stderr[-1500:]}"


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
def synthetic(tmp_path_factory):
    out = tmp_path_factory.mktemp("prep") / "synthetic"
    proc = run("synthetic", "--out", out, "--num", 24, "--size", 32, "--frames", 4, "--fit-samples", 24,
               "--shard-size", 10)
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


def test_butterfly_from_a_local_parquet_copy(tmp_path):
    src = write_butterfly_parquet(tmp_path / "train.parquet")
    out = tmp_path / "butterfly"
    proc = run("butterfly", "--from", src, "--out", out, "--size", 40, "--text-encoder", "null", "--codec", "pixel",
               "--pixel-factor", 4)
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
    for _, b in zip(range(8), build_loader(out, patch_size=4, patch_size_t=1, seq_length=64, batch_size=2)):
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
    ],
)
def test_bad_inputs_give_one_clear_line(tmp_path, args, message):
    proc = run(*[a.format(tmp=tmp_path) for a in args])
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert len([ln for ln in proc.stderr.splitlines() if ln.strip()]) == 1


def test_pca_patch_and_one_latent_scale(tmp_path):
    """--pca-patch 4 --latent-norm global: 4x4-pixel cells, and one std for every channel in ditcore.json."""
    out = tmp_path / "pca4"
    proc = run("synthetic", "--out", out, "--num", 8, "--size", 32, "--frames", 4, "--fit-samples", 8,
               "--pca-patch", 4, "--pca-channels", 12, "--latent-norm", "global")
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = read_info(out)
    assert info.codec["patch"] == 4 and info.spatial_factor == 4 and info.latent_channels == 12
    assert len(set(info.latent_stats["std"])) == 1 and len(set(info.latent_stats["mean"])) == 12
    pixels, _, _ = generate(0, 0, 32, 4, 0.5)
    original = torch.from_numpy(pixels).permute(3, 0, 1, 2)[None].float() / 127.5 - 1
    assert decoded(out, "00000000").shape[-2:] == (32, 32)
    assert psnr(decoded(out, "00000000"), original) > 24.0


def test_existing_output_is_refused_without_overwrite(synthetic):
    out, _ = synthetic
    proc = run("mock", "--out", out, "--num", 2)
    assert proc.returncode == 2 and "already exists and is not empty" in proc.stderr
    assert read_info(out).counts["samples"] == 24  # untouched


@pytest.mark.parametrize("command", ["synthetic", "butterfly", "folder", "mock"])
def test_every_source_has_help(command):
    proc = run(command, "--help")
    assert proc.returncode == 0 and "--out" in proc.stdout
