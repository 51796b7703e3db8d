"""How good a model is: FID and FD_DINOv2 here, the Fréchet distance between the features of sampled images and of
a reference set; the loss on held-out data at fixed noise levels in ditcore.eval.heldout.

The distance is torchmetrics' `FrechetInceptionDistance`, picked over torch-fidelity and clean-fid for correctness
where they differ:
- its Inception network is torch-fidelity's FeatureExtractorInceptionV3, the TF-ported `pt_inception-2015-12-05`
  weights with TF1's bilinear resize to 299 px: the network and resize of the original TF FID code and of ADM's
  evaluator, which DiT's numbers come from (clean-fid resizes with PIL bicubic instead: its "clean" FID is another
  number than the papers');
- it keeps sums of features and of their outer products in float64 and takes the trace of the matrix square root
  from the eigenvalues of Σ₁Σ₂ (no scipy.linalg.sqrtm, whose float32 round trip and complex parts are a known
  source of drift);
- it is a torchmetrics `Metric`: its states are sums that it reduces over torch.distributed ranks itself, so N
  samples split over ranks give the figure of N samples in one process (torch-fidelity and clean-fid score one
  process's files);
- it takes any `nn.Module` as the feature network, so FD_DINOv2 and the tests' small random network go through the
  same code as FID.

torch-fidelity (the Inception weights) is the optional extra `ditcore[fid]`; DINOv2 loads through transformers.
"""

from ditcore.eval.features import FEATURES, FIGURE, DINOv2Features, FeatureError, FeatureNet, feature_net
from ditcore.eval.frechet import FrechetDistance
from ditcore.eval.reference import ReferenceError, ReferenceStats, dataset_reference, load_reference
from ditcore.eval.sampled import SamplePlan, score_samples

__all__ = ["FEATURES", "FIGURE", "DINOv2Features", "FeatureError", "FeatureNet", "FrechetDistance", "ReferenceError",
           "ReferenceStats", "SamplePlan", "dataset_reference", "feature_net", "load_reference",
           "score_samples"]
