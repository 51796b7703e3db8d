"""Loading a checkpoint for sampling and checking a request: shared by the CLI and the Gradio app.

A checkpoint is a ditcore export, a training checkpoint (its EMA weights: a run sampled before it is exported), a run
directory (its export, else its newest complete checkpoint), or one of the field's checkpoints (ditcore.interop: an
original DiT file, a diffusers DiTTransformer2DModel or DiT pipeline folder, a WanTransformer3DModel or WanPipeline
folder), which becomes the same `Exported`: its network under the preconditioning or objective it was trained with, a
diffusers VAE, the latent statistics that give the network the latents it saw in training, and its text encoder.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from ditcore import interop, runs
from ditcore.choices import SAMPLE_SOLVERS as SOLVERS
from ditcore.codecs import DiffusersVAECodec, LatentStats
from ditcore.codecs.text import MAX_TOKENS, TextEncoder, load_text_encoder
from ditcore.data.fit import latent_shapes
from ditcore.data.schema import DatasetInfo
from ditcore.export import CONFIG, DEFAULT_GUIDANCE, WEIGHTS, Exported, load_export, recorded_objective
from ditcore.interop import diffusers_wan
from ditcore.models import arch_of, build
from ditcore.sampling import SCHEDULES, SampleResult, sample, token_grid
from ditcore.tensorfile import non_finite

# Inclusive ranges; seed: what torch.Generator.manual_seed accepts.
LIMITS = {"steps": (1, 500), "guidance": (0.0, 30.0), "frames": (1, 128), "size": (8, 1024), "seed": (0, 2**64 - 1)}
# The text encoder reads only the first MAX_TOKENS tokens (a few hundred characters); a prompt far longer than
# that is a paste accident or abuse, and is refused rather than silently cut.
MAX_PROMPT_CHARS = 2000
# The VAE DiT's authors sample their checkpoints with (their sample.py's default, --vae ema): the latent space every
# DiT checkpoint of theirs, and diffusers' facebook/DiT-XL-2-* pipelines, were trained in
DIT_VAE = "stabilityai/sd-vae-ft-ema"
# What the field's checkpoints of each architecture are sampled with, as their pipelines sample them: the class of VAE
# their latents are (a local folder of another class is refused), the VAE when none is given (Wan's has none: it is in
# its pipeline folder) and the guidance weight (DiTPipeline's 4, WanPipeline's 5)
FOREIGN = {"dit": ("AutoencoderKL", DIT_VAE, DEFAULT_GUIDANCE),
           "wan": (diffusers_wan.VAE_CLASS, None, diffusers_wan.GUIDANCE)}


class RequestError(ValueError):
    """A request that cannot be sampled, with what to change."""


@dataclass
class Sampler:
    exported: Exported
    text: TextEncoder | None
    path: Path
    load_seconds: dict[str, float] = field(default_factory=dict)  # model, codec, text encoder: apart from sampling

    @classmethod
    def load(cls, checkpoint: str | Path, vae: str | None = None, num_heads: int | None = None,
             text_encoder: str | None = None) -> Sampler:
        """vae, num_heads, text_encoder: for the field's checkpoints (see load_foreign); a ditcore export has its
        own codec and text encoder."""
        if interop.is_foreign(checkpoint):
            exported, path = load_foreign(checkpoint, vae, num_heads, text_encoder), Path(checkpoint)
        elif vae is not None or num_heads is not None or text_encoder is not None:
            raise RequestError(f"--vae, --num-heads and --text-encoder are for the field's checkpoints "
                               f"({interop.KINDS}); '{checkpoint}' is a ditcore export or run, which decodes with the "
                               "codec it trained with, encodes text as its dataset did and records its heads — leave "
                               "them out")
        else:
            path = runs.find_sampleable(checkpoint)
            exported = load_checkpoint(path) if runs.is_complete(path) else load_export(path)
        text = None
        if exported.model.cfg.text_dim:  # the encoder the dataset was made with; its model loads in load_text()
            text = load_text_encoder(exported.info.text_encoder["name"])
        return cls(exported, text, path, dict(exported.load_seconds))

    def chosen(self, checkpoint: str | Path) -> str | None:
        """The line that says which checkpoint a run directory without an export is sampled from, else None."""
        if runs.is_complete(self.path) and Path(checkpoint) != self.path:
            return (f"sampling {self.path} (step {self.exported.extra.get('step')}): the newest complete checkpoint "
                    f"of {checkpoint}, which has no {runs.EXPORT}/ yet")
        return None

    def load_text(self) -> None:
        """Load the text encoder's model (seconds: it imports transformers), timed as loading. run() calls it after
        checking the request, so a bad request is refused at once; the app calls it at start."""
        if self.text is not None and "text encoder" not in self.load_seconds:
            t0 = time.perf_counter()
            self.text.load()
            self.load_seconds["text encoder"] = time.perf_counter() - t0
            if self.text.dim != self.exported.model.cfg.text_dim:  # e.g. --text-encoder of another model's width
                raise RequestError(f"the text encoder {self.text.name!r} gives states {self.text.dim} wide, the "
                                   f"network reads text {self.exported.model.cfg.text_dim} wide — pass the encoder it "
                                   "was trained with")

    @property
    def class_conditional(self) -> bool:
        return self.exported.model.cfg.num_classes > 0

    def loaded(self) -> str:
        """How long loading took, by part: 'loading took 6.20 s (model 0.15 s, codec 0.01 s, text encoder 6.04 s)'."""
        parts = ", ".join(f"{name} {s:.2f} s" for name, s in self.load_seconds.items())
        return f"loading took {sum(self.load_seconds.values()):.2f} s ({parts})"

    def prompts(self) -> list[str]:
        """The prompts the run validated with: what to offer as examples (for a class-conditional model, the row
        labels of its contact sheet). The export records them; older exports: the run's config beside export/."""
        recorded = self.exported.extra.get("prompts")
        if recorded is None:
            folder = self.path if runs.is_complete(self.path) else self.path.parent  # a checkpoint holds its config
            try:
                config = yaml.safe_load((folder / runs.CONFIG_FILE).read_text())
                recorded = config["validation"]["prompts"]
            except (OSError, yaml.YAMLError, UnicodeDecodeError, TypeError, KeyError):
                return []  # an export on its own, or a config this version cannot read: no examples
        return [p for p in recorded if isinstance(p, str) and p.strip()] if isinstance(recorded, list) else []

    def example_classes(self) -> list[int]:
        """The class labels the run validated with (one per validation prompt, as dit-train samples them)."""
        n = self.exported.model.cfg.num_classes
        if "imported" in self.exported.extra:  # the field's checkpoints: no run, and class 0 is nothing special
            return []
        return list(range(min(n, len(self.prompts()) or 1))) if n else []

    def example(self) -> str:
        """A hint for messages: ", e.g. '<the run's first validation prompt>'", or nothing when none is known."""
        prompts = self.prompts()
        return f", e.g. {prompts[0]!r}" if prompts else ""

    def check(self, *, prompts=None, steps, guidance, frames, height, width, seed=0, solver="heun",
              schedule="karras", negative_prompt=None, class_labels=None) -> None:
        """Raise RequestError naming the first value of the wrong type or out of range.

        Cheap (nothing is allocated), so a request is refused before it costs memory; values may come straight from
        an API caller's JSON, so the types are checked too.
        """
        _check_numbers(steps=steps, guidance=guidance, frames=frames, height=height, width=width, seed=seed)
        if solver not in SOLVERS:
            raise RequestError(f"solver={solver!r} is unknown: expected one of {', '.join(SOLVERS)}")
        if solver == "unipc" and self.exported.objective != "flow":
            raise RequestError("solver unipc samples flow-matching networks, and this one was trained with "
                               f"{self.exported.objective.upper()} — use heun or euler")
        self._check_schedule(schedule, steps, solver)
        if self.class_conditional:
            n = self.exported.model.cfg.num_classes
            if not class_labels or any(not _is_number(c, int) or not 0 <= c < n for c in class_labels):
                raise RequestError(f"class labels {class_labels} are invalid: expected integers in 0..{n - 1}")
        else:
            self._check_prompts(prompts, negative_prompt)
        try:
            token_grid(self.exported.model, self.exported.codec, frames, height, width)
        except ValueError as e:
            raise RequestError(str(e)) from None

    def _check_schedule(self, schedule, steps: int, solver: str) -> None:
        vp = self.exported.vp
        if schedule not in SCHEDULES:
            raise RequestError(f"schedule={schedule!r} is unknown: expected one of {', '.join(SCHEDULES)}")
        if schedule != "ddim":
            return
        if self.exported.objective == "flow":
            raise RequestError("schedule ddim steps through a DDPM network's timesteps, and this one is a flow "
                               "network (its times follow its own shift) — leave the schedule at karras")
        if vp is None:
            raise RequestError("schedule ddim steps through a DDPM network's timesteps, and this model is "
                               "EDM-preconditioned (it has none) — use schedule karras")
        if steps > vp.timesteps:
            raise RequestError(f"steps={steps} is more than the network's {vp.timesteps} timesteps that schedule "
                               f"ddim steps through: expected 1..{vp.timesteps}")
        try:  # a steps_offset may push the timesteps past the network's last
            why = vp.ddim_refusal(steps, solver)
        except ValueError as e:
            raise RequestError(str(e)) from None
        if why:
            raise RequestError(why)

    def _check_prompts(self, prompts, negative_prompt) -> None:
        for p in prompts or [""]:
            _check_text("prompt", p)
            if not p.strip():
                raise RequestError(f"the prompt is empty: describe what to draw{self.example()}")
        if negative_prompt is not None:
            _check_text("negative prompt", negative_prompt)

    def sides(self) -> tuple[list[int], list[int]]:
        """Heights and widths (pixels) this model samples: multiples of codec factor × patch, within max_grid."""
        cfg, codec = self.exported.model.cfg, self.exported.codec
        step = codec.spatial_factor * cfg.patch_size
        return tuple([s for s in range(step, min(n * step, 512) + 1, step) if s >= 16] for n in cfg.max_grid[1:])

    def trained_sizes(self) -> list[tuple[int, int]]:
        """(height, width) in pixels of the run's training samples that this model samples, most common first:
        from the latent shapes (C×T×H×W) that dit-prepare records in the dataset (older datasets: none)."""
        heights, widths = self.sides()
        factor, sizes = self.exported.codec.spatial_factor, Counter()
        for (_, _, h, w), n in latent_shapes(self.exported.info).items():
            if h * factor in heights and w * factor in widths:
                sizes[(h * factor, w * factor)] += n
        return [size for size, _ in sizes.most_common()]

    def default_size(self) -> tuple[int, int]:
        """The run's most common training size; else the size it validated at; else 64² (or the smallest)."""
        heights, widths = self.sides()
        validated = self.exported.extra.get("size")
        for h, w in [*self.trained_sizes(), (validated, validated), (64, 64)]:
            if h in heights and w in widths:
                return h, w
        return heights[0], widths[0]

    def run(self, *, prompts=None, negative_prompt=None, class_labels=None, steps=18, guidance=4.0, seed=0,
            frames=1, height=64, width=64, solver="heun", schedule="karras", fps=8.0,
            callback=None) -> tuple[SampleResult, float]:
        self.check(prompts=prompts, steps=steps, guidance=guidance, frames=frames, height=height, width=width,
                   seed=seed, solver=solver, schedule=schedule, negative_prompt=negative_prompt,
                   class_labels=class_labels)
        self.load_text()  # not part of the generation time
        t0 = time.perf_counter()
        states = negative = None
        if self.text is not None:
            states = self.text.encode(list(prompts))
            # no negative prompt: the unconditional text the network was trained with, no text at all (ditcore's
            # runs) or the encoding of a caption (WanPipeline's "")
            unconditional = negative_prompt or self.exported.negative_prompt
            if unconditional is not None and guidance != 1.0:
                negative = self.text.encode([unconditional]) * len(prompts)
        result = sample(self.exported.model, self.exported.codec, self.exported.stats, text_states=states,
                        negative_states=negative, class_labels=class_labels, frames=frames, height=height,
                        width=width, steps=steps, guidance=guidance, solver=solver, seed=seed, fps=fps,
                        schedule=schedule, callback=callback, **self.exported.sampling())
        if not torch.isfinite(result.latents).all():  # decoded, NaN would be an all-black picture passing as a sample
            raise RequestError("the sample came out non-finite (NaN/Inf) although the weights are finite: the model's "
                               "output overflowed — try a lower guidance, other steps, or another checkpoint")
        return result, time.perf_counter() - t0


def load_checkpoint(folder: Path, picked: bool = False) -> Exported:
    """A complete training checkpoint's EMA weights (verified against its manifest, consolidated from any layout) as
    an export: the checkpoint records what the export will beside them (ditcore.export.describe); one written by an
    older dit-train, which did not, takes the rest from its run's export. Errors name the checkpoint and what to
    sample instead (picked: the app's picker, where another is picked by name)."""
    run = folder.parent.parent
    instead = "pick an earlier checkpoint" if picked else _instead(run, folder)
    try:
        state = runs.load_weights(folder, runs.EMA)
    except runs.CheckpointError as e:  # damaged since it was written (its manifest says how), or unreadable
        raise runs.CheckpointError(f"{e} — {'pick another checkpoint' if picked else instead}") from None
    bad = non_finite(state)
    if bad:  # sampled, NaN weights give an all-black picture
        raise RequestError(f"checkpoint {folder.name if picked else folder} holds non-finite weights in {len(bad)} "
                           f"tensors, e.g. {bad[0]}: the run had diverged by then — {instead}")
    if (folder / CONFIG).is_file():
        return load_export(folder, weights=state)
    export = runs.export_dir(run)
    if not (export / WEIGHTS).is_file():
        raise runs.CheckpointError(f"checkpoint {folder} was written by an older dit-train, which recorded no {CONFIG} "
                                   f"beside its weights, and {run} has no {runs.EXPORT}/ to take the model from — "
                                   f"resume the run (dit-train --resume {folder}) to the end, which exports it")
    exported = load_export(export)
    try:
        exported.model.load_state_dict(state)
    except RuntimeError as e:  # weights of another architecture than the export's
        raise runs.CheckpointError(f"checkpoint {folder} does not fit {export}'s model "
                                   f"({str(e).splitlines()[0]}) — sample {export} or another checkpoint") from None
    exported.extra["step"] = runs.step_of(folder)
    return exported


def _instead(run: Path, ckpt: Path) -> str:
    """What to sample instead of a checkpoint that cannot be: the one its trajectory continued from, if any."""
    earlier = runs.trajectory(run, ckpt)[1:] if runs.is_complete(ckpt) else runs.complete_checkpoints(run)[-1:]
    return (f"sample an earlier checkpoint: --checkpoint {earlier[0]}" if earlier else
            f"{run} has no earlier complete checkpoint to sample")


def load_foreign(path: str | Path, vae: str | None = None, num_heads: int | None = None,
                 text_encoder: str | None = None) -> Exported:
    """One of the field's checkpoints (ditcore.interop.read) as an export: the network (eval) under the
    preconditioning or objective it was trained with (a DDPM schedule: VP; Wan: flow, its scheduler's shift and
    solver), its pipeline's guidance default, a VAE codec — `vae` (a local folder or hub id), else a pipeline's own
    vae/, else DiT's — and a text encoder for a text-conditioned network: `text_encoder` (ditcore's name, e.g.
    umt5:<folder>), else its pipeline's. num_heads: for an original checkpoint whose width is none of the paper's (a
    state dict does not record its heads)."""
    t0 = time.perf_counter()
    imported = interop.read(path, num_heads)
    cfg = imported.cfg
    vae_class, default_vae, guidance = FOREIGN[arch_of(cfg)]
    text = _foreign_text(path, imported, text_encoder)
    model = build(cfg)
    model.load_state_dict(imported.tensors)  # strict: the import gives every weight its place
    model.eval()
    t1 = time.perf_counter()
    source = vae or imported.vae or default_vae
    if source is None:
        raise ValueError(f"'{path}' is a bare {imported.kind} folder, which holds no VAE: pass --vae <the "
                         f"{vae_class} it was trained with, e.g. a WanPipeline folder's vae/> (or give the pipeline "
                         "folder as --checkpoint)")
    _check_vae_class(source, vae_class)
    codec = DiffusersVAECodec(source, vae_class)
    if codec.latent_channels != cfg.in_channels:
        raise ValueError(f"the VAE {str(source)!r} has {codec.latent_channels} latent channels, the network takes "
                         f"{cfg.in_channels} — pass the VAE it was trained with (--vae)")
    stats = imported.latent_stats or _vae_units(vae_class, codec, cfg.in_channels)
    info = DatasetInfo(codec=codec.save(Path(path)), latent_stats=stats.to_dict(), text_encoder=text,
                       latent_channels=cfg.in_channels, spatial_factor=codec.spatial_factor,
                       temporal_factor=codec.temporal_factor, num_classes=cfg.num_classes)
    extra = {"imported": imported.summary(), "guidance": guidance, "prompts": [],
             **recorded_objective(imported.objective, imported.shift),
             "precond": "edm" if imported.vp is None else "vp", **({} if imported.vp is None else
                                                                   {"vp": imported.vp.to_dict()})}
    if imported.solver is not None:  # its pipeline's scheduler's loop: dit-sample's default solver for it
        extra["solver"] = imported.solver
    if imported.negative_prompt is not None:
        extra["negative_prompt"] = imported.negative_prompt
    if arch_of(cfg) == "dit":  # its training size, the default: DiT's grid is its one size (Wan's bounds RoPE only)
        extra["size"] = cfg.max_grid[1] * cfg.patch_size * codec.spatial_factor
    return Exported(model, codec, stats, info, extra, {"model": t1 - t0, "codec": time.perf_counter() - t1})


def _foreign_text(path, imported: interop.Imported, text_encoder: str | None) -> dict:
    """The dataset-info record of the text encoder an import is sampled with: `text_encoder`, else its pipeline's;
    null for a network without text."""
    if not imported.cfg.text_dim:
        if text_encoder is not None:
            raise ValueError(f"--text-encoder is for text-conditioned networks: '{path}' ({imported.kind}) reads no "
                             "text (class labels: --class) — leave it out")
        return {"name": "null", "dim": 0}
    name = text_encoder or imported.text_encoder
    if name is None:
        raise ValueError(f"'{path}' is a bare {imported.kind} folder, which names no text encoder: pass "
                         "--text-encoder umt5:<its WanPipeline folder, or google/umt5-xxl> (or give the pipeline "
                         "folder as --checkpoint)")
    load_text_encoder(name)  # the name checked now (nothing loads yet): an unknown one is refused before the model
    return {"name": name, "dim": imported.cfg.text_dim}


def _vae_units(vae_class: str, codec: DiffusersVAECodec, channels: int) -> LatentStats:
    """The units a network is trained on of this VAE's latents z: DiT's (z − shift)·scaling_factor (0.18215·z), Wan's
    (z − latents_mean)/latents_std per channel — read from the VAE's config."""
    config = codec.vae.config
    if vae_class == diffusers_wan.VAE_CLASS:
        return diffusers_wan.latent_units(dict(config))
    return LatentStats.of_vae(channels, config.scaling_factor, getattr(config, "shift_factor", None) or 0.0)


def _check_vae_class(source: str | Path, expected: str) -> None:
    """A local VAE folder of another class would load as the expected one with random weights (diffusers only
    warns): refused by the class its config.json names."""
    config = Path(source).expanduser() / "config.json"
    if not config.is_file():
        return  # a hub id, or a folder the loader reports on
    try:
        name = json.loads(config.read_text()).get("_class_name")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return  # the loader names what is wrong with it
    if name not in (None, expected):
        example = f" (as {DIT_VAE})" if expected == "AutoencoderKL" else " (a WanPipeline folder's vae/)"
        raise ValueError(f"the VAE folder '{source}' holds a {name}: the network's latents are an {expected}'s"
                         f"{example} — pass one with --vae")


def _check_numbers(**values) -> None:
    """Each of steps, guidance, frames, height, width and seed of the right type and within LIMITS."""
    for name, value in values.items():
        kind = float if name == "guidance" else int
        lo, hi = LIMITS["size" if name in ("height", "width") else name]
        if not _is_number(value, kind):
            what = "an integer" if kind is int else "a number"
            raise RequestError(f"{name}={value!r} is not {what}: expected {lo}..{hi}")
        if not lo <= value <= hi:  # also refuses nan
            raise RequestError(f"{name}={value} is out of range: expected {lo}..{hi}")


def _is_number(value, kind: type) -> bool:
    """An int (kind int), or an int or float (kind float); bools are not numbers here, though Python says so."""
    return isinstance(value, (int, float) if kind is float else int) and not isinstance(value, bool)


def _check_text(name: str, text) -> None:
    if not isinstance(text, str):
        raise RequestError(f"the {name} must be text, got {text!r}")
    if len(text) > MAX_PROMPT_CHARS:
        raise RequestError(f"the {name} is {len(text)} characters long; the limit is {MAX_PROMPT_CHARS} (the text "
                           f"encoder reads only the first {MAX_TOKENS} tokens) — shorten it")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate: from undecodable bytes in argv, or "\ud800" in an API call
        raise RequestError(f"the {name} is not valid text: character {e.start + 1} ({text[e.start]!r}) is not a "
                           "Unicode character — retype it (a terminal whose encoding is not UTF-8 can cause this)"
                           ) from None
