"""The Fréchet distance of sampled images to reference statistics, summed over ranks: torchmetrics' metric.

The metric keeps, for the reference ("real") and the samples ("fake"), the sum of features, the sum of their outer
products and the count, in float64, and sums each over the ranks of its process group when it computes. The
reference's statistics are put into the real sums of ONE rank of the group (`holds_reference`): summed over the
group they are the reference exactly once, whatever the number of ranks.
"""

from __future__ import annotations

import torch

from ditcore.eval.features import INSTALL_FID, FeatureError, FeatureNet


def _metric_class():
    try:
        from torchmetrics.image.fid import FrechetInceptionDistance
    except (ImportError, RuntimeError) as e:  # torch-fidelity installed, but its torchvision does not import
        raise FeatureError(f"torchmetrics' FID does not import here ({str(e).strip().splitlines()[0]}) — "
                           f"{INSTALL_FID}") from None
    return FrechetInceptionDistance


class FrechetDistance:
    """Add images on every rank, then `compute()` (collective over `process_group`, default: all ranks)."""

    def __init__(self, net: FeatureNet, reference=None, *, process_group=None, device: str | torch.device = "cpu",
                 holds_reference: bool = True):
        kwargs = {"feature_extractor_weights_path": net.weights, "antialias": False} if isinstance(net.module, int) \
            else {}
        metric = _metric_class()
        try:
            self.metric = metric(feature=net.module, normalize=False, process_group=process_group, **kwargs).to(device)
        except ModuleNotFoundError as e:
            raise FeatureError(f"{e} — {INSTALL_FID}") from None
        except (OSError, RuntimeError) as e:  # torch-fidelity downloads its Inception weights on first use
            if not isinstance(net.module, int):
                raise
            raise FeatureError(f"cannot load FID's Inception weights ({str(e).strip().splitlines()[0]}) — pass a "
                               "local copy of torch-fidelity's pt_inception-2015-12-05 file as the weights") from None
        self.net, self.reference = net, reference if holds_reference else None
        self.reset()

    def reset(self) -> None:
        """Forget the samples added; keep the reference (a metric built once serves every validation)."""
        self.metric.reset()
        if self.reference is not None:
            self.reference.load_into(self.metric)

    @torch.no_grad()
    def add(self, images: torch.Tensor, real: bool = False) -> None:
        """images: uint8 (B, H, W, 3), as the sampler writes them, or (B, 3, H, W)."""
        if images.dtype != torch.uint8:
            raise ValueError(f"images of dtype {images.dtype}: expected uint8 pixels 0..255")
        if images.shape[-1] == 3 and images.shape[1] != 3:
            images = images.permute(0, 3, 1, 2)
        self.metric.update(images.to(self.metric.device).contiguous(), real=real)

    def sums(self, real: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
        """This rank's (feature sum, outer-product sum, count) of one side."""
        m, side = self.metric, "real" if real else "fake"
        return (getattr(m, f"{side}_features_sum"), getattr(m, f"{side}_features_cov_sum"),
                int(getattr(m, f"{side}_features_num_samples")))

    def compute(self) -> float:
        """The Fréchet distance over every rank's images (collective: every rank of the group must call it)."""
        if not hasattr(self.metric, "orig_dtype"):  # no features added on this rank: the float64 sums are the result
            self.metric.orig_dtype = torch.float64
        return float(self.metric.compute())
