"""Diffusion formulations, targets, loss weights and samplers.

Three formulations share one difficulty axis (``Formulation``: SNR, log SNR and per-sample (a, c, p, q)
coefficients): discrete DDPM (``DDPMSchedule``, t = timestep index), EDM (``EDMFormulation``, t = sigma) and the
linear-interpolant flow (``FlowFormulation``, t in [0, 1]).
"""

from diffcurr_fast.diffusion.axis import Formulation, TrainingDraw, log_snr_to_snr, snr_to_db, snr_to_log_snr
from diffcurr_fast.diffusion.ddpm import BETA_SCHEDULES, PREDICTIONS, DDPMSchedule
from diffcurr_fast.diffusion.edm import (
    EDM_PREDICTIONS,
    EDMDenoiser,
    EDMFormulation,
    EDMPrecond,
    edm_loss,
    karras_sigmas,
)
from diffcurr_fast.diffusion.flow import FLOW_PREDICTIONS, FlowFormulation, flow_loss
from diffcurr_fast.diffusion.losses import (
    approx_standard_normal_cdf,
    discretized_gaussian_log_likelihood,
    hybrid_loss,
    mean_flat,
    normal_kl,
    training_losses,
    vb_terms_bpd,
    weighted_mse,
)
from diffcurr_fast.diffusion.readout import FIXED_VARIANCES, Readout
from diffcurr_fast.diffusion.registry import FORMULATIONS, formulation_class
from diffcurr_fast.diffusion.respace import RespacedModel, respace, space_timesteps
from diffcurr_fast.diffusion.samplers import (
    FLOW_METHODS,
    ddim_sample,
    ddim_step,
    ddpm_sample,
    ddpm_step,
    edm_heun_sample,
    edm_heun_step,
    flow_euler_step,
    flow_heun_step,
    flow_sample,
    guided_forward,
    guided_model_output,
    make_generator,
)
from diffcurr_fast.diffusion.weights import WEIGHTINGS, loss_weights

# Every prediction some formulation trains (``diffusion.prediction``'s choices; each formulation's own are its
# ``limits["prediction"]``).
ALL_PREDICTIONS = tuple(dict.fromkeys(p for name in FORMULATIONS for p in formulation_class(name).limits["prediction"]))


def build_formulation(d) -> Formulation:
    """The formulation of a ``DiffusionConfig``-like ``d`` (``formulation``, ``num_timesteps`` and the chosen
    formulation's own options): ``from_options`` of the class ``diffusion.formulation`` names."""
    return formulation_class(d.formulation).from_options(d)


__all__ = [
    "BETA_SCHEDULES",
    "ALL_PREDICTIONS",
    "FORMULATIONS",
    "formulation_class",
    "TrainingDraw",
    "build_formulation",
    "EDM_PREDICTIONS",
    "FIXED_VARIANCES",
    "FLOW_METHODS",
    "FLOW_PREDICTIONS",
    "PREDICTIONS",
    "WEIGHTINGS",
    "DDPMSchedule",
    "EDMDenoiser",
    "EDMFormulation",
    "EDMPrecond",
    "FlowFormulation",
    "Formulation",
    "Readout",
    "RespacedModel",
    "approx_standard_normal_cdf",
    "ddim_sample",
    "ddim_step",
    "ddpm_sample",
    "ddpm_step",
    "discretized_gaussian_log_likelihood",
    "edm_heun_sample",
    "edm_heun_step",
    "edm_loss",
    "flow_euler_step",
    "flow_heun_step",
    "flow_loss",
    "flow_sample",
    "guided_forward",
    "guided_model_output",
    "hybrid_loss",
    "karras_sigmas",
    "log_snr_to_snr",
    "loss_weights",
    "make_generator",
    "mean_flat",
    "normal_kl",
    "respace",
    "snr_to_db",
    "snr_to_log_snr",
    "space_timesteps",
    "training_losses",
    "vb_terms_bpd",
    "weighted_mse",
]
