"""How exactly ditcore reproduces diffusers' DiT at full size: DiT-XL/2 (256 px: 1152 wide, 28 blocks, 16 heads,
learned Σ, 1000 classes), random weights (no hub here), converted by ditcore.interop.

Prints the largest difference of ditcore's forward from diffusers' DiTTransformer2DModel in float32, against the same
forward in float64 (each model's own float32 rounding error), and of an export → import round trip.

    python bench/interop_accuracy.py [--depth 28] [--batch 2]
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time
from pathlib import Path

import torch
from diffusers import DiTTransformer2DModel

from ditcore import interop
from ditcore.models import DiT


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=28)
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    theirs = DiTTransformer2DModel(num_layers=args.depth, out_channels=8).eval()  # DiT-XL/2-256's config
    with torch.no_grad():  # every weight random (its init zeroes adaLN outputs), one embedder shared by all blocks
        for p in theirs.parameters():
            p.copy_(torch.randn(p.shape) * (p.shape[1] ** -0.5 if p.ndim == 2 else 0.3))
        for block in theirs.transformer_blocks[1:]:
            block.norm1.emb.load_state_dict(theirs.transformer_blocks[0].norm1.emb.state_dict())
    with tempfile.TemporaryDirectory() as tmp:
        theirs.save_pretrained(Path(tmp) / "transformer")
        t0 = time.perf_counter()
        got = interop.read(Path(tmp) / "transformer")
        print(f"read + convert: {time.perf_counter() - t0:.1f} s; {got.summary()}")
        ours = DiT(got.cfg).eval()
        ours.load_state_dict(got.tensors)
        back = interop.read(interop.export_diffusers(Path(tmp) / "exported", got.cfg, ours.state_dict(), got.vp))
        same = all(torch.equal(back.tensors[k], v) for k, v in ours.state_dict().items())
        print(f"export -> import round trip bitwise: {same} ({len(back.tensors)} tensors), config equal: "
              f"{back.cfg == got.cfg}")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, 4, 32, 32, generator=g)
    t = torch.tensor([999, 500, 3, 0][:args.batch])
    y = torch.tensor([207, 1000, 88, 3][:args.batch])  # 1000: the null class
    with torch.no_grad():
        expected = theirs(x, timestep=t, class_labels=y).sample
        actual = ours.forward_latents(x[:, :, None], t.float(), class_labels=y)[:, :, 0]
        exact = copy.deepcopy(theirs).double()(x.double(), timestep=t, class_labels=y).sample
    scale = exact.abs().max().item()
    print(f"max |output| {scale:.3g}; max |ditcore - diffusers| {(actual - expected).abs().max().item():.3g}; "
          f"float32 error of diffusers {(expected.double() - exact).abs().max().item():.3g}, of ditcore "
          f"{(actual.double() - exact).abs().max().item():.3g} (against diffusers in float64)")


if __name__ == "__main__":
    main()
