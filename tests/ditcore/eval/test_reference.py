"""Reference statistics: from a dataset (decoded by its codec), cached beside it and rebuilt when stale; a stats file
ditcore wrote; ADM's .npz. And the figure they give: the data's own images score near zero, a shifted set higher."""

import json

import numpy as np
import pytest
import torch
from torch import nn

from ditcore.codecs import LatentStats, PixelCodec
from ditcore.data.blend import write_blend
from ditcore.data.schema import DatasetInfo, read_info
from ditcore.data.writer import ShardWriter, finish_dataset, start_dataset
from ditcore.eval import FeatureNet, FrechetDistance, ReferenceError, ReferenceStats, dataset_reference, load_reference
from ditcore.sampling import to_uint8

SIZE, N = 16, 96


class RandomFeatures(nn.Module):
    """A small fixed random network in place of Inception: uint8 images → 8 features."""

    num_features = 8

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.conv = nn.Conv2d(3, 8, 4, stride=4)
        with torch.no_grad():
            self.conv.weight.copy_(torch.randn(self.conv.weight.shape, generator=g) * 0.3)
            self.conv.bias.zero_()

    def forward(self, images):
        return torch.tanh(self.conv(images.float() / 127.5 - 1)).mean((2, 3))  # (B, 8)


def net() -> FeatureNet:
    return FeatureNet("random-test", RandomFeatures())


def images(n: int, seed: int) -> torch.Tensor:
    """(n, 3, H, W) in [-1, 1]: a colour per image and smooth noise, drawn from one distribution."""
    g = torch.Generator().manual_seed(seed)
    colour = torch.rand(n, 3, 1, 1, generator=g) * 1.4 - 0.7
    noise = nn.functional.interpolate(torch.randn(n, 3, 4, 4, generator=g), size=(SIZE, SIZE), mode="bilinear")
    return (colour + 0.3 * noise).clamp(-1, 1)


def write_images(root, pixels: torch.Tensor, mean: float = 0.0, std: float = 1.0):
    """`pixels` through the exact pixel codec, normalised by (mean, std), and a 2-frame clip, which FID leaves out."""
    start_dataset(root, overwrite=False)
    codec, stats = PixelCodec(4), LatentStats.from_dict({"mean": [mean] * 48, "std": [std] * 48})
    with ShardWriter(root, max_count=40) as writer:
        for i, image in enumerate(pixels):
            latent = stats.normalize(codec.encode(image[None, :, None]))[0]  # (C, 1, h, w)
            writer.write(f"{i:05d}", latent, torch.zeros(0, 1), {"caption": ""})
        clip = stats.normalize(codec.encode(images(2, 1).permute(1, 0, 2, 3)[None]))[0]  # (C, 2, h, w)
        writer.write("clip", clip, torch.zeros(0, 1), {"caption": ""})
    info = DatasetInfo(codec=codec.save(root), latent_stats=stats.to_dict(),
                       text_encoder={"name": "null", "dim": 0}, latent_channels=48, spatial_factor=4,
                       temporal_factor=1, counts={"latent_shapes": dict(writer.latent_shapes)})
    finish_dataset(root, info)
    return root


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """N images of SIZE² pixels (and a clip)."""
    return write_images(tmp_path_factory.mktemp("fid") / "data", images(N, 0))


def score(reference: ReferenceStats, pixels: torch.Tensor) -> float:
    fd = FrechetDistance(net(), reference)
    fd.add(to_uint8(pixels))
    return fd.compute()


def test_the_datas_own_images_score_near_zero_and_a_shifted_set_higher(dataset):
    reference = dataset_reference(dataset, net=net(), limit=48, batch=20)
    assert (reference.n, reference.height, reference.width) == (48, SIZE, SIZE)
    data = images(N, 0)
    same = score(reference, data[:48])  # the reference's own images (bf16 latents, decoded as samples are)
    other = score(reference, data[48:])  # 48 other images of the same distribution
    brighter = score(reference, (data[48:] + 0.5).clamp(-1, 1))
    print(f"FD same images {same:.3g}, other images {other:.3g}, brighter {brighter:.3g}")
    assert abs(same) < 1e-3 * brighter
    assert other < 0.2 * brighter


def test_the_cache_is_reused_and_rebuilt_when_the_dataset_changes(dataset, monkeypatch):
    first = dataset_reference(dataset, net=net(), limit=32)
    cache = dataset / "eval" / f"fid-random-test-{SIZE}x{SIZE}-32.safetensors"
    meta = json.loads(cache.with_suffix(".json").read_text())
    assert meta["features"] == "random-test" and meta["n"] == 32 and meta["source"] == str(dataset)

    import ditcore.codecs

    def no_decoding(*args):
        raise AssertionError("the cache should have been read")

    with monkeypatch.context() as m:
        m.setattr(ditcore.codecs, "load_codec", no_decoding)
        again = dataset_reference(dataset, net=net(), limit=32)
    assert torch.equal(again.mu, first.mu) and torch.equal(again.sigma, first.sigma)
    assert load_reference(cache, "random-test").n == 32  # the file on its own is a reference too

    info = read_info(dataset)  # the dataset prepared again: its fingerprint changes, the cache is stale
    info.counts["note"] = "prepared again"
    info.write(dataset)
    with monkeypatch.context() as m:
        m.setattr(ditcore.codecs, "load_codec", no_decoding)
        with pytest.raises(AssertionError, match="the cache should have been read"):
            dataset_reference(dataset, net=net(), limit=32)
    rebuilt = dataset_reference(dataset, net=net(), limit=32)
    assert json.loads(cache.with_suffix(".json").read_text())["dataset"] != meta["dataset"]
    torch.testing.assert_close(rebuilt.mu, first.mu, rtol=0, atol=1e-12)  # the same images


def test_a_blends_reference_mixes_its_datasets_images_by_their_weights(dataset, tmp_path):
    """Each dataset's images decoded with its own latent statistics, weighed as training draws them."""
    alone = dataset_reference(dataset, net=net())
    again = write_images(tmp_path / "again", images(N, 0), mean=0.3, std=2.0)  # the same images in other units
    write_blend(tmp_path / "same", [(dataset, 3.0, {}, "data"), (again, 1.0, {}, "again")])
    same = dataset_reference(tmp_path / "same", net=net())
    assert (same.n, same.height, same.width) == (2 * N, SIZE, SIZE)
    torch.testing.assert_close(same.mu, alone.mu, rtol=0, atol=1e-3)  # bf16 latents: a pixel may round otherwise
    torch.testing.assert_close(same.sigma, alone.sigma, rtol=0, atol=1e-3)

    bright = write_images(tmp_path / "bright", (images(N, 2) + 0.6).clamp(-1, 1), mean=0.3, std=2.0)
    write_blend(tmp_path / "blend", [(dataset, 3.0, {}, "data"), (bright, 1.0, {}, "bright")])
    blend = dataset_reference(tmp_path / "blend", net=net())
    drawn = torch.cat([images(72, 5), (images(24, 6) + 0.6).clamp(-1, 1)])  # other images, 3 to 1 as the blend
    scores = {name: score(ref, drawn) for name, ref in (("blend", blend), ("data", alone),
                                                         ("bright", dataset_reference(bright, net=net())))}
    print(", ".join(f"FD against {name} {value:.3g}" for name, value in scores.items()))
    assert scores["blend"] < 0.2 * min(scores["data"], scores["bright"])


def test_an_adm_npz_is_read_without_pickle(tmp_path):
    rng = np.random.default_rng(0)
    mu, a = rng.normal(size=4), rng.normal(size=(4, 4))
    np.savez(tmp_path / "ref.npz", arr_0=np.zeros((2, 8, 8, 3), np.uint8), mu=mu, sigma=a @ a.T)
    stats = load_reference(tmp_path / "ref.npz", "inception")
    assert torch.equal(stats.mu, torch.tensor(mu)) and torch.equal(stats.sigma, torch.tensor(a @ a.T))
    with pytest.raises(ReferenceError, match=r"holds statistics of inception features.*--features inception"):
        load_reference(tmp_path / "ref.npz", "dinov2:dinov2-large")
    np.savez(tmp_path / "pickled.npz", mu=np.array([{"code": 1}], dtype=object), sigma=np.eye(1))
    with pytest.raises(ReferenceError, match=r"is not an \.npz with mu and sigma"):
        load_reference(tmp_path / "pickled.npz", "inception")
    with pytest.raises(ReferenceError, match="does not exist — pass a ditcore dataset folder"):
        load_reference(tmp_path / "nope", "inception")
