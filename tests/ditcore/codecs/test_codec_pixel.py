import json
import math

import pytest
import torch

from ditcore.codecs import CODECS, PixelCodec, load_codec, psnr
from ditcore.testing import EPS32


def pixels(*shape, seed=0):
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def test_round_trip_is_exact():
    codec = PixelCodec(4)
    x = pixels(2, 3, 3, 16, 24)
    z = codec.encode(x)
    assert z.shape == (2, 48, 3, 4, 6)
    assert torch.equal(codec.decode(z), x)


def test_patch_layout_golden_values():
    # channel c·f² + i·f + j of cell (h, w) is pixel (c, h·f + i, w·f + j): the layout PatchPCACodec relies on
    codec, x = PixelCodec(2), pixels(1, 3, 1, 4, 6)
    z = codec.encode(x)
    for c, i, j, h, w in [(0, 0, 0, 0, 0), (1, 0, 1, 1, 2), (2, 1, 0, 0, 1), (2, 1, 1, 1, 1)]:
        assert z[0, c * 4 + i * 2 + j, 0, h, w] == x[0, c, 0, h * 2 + i, w * 2 + j]


def test_frames_are_encoded_alone():
    codec, x = PixelCodec(2), pixels(2, 3, 4, 8, 8)
    z = codec.encode(x)
    for t in range(4):
        assert torch.equal(z[:, :, t : t + 1], codec.encode(x[:, :, t : t + 1]))


def test_shape_errors_name_the_shape_and_the_fix():
    codec = PixelCodec(8)
    with pytest.raises(ValueError, match=r"20x64: height and width must be multiples of 8 — crop or resize to 16x64"):
        codec.encode(pixels(1, 3, 1, 20, 64))
    with pytest.raises(ValueError, match=r"\(1, 3, 64, 64\): expected \(B, 3, T, H, W\); .*unsqueeze\(2\)"):
        codec.encode(pixels(1, 3, 64, 64))
    with pytest.raises(ValueError, match=r"\(1, 4, 1, 8, 8\): expected \(B, 192, T, H, W\)"):
        codec.decode(pixels(1, 4, 1, 8, 8))
    with pytest.raises(ValueError, match="factor=0 is invalid"):
        PixelCodec(0)


def test_latent_size():
    assert PixelCodec(8).latent_size(5, 64, 96) == (5, 8, 12)
    with pytest.raises(ValueError, match="multiples of 8"):
        PixelCodec(8).latent_size(1, 60, 64)


def test_save_and_load_codec(tmp_path):
    codec = PixelCodec(2)
    config = json.loads(json.dumps(codec.save(tmp_path)))
    assert config == {"kind": "pixel", "factor": 2}
    loaded = load_codec(config, tmp_path)
    x = pixels(1, 3, 2, 8, 8)
    assert isinstance(loaded, PixelCodec) and torch.equal(loaded.encode(x), codec.encode(x))


def test_unknown_kind_names_the_allowed_kinds(tmp_path):
    with pytest.raises(ValueError, match="kind='jpeg' is unknown: expected one of " + ", ".join(CODECS)):
        load_codec({"kind": "jpeg"}, tmp_path)


def test_psnr_golden_value():
    x = pixels(1, 3, 1, 8, 8)
    # 10·log10(2² / 0.02²), but x + 0.02 is rounded in float32 next to |x| ≤ 1: each difference is 0.02 within
    # (1.02 / 0.02)·u relative, the mean square twice that, and 10·log10 turns a relative error r into 10 / ln 10 · r dB
    assert psnr(x, x + 0.02) == pytest.approx(40.0, abs=10 / math.log(10) * 2 * (1.02 / 0.02) * EPS32)
    assert psnr(x, x) == float("inf")
