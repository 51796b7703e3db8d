"""ditcore's DDPM objective (ditcore.diffusion.ddpm.DDPMLoss) against DiT's own: facebookresearch/DiT's
`create_diffusion(timestep_respacing="")` (its train.py's: 1000 linear steps, ε-prediction, MSE + the learned-range
variational bound) `training_losses`, on the same network, x₀, noise, timesteps and classes.

DiT's code is not a dependency: pass a checkout of github.com/facebookresearch/DiT (its diffusion/ package is imported
from there). Prints each sample's loss both ways, from t = 0 (the decoder's NLL) to t = 999, and the largest relative
difference (measured: 4.9e-7, float32).

    python bench/ddpm_loss_vs_dit.py PATH_TO_DiT [--hidden 64] [--depth 2]
"""

from __future__ import annotations

import argparse
import sys

import torch

from ditcore.diffusion import EDMPrecond
from ditcore.diffusion.ddpm import DDPMLoss
from ditcore.diffusion.vp import DiscreteVP
from ditcore.layout import grid_positions, patchify
from ditcore.models import DiT, DiTConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dit_repo", help="a checkout of facebookresearch/DiT")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--depth", type=int, default=2)
    args = parser.parse_args()
    sys.path.insert(0, args.dit_repo)
    from diffusion import create_diffusion  # DiT's

    cfg = DiTConfig(hidden_size=args.hidden, depth=args.depth, num_heads=4, in_channels=4, num_classes=3,
                    pos_embed="sincos_2d", max_grid=(1, 4, 4), qk_norm=False, learn_sigma=True)
    model = DiT(cfg).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # every weight random: adaLN-Zero's zero init would make ε̂ ≡ 0 and Σ's values 0
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (p.shape[1] ** -0.5 if p.ndim == 2 else 0.3))
    t = torch.tensor([0, 1, 2, 10, 100, 500, 900, 999])
    x0, noise = torch.randn(len(t), 4, 8, 8, generator=g), torch.randn(len(t), 4, 8, 8, generator=g)
    y = torch.arange(len(t)) % 4  # 3: the null class

    def dit_model(x, timesteps, y):  # DiT's call: latents (N, C, H, W) → (N, 2C, H, W)
        return model.forward_latents(x[:, :, None], timesteps.float(), class_labels=y)[:, :, 0]

    vp = DiscreteVP()
    loss, denoiser, pos = DDPMLoss(vp, learn_sigma=True), EDMPrecond(model, vp=vp), grid_positions((1, 4, 4))
    sigma = vp.sigmas()[t].float()[:, None]
    with torch.no_grad():
        theirs = create_diffusion(timestep_respacing="").training_losses(dit_model, x0, t, dict(y=y), noise=noise)
        ours = torch.stack([loss(denoiser, patchify(x0[i:i + 1, :, None], 2), sigma=sigma[i:i + 1],
                                 noise=patchify(noise[i:i + 1, :, None], 2), pos=pos, class_labels=y[i:i + 1, None])
                            for i in range(len(t))])
    print(f"{'t':>5} {'DiT':>12} {'ditcore':>12}   (DiT's mse + vb)")
    for i, step in enumerate(t.tolist()):
        print(f"{step:5d} {theirs['loss'][i]:12.7f} {ours[i]:12.7f}   "
              f"{theirs['mse'][i]:.5f} + {theirs['vb'][i]:.5f}")
    print(f"largest relative difference: {((ours - theirs['loss']).abs() / theirs['loss']).max():.2e}")


if __name__ == "__main__":
    main()
