"""How a sampler reads a network's output: ``Readout``, built once per model and passed down whole.

The DDPM posterior (``DDPMSchedule.p_mean_variance``), its VB term (``vb_terms_bpd``), the DDPM / DDIM samplers and
``runs.sampling.sample`` all take one ``Readout`` instead of its four fields one by one; a run builds it from its
config with ``runs.sampling.sampling_readout``.
"""

from __future__ import annotations

from dataclasses import dataclass

FIXED_VARIANCES = ("large", "small")


@dataclass(frozen=True)
class Readout:
    """How to read a network output (B, C', ...) for an x_t of C channels.

    - ``prediction``: what the first C channels predict (DDPM: ``eps``, ``x0`` or ``v``; the formulation checks it);
    - ``learn_sigma``: whether C more channels follow, the IDDPM variance interpolation value v in [-1, 1]
      (Nichol & Dhariwal Eq. 15), so C' = 2 C;
    - ``clip_denoised``: whether x0_hat is clipped to [-1, 1] at every step (data in pixel range); the ODE samplers
      of ``runs.sampling.sample`` clip their result instead;
    - ``fixed_variance``: sigma_t^2 when it is not learned, ``large`` (beta_t, Ho et al.'s and DiT's choice) or
      ``small`` (the posterior's beta_tilde_t); DDIM ignores it.
    """

    prediction: str = "eps"
    learn_sigma: bool = False
    clip_denoised: bool = False
    fixed_variance: str = "large"

    def __post_init__(self) -> None:
        if not isinstance(self.prediction, str):
            raise ValueError(f"prediction must be a name such as 'eps', got {self.prediction!r}")
        for name in ("learn_sigma", "clip_denoised"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.fixed_variance not in FIXED_VARIANCES:
            raise ValueError(f"unknown fixed_variance {self.fixed_variance!r}; choose one of {FIXED_VARIANCES}")

    def out_channels(self, channels: int) -> int:
        """C' of a network output for an x_t of ``channels`` channels: 2 C with a learned variance, else C."""
        return 2 * channels if self.learn_sigma else channels
