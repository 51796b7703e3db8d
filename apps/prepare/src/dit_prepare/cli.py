"""The `dit-prepare` command line: raw images/videos + captions → an Energon dataset of latents + text states."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import enum
import functools
import inspect
import typing
from pathlib import Path

import typer

from ditcore.choices import CODEC_NAMES, TEXT_ENCODER_FAMILIES, TEXT_ENCODERS, VAE_CLASSES
from ditcore.cli import entry_point, fail, new_app, stop_on_signal, version_option

app = new_app(
    "dit-prepare",
    help="Turn images/videos + captions into an Energon dataset of precomputed latents and text embeddings.\n\n"
         "Every source writes WebDataset shards, indexes them with Energon (CrudeWebdataset) and records the "
         "codec, latent statistics and text encoder in ditcore.json. Under torchrun each rank writes its own shards.",
    no_args_is_help=True,
)


@app.callback()
def main(version_: bool = version_option("dit-prepare")) -> None:
    """Turn images/videos + captions into an Energon dataset of precomputed latents and text embeddings."""


# The choices of the options below; Typer checks them and --help lists them.
CodecName = enum.StrEnum("CodecName", [(kind, kind) for kind in CODEC_NAMES])


class LatentNorm(enum.StrEnum):
    channel = "channel"
    global_ = "global"


class Fit(enum.StrEnum):
    crop = "crop"
    resize = "resize"
    buckets = "buckets"


class Labels(enum.StrEnum):
    none = "none"
    subfolders = "subfolders"


VaeClass = enum.StrEnum("VaeClass", [(name, name) for name in VAE_CLASSES])


def _text_encoder_name(name: str) -> str:
    """A name that ditcore.codecs.text.load_text_encoder takes, checked before any work starts."""
    family, _, source = name.partition(":")
    if name in TEXT_ENCODERS or (family in TEXT_ENCODER_FAMILIES and source):
        return name
    choices = [*TEXT_ENCODERS, *(f"{f}:<hub id or folder>" for f in TEXT_ENCODER_FAMILIES)]
    raise typer.BadParameter(f"text encoder {name!r} is unknown: expected {', '.join(choices[:-1])} or "
                             f"{choices[-1]}, e.g. t5:google-t5/t5-11b or umt5:Wan-AI/Wan2.1-T2V-1.3B-Diffusers")


# Options every source shares. Typer reads these defaults as the option definitions.
OUT = typer.Option(..., "--out", "-o", help="Output dataset folder (created; must be empty unless --overwrite).")
CODEC = typer.Option(CodecName.pca, help="Latent codec: pca (fitted on the data, see --pca-patch), pixel (exact "
                                 "pixel_unshuffle) or vae (diffusers, see --vae).")
PCA_CHANNELS = typer.Option(16, min=1, max=768, help="Latent channels K of the PCA codec (at most 3·patch²).")
PCA_PATCH = typer.Option(8, min=1, max=16, help="Pixels per side of a PCA patch (one latent cell).")
LATENT_NORM = typer.Option(LatentNorm.channel, help="Latent scaling: channel (each channel to the same std) or "
                                                    "global (one scale for all: keeps a PCA codec's fine-detail "
                                                    "channels small, as they are in the pixels).")
PIXEL_FACTOR = typer.Option(2, min=1, help="Spatial factor of the pixel codec.")
VAE = typer.Option(None, help="With --codec vae: a diffusers VAE hub id or local folder.")
VAE_CLASS = typer.Option(VaeClass.AutoencoderKL, help="With --codec vae: the diffusers class (AutoencoderKLWan is "
                                                      "a video VAE).")
TEXT = typer.Option("minilm", "--text-encoder", metavar="<minilm|null|t5:ID|umt5:ID>", callback=_text_encoder_name,
                    help="minilm (offline default), null (no text), t5:<hub id or folder>, or umt5:<hub id or "
                         "folder>: Wan 2.1's encoder (a model's folder, a diffusers Wan pipeline's or its "
                         "text_encoder/, e.g. umt5:Wan-AI/Wan2.1-T2V-1.3B-Diffusers), captions cleaned as Wan "
                         "cleans prompts and up to 512 tokens long.")
FIT = typer.Option(256, min=1, help="Samples to fit the codec and measure latent statistics on.")
WORKERS = typer.Option(0, min=0, help="Processes that load/render samples (0: in this process).")
SHARD = typer.Option(1000, min=1, help="Samples per shard.")
OVERWRITE = typer.Option(False, help="Replace an existing dataset at --out.")
KEEP_PARTIAL = typer.Option(False, help="On failure or Ctrl-C keep what was written (to inspect it); by default "
                                        "the partial output is removed.")
VAL_SAMPLES = typer.Option(0, min=0, metavar="N", help="Hold out N samples as a dataset of their own at OUT/val, "
                                                        "for dit-train's held-out loss: of the source's M samples, "
                                                        "those at index (2k+1)·M // 2N for k < N (evenly spread "
                                                        "over its order). 0: none.")
SEED = typer.Option(0, min=0, help="Random seed.")


# Option groups: dataclasses whose fields carry their typer.Option (flag, default, range, help) as metadata.
@dataclasses.dataclass(frozen=True)
class EncodeOptions:
    """How pixels and captions become latents and text states: the options of the sources that encode pixels."""

    codec: CodecName = dataclasses.field(metadata={"option": CODEC})
    pca_channels: int = dataclasses.field(metadata={"option": PCA_CHANNELS})
    pca_patch: int = dataclasses.field(metadata={"option": PCA_PATCH})
    latent_norm: LatentNorm = dataclasses.field(metadata={"option": LATENT_NORM})
    pixel_factor: int = dataclasses.field(metadata={"option": PIXEL_FACTOR})
    vae: str | None = dataclasses.field(metadata={"option": VAE})
    vae_class: VaeClass = dataclasses.field(metadata={"option": VAE_CLASS})
    text_encoder: str = dataclasses.field(metadata={"option": TEXT})
    fit_samples: int = dataclasses.field(metadata={"option": FIT})
    workers: int = dataclasses.field(metadata={"option": WORKERS})

    def codec_choice(self):
        """The codec options, checked together, as a dit_prepare.pipeline.CodecChoice."""
        from dit_prepare.pipeline import CodecChoice

        if self.codec == CodecName.vae and not self.vae:
            fail("--codec vae needs --vae HUB_ID_OR_FOLDER")
        if self.codec == CodecName.pca and self.pca_channels > 3 * self.pca_patch**2:
            fail(f"--pca-channels {self.pca_channels} is more than a {self.pca_patch}x{self.pca_patch} patch holds "
                 f"(3·{self.pca_patch}² = {3 * self.pca_patch**2}): lower it or raise --pca-patch")
        return CodecChoice(str(self.codec), self.pca_channels, self.pca_patch, str(self.latent_norm),
                           self.pixel_factor, self.vae, str(self.vae_class))


@dataclasses.dataclass(frozen=True)
class WriteOptions:
    """How the dataset is written: the options of every source."""

    shard_size: int = dataclasses.field(metadata={"option": SHARD})
    overwrite: bool = dataclasses.field(metadata={"option": OVERWRITE})
    keep_partial: bool = dataclasses.field(metadata={"option": KEEP_PARTIAL})
    val_samples: int = dataclasses.field(metadata={"option": VAL_SAMPLES})


def option_groups(*groups: type, **defaults):
    """Declare option groups once for several commands (as click apps share option decorators).

    Typer reads a command's options from its signature: the decorated command lists its own parameters, then the
    fields of each group in order, and receives one value per group in its keyword-only parameters (in the same
    order). `defaults` replace a field's default by name, its help and range kept.
    """

    def decorate(command):
        signature = inspect.signature(command)
        own = [p for p in signature.parameters.values() if p.kind is not p.KEYWORD_ONLY]
        slots = [p.name for p in signature.parameters.values() if p.kind is p.KEYWORD_ONLY]
        if len(slots) != len(groups):
            raise TypeError(f"{command.__name__} has {len(slots)} keyword-only parameters for {len(groups)} groups")
        added = []
        for group in groups:
            hints = typing.get_type_hints(group)
            for f in dataclasses.fields(group):
                option = copy.copy(f.metadata["option"])
                if f.name in defaults:
                    option.default = defaults[f.name]
                added.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=option,
                                               annotation=hints[f.name]))
        if unknown := set(defaults) - {p.name for p in added}:
            raise TypeError(f"{command.__name__}: no option group has {sorted(unknown)}")

        @functools.wraps(command)
        def run(**values):
            for slot, group in zip(slots, groups, strict=True):
                values[slot] = group(**{f.name: values.pop(f.name) for f in dataclasses.fields(group)})
            return command(**values)

        run.__signature__ = signature.replace(parameters=own + added)
        return run

    return decorate


def _run(source_factory, out: Path, choice, encode: EncodeOptions, write: WriteOptions) -> None:
    """Shared by the sources: build the source and text encoder, run the pipeline, print one summary (rank 0's:
    under torchrun it holds every rank's counts) with the tokens a sample makes at each dit-train config's patch."""
    from dit_prepare.pipeline import dist_env, prepare
    from dit_prepare.tokens import shipped_model_shapes, token_lines

    with _one_line_errors():
        from ditcore.codecs.text import load_text_encoder

        source = source_factory(choice.spatial_factor())
        encoder = load_text_encoder(encode.text_encoder)
        summary = prepare(source, out, codec=choice, text_encoder=encoder, fit_samples=encode.fit_samples,
                          workers=encode.workers, shard_size=write.shard_size, overwrite=write.overwrite,
                          keep_partial=write.keep_partial, val_samples=write.val_samples,
                          num_classes=getattr(source, "num_classes", 0),
                          class_names=getattr(source, "classes", []))  # a class-labelled source has both
    if dist_env()[0] != 0:
        return
    typer.echo(f"dataset   {out}")
    for line in summary.lines() + token_lines(summary.latent_shapes, shipped_model_shapes()):
        typer.echo(line)


@contextlib.contextmanager
def _one_line_errors():
    """Bad input → `error: ...` (with what happened to the partial output) and exit 2; Ctrl-C, SIGTERM or SIGHUP stop
    the pipeline at its next sample (ditcore.stopping) → `error: interrupted by ...` and the same note, exit 128 + the
    signal."""
    from dit_prepare.sources import SourceError

    with stop_on_signal():
        try:
            yield
        except (SourceError, FileExistsError, ValueError, OSError, RuntimeError) as e:
            fail(" — ".join([str(e), *getattr(e, "__notes__", [])]))


@app.command()
@option_groups(EncodeOptions, WriteOptions)
def synthetic(
    out: Path = OUT,
    num: int = typer.Option(2000, min=1, help="Number of samples."),
    size: int = typer.Option(64, min=16, help="Image side in pixels (square)."),
    frames: int = typer.Option(8, min=2, help="Frames per clip."),
    video_ratio: float = typer.Option(0.5, min=0.0, max=1.0, help="Fraction of samples that are clips."),
    fps: float = typer.Option(8.0, min=0.1, help="Frame rate recorded for clips."),
    simple: bool = typer.Option(False, help="The variety a small model learns in minutes (make demo's data): "
                                            "plain wings of one wingspan, in the middle of the frame, on a plain "
                                            "light background; clips hover there, flapping slowly (a flap every "
                                            "12-25 frames, the wings at least 0.6 open); wing colours, background "
                                            "tints and the flap's phase and speed still vary."),
    seed: int = SEED,
    *, encode: EncodeOptions, write: WriteOptions,
) -> None:
    """Procedurally drawn butterflies (images and wing-flapping clips) with exact captions; needs nothing."""
    from dit_prepare.sources import SyntheticSource

    if size % encode.pca_patch and encode.codec == CodecName.pca:
        fail(f"--size {size} must be a multiple of --pca-patch {encode.pca_patch} for the PCA codec")
    _run(lambda factor: SyntheticSource(num, size, frames, video_ratio, seed, fps, simple=simple), out,
         encode.codec_choice(), encode, write)


@app.command()
@option_groups(EncodeOptions, WriteOptions)
def butterfly(
    out: Path = OUT,
    from_: Path = typer.Option(None, "--from", help="A local parquet file or folder in the dataset's schema "
                                                    "(image, name) instead of the Hugging Face hub."),
    size: int = typer.Option(64, min=8, help="Short side after resizing, in pixels."),
    num: int = typer.Option(None, min=1, help="Use at most this many samples."),
    hub_id: str = typer.Option("huggan/smithsonian_butterflies_subset", help="Hugging Face dataset id."),
    *, encode: EncodeOptions, write: WriteOptions,
) -> None:
    """The Smithsonian butterflies (huggan/smithsonian_butterflies_subset), captions from `name`."""
    from dit_prepare.sources import ButterflySource

    _run(lambda factor: ButterflySource(size, factor, from_, hub_id, num), out, encode.codec_choice(), encode, write)


@app.command()
# the demo's recipe (make demo): a 64 px image is 16x16 latent cells, 16 tokens at dit-train --config demo's
# patch 4, 8 images per 128-token row; 8x8-pixel cells would give 4 tokens, 32 images a row, a loader-bound run
@option_groups(EncodeOptions, WriteOptions, pca_patch=4, latent_norm=LatentNorm.global_)
def folder(
    path: Path = typer.Argument(..., help="Folder of images (png/jpg/webp) and videos (mp4/webm/gif)."),
    out: Path = OUT,
    size: int = typer.Option(64, min=8, help="Pixels: the side of the square (--fit crop), the short side (resize) "
                                             "or the square bucket's side (buckets). A multiple of the codec's "
                                             "factor x the largest patch of dit-train's shipped configs (16 with "
                                             "the default codec)."),
    fit: Fit = typer.Option(Fit.crop, help="crop: centre crop to a square (every sample the same tokens); resize: "
                                           "keep the aspect ratio, crop each side to that multiple; buckets: the "
                                           "nearest of a few aspect ratios (1:2 to 2:1), each about size² pixels."),
    frames: int = typer.Option(8, min=1, help="Frames taken from each video."),
    fps: float = typer.Option(0.0, min=0.0, help="Sample video frames at this rate (0: every frame)."),
    num: int = typer.Option(None, min=1, help="Use at most this many files."),
    labels: Labels = typer.Option(Labels.none, help="subfolders: class labels from ImageNet's layout, "
                                                    "PATH/CLASS_NAME/file: label i is the i-th subfolder by name "
                                                    "(as torchvision's ImageFolder); captions become optional (the "
                                                    "class name stands in); files directly in PATH are skipped."),
    num_classes: int = typer.Option(None, min=1, help="With --labels subfolders: the model's class count, at least "
                                                      "the subfolders' (default: their number), e.g. 1000 to keep "
                                                      "an ImageNet model's class embedding."),
    *, encode: EncodeOptions, write: WriteOptions,
) -> None:
    """Your own images and videos; captions from sidecar .txt files or a captions.jsonl ({"file", "caption"}), class
    labels from subfolders (--labels subfolders)."""
    from dit_prepare.sources import FolderSource, Framing
    from dit_prepare.tokens import largest_patch, shipped_model_shapes

    choice = encode.codec_choice()
    patch = largest_patch(shipped_model_shapes())
    with _one_line_errors():  # --codec vae loads the VAE here: a missing folder or no hub is one line
        unit = choice.spatial_factor() * patch
    if size % unit:
        lower, upper = max(unit, size // unit * unit), (size // unit + 1) * unit
        fail(f"--size {size} is not a multiple of {unit} (the codec's {choice.spatial_factor()} pixels per latent "
             f"cell x patch {patch}, the largest of dit-train's configs): use {lower} or {upper}")
    framing = Framing(str(fit), size, unit)
    _run(lambda factor: FolderSource(path, framing, frames, fps, limit=num, labels=str(labels),
                                     num_classes=num_classes), out, choice, encode, write)


@app.command()
@option_groups(WriteOptions)
def mock(
    out: Path = OUT,
    num: int = typer.Option(1000, min=1, help="Number of samples."),
    latent_shape: str = typer.Option("16,1,32,32", help="Latent C,T,H,W of image samples."),
    video_latent_shape: str = typer.Option("16,4,16,16", help="Latent C,T,H,W of clip samples."),
    video_ratio: float = typer.Option(0.5, min=0.0, max=1.0, help="Fraction of samples that are clips."),
    text_len: int = typer.Option(32, min=0, help="Text tokens per sample."),
    text_dim: int = typer.Option(384, min=0, help="Width of the text states (0: no text)."),
    seed: int = SEED,
    *, write: WriteOptions,
) -> None:
    """Random latents and text states of given shapes, for throughput work (nothing to decode)."""
    from dit_prepare.pipeline import dist_env, prepare
    from dit_prepare.sources import MockSource

    try:
        shapes = [tuple(int(v) for v in s.split(",")) for s in (latent_shape, video_latent_shape)]
        if any(len(s) != 4 or min(s) < 1 for s in shapes) or shapes[0][0] != shapes[1][0]:
            raise ValueError
    except ValueError:
        fail(f"--latent-shape {latent_shape!r} / --video-latent-shape {video_latent_shape!r}: expected four "
             "positive integers C,T,H,W each, with the same C")
    with _one_line_errors():
        summary = prepare(MockSource(num, *shapes, video_ratio, text_len, text_dim, seed), out,
                          shard_size=write.shard_size, overwrite=write.overwrite, keep_partial=write.keep_partial,
                          progress=False, val_samples=write.val_samples)
    if dist_env()[0] == 0:
        typer.echo(f"dataset   {out}\n{summary.lines()[0]}\ntime      {summary.seconds:.1f} s")
        if summary.heldout:
            typer.echo(next(line for line in summary.lines() if line.startswith("held out")))


SPEC = "PATH[:WEIGHT[:KEY=VALUE...]]"
# Typer keeps the single line breaks of every paragraph after the first: each paragraph is one string
BLEND_HELP = "\n\n".join([
    "Several prepared datasets trained on as one, each drawn by its weight (dit-train data.path=OUT).",
    "A sample comes from dataset i with probability WEIGHT_i / the sum of the weights (the weights are normalised to "
    "sum 1). No sample is copied: OUT holds "
    "blend.yaml (Energon's metadataset over the datasets, by paths relative to OUT: move OUT and the datasets "
    "together) and ditcore.json, written last.",
    f"Each --dataset is {SPEC}, e.g. data/photos:3:name=photos:cfg_drop=0.2. Keys: name= names the dataset in "
    "dit-train's metrics (default: its folder's name; letters, digits, '_', '.', '-'); cfg_drop= the probability in "
    "[0, 1] that a sample of this dataset is trained without its caption (and other conditions) instead of "
    "edm.cfg_dropout.",
    "The datasets must share the codec (a fitted codec's parameter files too), the text encoder and its width, the "
    "latent factors and the classes: a latent and a text then mean the same whichever dataset they come from. Their "
    "latent statistics may differ: a dataset's samples are mapped into the first dataset's units as they are read.",
])


@app.command(help=BLEND_HELP)
def blend(
    out: Path = typer.Argument(None, metavar="OUT", show_default=False,
                               help="The blend's folder (created; --out/-o OUT, as the other commands take it, works "
                                    "too). Must be empty unless --overwrite; never one of the datasets."),
    datasets: list[str] = typer.Option(None, "--dataset", "-d", metavar=SPEC, show_default=False,
                                       help="A prepared dataset, its weight (default 1) and keys. Twice or more."),
    out_option: Path = typer.Option(None, "--out", "-o", metavar="OUT", show_default=False,
                                    help="OUT as an option, as the other commands take it."),
    overwrite: bool = typer.Option(False, help="Replace an existing blend at OUT (never a dataset)."),
) -> None:
    from ditcore.data.blend import members, parse_spec, write_blend
    from ditcore.data.schema import read_info

    if out is not None and out_option is not None and out != out_option:
        fail(f"OUT given twice, as '{out}' and --out '{out_option}' — give one")
    out = out if out is not None else out_option
    if out is None:
        fail(f"no OUT: give the blend's folder — dit-prepare blend OUT --dataset {SPEC} --dataset ...")
    try:
        specs = [parse_spec(spec) for spec in datasets or []]
        info = write_blend(out, specs, overwrite=overwrite)
        blended = members(out, info)
        samples = [read_info(m.root).counts.get("samples", "?") for m in blended]
    except (ValueError, FileExistsError, OSError) as e:  # ditcore.data.schema.DatasetError is a ValueError
        fail(str(e))
    rows = [("dataset", "weight", "samples", "latents", "subflavors", "path")]
    for m, n, (path, *_) in zip(blended, samples, specs, strict=True):
        units = "mapped" if m.latent_map(info.latent_stats) is not None else "same"
        flavors = " ".join(f"{k}={v}" for k, v in m.subflavors.items()) or "-"
        rows.append((m.name, f"{m.weight:.3f}", str(n), units, flavors, str(path)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    typer.echo(f"blend     {out}: {len(blended)} datasets, {info.counts.get('samples', '?')} samples "
               f"(dit-train data.path={out})")
    for row in rows:
        typer.echo(" " * 10 + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + "  " + row[-1])
    typer.echo(f"latents   in {blended[0].name}'s units; mapped: a dataset's own statistics differ, its samples are "
               "mapped into them as they are read")


run = entry_point(app)  # the console script: usage errors are one line, exit code 2
