"""Diffusion formulations, targets, loss weights and samplers.

Three formulations share one difficulty axis (``Formulation``: SNR, log SNR and per-sample (a, c, p, q)
coefficients): discrete DDPM (``DDPMSchedule``, t = timestep index), EDM (``EDMFormulation``, t = sigma) and the
linear-interpolant flow (``FlowFormulation``, t in [0, 1]).
"""

from diffcurr_fast.diffusion.axis import Formulation, TrainingTerms, log_snr_to_snr, snr_to_db, snr_to_log_snr
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

# The formulations by name (``diffusion.formulation``).
FORMULATIONS = ("ddpm", "flow", "edm")
# The values each formulation allows for the config's formulation-dependent fields (the keys of
# ``FORMULATION_DEFAULTS``), where it does not take all of them: the predictions it trains; flow and EDM train without
# learned variance, an extra loss weighting or Denoising Task Routing (whose masks are defined on DDPM's timestep
# index), and only the ODE steps (euler, heun of ``runs.sampling.SAMPLERS``) sample them. DDPM takes every sampler.
FORMULATION_LIMITS = {
    "ddpm": {"prediction": PREDICTIONS},
    "flow": {
        "prediction": ("velocity",),
        "learn_sigma": (False,),
        "weighting": ("none",),
        "dtr": (False,),
        "sampler": ("euler", "heun"),
    },
    "edm": {
        "prediction": ("x0",),
        "learn_sigma": (False,),
        "weighting": ("none",),
        "dtr": (False,),
        "sampler": ("euler", "heun"),
    },
}
TRAIN_PREDICTIONS = {name: limits["prediction"] for name, limits in FORMULATION_LIMITS.items()}
ALL_PREDICTIONS = tuple(dict.fromkeys(p for preds in TRAIN_PREDICTIONS.values() for p in preds))
# Each formulation's own choices, which ``auto`` in the config stands for: DDPM trains eps with the IDDPM learned
# variance and samples with DDIM; flow trains the velocity (SiT) and EDM its preconditioned denoiser (x0), both
# without learned variance or an extra loss weighting, and both sample their ODE with Heun (EDM Alg. 1 on its
# Karras sigma grid; for flow SiT's second-order ODE step). Denoising Task Routing (``dtr``) routes DDPM timesteps.
FORMULATION_DEFAULTS = {
    "ddpm": {"prediction": "eps", "learn_sigma": True, "weighting": "none", "sampler": "ddim", "dtr": False},
    "flow": {"prediction": "velocity", "learn_sigma": False, "weighting": "none", "sampler": "heun", "dtr": False},
    "edm": {"prediction": "x0", "learn_sigma": False, "weighting": "none", "sampler": "heun", "dtr": False},
}


def build_formulation(d) -> Formulation:
    """The formulation described by a ``DiffusionConfig``-like ``d`` (fields formulation, num_timesteps,
    beta_schedule, sigma_data, P_mean, P_std, sigma_min, sigma_max)."""
    if d.formulation == "flow":
        return FlowFormulation()
    if d.formulation == "edm":
        return EDMFormulation(d.sigma_data, d.P_mean, d.P_std, d.sigma_min, d.sigma_max)
    if d.formulation == "ddpm":
        return DDPMSchedule(d.num_timesteps, d.beta_schedule)
    raise ValueError(f"unknown formulation {d.formulation!r}; valid choices: {', '.join(FORMULATIONS)}")


__all__ = [
    "BETA_SCHEDULES",
    "ALL_PREDICTIONS",
    "FORMULATIONS",
    "FORMULATION_DEFAULTS",
    "FORMULATION_LIMITS",
    "TRAIN_PREDICTIONS",
    "TrainingTerms",
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
