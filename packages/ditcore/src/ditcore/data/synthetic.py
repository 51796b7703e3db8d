"""Procedurally drawn butterflies, as still images and short clips, with exact captions.

This is the embedded default dataset of the CPU demo and CI: a tiny DiT trained on it for a few minutes must
learn to follow the caption's colour, so the wings are large and saturated and the backgrounds are desaturated.
Everything drawn is in a `ButterflySpec`; the caption is derived from it, so it never disagrees with the pixels.
Sample `i` of a dataset depends on (seed, i) alone, so sharded or multi-worker writers produce the same data.

Drawing is numpy only, vectorised over (frame, row, column). Shapes are signed distances in pixels, turned
into coverage with a one-pixel ramp, so edges are anti-aliased at any resolution (32-128 px).
Butterfly coordinates: u = |column - centre| / s across (mirrored, so the wings are exactly symmetric),
v = (row - centre) / s down, with s the half wingspan in pixels; the wings reach u = 1 when fully open.
"""

from __future__ import annotations

import colorsys
import math
from dataclasses import asdict, dataclass

import numpy as np

from ditcore.errors import ConfigError

# Wing colours: saturated and at least 20 degrees of hue apart, so each is unambiguous in pixels and in captions.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (225, 30, 35),
    "orange": (250, 135, 0),
    "yellow": (250, 220, 0),
    "green": (30, 185, 45),
    "cyan": (0, 200, 215),
    "blue": (30, 70, 235),
    "purple": (140, 35, 215),
    "pink": (245, 95, 185),
}
# Colours of the pattern marks (spots or stripes); unsaturated, so they never compete with the wing colour.
SPOT_COLOURS: dict[str, tuple[int, int, int]] = {"white": (250, 250, 250), "black": (20, 20, 20)}
PATTERNS = ("plain", "spots", "stripes")
DIRECTIONS = ("left", "right", "up", "down")
BACKGROUNDS = ("solid", "gradient", "noise")

BODY_RGB = (35, 28, 24)  # body, head and antennae: near black, unsaturated
SIZE_RANGE = (0.35, 0.65)  # wingspan (fully open) as a fraction of the frame width
CLIP_SIZE_RANGE = (0.4, 0.65)  # flapping wings are narrower on average, so clips draw larger butterflies
SIMPLE_SIZE = 0.6  # the one wingspan of sample_spec(simple=True), stills and clips
TRAVEL_RANGE = (0.15, 0.3)  # distance a clip's butterfly drifts from first to last frame, fraction of the frame
# How far the drawing reaches above and below its centre, in half-wingspans (antenna tips, lower wing tips).
REACH_UP, REACH_DOWN = 0.95, 0.72
MIN_OPENING = 0.35  # horizontal wing scale when the wings are closed: keeps the colour visible in every frame
# sample_spec(simple=True)'s clips flap slower and less deep: a flap every 12-25 frames, the wings at least 0.6 open,
# so neighbouring frames differ by a few pixels of wing and a small model keeps the tokens of a frame in step.
SIMPLE_MIN_OPENING = 0.6
SIMPLE_FLAP_SLOWDOWN = 0.25
NOISE_GRID = 6  # soft background noise is bilinear over this many control points per side, at any resolution
NOISE_AMPLITUDE = 22.0  # grey levels


@dataclass(frozen=True)
class ButterflySpec:
    """Everything that is drawn. Positions and sizes are fractions of the frame, so any resolution renders it.

    x, y: centre of the butterfly (for a clip: at mid-clip), from the top-left corner.
    size: wingspan with the wings fully open, as a fraction of the frame width.
    direction: where a clip drifts (None for a still image or a clip that hovers); travel: how far, first to last
    frame.
    flap_phase, flap_speed, min_opening: the wing opening at frame f is
    min_opening + (1 - min_opening) |cos(phase + speed f)| (the wings' horizontal scale).
    background_bottom: the gradient's bottom colour (equal to `background` for the other kinds).
    noise_seed: seeds the soft noise of background_kind "noise".
    lower_wing: scale of the lower wings relative to the upper ones, for variety of shape.
    """

    colour: str
    pattern: str
    spot_colour: str | None
    background: tuple[int, int, int]
    background_kind: str
    size: float
    x: float
    y: float
    direction: str | None
    travel: float = 0.0
    flap_phase: float = 0.0
    flap_speed: float = 0.0
    background_bottom: tuple[int, int, int] | None = None
    noise_seed: int = 0
    lower_wing: float = 1.0
    min_opening: float = MIN_OPENING

    def __post_init__(self):
        if self.colour not in COLOURS:
            raise ConfigError("colour", self.colour, f"one of {', '.join(COLOURS)}")
        if self.pattern not in PATTERNS:
            raise ConfigError("pattern", self.pattern, f"one of {', '.join(PATTERNS)}")
        if (self.pattern == "plain") != (self.spot_colour is None):
            marks = ", ".join(SPOT_COLOURS)
            raise ConfigError("spot_colour", self.spot_colour,
                              f"None for pattern 'plain', else one of {marks} (pattern={self.pattern!r})")
        if self.spot_colour is not None and self.spot_colour not in SPOT_COLOURS:
            raise ConfigError("spot_colour", self.spot_colour, f"one of {', '.join(SPOT_COLOURS)}")
        if self.background_kind not in BACKGROUNDS:
            raise ConfigError("background_kind", self.background_kind, f"one of {', '.join(BACKGROUNDS)}")
        if self.direction is not None and self.direction not in DIRECTIONS:
            raise ConfigError("direction", self.direction,
                              f"None (a still or a hovering clip) or one of {', '.join(DIRECTIONS)}")
        if not 0 < self.size <= 1:
            raise ConfigError("size", self.size, "a wingspan in (0, 1], as a fraction of the frame width")
        if not 0 < self.min_opening <= 1:
            raise ConfigError("min_opening", self.min_opening, "a horizontal wing scale in (0, 1]")


def _pale_colour(rng: np.random.Generator, light: bool) -> tuple[int, int, int]:
    """A desaturated light or dark colour: backgrounds must never look like a wing colour."""
    value = rng.uniform(0.75, 0.95) if light else rng.uniform(0.08, 0.28)
    rgb = colorsys.hsv_to_rgb(rng.random(), rng.uniform(0.0, 0.15), value)
    return tuple(round(255 * c) for c in rgb)


def _lightened(rgb: tuple[int, int, int]) -> tuple[int, int, int]:
    """A dark pale colour mirrored to the light range (value v -> 1 - v, same hue and saturation); light ones stay."""
    h, s, v = colorsys.rgb_to_hsv(*(c / 255 for c in rgb))
    return tuple(round(255 * c) for c in colorsys.hsv_to_rgb(h, s, max(v, 1 - v)))


def _centre_range(reach_lo: float, reach_hi: float, pad: float) -> tuple[float, float]:
    """Allowed centres along one axis so that [centre - reach_lo, centre + reach_hi] stays inside [0, 1]."""
    lo, hi = reach_lo + pad, 1 - reach_hi - pad
    return (lo, hi) if lo <= hi else ((lo + hi) / 2,) * 2


def sample_spec(rng: np.random.Generator, video: bool, simple: bool = False) -> ButterflySpec:
    """A random butterfly; with video=True it also flaps and drifts, and it is a little larger.

    simple: the variety a small model learns in minutes (the CPU demo's data): plain wings of one wingspan
    (SIMPLE_SIZE) in the middle of the frame, on a plain light background (a dark one drawn is lightened); a
    clip hovers there, flapping (no drift: the prompt "a red butterfly" then names all a clip shows, where with
    four drift directions to choose from the demo's model cut its clips into tiles of several), flapping slower
    and less deep (SIMPLE_FLAP_SLOWDOWN, SIMPLE_MIN_OPENING). Wing colours, background tints, wing shapes and the
    flap's phase vary as before. The same numbers are drawn either way, so the two datasets differ in pattern,
    size, position, background, drift and flap speed and depth alone.
    """
    colour = str(rng.choice(list(COLOURS)))
    pattern = str(rng.choice(PATTERNS))
    spot_colour = None if pattern == "plain" else str(rng.choice(list(SPOT_COLOURS)))
    background_kind = str(rng.choice(BACKGROUNDS))
    background = _pale_colour(rng, light=rng.random() < 0.6)
    bottom = _pale_colour(rng, light=rng.random() < 0.5) if background_kind == "gradient" else background
    size = float(rng.uniform(*(CLIP_SIZE_RANGE if video else SIZE_RANGE)))
    if video:
        direction = str(rng.choice(DIRECTIONS))
        travel = float(rng.uniform(*TRAVEL_RANGE))
        flap_phase = float(rng.uniform(0, math.pi))
        flap_speed = float(rng.uniform(0.5, 1.0))  # radians per frame: a full flap every 3-6 frames
    else:
        # Stills show the wings (nearly) fully open: the wing colour is the signal to learn.
        direction, travel, flap_phase, flap_speed = None, 0.0, float(rng.uniform(-0.5, 0.5)), 0.0
    half = size / 2
    # The centre is the mid-clip position; half the travel on each side keeps the whole clip in frame.
    drift_x = travel / 2 if direction in ("left", "right") else 0.0
    drift_y = travel / 2 if direction in ("up", "down") else 0.0
    x = rng.uniform(*_centre_range(half + drift_x, half + drift_x, pad=0.02))
    y = rng.uniform(*_centre_range(REACH_UP * half + drift_y, REACH_DOWN * half + drift_y, pad=0.02))
    if simple:  # the drawing reaches further up than down: centre its extent, not its body
        pattern, spot_colour, size = "plain", None, SIMPLE_SIZE
        background_kind, background = "solid", _lightened(background)
        bottom = background
        x, y = 0.5, 0.5 + (REACH_UP - REACH_DOWN) * SIMPLE_SIZE / 4
        direction, travel = None, 0.0  # a clip hovers
        flap_speed *= SIMPLE_FLAP_SLOWDOWN
    return ButterflySpec(
        colour=colour, pattern=pattern, spot_colour=spot_colour, background=background,
        background_kind=background_kind, size=size, x=float(x), y=float(y), direction=direction, travel=travel,
        flap_phase=flap_phase, flap_speed=flap_speed, background_bottom=bottom,
        noise_seed=int(rng.integers(2**31)), lower_wing=float(rng.uniform(0.85, 1.1)),
        min_opening=SIMPLE_MIN_OPENING if simple else MIN_OPENING,
    )


def caption(spec: ButterflySpec, video: bool) -> str:
    """What is drawn, in words: 'a red butterfly with white spots', plus ' flying left' for a clip that drifts
    left or ' hovering' for one that stays in place."""
    article = "an" if spec.colour[0] in "aeiou" else "a"
    text = f"{article} {spec.colour} butterfly"
    if spec.pattern != "plain":
        text += f" with {spec.spot_colour} {spec.pattern}"
    if video:
        text += f" flying {spec.direction}" if spec.direction else " hovering"
    return text


# ---------------------------------------------------------------------------------------------------------------
# Drawing. Every shape function returns a signed distance in pixels (negative inside), computed in butterfly
# coordinates and converted to pixels with the gradient: d_px ≈ f / |∇_px f|. su and sv are pixels per unit of
# u and v; su differs from sv while the wings are partly closed (u is stretched by the opening).


def _coverage(sd: np.ndarray) -> np.ndarray:
    return np.clip(0.5 - sd, 0.0, 1.0)


def _ellipse(u, v, cu: float, cv: float, au: float, av: float, theta: float, su, sv) -> np.ndarray:
    """Ellipse centred (cu, cv) with semi-axes (au, av), its au-axis turned by theta (negative: outer end up)."""
    c, s = math.cos(theta), math.sin(theta)
    du, dv = u - cu, v - cv
    p, q = du * c + dv * s, dv * c - du * s
    k = np.sqrt((p / au) ** 2 + (q / av) ** 2) + 1e-9  # 1 on the outline
    kp, kq = p / (au * au * k), q / (av * av * k)
    ku, kv = kp * c - kq * s, kp * s + kq * c
    return (k - 1) / np.sqrt((ku / su) ** 2 + (kv / sv) ** 2 + 1e-12)


def _segment(x, y, x0: float, y0: float, x1: float, y1: float, half_width: float) -> np.ndarray:
    """Capsule around the segment (x0, y0)-(x1, y1); all in pixels."""
    dx, dy = x1 - x0, y1 - y0
    t = np.clip(((x - x0) * dx + (y - y0) * dy) / (dx * dx + dy * dy), 0.0, 1.0)
    return np.hypot(x - x0 - t * dx, y - y0 - t * dy) - half_width


def _wings(u, v, lower: float, su, sv) -> np.ndarray:
    upper_sd = _ellipse(u, v, 0.5, -0.28, 0.52, 0.38, -0.45, su, sv)
    lower_sd = _ellipse(u, v, 0.36 * lower, 0.28 * lower, 0.38 * lower, 0.3 * lower, 0.6, su, sv)
    return np.minimum(upper_sd, lower_sd)


def _spots(u, v, lower: float, su, sv) -> np.ndarray:
    spots = [(0.78, -0.5, 0.12), (0.5, -0.27, 0.09), (0.44 * lower, 0.38 * lower, 0.1 * lower)]
    return np.minimum.reduce([_ellipse(u, v, cu, cv, r, r, 0.0, su, sv) for cu, cv, r in spots])


def _stripes(u, v, su, sv, half_width) -> np.ndarray:
    """Bands across the wings, slanted like a swallowtail's, at w = u - 0.3 v = 0.45 and 0.75."""
    w = u - 0.3 * v
    centre = np.min([np.abs(w - c) for c in (0.45, 0.75)], axis=0)
    return centre / np.sqrt((1 / su) ** 2 + (0.3 / sv) ** 2) - half_width


def _soft_noise(seed: int, size: int) -> np.ndarray:
    """(size, size) smooth noise in [-1, 1]: a fixed coarse grid, bilinearly resampled (same look at any size)."""
    grid = np.random.default_rng(seed).uniform(-1.0, 1.0, (NOISE_GRID, NOISE_GRID))
    pos = (np.arange(size) + 0.5) / size * (NOISE_GRID - 1)
    i0 = np.minimum(pos.astype(int), NOISE_GRID - 2)
    w = (pos - i0)[:, None]
    rows = grid[i0] * (1 - w) + grid[i0 + 1] * w  # (size, NOISE_GRID)
    return rows[:, i0] * (1 - w.T) + rows[:, i0 + 1] * w.T


def _background(spec: ButterflySpec, size: int) -> np.ndarray:
    top = np.array(spec.background, dtype=np.float32)
    if spec.background_kind == "gradient":
        g = ((np.arange(size, dtype=np.float32) + 0.5) / size)[:, None, None]
        bottom = np.asarray(spec.background_bottom, dtype=np.float32)
        return np.broadcast_to(top * (1 - g) + bottom * g, (size, size, 3))
    if spec.background_kind == "noise":
        # Grey noise (the same in every channel) keeps the background desaturated.
        return top + NOISE_AMPLITUDE * _soft_noise(spec.noise_seed, size).astype(np.float32)[..., None]
    return np.broadcast_to(top, (size, size, 3))


def _paint(img: np.ndarray, coverage: np.ndarray, rgb) -> np.ndarray:
    a = coverage[..., None]
    return img * (1 - a) + np.asarray(rgb, dtype=np.float32) * a


def render(spec: ButterflySpec, size: int, frames: int = 1) -> np.ndarray:
    """Pixels (frames, size, size, 3) uint8. Over a clip the wings flap and the centre drifts in spec.direction."""
    if size < 8:
        raise ConfigError("size", size, "an image side of at least 8 pixels")
    if frames < 1:
        raise ConfigError("frames", frames, "an integer >= 1")
    f = np.arange(frames, dtype=np.float64)
    progress = f / (frames - 1) - 0.5 if frames > 1 else np.zeros(1)  # -0.5 .. 0.5 around the mid-clip centre
    step = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1), None: (0, 0)}[spec.direction]
    cx = (spec.x + step[0] * spec.travel * progress) * size
    cy = (spec.y + step[1] * spec.travel * progress) * size
    opening = spec.min_opening + (1 - spec.min_opening) * np.abs(np.cos(spec.flap_phase + spec.flap_speed * f))

    # float32 throughout: twice as fast as float64, and pixel centres (k + 0.5) are still exact, so a butterfly
    # at x = 0.5 is mirrored bit for bit.
    s = spec.size * size / 2  # half wingspan, pixels
    pix = np.arange(size, dtype=np.float32) + 0.5
    cx, cy = cx.astype(np.float32)[:, None, None], cy.astype(np.float32)[:, None, None]
    dx = np.abs(pix[None, None, :] - cx)  # (F, 1, W), mirrored about the body axis
    dy = pix[None, :, None] - cy  # (F, H, 1)
    su = (opening * s).astype(np.float32)[:, None, None]  # (F, 1, 1): closing the wings squeezes u
    u, v = dx / su, dy / s  # wing coordinates, (F, 1, W) and (F, H, 1)

    wing = _coverage(_wings(u, v, spec.lower_wing, su, s))  # (F, H, W)
    img = _paint(_background(spec, size)[None], wing, COLOURS[spec.colour])
    if spec.pattern != "plain":
        if spec.pattern == "spots":
            marks = _spots(u, v, spec.lower_wing, su, s)
        else:  # at least ~1 px wide when open, so small stripes stay stripes; they narrow as the wings close
            marks = _stripes(u, v, su, s, half_width=max(0.05 * s, 0.55) * opening[:, None, None])
        img = _paint(img, _coverage(marks) * wing, SPOT_COLOURS[spec.spot_colour])

    # Body, head and antennae do not flap: they are drawn in unsqueezed pixels around the centre.
    ub = dx / s
    body = _ellipse(ub, v, 0.0, 0.05, 0.075, 0.5, 0.0, s, s)
    head = _ellipse(ub, v, 0.0, -0.5, 0.1, 0.1, 0.0, s, s)
    antenna = _segment(dx, dy, 0.04 * s, -0.55 * s, 0.3 * s, -0.9 * s, max(0.025 * s, 0.45))
    knob = np.hypot(dx - 0.3 * s, dy + 0.9 * s) - max(0.05 * s, 0.6)
    img = _paint(img, _coverage(np.minimum.reduce([body, head, antenna, knob])), BODY_RGB)
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


def generate(index: int, seed: int, size: int, frames: int, video_ratio: float,
             simple: bool = False) -> tuple[np.ndarray, str, dict]:
    """The index-th sample of the dataset `seed`: (pixels (F, size, size, 3) uint8, caption, metadata).

    A sample is a clip of `frames` frames with probability video_ratio, else a still image (F = 1); which one
    is decided by the same per-sample generator, so the answer depends on (index, seed, video_ratio) only.
    simple: the demo's variety, see `sample_spec`.
    """
    if index < 0 or seed < 0:
        raise ConfigError("index" if index < 0 else "seed", min(index, seed), "an integer >= 0")
    if not 0.0 <= video_ratio <= 1.0:
        raise ConfigError("video_ratio", video_ratio, "a fraction of clips in [0, 1]")
    if video_ratio > 0 and frames < 2:
        raise ConfigError("frames", frames, f"at least 2 to make clips (video_ratio={video_ratio}); or video_ratio=0")
    rng = np.random.default_rng([seed, index])
    video = bool(rng.random() < video_ratio)
    spec = sample_spec(rng, video, simple)
    pixels = render(spec, size, frames if video else 1)
    return pixels, caption(spec, video), {**asdict(spec), "video": video}
