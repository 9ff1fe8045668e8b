"""Flow matching with the linear interpolant (SiT, Ma et al. 2024; rectified flow, Liu et al. 2023).

x_t = (1 - t) x0 + t eps with continuous t in [0, 1]: t = 0 is data, t = 1 is pure noise. The velocity
dx_t/dt = eps - x0 is the default regression target; SNR(t) = (1 - t)^2 / t^2. Here ``t`` is a float tensor.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from diffcurr_fast.diffusion.axis import Formulation, TrainingDraw, t_trusted, trusted_t
from diffcurr_fast.diffusion.losses import weighted_mse

FLOW_PREDICTIONS = ("velocity", "eps", "x0")


class FlowFormulation(Formulation):
    """Linear-interpolant flow as a ``Formulation``. Training times are drawn by ``diffcurr_fast.timesteps`` on G
    equal cells of t (``training_draw``): uniform t (SiT) with ``timesteps.sampler=uniform``, SD3's logit-normal t
    with ``lognormal``."""

    discrete = False
    predictions = FLOW_PREDICTIONS
    # the velocity (SiT), no learned variance or extra loss weighting; its ODE sampled with SiT's second-order step
    defaults = {"prediction": "velocity", "learn_sigma": False, "weighting": "none", "sampler": "heun"}
    limits = {
        "prediction": ("velocity",),
        "learn_sigma": (False,),
        "weighting": ("none",),
        "sampler": ("euler", "heun"),
    }

    def __repr__(self) -> str:
        return "FlowFormulation()"

    def check_t(self, t: torch.Tensor) -> torch.Tensor:
        """t as float64; must lie in [0, 1]."""
        t = torch.as_tensor(t)
        if not t.dtype.is_floating_point:
            raise ValueError(f"flow t must be a floating tensor in [0, 1], got dtype {t.dtype}")
        if t_trusted():
            return t.to(torch.float64)
        if bool(torch.isnan(t).any()) or (t.numel() and (float(t.min()) < 0.0 or float(t.max()) > 1.0)):
            raise ValueError("flow t out of range: values must lie in [0, 1]")
        return t.to(torch.float64)

    def log_snr(self, t: torch.Tensor) -> torch.Tensor:
        """log SNR = 2 (ln(1 - t) - ln t): +inf at t = 0, -inf at t = 1."""
        t = self.check_t(t)
        return 2.0 * (torch.log1p(-t) - torch.log(t))

    def snr(self, t: torch.Tensor) -> torch.Tensor:
        """SNR = (1 - t)^2 / t^2: inf at t = 0, 0 at t = 1."""
        t = self.check_t(t)
        return (1.0 - t) ** 2 / t**2

    def t_range(self) -> tuple[float, float]:
        """(0, 1)."""
        return 0.0, 1.0

    def t_from_log_snr(self, log_snr: torch.Tensor) -> torch.Tensor:
        """t = 1 / (1 + exp(log_snr / 2)) = sigmoid(-log_snr / 2) (monotone decreasing)."""
        lam = torch.as_tensor(log_snr, dtype=torch.float64)
        if bool(torch.isnan(lam).any()):
            raise ValueError("log_snr must not be NaN")
        return torch.sigmoid(-lam / 2.0)

    def cell_grid(self, num_cells: int) -> torch.Tensor:
        """(G,) cell centres (k + 0.5) / G of t in [0, 1] (SNR finite on all of them)."""
        return (torch.arange(num_cells, dtype=torch.float64) + 0.5) / num_cells

    def cell_input_edges(self, num_cells: int) -> torch.Tensor:
        """(G + 1,) edges k / G: the network sees t itself."""
        return torch.arange(num_cells + 1, dtype=torch.float64) / num_cells

    def training_draw(
        self,
        k: torch.Tensor,
        num_cells: int,
        prediction: str = "velocity",
        weighting: str = "none",
        gamma: float = 5.0,
        generator: torch.Generator | None = None,
    ) -> TrainingDraw:
        """t = (k + u) / G with u ~ U[0, 1); x_t = (1 - t) x0 + t eps and target velocity eps - x0 (SiT); w = 1."""
        if weighting != "none":
            raise ValueError(f"flow training has no {weighting!r} weighting; use 'none'")
        t = self.point_in_cells(k, num_cells, generator)  # (B,) in [0, 1), on k's device: no read-back
        with trusted_t():  # in range by construction
            p, q = self.target_coefficients(t, prediction)
        return TrainingDraw(t=t, t_in=t, a=1.0 - t, c=t, p=p, q=q, w=torch.ones_like(t))

    def coefficients(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(a, c) = (1 - t, t)."""
        t = self.check_t(t)
        return 1.0 - t, t

    def target_coefficients(self, t: torch.Tensor, prediction: str = "velocity") -> tuple[torch.Tensor, torch.Tensor]:
        """velocity (-1, 1) (d x_t / dt = eps - x0); eps (0, 1); x0 (1, 0)."""
        self.check_prediction(prediction)
        t = self.check_t(t)
        one, zero = torch.ones_like(t), torch.zeros_like(t)
        if prediction == "velocity":
            return -one, one
        if prediction == "eps":
            return zero, one
        return one, zero


def flow_loss(
    model: Callable[..., torch.Tensor],
    x0: torch.Tensor,
    t: torch.Tensor,
    noise: torch.Tensor | None = None,
    y: torch.Tensor | None = None,
    *,
    prediction: str = "velocity",
    weights: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Per-sample flow-matching loss mean_j (model(x_t, t, y) - target)^2 with target = eps - x0 for velocity.

    ``t`` (B,) in [0, 1] (the trainer draws it through ``diffcurr_fast.timesteps``); ``noise`` defaults to standard
    normal; ``weights`` (B,) multiply the result. Reduced in float32 (or wider), shape (B,).
    """
    form = FlowFormulation()
    form.check_prediction(prediction)
    if noise is None:
        noise = torch.randn(x0.shape, generator=generator, device=x0.device, dtype=x0.dtype)
    x_t = form.q_sample(x0, t, noise)  # (B, ...)
    target = form.target(x0, noise, t, prediction)
    pred = model(x_t, torch.as_tensor(t).to(device=x0.device, dtype=x0.dtype), y)
    return weighted_mse(pred, target, weights)
