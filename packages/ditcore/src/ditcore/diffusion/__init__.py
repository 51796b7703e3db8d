"""EDM diffusion: preconditioning, loss, samplers, classifier-free guidance and EMA."""

from ditcore.diffusion.edm import EDMLoss, EDMPrecond, edm_coefficients, edm_weight
from ditcore.diffusion.ema import EMA
from ditcore.diffusion.sampler import ddim_sampler, edm_sampler, guided, karras_sigmas

__all__ = [
    "EMA", "EDMLoss", "EDMPrecond", "ddim_sampler", "edm_coefficients", "edm_sampler", "edm_weight",
    "guided", "karras_sigmas",
]
