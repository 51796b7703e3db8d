"""Loading a checkpoint for sampling and checking a request: shared by the CLI and the Gradio app."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from ditcore.codecs.text import TextEncoder, load_text_encoder
from ditcore.export import Exported, load_export
from ditcore.sampling import SampleResult, sample, token_grid

LIMITS = {"steps": (1, 500), "guidance": (0.0, 30.0), "frames": (1, 128), "size": (8, 1024)}


class RequestError(ValueError):
    """A request that cannot be sampled, with what to change."""


def resolve_checkpoint(path: str | Path) -> Path:
    """An export folder, or a run directory (its export/)."""
    path = Path(path)
    if (path / "model.safetensors").is_file():
        return path
    if (path / "export" / "model.safetensors").is_file():
        return path / "export"
    if not path.exists():
        raise FileNotFoundError(f"checkpoint '{path}' does not exist")
    raise FileNotFoundError(f"'{path}' is neither an export (model.safetensors) nor a run directory with "
                            "export/ — dit-train writes RUN_DIR/export/ at the end of training")


@dataclass
class Sampler:
    exported: Exported
    text: TextEncoder | None
    path: Path

    @classmethod
    def load(cls, checkpoint: str | Path) -> Sampler:
        path = resolve_checkpoint(checkpoint)
        exported = load_export(path)
        text = None
        if exported.model.cfg.text_dim:
            text = load_text_encoder(exported.info.text_encoder["name"])  # the encoder the dataset was made with
        return cls(exported, text, path)

    @property
    def class_conditional(self) -> bool:
        return self.exported.model.cfg.num_classes > 0

    def check(self, *, prompts, steps, guidance, frames, height, width, class_labels=None) -> None:
        """Raise RequestError naming the first out-of-range value."""
        for name, value, (lo, hi) in (("steps", steps, LIMITS["steps"]), ("guidance", guidance, LIMITS["guidance"]),
                                      ("frames", frames, LIMITS["frames"]), ("height", height, LIMITS["size"]),
                                      ("width", width, LIMITS["size"])):
            if not lo <= value <= hi:
                raise RequestError(f"{name}={value} is out of range: expected {lo}..{hi}")
        if self.class_conditional:
            n = self.exported.model.cfg.num_classes
            if not class_labels or any(not 0 <= c < n for c in class_labels):
                raise RequestError(f"class labels {class_labels} are invalid: expected integers in 0..{n - 1}")
        elif not prompts or any(not p.strip() for p in prompts):
            raise RequestError("the prompt is empty: describe what to draw, e.g. 'a red butterfly'")
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
                   class_labels=class_labels)
        t0 = time.perf_counter()
        states = negative = None
        if self.text is not None:
            states = self.text.encode(list(prompts))
            if negative_prompt:
                negative = self.text.encode([negative_prompt]) * len(prompts)
        result = sample(self.exported.model, self.exported.codec, self.exported.stats, text_states=states,
                        negative_states=negative, class_labels=class_labels, frames=frames, height=height,
                        width=width, steps=steps, guidance=guidance, solver=solver, seed=seed, fps=fps,
                        callback=callback)
        return result, time.perf_counter() - t0
