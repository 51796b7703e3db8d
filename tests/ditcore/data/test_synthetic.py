import colorsys
import time
from dataclasses import replace

import numpy as np
import pytest

from ditcore.data.synthetic import (
    COLOURS,
    DIRECTIONS,
    MIN_OPENING,
    PATTERNS,
    SIMPLE_FLAP_SLOWDOWN,
    SIMPLE_MIN_OPENING,
    SIMPLE_SIZE,
    SPOT_COLOURS,
    ButterflySpec,
    caption,
    generate,
    render,
    sample_spec,
)
from ditcore.errors import ConfigError

NAMES = list(COLOURS)
HUES = np.array([colorsys.rgb_to_hsv(*(c / 255 for c in COLOURS[n]))[0] for n in NAMES])
# Unit steps (row, column) of each drift direction; rows grow downwards.
STEPS = {"left": (0, -1), "right": (0, 1), "up": (-1, 0), "down": (1, 0)}


def saturated(px: np.ndarray) -> np.ndarray:
    """Mask of strongly coloured pixels (HSV saturation > 0.5, not dark): the wings, never background or marks."""
    x = px.astype(np.float64)
    hi, lo = x.max(-1), x.min(-1)
    return (hi - lo > 0.5 * hi) & (hi > 80)


def dominant_colour(px: np.ndarray) -> tuple[str, float]:
    """The COLOURS name whose hue is nearest to most saturated pixels, and the share of pixels that voted for it.

    Hue, not RGB distance: anti-aliased blends of a wing with black marks keep its hue but not its RGB.
    """
    x = px.reshape(-1, 3).astype(np.float64)[saturated(px).reshape(-1)] / 255
    hi, d = x.max(1), x.max(1) - x.min(1)
    r, g, b = x.T
    hue = np.where(hi == r, ((g - b) / d) % 6, np.where(hi == g, (b - r) / d + 2, (r - g) / d + 4)) / 6
    gap = np.abs(hue[:, None] - HUES[None])
    votes = np.bincount(np.minimum(gap, 1 - gap).argmin(1), minlength=len(NAMES))
    return NAMES[votes.argmax()], votes.max() / votes.sum()


def centre_of_mass(mask: np.ndarray) -> np.ndarray:
    rows, cols = np.nonzero(mask)
    return np.array([rows.mean(), cols.mean()])


def test_vocabulary():
    assert len(COLOURS) >= 8 and set(PATTERNS) == {"plain", "spots", "stripes"}
    assert set(SPOT_COLOURS) == {"white", "black"} and DIRECTIONS == ("left", "right", "up", "down")
    # wing colours are saturated (pink, the palest, has 0.61) and at least 20 degrees of hue apart
    for rgb in COLOURS.values():
        assert colorsys.rgb_to_hsv(*(c / 255 for c in rgb))[1] > 0.6
    gaps = np.abs(HUES[:, None] - HUES[None])[~np.eye(len(HUES), dtype=bool)]
    assert np.minimum(gaps, 1 - gaps).min() * 360 > 20


def test_captions_are_exact_sentences():
    spec = ButterflySpec(colour="red", pattern="spots", spot_colour="white", background=(200, 200, 200),
                         background_kind="solid", size=0.5, x=0.5, y=0.5, direction="left", travel=0.2)
    assert caption(spec, video=False) == "a red butterfly with white spots"
    assert caption(spec, video=True) == "a red butterfly with white spots flying left"
    plain = replace(spec, colour="orange", pattern="plain", spot_colour=None, direction="up")
    assert caption(plain, video=True) == "an orange butterfly flying up"
    assert caption(replace(plain, direction=None, travel=0.0), video=True) == "an orange butterfly hovering"
    assert caption(replace(spec, pattern="stripes", spot_colour="black"), False) == "a red butterfly with black stripes"


def test_generate_is_deterministic_per_index_and_seed():
    for index in (0, 7, 123):
        a, cap_a, meta_a = generate(index, 5, 32, 4, 0.5)
        b, cap_b, meta_b = generate(index, 5, 32, 4, 0.5)
        np.testing.assert_array_equal(a, b)
        assert (cap_a, meta_a) == (cap_b, meta_b)
    # a sample does not depend on which samples were drawn before it (sharded writers)
    generate(3, 5, 32, 4, 0.5)
    np.testing.assert_array_equal(generate(7, 5, 32, 4, 0.5)[0], generate(7, 5, 32, 4, 0.5)[0])
    samples = {generate(i, s, 32, 4, 0.5)[0].tobytes() for i in range(10) for s in (0, 1)}
    assert len(samples) == 20


def test_the_caption_colour_dominates_the_pixels():
    # 400 samples, stills and clips, at the CI's smallest (32 px) and usual (64 px) resolutions.
    # Measured: 100% of samples classified right, and every saturated pixel votes for the captioned colour.
    hits, shares, wing = 0, [], []
    for size in (32, 64):
        for i in range(200):
            px, cap, meta = generate(i, 7, size, 4, 0.5)
            colour, share = dominant_colour(px)
            hits += colour == meta["colour"] and cap.split()[1] == colour
            shares.append(share)
            wing.append(saturated(px).mean(axis=(1, 2)))
    assert hits / 400 >= 0.99
    assert np.median(shares) > 0.95
    # the wings are a sizeable part of the picture, even closed wings of the smallest butterfly at 32 px
    # (measured: 8.7% of a frame on average, at least 0.68%)
    wing = np.concatenate(wing)
    assert wing.mean() > 0.07 and wing.min() > 0.005


def test_patterns_are_drawn_in_the_mark_colour():
    rng = np.random.default_rng(1)
    cover = {"spots": [], "stripes": []}
    for _ in range(60):
        spec = replace(sample_spec(rng, video=False), background_kind="solid")
        if spec.pattern == "plain":
            continue
        marked = render(spec, 64)[0].astype(np.int64)
        plain = render(replace(spec, pattern="plain", spot_colour=None), 64)[0].astype(np.int64)
        wing = saturated(plain)
        changed = (np.abs(marked - plain).sum(-1) > 30) & wing
        cover[spec.pattern].append(changed.sum() / wing.sum())
        # the fully covered mark pixels are the captioned mark colour
        near = np.abs(marked[changed] - SPOT_COLOURS[spec.spot_colour]).max(-1) < 40
        assert near.sum() >= 5, caption(spec, False)
        # marks stay on the wings: where the plain butterfly leaves the background bare, nothing differs
        bare = (plain == spec.background).all(-1)
        assert bare.mean() > 0.5 and (marked[bare] == plain[bare]).all()
    # marks are visible but leave the wing colour in the majority (measured over 300: spots 15-27%, stripes 27-38%)
    assert min(cover["spots"]) > 0.1 and max(cover["spots"]) < 0.3
    assert min(cover["stripes"]) > 0.2 and max(cover["stripes"]) < 0.45


@pytest.mark.parametrize("size", [63, 64])
def test_still_butterfly_is_mirror_symmetric_about_its_body(size):
    rng = np.random.default_rng(2)
    for _ in range(20):
        spec = replace(sample_spec(rng, video=False), x=0.5, background_kind="solid")
        img = render(spec, size)[0]
        np.testing.assert_array_equal(img, img[:, ::-1])
    # with soft noise the background is not symmetric, but the inside of the wings still is (edge pixels blend
    # with the background, so the mask is shrunk by one pixel)
    img = render(replace(spec, background_kind="noise"), size)[0]
    wing = saturated(img) & saturated(img[:, ::-1])
    inner = wing & np.roll(wing, 1, 0) & np.roll(wing, -1, 0) & np.roll(wing, 1, 1) & np.roll(wing, -1, 1)
    assert inner.sum() > 50
    np.testing.assert_array_equal(img[inner], img[:, ::-1][inner])


def test_stills_have_open_wings_of_the_sampled_span():
    for i in range(50):
        px, _, meta = generate(i, 3, 64, 8, 0.0)
        assert px.shape == (1, 64, 64, 3) and not meta["video"] and meta["direction"] is None
        # stills open their wings to at least 0.92 of the span (measured: 0.8 x span + 0.2 px to span + 0.3 px)
        span = saturated(px[0]).any(axis=0).sum()  # pixels
        assert 0.8 * meta["size"] * 64 - 1 <= span <= meta["size"] * 64 + 1, (span, meta["size"])
        assert 0.3 * 64 <= span <= 0.66 * 64


def test_clips_flap_and_drift_in_the_captioned_direction():
    for i in range(40):
        px, cap, meta = generate(i, 11, 64, 8, 1.0)
        assert px.shape == (8, 64, 64, 3) and meta["video"] and cap.endswith(f"flying {meta['direction']}")
        wing = saturated(px)  # (F, H, W)
        width = wing.any(axis=1).sum(-1)
        assert width.max() / width.min() > 1.4, (cap, width)  # the wings open and close (measured: >= 1.6)
        moved = centre_of_mass(wing[-1]) - centre_of_mass(wing[0])  # (row, column), pixels
        expected = np.array(STEPS[meta["direction"]]) * meta["travel"] * 64
        # measured over 300 clips: at most 0.49 px off the drawn drift
        np.testing.assert_allclose(moved, expected, atol=1.0, err_msg=cap)
        assert np.sign(moved @ STEPS[meta["direction"]]) == 1


def test_video_ratio_and_vocabulary_coverage():
    seen = {"colour": set(), "pattern": set(), "spot_colour": set(), "direction": set(), "background_kind": set()}
    clips = 0
    for i in range(300):
        px, cap, meta = generate(i, 4, 16, 2, 0.3)
        clips += meta["video"]
        assert px.shape[0] == (2 if meta["video"] else 1) and ("flying" in cap) == meta["video"]
        for key, values in seen.items():
            values.add(meta[key])
    assert abs(clips / 300 - 0.3) < 0.08  # binomial std is 0.026
    assert seen["colour"] == set(COLOURS) and seen["pattern"] == set(PATTERNS)
    assert seen["spot_colour"] == {*SPOT_COLOURS, None} and seen["direction"] == {*DIRECTIONS, None}
    assert seen["background_kind"] == {"solid", "gradient", "noise"}
    assert all(not generate(i, 4, 16, 2, 0.0)[2]["video"] for i in range(20))
    assert all(generate(i, 4, 16, 2, 1.0)[2]["video"] for i in range(20))


def test_the_picture_is_the_same_at_any_resolution():
    # positions and sizes are fractions of the frame: a 128 px render, box-downsampled, is the 32 px render
    rng = np.random.default_rng(6)
    for _ in range(10):
        spec = sample_spec(rng, video=True)
        big = render(spec, 128, 4).astype(np.float64).reshape(4, 32, 4, 32, 4, 3).mean(axis=(2, 4))
        small = render(spec, 32, 4).astype(np.float64)
        assert np.abs(big - small).mean() < 4.0


def test_render_is_fast():
    spec = sample_spec(np.random.default_rng(0), video=True)
    render(spec, 64, 8)
    image = min(_seconds(lambda: render(spec, 64)) for _ in range(5))
    clip = min(_seconds(lambda: render(spec, 64, 8)) for _ in range(5))
    # measured on 2 CPU cores: about 1 ms and 7 ms
    assert image < 0.05 and clip < 0.2, (image, clip)


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def test_errors_say_what_to_do():
    with pytest.raises(ConfigError, match=r"colour='teal' is invalid: expected one of red, orange"):
        replace(sample_spec(np.random.default_rng(0), False), colour="teal")
    with pytest.raises(ConfigError, match=r"spot_colour=None is invalid: expected None for pattern 'plain'"):
        replace(sample_spec(np.random.default_rng(0), False), pattern="spots", spot_colour=None)
    with pytest.raises(ConfigError, match=r"frames=1 is invalid: expected at least 2 to make clips"):
        generate(0, 0, 32, 1, 0.5)
    with pytest.raises(ConfigError, match=r"video_ratio=1.5 is invalid"):
        generate(0, 0, 32, 8, 1.5)
    with pytest.raises(ConfigError, match=r"direction='sideways' is invalid: expected None \(a still or a hovering"):
        replace(sample_spec(np.random.default_rng(0), True), direction="sideways")
    with pytest.raises(ConfigError, match=r"min_opening=0 is invalid: expected a horizontal wing scale in \(0, 1\]"):
        replace(sample_spec(np.random.default_rng(0), True), min_opening=0)
    with pytest.raises(ConfigError, match=r"size=4 is invalid: expected an image side of at least 8"):
        render(sample_spec(np.random.default_rng(0), False), 4)


def test_simple_butterflies_are_plain_of_one_size_in_the_middle_and_differ_in_nothing_else():
    for i in range(12):
        pixels, caption, meta = generate(i, 0, 64, 8, 0.5, simple=True)
        _, caption_full, meta_full = generate(i, 0, 64, 8, 0.5)
        plain = caption_full.split(" with ")[0].split(" flying ")[0]
        assert caption == plain + (" hovering" if meta["video"] else "")  # a clip stays in the middle
        assert " with " not in caption and meta["direction"] is None and meta["travel"] == 0
        if meta["video"]:  # every frame in place: the wings' mean column is the middle in each
            for frame in pixels.astype(int):
                columns = np.nonzero(frame.max(-1) - frame.min(-1) > 100)[1]
                assert abs(columns.mean() - 31.5) < 0.5
            # slower and less deep than the full data's flap: the narrowest frame keeps 0.6 of the span (the
            # full data's closed wings keep 0.35), and neighbouring frames differ by a few columns of wing
            assert meta["flap_speed"] == pytest.approx(SIMPLE_FLAP_SLOWDOWN * meta_full["flap_speed"])
            assert (meta["min_opening"], meta_full["min_opening"]) == (SIMPLE_MIN_OPENING, MIN_OPENING)
            width = saturated(pixels).any(axis=1).sum(-1)  # wing columns per frame
            assert width.min() >= SIMPLE_MIN_OPENING * width.max() - 2, width
            assert np.abs(np.diff(width)).max() <= 8, width
        differ = ("x", "y", "size", "pattern", "spot_colour", "background", "background_kind", "background_bottom",
                  "direction", "travel", "flap_speed", "min_opening")
        assert {k: v for k, v in meta.items() if k not in differ} == \
            {k: v for k, v in meta_full.items() if k not in differ}
        assert (meta["x"], meta["size"], meta["pattern"], meta["spot_colour"]) == (0.5, SIMPLE_SIZE, "plain", None)
        assert meta["background_kind"] == "solid" and meta["background_bottom"] == meta["background"]
        assert min(meta["background"]) >= 0.7 * 255 * (1 - 0.15)  # light: value >= 0.72, saturation <= 0.15
        if min(meta_full["background"]) > 100:  # drawn light already: kept
            assert meta["background"] == meta_full["background"]
        middle = pixels[len(pixels) // 2].astype(int)
        coloured = np.nonzero(middle.max(-1) - middle.min(-1) > 100)  # wing pixels
        # mirror-symmetric about the middle column, so the wing pixels' mean column is the middle: 31.5
        assert abs(coloured[1].mean() - 31.5) < 0.5
        rows = coloured[0]
        assert abs((rows.min() + rows.max()) / 2 - 31.5) < 0.15 * 64  # the drawing's extent is about centred
