"""Does a sampled image look like one of the synthetic butterflies? A check of what a person sees.

The demo's samples are judged on the features a person names when asked whether an image shows "a red
butterfly" of this dataset (see `ditcore.data.synthetic`):

- colour: most strongly coloured pixels have the prompted wing colour (nearest of the eight hues);
- one butterfly: those pixels form one compact blob (the wings, bridged over the thin body and any stripes);
- mirror symmetry: the blob matches its mirror image about a vertical axis;
- a dark body: the pixels on that axis, between the wings, are dark and unsaturated;
- a plain background: away from the butterfly the image is unsaturated and smooth;
- no patch grid: pixel steps across the borders of a p×p grid (the codec's or the tokens' patches) are not
  larger than steps elsewhere.

Each test gives a number and a threshold; the thresholds were set so that the dataset's own images and their
codec reconstructions pass (`tests/ditcore/data/test_judge.py` checks that) while the blocky samples of an
undertrained demo fail. Pure numpy, for images of 32–256 pixels.
"""

from __future__ import annotations

import colorsys
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ditcore.data.synthetic import COLOURS

# Pixels at least this saturated and bright are "coloured": wing colours have saturation >= 0.8 and value
# >= 0.7, backgrounds and marks <= 0.15 saturation; anti-aliased wing edges fall in between.
WING_SATURATION, WING_VALUE = 0.45, 0.35
BODY_DARKNESS = 0.5  # body pixels are darker than this fraction of the wings' median value
HUES = {name: colorsys.rgb_to_hsv(*(c / 255 for c in rgb))[0] for name, rgb in COLOURS.items()}


@dataclass(frozen=True)
class Thresholds:
    colour_share: float = 0.6  # of coloured pixels nearest in hue to the prompted colour
    min_wing_area: float = 0.01  # coloured pixels, fraction of the image
    max_wing_area: float = 0.5
    main_blob: float = 0.9  # share of coloured pixels in the largest blob (bridged over 2 px)
    symmetry: float = 0.6  # IoU of the wing mask and its mirror image about the best vertical axis
    body: float = 0.5  # share of the wings' central rows with a dark pixel on the axis (±1 px)
    background_saturation: float = 0.2  # mean saturation away from the butterfly
    background_roughness: float = 0.06  # mean |Laplacian| (in [0, 1] units) away from the butterfly
    grid: float = 4.0  # grey levels by which steps across p×p patch borders exceed others (GRID_PERIODS)


GRID_PERIODS = (4, 8, 16)


@dataclass
class Verdict:
    colour: bool  # the prompted colour (when one was given)
    butterfly: bool  # one compact, symmetric butterfly with a dark body on a plain background, no patch grid
    scores: dict[str, float] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)  # names of the failed shape tests

    def __str__(self) -> str:
        shown = ", ".join(f"{k}={v:.2f}" for k, v in self.scores.items())
        return f"colour={'ok' if self.colour else 'WRONG'} butterfly={'ok' if self.butterfly else 'NO'} ({shown})"


def _hsv(rgb: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(H, W, 3) in [0, 1] → hue (in turns), saturation, value; each (H, W)."""
    hi, lo = rgb.max(-1), rgb.min(-1)
    delta = hi - lo
    sat = np.where(hi > 0, delta / np.maximum(hi, 1e-12), 0.0)
    r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
    d = np.maximum(delta, 1e-12)
    hue = np.select([hi == r, hi == g], [((g - b) / d) % 6, (b - r) / d + 2], (r - g) / d + 4) / 6
    return hue, sat, hi


def _dilate(mask: np.ndarray, radius: int) -> np.ndarray:
    out = mask.copy()
    H, W = mask.shape
    padded = np.pad(mask, radius)
    for dy in range(-radius, radius + 1):
        for dx in range(-radius, radius + 1):
            out |= padded[radius + dy:radius + dy + H, radius + dx:radius + dx + W]
    return out


def _largest_component(mask: np.ndarray) -> np.ndarray:
    """The largest 8-connected component of a boolean mask (all False for an empty one)."""
    H, W = mask.shape
    label = np.zeros((H, W), dtype=np.int32)
    best, best_size, n = 0, 0, 0
    for y0, x0 in zip(*np.nonzero(mask), strict=True):
        if label[y0, x0]:
            continue
        n += 1
        label[y0, x0], size, queue = n, 0, deque([(y0, x0)])
        while queue:
            y, x = queue.popleft()
            size += 1
            for yy in range(max(y - 1, 0), min(y + 2, H)):
                for xx in range(max(x - 1, 0), min(x + 2, W)):
                    if mask[yy, xx] and not label[yy, xx]:
                        label[yy, xx] = n
                        queue.append((yy, xx))
        if size > best_size:
            best, best_size = n, size
    return label == best if best else np.zeros_like(mask)


def _mirror_iou(mask: np.ndarray) -> tuple[float, float]:
    """(best IoU of the mask and its mirror about a vertical axis, that axis in pixel units): axes on whole and
    half pixels across the mask's extent."""
    cols = np.nonzero(mask.any(0))[0]
    best, axis = 0.0, (cols[0] + cols[-1]) / 2
    W = mask.shape[1]
    for twice in range(2 * cols[0], 2 * cols[-1] + 1):  # axis at twice / 2: column j mirrors to twice - j
        j = np.arange(W)
        mirror = twice - j
        valid = (mirror >= 0) & (mirror < W)
        flipped = np.zeros_like(mask)
        flipped[:, j[valid]] = mask[:, mirror[valid]]
        iou = (mask & flipped).sum() / max((mask | flipped).sum(), 1)
        if iou > best:
            best, axis = float(iou), twice / 2
    return best, axis


def grid_step(image: np.ndarray, period: int) -> float:
    """How much a period×period patch grid shows, in grey levels (0-255): the mean excess step across the
    grid's lines minus the mean excess step across other lines, horizontally and vertically together.

    The excess step across a line is how much the step between its two pixels exceeds the larger step beside
    it (0 inside a smooth region or a soft edge, positive at a seam). A picture without a grid has its seams
    (sharp edges) anywhere, so the difference is about 0; a field of p×p blocks has them on the grid lines.
    """
    on, off = [], []
    for axis in (0, 1):
        step = np.abs(np.diff(image, axis=axis)).mean(-1)  # (H-1, W) or (H, W-1): per-pixel steps
        step = np.moveaxis(step, axis, 0)  # lines first
        beside = np.maximum(np.pad(step, ((1, 0), (0, 0)))[:-1], np.pad(step, ((0, 1), (0, 0)))[1:])
        excess = np.maximum(step - beside, 0).mean(1)  # one value per line
        on_grid = (np.arange(excess.size) % period) == period - 1
        on.append(excess[on_grid])
        off.append(excess[~on_grid])
    # Medians: a few sharp edges that happen to lie on grid lines do not make a grid; seams on most lines do.
    return float((np.median(np.concatenate(on)) - np.median(np.concatenate(off))) * 255)


def _colour_share(hue: np.ndarray, wing: np.ndarray, colour: str) -> float:
    """The share of wing pixels whose hue is nearest the prompted colour's."""
    if not wing.any():
        return 0.0
    names = list(HUES)
    distance = np.abs(hue[wing][:, None] - np.array([HUES[n] for n in names])[None])
    nearest = np.minimum(distance, 1 - distance).argmin(1)  # hue is circular
    return float((nearest == names.index(colour)).mean())


def _shape(wing: np.ndarray, val: np.ndarray, height: int) -> tuple[dict[str, float], np.ndarray]:
    """The butterfly's shape scores (main_blob, symmetry, body) and the background mask: the pixels away from it."""
    if not wing.any():
        return dict(main_blob=0.0, symmetry=0.0, body=0.0), np.ones_like(wing)
    blob = _largest_component(_dilate(wing, 2)) & wing
    scores = {"main_blob": float(blob.sum() / wing.sum())}
    scores["symmetry"], axis = _mirror_iou(blob)
    rows = np.nonzero(blob.any(1))[0]
    top, bottom = rows[0], rows[-1]
    # The body runs down the middle: the central rows of the wings' extent, at the axis (±1 px).
    lo, hi = top + (bottom - top) // 4, bottom - (bottom - top) // 4 + 1
    c0, c1 = int(np.floor(axis - 1)), int(np.ceil(axis + 1)) + 1
    band = val[lo:hi, max(c0, 0):c1]
    # dark: a row of the band holds a pixel much darker than the wings (on any background)
    dark = band.min(1) < BODY_DARKNESS * np.median(val[blob]) if band.size else np.zeros(0, bool)
    scores["body"] = float(dark.mean()) if dark.size else 0.0
    away = ~_dilate(blob, max(3, height // 16))
    away[max(top - 4, 0):bottom + 5, max(c0 - 3, 0):c1 + 3] = False  # body, head and antennae are not background
    return scores, away


def judge(image: np.ndarray, colour: str | None = None, thresholds: Thresholds = Thresholds()) -> Verdict:
    """Judge one image (H, W, 3) uint8 against the prompted wing colour (None: colour not judged)."""
    if image.ndim != 3 or image.shape[-1] != 3 or image.dtype != np.uint8:
        raise ValueError(f"judge takes one image (H, W, 3) uint8, got {image.dtype} {tuple(image.shape)}")
    if colour is not None and colour not in COLOURS:
        raise ValueError(f"colour {colour!r} is not one of the dataset's: {', '.join(COLOURS)}")
    t = thresholds
    rgb = image.astype(np.float64) / 255
    hue, sat, val = _hsv(rgb)
    wing = (sat >= WING_SATURATION) & (val >= WING_VALUE)
    area = float(wing.mean())
    scores = {"wing_area": area}

    colour_ok = True
    if colour is not None:
        share = _colour_share(hue, wing, colour)
        scores["colour_share"] = share
        colour_ok = share >= t.colour_share and area >= t.min_wing_area

    failed = []
    if not t.min_wing_area <= area <= t.max_wing_area:
        failed.append("wing_area")
    shape, away = _shape(wing, val, image.shape[0])
    scores.update(shape)
    grey = rgb.mean(-1)
    laplacian = np.abs(4 * grey[1:-1, 1:-1] - grey[:-2, 1:-1] - grey[2:, 1:-1] - grey[1:-1, :-2] - grey[1:-1, 2:])
    inner = away[1:-1, 1:-1]
    scores["background_saturation"] = float(sat[away].mean()) if away.any() else 1.0
    scores["background_roughness"] = float(laplacian[inner].mean()) if inner.any() else 1.0
    scores["grid"] = max(grid_step(rgb, p) for p in GRID_PERIODS if p < min(image.shape[:2]))

    for name in ("main_blob", "symmetry", "body"):
        if scores[name] < getattr(t, name):
            failed.append(name)
    for name in ("background_saturation", "background_roughness", "grid"):
        if scores[name] > getattr(t, name):
            failed.append(name)
    return Verdict(colour=colour_ok, butterfly=not failed, scores=scores, failed=failed)


def colour_of(prompt: str) -> str | None:
    """The wing colour a prompt names ('a red butterfly flying left' → 'red'), or None."""
    words = prompt.lower().replace(",", " ").split()
    named = [w for w in words if w in COLOURS]
    return named[0] if named else None
