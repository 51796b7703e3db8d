"""Energon loader throughput (packed batches/s, tokens/s) vs what a DiT training step consumes, same run.

    python bench/loader_throughput.py DATASET [--preset DiT-S/2 --seq-length 256 --batch 8 --workers 2]

Prints the loader's tokens/s, the model's training tokens/s at the same batch shape, and their ratio
(> 1: the loader keeps up with training on this machine).
"""

from __future__ import annotations

import argparse
import time

import torch

from ditcore.data.loader import build_loader
from ditcore.data.schema import read_info
from ditcore.diffusion import EDMLoss, EDMPrecond
from ditcore.models import DiT, preset


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dataset")
    ap.add_argument("--preset", default="DiT-S/2")
    ap.add_argument("--seq-length", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batches", type=int, default=100)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    info = read_info(args.dataset)
    cfg = preset(args.preset, in_channels=info.latent_channels, text_dim=info.text_encoder["dim"],
                 num_classes=info.num_classes)

    loader = build_loader(args.dataset, patch_size=cfg.patch_size, patch_size_t=cfg.patch_size_t,
                          seq_length=args.seq_length, batch_size=args.batch, num_workers=args.workers)
    it = iter(loader)
    first = next(it)  # includes worker start-up
    t0 = time.perf_counter()
    real = 0
    for _ in range(args.batches):
        b = next(it)
        real += int(b.mask.sum())
    dt = time.perf_counter() - t0
    loader_tps = real / dt
    fill = real / (args.batches * args.batch * args.seq_length)

    model = EDMPrecond(DiT(cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    b = first
    inputs = b.inputs()
    times = []
    for _ in range(args.steps + 1):
        t = time.perf_counter()
        loss = EDMLoss()(model, b.x, inputs, mask=b.mask)
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t)
    step = min(times[1:])
    train_tps = int(b.mask.sum()) / step
    print(f"dataset {args.dataset}: rows of {args.seq_length} tokens, batch {args.batch}, {args.workers} workers; "
          f"rows {fill:.0%} filled by packing")
    print(f"  loader   {args.batches / dt:8.1f} packed batches/s  {loader_tps:10.0f} real tokens/s")
    print(f"  training {1 / step:8.2f} steps/s          {train_tps:10.0f} real tokens/s ({args.preset}, fwd+bwd+AdamW)")
    print(f"ratio loader / training tokens/s: {loader_tps / train_tps:.0f}x")


if __name__ == "__main__":
    main()
