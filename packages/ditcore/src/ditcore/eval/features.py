"""The feature networks of the Fréchet distance: what an image becomes before its statistics are taken.

Every network takes images as torchmetrics' Inception does, uint8 (B, 3, H, W), and returns (B, num_features).
- inception: torchmetrics' own (torch-fidelity's TF-ported FID Inception, pool3, 2048 features), resized to 299 px
  as TF1 resized (`antialias=False`: the papers' FID; torchmetrics' default antialiased resize is another number);
- dinov2: a transformers Dinov2Model (safetensors: loading runs no code), as FD_DINOv2 (Stein et al. 2023, dgm-eval)
  reads it: bicubic resize to 224 px, ImageNet normalisation, the final-norm CLS token;
- any nn.Module with `num_features`, e.g. the tests' small random network: the same metric code around it.
"""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ditcore.choices import FEATURES

FIGURE = {"inception": "FID", "dinov2": "FD_DINOv2"}  # what the distance is called with each network's features
DINOV2_DEFAULT = "facebook/dinov2-large"  # FD_DINOv2's ViT-L/14
DINOV2_SIZE = 224
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def install_fid_command() -> str:
    """The command that adds the `fid` extra (torch-fidelity) to this ditcore. ditcore is not on PyPI, so `pip install
    'ditcore[fid]'` finds nothing: pip installs the extra from the repository this ditcore was installed from (`make
    install`: editable, from packages/ditcore), with its constraints file, which keeps pip from replacing torch; a
    ditcore installed from elsewhere gets the extra's requirements by name, as its metadata lists them."""
    from importlib.metadata import requires

    python = _shown(Path(sys.executable))
    package = Path(__file__).resolve().parents[3]  # src/ditcore/eval/features.py → packages/ditcore
    if not (package / "pyproject.toml").is_file():
        extra = [r.split(";")[0].strip() for r in requires("ditcore") or [] if "extra == \"fid\"" in r]
        return f"{python} -m pip install {' '.join(map(shlex.quote, extra or ['torch-fidelity']))}"
    constraints = package.parent.parent / "constraints.txt"
    given = f" -c {_shown(constraints)}" if constraints.is_file() else ""
    return f"{python} -m pip install{given} -e {shlex.quote(f'{_shown(package)}[fid]')}"


def _shown(path: Path) -> str:
    """A path as short as it is exact: relative to the working folder where it lies inside it."""
    relative = os.path.relpath(path)
    return shlex.quote(relative if not relative.startswith("..") else str(path))


INSTALL_FID = (f"{install_fid_command()} (torch-fidelity, the fid extra) and the torchvision built for this torch "
               f"{torch.__version__.split('+')[0]} (PyPI's torchvision does not import beside the CPU wheel: install "
               "it from the index torch came from)")


class FeatureError(RuntimeError):
    """A feature network that cannot be built, with what to install or pass."""


@dataclass
class FeatureNet:
    """A feature network and its name: `name` keys cached reference statistics, so two networks whose features
    differ must have different names (inception, dinov2:<model>, or the tests' own)."""

    name: str
    module: nn.Module | int  # int: torchmetrics builds its Inception with this many features
    weights: str | None = None  # inception: a local copy of its weights file


class DINOv2Features(nn.Module):
    """uint8 (B, 3, H, W) → the CLS token of a transformers Dinov2Model after its final norm: (B, hidden_size)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model.eval()
        self.num_features = model.config.hidden_size  # torchmetrics reads it instead of running a dummy image
        self.register_buffer("mean", torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(IMAGENET_STD).view(1, 3, 1, 1), persistent=False)

    def train(self, mode: bool = True) -> DINOv2Features:
        return super().train(False)  # a fixed network: dropout stays off whatever the caller sets

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images.float() / 255
        x = nn.functional.interpolate(x, size=(DINOV2_SIZE, DINOV2_SIZE), mode="bicubic", align_corners=False,
                                      antialias=True).clamp(0, 1)
        x = (x - self.mean) / self.std
        return self.model(pixel_values=x.to(self.model.dtype)).pooler_output.float()  # (B, D)

    @classmethod
    def load(cls, name_or_path: str | Path = DINOV2_DEFAULT) -> DINOv2Features:
        """A hub id or a local save_pretrained folder, safetensors weights only (use_safetensors: no pickle)."""
        try:
            from transformers import Dinov2Model
        except ImportError as e:
            raise FeatureError(f"dinov2 features need transformers ({e}) — pip install transformers") from None
        from ditcore.codecs.hub import offline, offline_hint

        why = None if Path(name_or_path).is_dir() else offline()  # offline: the cache alone, at once
        try:
            model = Dinov2Model.from_pretrained(str(name_or_path), use_safetensors=True, local_files_only=bool(why))
        except (OSError, ValueError) as e:
            first = f"offline ({why}) and not in the Hugging Face cache" if why else (
                str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
            raise FeatureError(f"cannot load the DINOv2 model '{name_or_path}': {first} — "
                               f"{offline_hint(str(name_or_path))}") from None
        return cls(model)


def feature_net(features: str, weights: str | Path | None = None) -> FeatureNet:
    """The network of `features` (inception or dinov2). weights: inception, a local copy of torch-fidelity's
    pt_inception-2015-12-05 file (else it downloads it once); dinov2, a hub id or folder (default ViT-L/14)."""
    if features == "inception":
        import importlib.util

        if importlib.util.find_spec("torch_fidelity") is None:
            raise FeatureError(f"FID's Inception network is torch-fidelity's, which is not installed — {INSTALL_FID}; "
                               "or use --features dinov2")
        return FeatureNet("inception", 2048, None if weights is None else str(weights))
    if features == "dinov2":
        name = str(weights or DINOV2_DEFAULT)
        return FeatureNet(f"dinov2:{Path(name).name}", DINOv2Features.load(name))
    raise FeatureError(f"features={features!r} is unknown: expected one of {', '.join(FEATURES)}")
