"""A blend's folder (ditcore.data.blend): member specs, the up-front refusals, paths that move with the folder, the
latent-statistics map, and a write that never leaves something passing for a blend."""

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from ditcore.codecs import LatentStats
from ditcore.data.blend import BLEND_FILE, check_compatible, members, parse_spec, write_blend
from ditcore.data.schema import DatasetError, DatasetInfo, is_blend, read_info
from ditcore.data.writer import TYPED_CONFIG, ShardWriter, finish_dataset, start_dataset

N = 6
PIXEL = {"kind": "pixel", "factor": 1}
PCA = {"kind": "patch_pca", "patch": 2, "channels": 4, "file": "codec_pca.safetensors"}
TEXT = {"name": "test", "dim": 8}


def stats(mean: float, std: float) -> dict:
    return LatentStats(torch.linspace(-1, 1, 4) + mean, torch.linspace(0.5, 2, 4) * std).to_dict()


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """Six samples (4-channel images and 2-frame clips) in two shards, indexed by Energon: written once, copied into
    every dataset below (`energon prepare` is a process of its own, ~3 s)."""
    root = tmp_path_factory.mktemp("shards") / "data"
    start_dataset(root, overwrite=False)
    g = torch.Generator().manual_seed(0)
    with ShardWriter(root, max_count=3) as w:
        for i in range(N):
            latent = torch.randn(4, 2 if i % 3 == 0 else 1, 4, 4, generator=g)
            w.write(f"s{i:05d}", latent, torch.randn(2, 8, generator=g), {"caption": f"c{i}", "fps": 8.0})
        shapes, keys = dict(w.latent_shapes), w.shape_keys
    finish_dataset(root, DatasetInfo(codec=PIXEL, latent_stats={}, text_encoder=TEXT, latent_channels=4,
                                     spatial_factor=1, temporal_factor=1,
                                     counts={"samples": N, "latent_shapes": shapes, "latent_shape_keys": keys}))
    return root


@pytest.fixture
def write_dataset(shards):
    """A finished dataset at `root` with the given codec, text encoder and latent statistics (a fitted codec's
    parameter file holding `codec_file`), its samples and index the shards fixture's."""

    def write(root: Path, *, codec=PIXEL, text_encoder=TEXT, latent_stats=None, codec_file: bytes = b"",
              **fields) -> Path:
        shutil.copytree(shards, root)
        if "file" in codec:
            (root / codec["file"]).write_bytes(codec_file)
        info = dataclasses.replace(read_info(shards), codec=codec, text_encoder=text_encoder,
                                   latent_stats=stats(0, 1) if latent_stats is None else latent_stats, **fields)
        info.write(root)
        return root

    return write


@pytest.mark.parametrize(("spec", "parsed"), [
    ("data/a", (Path("data/a"), 1.0, {}, None)),
    ("data/a:2.5", (Path("data/a"), 2.5, {}, None)),
    ("/abs/a:1e-3:name=photos-v2:cfg_drop=0.25", (Path("/abs/a"), 1e-3, {"cfg_drop": 0.25}, "photos-v2")),
    ("a:1:cfg_drop=1", (Path("a"), 1.0, {"cfg_drop": 1.0}, None)),
])
def test_spec(spec, parsed):
    assert parse_spec(spec) == parsed


@pytest.mark.parametrize(("spec", "message"), [
    (":2", "no path — give PATH[:WEIGHT[:KEY=VALUE...]]"),
    ("a:heavy", "weight 'heavy' is not a number"),
    ("a:0", "weight 0 must be a positive number"),
    ("a:-1", "weight -1 must be a positive number"),
    ("a:inf", "weight inf must be a positive number"),
    ("a:nan", "weight nan must be a positive number"),
    ("a:1:colour=red", "unknown key 'colour'; a member sets name= or cfg_drop= (a probability in [0, 1])"),
    ("a:1:cfg_drop=1.5", "cfg_drop=1.5 must be a probability in [0, 1]"),
    ("a:1:cfg_drop=nan", "cfg_drop=nan must be a probability in [0, 1]"),
    ("a:1:cfg_drop=most", "cfg_drop=most must be a probability in [0, 1]"),
    ("a:1:photos", "'photos' is not KEY=VALUE"),
    ("a:1:name=", "name= is empty"),
    ("a:1:name=x:name=y", "name= is given twice"),
    ("a:1:cfg_drop=0.1:cfg_drop=0.2", "cfg_drop= is given twice"),
])
def test_bad_spec_is_one_line_naming_it(spec, message):
    with pytest.raises(ValueError) as e:
        parse_spec(spec)
    assert str(e.value).startswith(f"--dataset {spec!r}: ") and message in str(e.value) and "\n" not in str(e.value)


BASE = DatasetInfo(codec=PIXEL, latent_stats=stats(0, 1), text_encoder=TEXT, latent_channels=4, spatial_factor=1,
                   temporal_factor=1)


@pytest.mark.parametrize(("change", "message"), [
    ({"codec": {"kind": "pixel", "factor": 2}},
     'has codec {"factor": 2, "kind": "pixel"}, dataset \'a\' {"factor": 1, "kind": "pixel"}'),
    ({"text_encoder": {"name": "minilm", "dim": 8}},
     'has text_encoder {"dim": 8, "name": "minilm"}, dataset \'a\' {"dim": 8, "name": "test"}'),
    ({"text_encoder": {"name": "test", "dim": 16}},
     'has text_encoder {"dim": 16, "name": "test"}, dataset \'a\' {"dim": 8, "name": "test"}'),
    ({"latent_channels": 8}, "has latent_channels 8, dataset 'a' 4"),
    ({"temporal_factor": 4}, "has temporal_factor 4, dataset 'a' 1"),
    ({"num_classes": 10}, "has num_classes 10, dataset 'a' 0"),
])
def test_incompatible_datasets_are_named_with_the_difference(change, message):
    infos = {"a": BASE, "same": dataclasses.replace(BASE, latent_stats=stats(1, 2), counts={"samples": 3}),
             "b": dataclasses.replace(BASE, **change)}
    with pytest.raises(DatasetError) as e:
        check_compatible(infos)
    assert str(e.value).startswith(f"dataset 'b' {message}: a blend's datasets must be prepared with the same codec")
    check_compatible({k: v for k, v in infos.items() if k != "b"})  # latent statistics and counts may differ


def test_a_fitted_codec_must_be_the_same_fit(write_dataset, tmp_path):
    """Two PCA codecs with equal settings but fitted on other data: the same config, other parameter files."""
    a = write_dataset(tmp_path / "a", codec=PCA, codec_file=b"components fitted on a")
    b = write_dataset(tmp_path / "b", codec=PCA, codec_file=b"components fitted on b")
    same = write_dataset(tmp_path / "same", codec=PCA, codec_file=b"components fitted on a")
    with pytest.raises(DatasetError, match=r"^dataset 'b' has another codec_pca\.safetensors than dataset 'a': its "
                                           "codec was fitted on other data"):
        write_blend(tmp_path / "blend", [(a, 1, {}, None), (same, 1, {}, None), (b, 1, {}, None)])
    assert not (tmp_path / "blend").exists()  # refused before anything was written
    write_blend(tmp_path / "blend", [(a, 1, {}, None), (same, 1, {}, None)])
    assert (tmp_path / "blend" / "codec_pca.safetensors").read_bytes() == b"components fitted on a"
    (same / "codec_pca.safetensors").unlink()
    with pytest.raises(DatasetError, match=r"^dataset 'same' .* has no codec_pca\.safetensors, its codec's parameters"):
        write_blend(tmp_path / "other", [(a, 1, {}, None), (same, 1, {}, None)])


def test_bad_member_lists_are_refused_before_writing(write_dataset, tmp_path):
    a, b = write_dataset(tmp_path / "a"), write_dataset(tmp_path / "b")
    unfinished = write_dataset(tmp_path / "unfinished")
    (unfinished / "ditcore.json").unlink()
    write_blend(tmp_path / "blend", [(a, 1, {}, None), (b, 1, {}, None)])
    out = tmp_path / "out"
    for specs, message in [
        ([(a, 1, {}, None)], r"a blend needs at least two datasets .*, got 1 — train on a single dataset by pointing"),
        ([(a, 1, {}, None), (tmp_path / "nope", 1, {}, None)], "dataset path '.*nope' does not exist"),
        ([(a, 1, {}, None), (unfinished, 1, {}, None)], "has no ditcore.json / .nv-meta/: it is not a finished"),
        ([(a, 1, {}, None), (a, 1, {}, None)], "two datasets are named 'a' — name one with PATH:WEIGHT:name=NAME"),
        ([(a, 1, {}, None), (b, 1, {}, "a")], "two datasets are named 'a'"),
        ([(a, 1, {}, None), (b, 1, {}, "b c")], "dataset name 'b c' .* must be letters, digits"),
        ([(a, 1, {}, None), (tmp_path / "blend", 1, {}, None)], "is a blend itself: list its datasets instead"),
    ]:
        with pytest.raises(DatasetError, match=message):
            write_blend(out, specs)
        assert not out.exists()


def test_the_folder_and_its_datasets_move_together(write_dataset, tmp_path):
    """Paths are relative to the blend's folder, in ditcore.json and in Energon's blend.yaml: a copy of the parent
    folder elsewhere is a blend of the copies, the original gone."""
    from megatron.energon import load_dataset
    from megatron.energon.epathlib import EPath

    here = tmp_path / "here"
    write_dataset(here / "data" / "a")
    write_dataset(here / "data" / "b")
    info = write_blend(here / "blends" / "mix", [(here / "data" / "a", 3, {}, None),
                                                 (here / "data" / "b", 1, {"cfg_drop": 0.5}, "bees")])
    assert [(e["name"], e["path"], e["weight"]) for e in info.blend] == [("a", "../../data/a", 0.75),
                                                                           ("bees", "../../data/b", 0.25)]
    there = shutil.copytree(here, tmp_path / "elsewhere" / "there")
    shutil.rmtree(here)
    blend = there / "blends" / "mix"
    assert is_blend(blend) and read_info(blend) == info
    assert [(m.name, m.root, m.weight, m.subflavors) for m in members(blend)] == [
        ("a", there / "data" / "a", 0.75, {}), ("bees", there / "data" / "b", 0.25, {"cfg_drop": 0.5})]
    refs = load_dataset(EPath(blend / BLEND_FILE)).splits["train"].blend  # Energon resolves them alike
    assert [(Path(str(r.path)), r.weight, r.subflavors) for r in refs] == [
        (there / "data" / "a", 0.75, {"dataset": "a"}),
        (there / "data" / "b", 0.25, {"dataset": "bees", "cfg_drop": 0.5})]
    shutil.rmtree(there / "data" / "b")
    with pytest.raises(DatasetError, match=r"^dataset 'bees' of blend '.*mix' cannot be read: dataset path "
                                           r"'.*data/b' does not exist"):
        members(blend)


def test_the_blend_counts_its_datasets(write_dataset, tmp_path):
    """Sample counts and the latent shapes dit-train's fit report reads are summed; example keys name their
    dataset."""
    a, b = write_dataset(tmp_path / "a"), write_dataset(tmp_path / "b")
    counts = write_blend(tmp_path / "blend", [(a, 1, {}, None), (b, 1, {}, None)]).counts
    assert counts["samples"] == 2 * N and counts["shards"] == 4
    assert counts["latent_shapes"] == {"4x2x4x4": 4, "4x1x4x4": 8}
    assert counts["latent_shape_keys"] == {"4x2x4x4": ["a/s00000", "a/s00003", "b/s00000"],
                                           "4x1x4x4": ["a/s00001", "a/s00002", "a/s00004"]}


def test_latents_are_mapped_into_the_first_datasets_units(write_dataset, tmp_path):
    """A member's stored latent x = its stats' normalisation of the raw latent z; scale·x + shift (per channel) is
    what the blend's statistics (the first member's) would have stored for the same z, to float32 rounding. A member
    with the blend's statistics gets no map: its samples stay bit for bit."""
    first, other = stats(0.3, 0.5), stats(-2.0, 3.0)
    a = write_dataset(tmp_path / "a", latent_stats=first)
    same = write_dataset(tmp_path / "same", latent_stats=json.loads(json.dumps(first)))
    b = write_dataset(tmp_path / "b", latent_stats=other)
    info = write_blend(tmp_path / "blend", [(a, 1, {}, None), (same, 1, {}, None), (b, 1, {}, None)])
    assert info.latent_stats == first
    ma, msame, mb = members(tmp_path / "blend")
    assert ma.latent_map(info.latent_stats) is None and msame.latent_map(info.latent_stats) is None
    scale, shift = mb.latent_map(info.latent_stats)
    z = torch.randn(4, 2, 8, 8, generator=torch.Generator().manual_seed(0)) * 5 - 1  # raw latents, in codec units
    x = LatentStats.from_dict(other).normalize(z)
    mapped = x * scale.view(4, 1, 1, 1) + shift.view(4, 1, 1, 1)
    expected = LatentStats.from_dict(first).normalize(z)
    # a few roundings of the values added (measured: at most 1.3 eps·(|expected| + |shift|) over 5 seeds)
    bound = 4 * torch.finfo(torch.float32).eps * (expected.abs() + shift.abs().view(4, 1, 1, 1))
    assert ((mapped - expected).abs() <= bound).all(), ((mapped - expected).abs() / bound).max()
    assert not torch.allclose(x, expected, atol=0.1)  # the units really differ


def test_output_rules_and_overwrite(write_dataset, tmp_path):
    """An existing blend is replaced only with overwrite (other files in the folder stay); never a dataset, a member
    or a file, with or without it."""
    a, b = write_dataset(tmp_path / "a"), write_dataset(tmp_path / "b")
    out = tmp_path / "blend"
    write_blend(out, [(a, 1, {}, None), (b, 1, {}, None)])
    (out / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="already exists and is not empty — choose another path or pass "
                                              "--overwrite"):
        write_blend(out, [(a, 3, {}, None), (b, 1, {}, None)])
    assert [m.weight for m in members(out)] == [0.5, 0.5]
    write_blend(out, [(a, 3, {}, None), (b, 1, {}, None)], overwrite=True)
    assert [m.weight for m in members(out)] == [0.75, 0.25] and (out / "notes.txt").read_text() == "mine"
    c = write_dataset(tmp_path / "c")
    (tmp_path / "file").write_text("x")
    for target, message in [(a, "is one of the blend's datasets"), (c, "holds a dataset, not a blend"),
                            (tmp_path / "file", "is a file — choose a folder path for the blend")]:
        for overwrite in (False, True):
            with pytest.raises((DatasetError, FileExistsError), match=message):
                write_blend(target, [(a, 1, {}, None), (b, 1, {}, None)], overwrite=overwrite)
    assert read_info(c).counts["samples"] == N and not is_blend(c)


def test_an_interrupted_write_never_passes_for_a_blend(write_dataset, tmp_path, monkeypatch):
    """ditcore.json comes last (and goes first when a blend is replaced): stopped before it, the folder is refused."""
    a, b = write_dataset(tmp_path / "a"), write_dataset(tmp_path / "b")
    out = tmp_path / "blend"
    write_blend(out, [(a, 1, {}, None), (b, 1, {}, None)])

    def interrupted(self, root):
        assert (Path(root) / BLEND_FILE).is_file()  # everything else is written by now
        raise KeyboardInterrupt

    monkeypatch.setattr(DatasetInfo, "write", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_blend(out, [(a, 3, {}, None), (b, 1, {}, None)], overwrite=True)
    with pytest.raises(KeyboardInterrupt):
        write_blend(tmp_path / "new", [(a, 1, {}, None), (b, 1, {}, None)])
    for folder in (out, tmp_path / "new"):
        assert not is_blend(folder)
        with pytest.raises(DatasetError, match="it is not a finished ditcore dataset"):
            read_info(folder)


def energon(*args):
    """Energon's command line (`energon ARGS`) in this process."""
    from click.testing import CliRunner
    from megatron.energon.cli.main import main

    return CliRunner().invoke(main, [str(a) for a in args])


def test_energons_cli_reads_the_datasets_not_the_blend(write_dataset, tmp_path):
    """`energon info`/`lint` (Energon 7.4) accept every member, and read no metadataset: on the blend's folder both
    look for a dataset's .nv-meta/ and fail; on blend.yaml, info refuses a file and lint fails without a word of why.
    The README sends them to the members."""
    a, b = write_dataset(tmp_path / "a"), write_dataset(tmp_path / "b")
    out = tmp_path / "blend"
    write_blend(out, [(a, 1, {}, None), (b, 1, {}, None)])
    for member in members(out):
        for cmd in ("info", "lint"):
            result = energon(cmd, member.root, "--dataset-config", TYPED_CONFIG)
            assert result.exit_code == 0, (cmd, result.output[-2000:], result.exception)
    assert f"{N} samples in 2 shards" in energon("info", a, "--dataset-config", TYPED_CONFIG).output
    for target in (out, out / BLEND_FILE):
        for cmd in ("info", "lint"):
            assert energon(cmd, target).exit_code != 0, (cmd, target)
