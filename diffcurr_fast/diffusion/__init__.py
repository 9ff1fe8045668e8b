"""Diffusion formulations, targets, loss weights and samplers."""

from diffcurr_fast.diffusion.ddpm import DDPMSchedule
from diffcurr_fast.diffusion.weights import loss_weights

__all__ = ["DDPMSchedule", "loss_weights"]
