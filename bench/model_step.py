"""One training step (forward + backward + AdamW) of ditcore's DiT vs diffusers' DiTTransformer2DModel.

Same depth, width, heads, patch size, input and batch, in the same process, runs alternating so that
both see the same machine load. Prints the median step time of each, training tokens/s and the ratio
peer_time / our_time (> 1.0: ours is faster). Absolute times on a shared machine are noise; the ratio
is the result.

    python bench/model_step.py                        # DiT-S/2, 256x256 images (32x32x4 latents), batch 8
    python bench/model_step.py --compile              # also both with their blocks torch.compile'd
    python bench/model_step.py --preset DiT-B/2 --batch 4 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ditcore.models import DiT, apply_compile, preset


def build_ours(name: str, latent: int, channels: int):
    cfg = preset(name, num_classes=1000, in_channels=channels, max_grid=(1, latent, latent))
    model = DiT(cfg)

    def forward(x, t, y):
        c_noise = t.float()  # the timestep: both models embed it with sinusoids + MLP
        return model.forward_latents(x[:, :, None], c_noise, class_labels=y)[:, :, 0]

    return model, forward, cfg


def build_peer(cfg):
    from diffusers import DiTTransformer2DModel

    model = DiTTransformer2DModel(
        num_attention_heads=cfg.num_heads,
        attention_head_dim=cfg.head_dim,
        in_channels=cfg.in_channels,
        out_channels=cfg.in_channels,  # EDM predicts no variance; the peer's default (learned sigma) would double it
        num_layers=cfg.depth,
        patch_size=cfg.patch_size,
        sample_size=cfg.max_grid[1],
        num_embeds_ada_norm=cfg.num_classes,
    )

    def forward(x, t, y):
        return model(x, timestep=t, class_labels=y, return_dict=False)[0]

    return model, forward


def make_step(model, forward):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(x, t, y, target):
        loss = torch.nn.functional.mse_loss(forward(x, t, y), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.item()

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="DiT-S/2", help="ditcore preset name (default: DiT-S/2)")
    ap.add_argument("--latent", type=int, default=32, help="latent height = width (default: 32, i.e. 256² pixels)")
    ap.add_argument("--channels", type=int, default=4, help="latent channels (default: 4)")
    ap.add_argument("--batch", type=int, default=8, help="samples per step (default: 8)")
    ap.add_argument("--rounds", type=int, default=8, help="timed steps of each model (default: 8)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps of each model first (default: 2)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    ap.add_argument("--compile", action="store_true",
                    help="also time both models with each transformer block torch.compile'd")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    ours, our_fwd, cfg = build_ours(args.preset, args.latent, args.channels)
    peer, peer_fwd = build_peer(cfg)
    n_params = {"ditcore": sum(p.numel() for p in ours.parameters()),
                "diffusers": sum(p.numel() for p in peer.parameters())}
    steps = {"ditcore": make_step(ours, our_fwd), "diffusers": make_step(peer, peer_fwd)}
    B, C, S = args.batch, args.channels, args.latent
    tokens = B * (S // cfg.patch_size) ** 2
    print(f"{args.preset}: depth {cfg.depth}, width {cfg.hidden_size}, heads {cfg.num_heads}, patch {cfg.patch_size}; "
          f"batch {B} x {tokens // B} tokens; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"params: ditcore {n_params['ditcore'] / 1e6:.2f}M, diffusers {n_params['diffusers'] / 1e6:.2f}M "
          "(diffusers keeps a timestep/class embedder in every block)")

    eager = time_steps(steps, B, C, S, args.rounds, args.warmup)
    report("eager", eager, tokens)
    ratios = {"eager vs eager": eager["diffusers"] / eager["ditcore"]}
    if args.compile:
        apply_compile(ours)
        for block in peer.transformer_blocks:
            block.compile()
        compiled = time_steps(steps, B, C, S, args.rounds, args.warmup)
        report("compiled", compiled, tokens)
        ratios["compiled vs eager"] = eager["diffusers"] / compiled["ditcore"]
        ratios["compiled vs compiled"] = compiled["diffusers"] / compiled["ditcore"]
    for name, r in ratios.items():
        print(f"ratio diffusers/ditcore step time, {name}: {r:.2f}x")


def time_steps(steps, B, C, S, rounds, warmup, device="cpu") -> dict[str, float]:
    """Median step time of each model; runs alternate, and who goes first alternates too. Each step ends with
    loss.item(), so on a GPU the host clock times the finished work."""
    g = torch.Generator().manual_seed(0)
    x, target = torch.randn(B, C, S, S, generator=g), torch.randn(B, C, S, S, generator=g)
    t, y = torch.randint(0, 1000, (B,), generator=g), torch.randint(0, 1000, (B,), generator=g)
    x, target, t, y = (v.to(device) for v in (x, target, t, y))
    for _ in range(warmup):  # includes compilation when blocks are compiled
        for step in steps.values():
            step(x, t, y, target)
    times: dict[str, list[float]] = {k: [] for k in steps}
    for i in range(rounds):
        for name in list(steps) if i % 2 == 0 else list(reversed(steps)):
            t0 = time.perf_counter()
            steps[name](x, t, y, target)
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def report(mode: str, med: dict[str, float], tokens: int) -> None:
    for name, sec in med.items():
        print(f"  {mode:8s} {name:10s} step {sec * 1e3:8.1f} ms  {tokens / sec:8.0f} tokens/s")


if __name__ == "__main__":
    main()
