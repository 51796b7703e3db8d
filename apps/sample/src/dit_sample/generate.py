"""Loading a checkpoint for sampling and checking a request: shared by the CLI and the Gradio app."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ditcore import runs
from ditcore.codecs.text import MAX_TOKENS, TextEncoder, load_text_encoder
from ditcore.export import Exported, load_export
from ditcore.sampling import SampleResult, sample, token_grid

# Inclusive ranges; seed: what torch.Generator.manual_seed accepts.
LIMITS = {"steps": (1, 500), "guidance": (0.0, 30.0), "frames": (1, 128), "size": (8, 1024), "seed": (0, 2**64 - 1)}
SOLVERS = ("heun", "euler")
# The text encoder reads only the first MAX_TOKENS tokens (a few hundred characters); a prompt far longer than
# that is a paste accident or abuse, and is refused rather than silently cut.
MAX_PROMPT_CHARS = 2000


class RequestError(ValueError):
    """A request that cannot be sampled, with what to change."""


@dataclass
class Sampler:
    exported: Exported
    text: TextEncoder | None
    path: Path

    @classmethod
    def load(cls, checkpoint: str | Path) -> Sampler:
        path = runs.find_export(checkpoint)
        exported = load_export(path)
        text = None
        if exported.model.cfg.text_dim:
            text = load_text_encoder(exported.info.text_encoder["name"])  # the encoder the dataset was made with
        return cls(exported, text, path)

    @property
    def class_conditional(self) -> bool:
        return self.exported.model.cfg.num_classes > 0

    def check(self, *, prompts=None, steps, guidance, frames, height, width, seed=0, solver="heun",
              negative_prompt=None, class_labels=None) -> None:
        """Raise RequestError naming the first value of the wrong type or out of range.

        Cheap (nothing is allocated), so a request is refused before it costs memory; values may come straight from
        an API caller's JSON, so the types are checked too.
        """
        for name, value, kind in (("steps", steps, int), ("guidance", guidance, float), ("frames", frames, int),
                                  ("height", height, int), ("width", width, int), ("seed", seed, int)):
            lo, hi = LIMITS["size" if name in ("height", "width") else name]
            if not _is_number(value, kind):
                what = "an integer" if kind is int else "a number"
                raise RequestError(f"{name}={value!r} is not {what}: expected {lo}..{hi}")
            if not lo <= value <= hi:  # also refuses nan
                raise RequestError(f"{name}={value} is out of range: expected {lo}..{hi}")
        if solver not in SOLVERS:
            raise RequestError(f"solver={solver!r} is unknown: expected one of {', '.join(SOLVERS)}")
        if self.class_conditional:
            n = self.exported.model.cfg.num_classes
            if not class_labels or any(not _is_number(c, int) or not 0 <= c < n for c in class_labels):
                raise RequestError(f"class labels {class_labels} are invalid: expected integers in 0..{n - 1}")
        else:
            for p in prompts or [""]:
                _check_text("prompt", p)
                if not p.strip():
                    raise RequestError("the prompt is empty: describe what to draw, e.g. 'a red butterfly'")
            if negative_prompt is not None:
                _check_text("negative prompt", negative_prompt)
        try:
            token_grid(self.exported.model, self.exported.codec, frames, height, width)
        except ValueError as e:
            raise RequestError(str(e)) from None

    def sizes(self) -> list[int]:
        """Square sizes (pixels) this model samples: multiples of codec factor × patch, within max_grid."""
        cfg, codec = self.exported.model.cfg, self.exported.codec
        step = codec.spatial_factor * cfg.patch_size
        largest = min(cfg.max_grid[1], cfg.max_grid[2]) * step
        return [s for s in range(step, min(largest, 512) + 1, step) if s >= 16]

    def run(self, *, prompts=None, negative_prompt=None, class_labels=None, steps=18, guidance=4.0, seed=0,
            frames=1, height=64, width=64, solver="heun", fps=8.0, callback=None) -> tuple[SampleResult, float]:
        self.check(prompts=prompts, steps=steps, guidance=guidance, frames=frames, height=height, width=width,
                   seed=seed, solver=solver, negative_prompt=negative_prompt, class_labels=class_labels)
        t0 = time.perf_counter()
        states = negative = None
        if self.text is not None:
            states = self.text.encode(list(prompts))
            if negative_prompt:
                negative = self.text.encode([negative_prompt]) * len(prompts)
        result = sample(self.exported.model, self.exported.codec, self.exported.stats, text_states=states,
                        negative_states=negative, class_labels=class_labels, frames=frames, height=height,
                        width=width, steps=steps, guidance=guidance, solver=solver, seed=seed, fps=fps,
                        prediction=self.exported.prediction, callback=callback)
        if not torch.isfinite(result.latents).all():  # decoded, NaN would be an all-black picture passing as a sample
            raise RequestError("the sample came out non-finite (NaN/Inf) although the weights are finite: the model's "
                               "output overflowed — try a lower guidance, other steps, or another checkpoint")
        return result, time.perf_counter() - t0


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
