"""A common difficulty axis for discrete and continuous diffusion formulations.

Every formulation (DDPM, EDM, flow / linear interpolant) writes its forward process as

    x_t    = a(t) x0 + c(t) noise            (coefficients)
    target = p(t) x0 + q(t) noise            (target_coefficients, per prediction type)

and exposes its signal-to-noise ratio SNR(t) = a(t)^2 / c(t)^2 and log SNR. ``t`` means the formulation's own
noise-level variable: an int64 timestep index for DDPM, sigma for EDM, a continuous t in [0, 1] for flow.
``t_from_log_snr`` is the monotone inverse of ``log_snr`` so curriculum code can cluster every formulation on
the same log-SNR axis and map cluster boundaries back to its own ``t``. The fused-ops layer consumes exactly
the per-sample (a, c, p, q) vectors returned here (float64; cast them to float32 at the kernel boundary).
"""

from __future__ import annotations

import contextlib
import math
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from diffcurr_fast.options import Options


def _bshape(coef: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Reshape a per-sample (B,) coefficient to (B, 1, ..., 1) in ``like``'s dtype and device."""
    return coef.to(device=like.device, dtype=like.dtype).reshape(coef.shape + (1,) * (like.ndim - coef.ndim))


_TRUST = threading.local()


@contextlib.contextmanager
def trusted_t():
    """Inside this context the formulations skip the range checks of t (each reads values back to the host: a
    device sync). For t a trainer drew itself, in range by construction; the dtype checks stay."""
    prev = getattr(_TRUST, "on", False)
    _TRUST.on = True
    try:
        yield
    finally:
        _TRUST.on = prev


def t_trusted() -> bool:
    """Whether the range checks of t are off (``trusted_t``)."""
    return getattr(_TRUST, "on", False)


@dataclass(frozen=True)
class TrainingDraw:
    """The per-sample terms of one training draw (``Formulation.training_draw``), each (B,) on the cells' device.

    Network input x_in = a x0 + c eps at network time ``t_in``; regression target p x0 + q eps; loss weight w.
    ``t`` is the formulation's own noise level (DDPM index, EDM sigma, flow time). Coefficients are float64
    (float32 where the device has no float64); the fused ops cast them at the kernel boundary.
    """

    t: torch.Tensor
    t_in: torch.Tensor
    a: torch.Tensor
    c: torch.Tensor
    p: torch.Tensor
    q: torch.Tensor
    w: torch.Tensor


class Formulation(ABC):
    """Base class of a diffusion formulation on the common difficulty (log-SNR) axis.

    Subclasses set ``discrete`` (True when ``t`` is an integer index) and ``predictions`` (the prediction types
    ``target_coefficients`` accepts), and implement the abstract methods. ``q_sample`` and ``target`` are
    derived from the coefficients and need no override.

    What the run config asks of a formulation (``runs.config``; ``registry.FORMULATIONS`` names it): ``Options``,
    its own fields in the ``diffusion`` section (``options.Options``: fields, help, its rules), and ``from_options``,
    which builds it from that section; ``defaults``, its own value of each formulation-dependent field, which
    ``auto`` stands for (``prediction``, ``learn_sigma``, ``weighting``, ``sampler``); ``limits``, the values it
    allows of those fields where it does not take all (``prediction``: the ones it trains; ``sampler``: the ones that
    can sample it).
    """

    discrete: bool = False
    predictions: tuple[str, ...] = ()
    Options: type[Options] = Options
    defaults: dict[str, Any] = {}
    limits: dict[str, tuple] = {}

    @classmethod
    def from_options(cls, d: Any) -> Formulation:
        """The formulation of the config's ``diffusion`` section ``d`` (its ``Options`` keys and
        ``num_timesteps``)."""
        return cls()

    # ---- the difficulty axis ------------------------------------------------------------------------
    @abstractmethod
    def check_t(self, t: torch.Tensor) -> torch.Tensor:
        """Validate ``t`` (raise ValueError when out of range) and return it in canonical dtype."""

    @abstractmethod
    def log_snr(self, t: torch.Tensor) -> torch.Tensor:
        """Natural-log SNR at ``t`` as float64; monotone non-increasing in ``t``."""

    def snr(self, t: torch.Tensor) -> torch.Tensor:
        """SNR(t) = a(t)^2 / c(t)^2 as float64 (may be 0 or inf at the ends of the axis)."""
        return torch.exp(self.log_snr(t))

    @abstractmethod
    def t_range(self) -> tuple[float, float]:
        """(t_lo, t_hi): the interval of ``t`` the formulation trains and samples on (lowest to highest noise)."""

    @abstractmethod
    def t_from_log_snr(self, log_snr: torch.Tensor) -> torch.Tensor:
        """Monotone inverse of ``log_snr``: the ``t`` whose log SNR is (nearest to) ``log_snr``."""

    def t_from_snr(self, snr: torch.Tensor) -> torch.Tensor:
        """Inverse of ``snr`` (through ``t_from_log_snr``); ``snr`` must be non-negative."""
        snr = torch.as_tensor(snr, dtype=torch.float64)
        if bool((snr < 0).any()) or bool(torch.isnan(snr).any()):
            raise ValueError("snr must be non-negative and not NaN")
        return self.t_from_log_snr(torch.log(snr))

    # ---- training on G cells of the difficulty axis -------------------------------------------------
    # The curriculum and TDC work on G cells: the T timesteps of DDPM, or G equal cells of a continuous axis
    # (flow t, EDM ln sigma). A training draw picks a cell k and, for a continuous axis, a point inside it.
    @staticmethod
    def point_in_cells(k: torch.Tensor, num_cells: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """(B,) float64 (k + u) / G, u ~ U[0, 1) from ``generator``: a uniform point of cells ``k`` of G equal cells
        of [0, 1), on k's device (u is drawn on the generator's device and moved without a read-back)."""
        u = torch.rand(k.shape, generator=generator, dtype=torch.float64).to(k.device, non_blocking=True)
        return (k.to(torch.float64) + u) / num_cells

    def cell_grid(self, num_cells: int) -> torch.Tensor | None:
        """(G,) float64 representative ``t`` of each cell (what the curriculum clusters); None: ``t`` = k."""
        return None

    def cell_prior(self, num_cells: int) -> torch.Tensor | None:
        """(G,) float64 mass of each cell under the training distribution; None: uniform over cells."""
        return None

    def cell_input_edges(self, num_cells: int) -> torch.Tensor | None:
        """(G + 1,) float64 network input time (``TrainingDraw.t_in``) at the cell edges, ascending, so a model
        called at input time s can be routed to its cell; None: the input time is the cell index itself."""
        return None

    @abstractmethod
    def training_draw(
        self,
        k: torch.Tensor,
        num_cells: int,
        prediction: str,
        weighting: str = "none",
        gamma: float = 5.0,
        generator: torch.Generator | None = None,
    ) -> TrainingDraw:
        """The terms of training at cells ``k`` (B,) int64 (a point inside each cell drawn from ``generator``)."""

    def variance_loss(
        self, out: torch.Tensor, x0: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor, prediction: str
    ) -> torch.Tensor:
        """(B,) loss of a learned variance (network output of 2C channels); only DDPM learns one (IDDPM)."""
        raise ValueError(f"{type(self).__name__} has no learned variance; set diffusion.learn_sigma false")

    # ---- forward process and targets ----------------------------------------------------------------
    @abstractmethod
    def coefficients(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-sample float64 (a, c) with x_t = a x0 + c noise."""

    @abstractmethod
    def target_coefficients(self, t: torch.Tensor, prediction: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-sample float64 (p, q) with target = p x0 + q noise for ``prediction``."""

    def check_prediction(self, prediction: str) -> str:
        """Return ``prediction`` if this formulation supports it; raise ValueError otherwise."""
        if prediction not in self.predictions:
            raise ValueError(f"unknown prediction {prediction!r}; choose one of {self.predictions}")
        return prediction

    def _check_batch(self, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        if noise.shape != x0.shape:
            raise ValueError(f"noise shape {tuple(noise.shape)} does not match x0 shape {tuple(x0.shape)}")
        t = torch.as_tensor(t)
        if t.ndim != 1 or t.shape[0] != x0.shape[0]:
            raise ValueError(f"t must have shape ({x0.shape[0]},), got {tuple(t.shape)}")
        return t

    def q_sample(self, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """Forward process x_t = a(t) x0 + c(t) noise, computed in ``x0``'s dtype."""
        t = self._check_batch(x0, t, noise)
        a, c = self.coefficients(t)
        return _bshape(a, x0) * x0 + _bshape(c, x0) * noise

    def target(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor, prediction: str) -> torch.Tensor:
        """Regression target p(t) x0 + q(t) noise for ``prediction``."""
        t = self._check_batch(x0, t, noise)
        p, q = self.target_coefficients(t, prediction)
        return _bshape(p, x0) * x0 + _bshape(q, x0) * noise


def log_snr_to_snr(log_snr: torch.Tensor) -> torch.Tensor:
    """SNR = exp(log SNR); -inf maps to 0 and +inf to inf (monotone increasing)."""
    return torch.exp(torch.as_tensor(log_snr, dtype=torch.float64))


def snr_to_log_snr(snr: torch.Tensor) -> torch.Tensor:
    """log SNR = ln(SNR); 0 maps to -inf and inf to +inf (monotone increasing). Raises on negative SNR."""
    snr = torch.as_tensor(snr, dtype=torch.float64)
    if bool((snr < 0).any()) or bool(torch.isnan(snr).any()):
        raise ValueError("snr must be non-negative and not NaN")
    return torch.log(snr)


def snr_to_db(snr: torch.Tensor) -> torch.Tensor:
    """SNR in decibels, 10 log10(SNR) (the grouping axis of TDC training)."""
    return snr_to_log_snr(snr) * (10.0 / math.log(10.0))
