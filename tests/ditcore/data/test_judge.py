"""The butterfly judge: the dataset's own pictures pass, and each kind of failure a person sees is caught."""

import numpy as np
import pytest

from ditcore.data.judge import colour_of, grid_step, judge
from ditcore.data.synthetic import COLOURS, generate


def dataset_frames(count: int, size: int = 64):
    """(image, colour) for the first `count` samples of dataset 0: stills and the first and middle clip frames."""
    for i in range(count):
        pixels, _, meta = generate(i, 0, size, 8, 0.5)
        for f in sorted({0, len(pixels) // 2}):
            yield pixels[f], meta["colour"]


@pytest.mark.parametrize("size", [64, 128])
def test_the_datasets_own_pictures_pass(size):
    verdicts = [judge(image, colour) for image, colour in dataset_frames(60, size)]
    assert all(v.colour for v in verdicts)
    failed = [v for v in verdicts if not v.butterfly]
    assert not failed, "\n".join(map(str, failed))


def test_another_colour_is_wrong():
    image, colour = next(dataset_frames(1))
    others = [c for c in COLOURS if c != colour]
    assert not any(judge(image, c).colour for c in others)


def test_blocks_of_8_pixels_are_a_grid():
    """The same pictures averaged over 8×8 blocks (what an undertrained model on 8-pixel tokens draws): a grid."""
    caught = 0
    frames = list(dataset_frames(20))
    for image, colour in frames:
        blocks = image.reshape(8, 8, 8, 8, 3).mean((1, 3), keepdims=True)
        blocky = np.broadcast_to(blocks, (8, 8, 8, 8, 3)).reshape(64, 64, 3).round().astype(np.uint8)
        verdict = judge(blocky, colour)
        caught += "grid" in verdict.failed
    assert caught >= 0.9 * len(frames)


def test_a_grid_measures_in_grey_levels():
    flat = np.full((64, 64, 3), 200.0) / 255
    assert grid_step(flat, 8) == 0
    seams = flat - (np.arange(64) // 8 % 2 * 10 / 255)[None, :, None]  # 8-pixel columns, alternately 10 levels darker
    assert grid_step(seams, 8) == pytest.approx(5.0)  # the median line of both axes: (10 + 0) / 2
    assert grid_step(seams, 4) == pytest.approx(0.0)  # half the 4-grid's lines have no seam


def test_half_a_butterfly_is_not_one():
    """One wing without its mirror image: no symmetry about a body."""
    image, colour = next(dataset_frames(1))
    coloured = image.astype(int).max(-1) - image.astype(int).min(-1) > 100
    axis = round(np.nonzero(coloured)[1].mean())
    half = image.copy()
    half[:, axis - 1:] = image[0, 0]  # the background's colour over the body and the right wing
    verdict = judge(half, colour)
    assert judge(image, colour).butterfly
    assert not verdict.butterfly and {"symmetry", "body"} & set(verdict.failed), verdict


def test_noise_and_blank_are_no_butterflies():
    rng = np.random.default_rng(0)
    noise = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
    blank = np.full((64, 64, 3), 230, dtype=np.uint8)
    assert not judge(noise, "red").butterfly
    assert not judge(blank, "red").butterfly and not judge(blank, "red").colour


def test_colour_of_a_prompt():
    assert colour_of("a red butterfly flying left") == "red"
    assert colour_of("An Orange butterfly") == "orange"
    assert colour_of("a butterfly") is None


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="uint8"):
        judge(np.zeros((64, 64, 3)), "red")
    with pytest.raises(ValueError, match="not one of"):
        judge(np.zeros((64, 64, 3), np.uint8), "teal")
