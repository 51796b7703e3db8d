"""Diffusion objectives: EDM (preconditioning, loss, samplers) and flow matching (rectified flow: loss, velocity
preconditioning, samplers), classifier-free guidance (linear, so it guides velocities as it guides denoisers) and
EMA."""

from ditcore.diffusion.edm import EDMLoss, EDMPrecond, edm_coefficients, edm_weight
from ditcore.diffusion.ema import EMA
from ditcore.diffusion.flow import (
    FlowLoss,
    FlowPrecond,
    TimeShift,
    flow_sampler,
    flow_timesteps,
    scheduler_sampler,
    unipc_scheduler,
)
from ditcore.diffusion.sampler import ddim_sampler, edm_sampler, guided, karras_sigmas

__all__ = [
    "EMA", "EDMLoss", "EDMPrecond", "FlowLoss", "FlowPrecond", "TimeShift", "ddim_sampler", "edm_coefficients",
    "edm_sampler", "edm_weight", "flow_sampler", "flow_timesteps", "guided", "karras_sigmas", "scheduler_sampler",
    "unipc_scheduler",
]
