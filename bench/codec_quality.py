"""Patch-PCA codec round-trip PSNR on the synthetic butterflies, at several channel counts K.

Fits on `--fit` samples and measures on `--test` other samples (images and 8-frame clips, 64x64), the
way dit-prepare fits on a dataset's first samples. The pixel codec (exact) is the reference: inf dB.

    python bench/codec_quality.py --channels 8 16 32
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from ditcore.codecs import PatchPCACodec, psnr
from ditcore.data.synthetic import generate


def pixels(index: int, size: int, frames: int) -> torch.Tensor:
    arr = generate(index, 0, size, frames, 0.5)[0]
    return torch.from_numpy(arr).permute(3, 0, 1, 2)[None].float() / 127.5 - 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--channels", type=int, nargs="+", default=[8, 16, 32], help="K values (default: 8 16 32)")
    ap.add_argument("--fit", type=int, default=256, help="samples to fit on (default: 256)")
    ap.add_argument("--test", type=int, default=128, help="held-out samples to measure on (default: 128)")
    ap.add_argument("--size", type=int, default=64, help="image side (default: 64)")
    args = ap.parse_args()
    fit = [pixels(i, args.size, 8) for i in range(args.fit)]
    test = [pixels(100_000 + i, args.size, 8) for i in range(args.test)]
    print(f"patch-PCA codec on synthetic butterflies {args.size}x{args.size} (half 8-frame clips): "
          f"fit on {args.fit}, measured on {args.test} held-out samples")
    for k in args.channels:
        codec = PatchPCACodec.fit(fit, patch=8, channels=k)
        scores = [psnr(codec.decode(codec.encode(p)), p) for p in test]
        print(f"  K={k:3d}  PSNR {np.mean(scores):6.2f} dB (min {np.min(scores):.2f})  "
              f"compression {3 * 64 / k:.0f}x")


if __name__ == "__main__":
    main()
