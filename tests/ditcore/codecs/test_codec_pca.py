import json

import pytest
import torch

from ditcore.codecs import PatchPCACodec, PixelCodec, load_codec, psnr
from ditcore.testing import assert_close_fp32


def smooth_images(n, size=64, seed=0):
    """(n, 3, 1, size, size) in [-1, 1]: a colour gradient plus four soft colour blobs per image."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.rand(*shape, generator=g)
    y, x = torch.meshgrid(torch.linspace(-1, 1, size), torch.linspace(-1, 1, size), indexing="ij")
    img = (r(n, 3, 1, 1) * 2 - 1) * 0.5 + (r(n, 3, 1, 1) - 0.5) * x + (r(n, 3, 1, 1) - 0.5) * y
    for _ in range(4):
        cx, cy, width = r(n, 1, 1, 1) * 2 - 1, r(n, 1, 1, 1) * 2 - 1, 0.1 + 0.4 * r(n, 1, 1, 1)
        img = img + (r(n, 3, 1, 1) * 2 - 1) * torch.exp(-((x - cx) ** 2 + (y - cy) ** 2) / (2 * width**2))
    return img.clamp(-1, 1).unsqueeze(2)


TRAIN, HELD_OUT = smooth_images(64, seed=0), smooth_images(16, seed=1)


def test_psnr_on_held_out_images_rises_with_channels():
    # Fitted on 64 images, measured on 16 others (64×64, 8×8 patches): 37.5 / 50.1 / 62.7 dB for K = 8 / 16 / 32.
    # The floors sit 3 dB under those numbers.
    floors = {8: 34.5, 16: 47.0, 32: 59.5}
    measured = {}
    for k, floor in floors.items():
        codec = PatchPCACodec.fit([TRAIN[:32], TRAIN[32:]], patch=8, channels=k)
        z = codec.encode(HELD_OUT)
        assert z.shape == (16, k, 1, 8, 8)
        measured[k] = psnr(codec.decode(z), HELD_OUT)
        assert measured[k] > floor, f"K={k}: {measured[k]:.2f} dB"
    assert measured[8] < measured[16] < measured[32]


def test_fit_matches_svd_of_the_patch_matrix():
    # Independent computation: the principal components are the top right singular vectors of the centred
    # patch matrix, and the component variances its squared singular values / N.
    codec = PatchPCACodec.fit([TRAIN[:16]], patch=4, channels=6)
    patches = PixelCodec(4).encode(TRAIN[:16]).movedim(1, -1).reshape(-1, 48).double()
    centred = patches - patches.mean(0)
    _, s, vh = torch.linalg.svd(centred, full_matrices=False)
    # The fit computes in float64 and stores float32: one rounding apart (work 1). Float64's own errors, about
    # N·2⁻⁵³ and 2⁻⁵³·‖C‖/(eigenvalue gap), are far below one float32 rounding.
    assert_close_fp32(codec.mean.double(), patches.mean(0), work=1)
    assert_close_fp32(codec.variance.double(), s[:6] ** 2 / len(patches), work=1)
    alignment = (codec.components.double() @ vh[:6].T).abs()  # equal up to sign: |⟨u_k, v_k⟩| = 1
    assert_close_fp32(alignment, torch.eye(6, dtype=torch.float64), work=1)  # unit vectors: Σ|u_i·v_i| ≤ 1
    # and reconstruction is the orthogonal projection onto those components
    projected = patches.mean(0) + centred @ vh[:6].T @ vh[:6]
    expected = PixelCodec(4).decode(projected.float().reshape(16, 1, 16, 16, 48).movedim(-1, 1))
    # encode: subtract the mean, a dot product over 48 features; decode: one over 6 channels, add the mean; the
    # components and the reference are float32 roundings of float64 values: 48 + 6 + 2 + 2
    assert_close_fp32(codec.decode(codec.encode(TRAIN[:16])), expected, work=48 + 6 + 2 + 2)


def test_components_are_orthonormal_and_the_fit_is_reproducible():
    a = PatchPCACodec.fit([TRAIN[:8]], channels=16)
    b = PatchPCACodec.fit([TRAIN[:8]], channels=16)
    # float32 roundings of orthonormal float64 rows (+2), then a float32 dot product over their 192 features
    assert_close_fp32(a.components @ a.components.T, torch.eye(16), work=192 + 2)
    assert torch.equal(a.components, b.components) and torch.equal(a.mean, b.mean)


def test_max_patches_stops_reading():
    # 8 images of 64×64 hold 8·64 patches: the cap makes the second batch irrelevant
    capped = PatchPCACodec.fit([TRAIN[:8], TRAIN[8:]], channels=8, max_patches=8 * 64)
    alone = PatchPCACodec.fit([TRAIN[:8]], channels=8)
    assert torch.equal(capped.components, alone.components)


def test_save_and_load_codec_give_identical_outputs(tmp_path):
    codec = PatchPCACodec.fit([TRAIN], channels=16)
    config = json.loads(json.dumps(codec.save(tmp_path)))
    assert config == {"kind": "patch_pca", "patch": 8, "channels": 16, "file": "codec_pca.safetensors"}
    loaded = load_codec(config, tmp_path)
    z = codec.encode(HELD_OUT)
    assert torch.equal(loaded.encode(HELD_OUT), z) and torch.equal(loaded.decode(z), codec.decode(z))
    assert (loaded.latent_channels, loaded.spatial_factor, loaded.temporal_factor) == (16, 8, 1)


def test_video_frames_are_encoded_alone():
    codec = PatchPCACodec.fit([TRAIN], channels=8)
    clip = TRAIN[:6].reshape(2, 3, 3, 64, 64)  # two clips of three frames
    z = codec.encode(clip)
    assert z.shape == (2, 8, 3, 8, 8)
    assert_close_fp32(z[:, :, 1:2], codec.encode(clip[:, :, 1:2]), work=1 + 3 * 8 * 8)  # the mean, a dot product


def test_errors_say_what_to_do(tmp_path):
    with pytest.raises(ValueError, match=r"channels=200 is invalid: expected 1..192"):
        PatchPCACodec.fit([TRAIN], channels=200)
    with pytest.raises(ValueError, match="got no pixels"):
        PatchPCACodec.fit([], channels=8)
    with pytest.raises(ValueError, match="multiples of 8"):
        PatchPCACodec.fit([TRAIN[:, :, :, :60]], channels=8)
    with pytest.raises(FileNotFoundError, match=r"codec_pca\.safetensors' not found"):
        load_codec({"kind": "patch_pca", "patch": 8, "channels": 16}, tmp_path)


def test_a_truncated_parameter_file_is_named_as_damaged(tmp_path):
    config = PatchPCACodec.fit([TRAIN[:8]], channels=8).save(tmp_path)
    path = tmp_path / config["file"]
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match=rf"^'{path}' is truncated or damaged \(Error while deserializing header: "
                                         r"incomplete metadata, file not fully covered\) — copy it again"):
        load_codec(config, tmp_path)
