"""The Fréchet distance as ditcore computes it (torchmetrics' metric, its states loaded from reference statistics)
against SciPy and the closed form; the feature networks."""

import numpy as np
import pytest
import scipy.linalg
import torch
from torch import nn

from ditcore.eval import DINOv2Features, FeatureError, FeatureNet, FrechetDistance, ReferenceStats, feature_net


class Features(nn.Module):
    """The inputs are the features: the metric's arithmetic alone."""

    def __init__(self, d: int):
        super().__init__()
        self.num_features = d

    def forward(self, x):
        return x


def scipy_fd(x: np.ndarray, y: np.ndarray) -> float:
    """The original FID code's formula: ‖μ₁ − μ₂‖² + tr(Σ₁ + Σ₂ − 2 (Σ₁Σ₂)^½), unbiased covariances."""
    mu1, mu2 = x.mean(0), y.mean(0)
    s1, s2 = np.cov(x, rowvar=False), np.cov(y, rowvar=False)
    root = scipy.linalg.sqrtm(s1 @ s2).real
    return float(((mu1 - mu2) ** 2).sum() + np.trace(s1 + s2 - 2 * root))


def test_the_distance_of_two_gaussian_samples_is_scipys():
    rng = np.random.default_rng(0)
    d, n = 6, 400
    a, b = rng.normal(size=(d, d)), rng.normal(size=(d, d))  # covariances a·aᵀ and b·bᵀ: they do not commute
    x = rng.normal(size=(n, d)) @ a.T + 1.0
    y = rng.normal(size=(n + 37, d)) @ b.T - 0.5
    fd = FrechetDistance(FeatureNet("identity", Features(d)))
    for part in np.array_split(x, 3):  # in batches, as images arrive
        fd.metric.update(torch.from_numpy(part), real=True)
    for part in np.array_split(y, 4):
        fd.metric.update(torch.from_numpy(part), real=False)
    expected = scipy_fd(x, y)
    assert expected > 1
    assert fd.compute() == pytest.approx(expected, rel=1e-9)


@pytest.mark.filterwarnings("ignore:The ``compute`` method:UserWarning")  # no images: both sides are statistics
def test_reference_statistics_give_the_closed_form_when_the_covariances_commute():
    """Σ₁ = Q diag(a) Qᵀ, Σ₂ = Q diag(b) Qᵀ: tr(Σ₁ + Σ₂ − 2(Σ₁Σ₂)^½) = Σᵢ (√aᵢ − √bᵢ)². Both sides are loaded from
    statistics (mean, covariance, count), as a cached reference is: the sums they become give them back exactly."""
    rng = np.random.default_rng(1)
    d = 5
    q, _ = np.linalg.qr(rng.normal(size=(d, d)))
    a, b = rng.uniform(0.5, 3, d), rng.uniform(0.5, 3, d)
    mu1, mu2 = rng.normal(size=d), rng.normal(size=d)
    real = ReferenceStats(torch.tensor(mu1), torch.tensor(q @ np.diag(a) @ q.T), 1000, "identity")
    fake = ReferenceStats(torch.tensor(mu2), torch.tensor(q @ np.diag(b) @ q.T), 17, "identity")
    fd = FrechetDistance(FeatureNet("identity", Features(d)), real)
    fake.load_into(fd.metric, real=False)
    expected = ((mu1 - mu2) ** 2).sum() + ((np.sqrt(a) - np.sqrt(b)) ** 2).sum()
    assert fd.compute() == pytest.approx(expected, rel=1e-10)


def test_dinov2_features_load_from_a_folder_and_are_the_normalised_cls_token(tmp_path):
    """The dinov2 path with a tiny random Dinov2Model saved as save_pretrained writes it (safetensors): bicubic to
    224 px, ImageNet normalisation, the CLS token after the final norm."""
    from transformers import Dinov2Config, Dinov2Model

    torch.manual_seed(0)
    cfg = Dinov2Config(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, patch_size=28)
    Dinov2Model(cfg).save_pretrained(tmp_path / "dino")
    assert (tmp_path / "dino" / "model.safetensors").is_file()
    net = feature_net("dinov2", tmp_path / "dino")
    assert net.name == "dinov2:dino" and net.module.num_features == 16
    images = torch.randint(0, 256, (3, 3, 40, 48), dtype=torch.uint8)
    x = nn.functional.interpolate(images.float() / 255, size=(224, 224), mode="bicubic", antialias=True).clamp(0, 1)
    x = (x - torch.tensor([0.485, 0.456, 0.406])[:, None, None]) / torch.tensor([0.229, 0.224, 0.225])[:, None, None]
    model = Dinov2Model.from_pretrained(tmp_path / "dino").eval()
    expected = model(pixel_values=x).last_hidden_state[:, 0]  # the last hidden state is after the final norm
    torch.testing.assert_close(net.module(images), expected)
    fd = FrechetDistance(net)
    fd.add(images.permute(0, 2, 3, 1), real=True)  # (B, H, W, 3), as the sampler writes images
    fd.add(images.flip(-1), real=False)
    assert fd.compute() > 0


def test_a_dinov2_model_that_is_not_there_is_one_readable_line(tmp_path):
    with pytest.raises(FeatureError, match=r"cannot load the DINOv2 model: the folder '.*missing' does not exist — "
                                           r"pass a folder written by save_pretrained, or a hub id"):
        DINOv2Features.load(tmp_path / "missing")


def test_inception_without_torch_fidelity_says_what_to_install():
    import importlib.util

    if importlib.util.find_spec("torch_fidelity") is not None:
        pytest.skip("torch-fidelity is installed here: the Inception network builds")
    with pytest.raises(FeatureError, match=r"torch-fidelity's, which is not installed — \.venv/bin/python -m pip "
                                           r"install -c constraints\.txt -e 'packages/ditcore\[fid\]'"):
        feature_net("inception")
