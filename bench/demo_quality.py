"""What a person sees in a trained demo: does "a {colour} butterfly" draw one butterfly of that colour?

Samples the eight colours of the synthetic butterflies with `--seeds` seeds each, as images and as clips,
and judges every picture with ditcore.data.judge: the prompted colour, and one compact, mirror-symmetric
butterfly with a dark body on a plain background without a patch grid. A clip shows the butterfly when every
frame has one blob of the prompted colour, and passes the shape tests when all its frames do.

    python bench/demo_quality.py runs/demo                  # 8 colours x 4 seeds, images and 8-frame clips
    python bench/demo_quality.py runs/demo --sheet judged.png   # also a contact sheet, failures marked

The sampler settings default to the ones the demo's validation uses (apps/train/configs/demo.yaml).
"""

from __future__ import annotations

import argparse
import collections
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml

from ditcore import runs
from ditcore.codecs.text import load_text_encoder
from ditcore.data.judge import _dilate, judge
from ditcore.data.synthetic import COLOURS
from ditcore.export import load_export
from ditcore.sampling import sample

PROMPTS = [f"{'an' if c[0] in 'aeiou' else 'a'} {c} butterfly" for c in COLOURS]
DEMO = yaml.safe_load((Path(__file__).resolve().parents[1] / "apps/train/configs/demo.yaml").read_text())["validation"]


TOKEN_PIXELS = 16  # the demo's tokens: patch 4 over a PCA code of 4x4-pixel patches


def box_contrast(image: np.ndarray, period: int = TOKEN_PIXELS) -> float:
    """The faint box around a butterfly, in grey levels: the RGB distance between the mean background of the
    period x period tokens that hold any of the butterfly and that of the other tokens (background: 4 px and more
    from any wing or body pixel). NaN where either side has too few background pixels."""
    x = image.astype(np.float32)
    subject = (x.max(-1) - x.min(-1) > 60) | (x.mean(-1) < 80)  # saturated wing or dark body
    H, W = subject.shape
    if H % period or W % period:
        return float("nan")
    near = _dilate(subject, 4)  # the judge's square dilation
    held = subject.reshape(H // period, period, W // period, period).any((1, 3))
    inside = np.kron(held, np.ones((period, period), bool))
    a, b = x[~near & inside], x[~near & ~inside]
    return float(np.linalg.norm(a.mean(0) - b.mean(0))) if min(len(a), len(b)) > 20 else float("nan")


@dataclass
class Rates:
    images: int = 0
    image_colour: int = 0
    image_butterfly: int = 0
    image_all_but_grid: int = 0  # pass every shape test except the patch grid one
    clips: int = 0
    clip_colour: int = 0
    clip_butterfly: int = 0  # every frame passes every shape test
    clip_shown: int = 0  # every frame shows one butterfly of the prompted colour (colour, wing area, one blob)
    frames: int = 0
    frame_butterfly: int = 0  # clip frames that pass every shape test
    failed: collections.Counter = field(default_factory=collections.Counter)  # test name → images failing it
    pictures: list = field(default_factory=list)  # (seed, prompt index, image, passed)
    boxes: dict = field(default_factory=lambda: {"images": [], "frames": []})  # box_contrast of each

    def lines(self) -> list[str]:
        out = [f"images  colour {self.image_colour}/{self.images} = {self.image_colour / self.images:.0%}   "
               f"one butterfly {self.image_butterfly}/{self.images} = {self.image_butterfly / self.images:.0%}   "
               f"(all but the grid test {self.image_all_but_grid}/{self.images})"]
        if self.clips:
            out.append(f"clips   colour {self.clip_colour}/{self.clips} = {self.clip_colour / self.clips:.0%}   "
                       f"butterfly shown {self.clip_shown}/{self.clips} = {self.clip_shown / self.clips:.0%}   "
                       f"one butterfly {self.clip_butterfly}/{self.clips} = {self.clip_butterfly / self.clips:.0%}"
                       f"   (every frame; frames passing every shape test {self.frame_butterfly}/{self.frames})")
        out.append("failed  " + (", ".join(f"{k} {n}" for k, n in self.failed.most_common()) or "nothing"))
        box = {k: np.nanmean(v) for k, v in self.boxes.items() if v and not np.isnan(v).all()}
        if box:
            out.append("box     background off in the tokens that hold the butterfly, mean RGB distance: "
                       + ", ".join(f"{k} {v:.1f}" for k, v in box.items()) + " grey levels")
        return out


def judge_run(checkpoint: str | Path, seeds: int = DEMO["seeds"], clip_frames: int = DEMO["clip_frames"],
              clip_seeds: int = 2, steps: int = DEMO["steps"], guidance: float = DEMO["guidance"],
              size: int = DEMO["size"]) -> Rates:
    exported = load_export(runs.find_export(checkpoint))
    model, codec, stats = exported.model, exported.codec, exported.stats
    states = load_text_encoder(exported.info.text_encoder["name"]).encode(PROMPTS)
    colours = list(COLOURS)
    rates = Rates()
    for frames, n_seeds in ((1, seeds), (clip_frames, clip_seeds if clip_frames > 1 else 0)):
        for seed in range(n_seeds):
            result = sample(model, codec, stats, text_states=states, frames=frames, height=size, width=size,
                            steps=steps, guidance=guidance, seed=seed, **exported.sampling())
            for i, clip in enumerate(result.pixels.numpy()):
                verdicts = [judge(frame, colours[i]) for frame in clip]
                rates.boxes["images" if frames == 1 else "frames"] += [box_contrast(f) for f in clip]
                colour, butterfly = all(v.colour for v in verdicts), all(v.butterfly for v in verdicts)
                if frames == 1:
                    rates.images += 1
                    rates.image_colour += colour
                    rates.image_butterfly += butterfly
                    rates.image_all_but_grid += set(verdicts[0].failed) <= {"grid"}
                    rates.failed.update(verdicts[0].failed + ([] if colour else ["colour"]))
                    rates.pictures.append((seed, i, clip[0], colour and butterfly))
                else:
                    rates.clips += 1
                    rates.clip_colour += colour
                    rates.clip_butterfly += butterfly
                    rates.clip_shown += colour and not any({"wing_area", "main_blob"} & set(v.failed) for v in verdicts)
                    rates.frames += len(verdicts)
                    rates.frame_butterfly += sum(v.butterfly for v in verdicts)
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="a run directory or its export/")
    ap.add_argument("--seeds", type=int, default=DEMO["seeds"], help="image seeds per colour (default: %(default)s)")
    ap.add_argument("--clip-frames", type=int, default=DEMO["clip_frames"],
                    help="frames of each clip; 1: no clips (default: %(default)s)")
    ap.add_argument("--clip-seeds", type=int, default=2, help="clip seeds per colour (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=DEMO["steps"], help="Heun steps (default: %(default)s)")
    ap.add_argument("--guidance", type=float, default=DEMO["guidance"],
                    help="classifier-free guidance (default: %(default)s)")
    ap.add_argument("--size", type=int, default=DEMO["size"], help="pixels per side (default: %(default)s)")
    ap.add_argument("--sheet", type=Path, help="write the judged images here (png), failures framed in red")
    args = ap.parse_args()
    rates = judge_run(args.checkpoint, args.seeds, args.clip_frames, args.clip_seeds, args.steps, args.guidance,
                      args.size)
    print("\n".join(rates.lines()))
    if args.sheet:
        from ditcore.media import contact_sheet, write_sample

        grid = np.zeros((len(PROMPTS), args.seeds, args.size + 4, args.size + 4, 3), np.uint8)
        for seed, i, image, passed in rates.pictures:
            grid[i, seed] = (0, 160, 0) if passed else (220, 0, 0)
            grid[i, seed, 2:-2, 2:-2] = image
        path = write_sample(contact_sheet(grid, PROMPTS, [f"seed {s}" for s in range(args.seeds)])[None], args.sheet)
        print(f"sheet   {path}")


if __name__ == "__main__":
    main()
