"""Discrete-time DDPM schedule (Ho et al. 2020; Nichol & Dhariwal 2021, "IDDPM").

Betas and every derived quantity are computed in float64 exactly as facebookresearch/DiT's
``gaussian_diffusion.py`` computes them, so a DiT trained here sees the same noise levels as the official
recipe. Tensors are kept in float64 on the CPU; ``coef(name, t)`` gathers a per-sample coefficient and casts
it to the caller's dtype/device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from diffcurr_fast.diffusion.axis import Formulation, TrainingDraw, t_trusted
from diffcurr_fast.diffusion.losses import vb_terms_bpd
from diffcurr_fast.diffusion.readout import Readout
from diffcurr_fast.diffusion.weights import loss_weights
from diffcurr_fast.options import Options, option

PREDICTIONS = ("eps", "x0", "v")
BETA_SCHEDULES = ("linear", "cosine")


def _linear_betas(num_timesteps: int) -> torch.Tensor:
    # IDDPM get_named_beta_schedule("linear"): 1e-4..0.02 scaled by 1000/T, linspace in float64.
    scale = 1000.0 / num_timesteps
    return torch.linspace(scale * 1e-4, scale * 0.02, num_timesteps, dtype=torch.float64)


def _cosine_betas(num_timesteps: int, max_beta: float = 0.999) -> torch.Tensor:
    # IDDPM Eq. 17: abar(t) = cos^2(((t/T + s) / (1 + s)) * pi/2), s = 0.008; beta_t = 1 - abar(t+1)/abar(t).
    def abar(x: float) -> float:
        return math.cos((x + 0.008) / 1.008 * math.pi / 2) ** 2

    betas = [min(1.0 - abar((i + 1) / num_timesteps) / abar(i / num_timesteps), max_beta) for i in range(num_timesteps)]
    return torch.tensor(betas, dtype=torch.float64)


@dataclass
class DDPMOptions(Options):
    """DDPM's options in the ``diffusion`` section."""

    beta_schedule: str = option("linear", "beta schedule", BETA_SCHEDULES)

    def validate(self, cfg: Any) -> None:
        t = cfg.diffusion.num_timesteps
        if self.beta_schedule == "linear" and t < 20:
            raise ValueError(  # its last beta, 0.02 x 1000 / T, would pass 1
                "diffusion.beta_schedule 'linear' needs diffusion.num_timesteps >= 20 (its betas scale with 1000 / T), "
                f"got {t}; give more timesteps or diffusion.beta_schedule=cosine"
            )


class DDPMSchedule(Formulation):
    """Variance-preserving discrete schedule: x_t = sqrt(abar_t) x0 + sqrt(1 - abar_t) eps, t in [0, T).

    ``t`` is always an int64 tensor of timestep indices. Besides the forward-process tables it holds the IDDPM
    posterior tables (``posterior_variance``, ``posterior_log_variance_clipped``, ``posterior_mean_coef1/2``)
    used by ``p_mean_variance``, the hybrid loss and the ancestral / DDIM samplers.
    """

    discrete = True
    predictions = PREDICTIONS
    Options = DDPMOptions
    # eps with the IDDPM learned variance, sampled with DDIM (the DiT release); every prediction and sampler
    defaults = {"prediction": "eps", "learn_sigma": True, "weighting": "none", "sampler": "ddim"}
    limits = {"prediction": PREDICTIONS}

    @classmethod
    def from_options(cls, d: Any) -> DDPMSchedule:
        return cls(d.num_timesteps, d.beta_schedule)

    def __init__(self, num_timesteps: int = 1000, beta_schedule: str = "linear", betas: torch.Tensor | None = None):
        if betas is None:
            if not isinstance(num_timesteps, int) or num_timesteps < 1:
                raise ValueError(f"num_timesteps must be a positive int, got {num_timesteps!r}")
            if beta_schedule == "linear":
                betas = _linear_betas(num_timesteps)
            elif beta_schedule == "cosine":
                betas = _cosine_betas(num_timesteps)
            else:
                raise ValueError(f"unknown beta_schedule {beta_schedule!r}; choose one of {BETA_SCHEDULES}")
        betas = torch.as_tensor(betas, dtype=torch.float64).cpu()
        if betas.ndim != 1 or not bool(((betas > 0) & (betas <= 1)).all()):
            raise ValueError("betas must be a 1-D tensor with values in (0, 1]")
        self.beta_schedule = beta_schedule
        self.num_timesteps = int(betas.shape[0])
        self.betas = betas
        alphas = 1.0 - betas
        self.alphas_cumprod = torch.cumprod(alphas, dim=0)
        self.alphas_cumprod_prev = torch.cat([torch.ones(1, dtype=torch.float64), self.alphas_cumprod[:-1]])
        self.sqrt_alphas_cumprod = self.alphas_cumprod.sqrt()
        self.sqrt_one_minus_alphas_cumprod = (1.0 - self.alphas_cumprod).sqrt()
        self.alphas_cumprod_next = torch.cat([self.alphas_cumprod[1:], torch.zeros(1, dtype=torch.float64)])
        self.log_one_minus_alphas_cumprod = torch.log1p(-self.alphas_cumprod)
        self.sqrt_recip_alphas_cumprod = (1.0 / self.alphas_cumprod).sqrt()
        self.sqrt_recipm1_alphas_cumprod = (1.0 / self.alphas_cumprod - 1.0).sqrt()
        # IDDPM Eq. 10-12 (Ho et al. Eq. 6-7): q(x_{t-1} | x_t, x0) = N(coef1 x0 + coef2 x_t, beta_tilde_t).
        self.posterior_variance = betas * (1.0 - self.alphas_cumprod_prev) / (1.0 - self.alphas_cumprod)
        # beta_tilde_0 = 0, so its log is clipped to beta_tilde_1 (as IDDPM does).
        if self.num_timesteps > 1:
            clipped = torch.cat([self.posterior_variance[1:2], self.posterior_variance[1:]])
        else:
            clipped = betas.clone()
        self.posterior_log_variance_clipped = torch.log(clipped)
        self.posterior_mean_coef1 = betas * self.alphas_cumprod_prev.sqrt() / (1.0 - self.alphas_cumprod)
        self.posterior_mean_coef2 = (1.0 - self.alphas_cumprod_prev) * alphas.sqrt() / (1.0 - self.alphas_cumprod)
        # "Fixed large" variance of Ho et al. (sigma_t^2 = beta_t, with beta_tilde_1 at t = 0), DiT's default.
        large = torch.cat([clipped[:1], betas[1:]])
        self.large_variance = large
        self.large_log_variance = torch.log(large)

    def __repr__(self) -> str:
        return f"DDPMSchedule(num_timesteps={self.num_timesteps}, beta_schedule={self.beta_schedule!r})"

    # ---- validation and gathering -------------------------------------------------------------------
    def check_t(self, t: torch.Tensor) -> torch.Tensor:
        """Return ``t`` as an int64 tensor after checking it lies in [0, T); raises ValueError otherwise."""
        t = torch.as_tensor(t)
        if t.dtype.is_floating_point or t.dtype == torch.bool or t.is_complex():
            raise ValueError(f"t must be an integer tensor of timestep indices, got dtype {t.dtype}")
        t = t.long()
        if t.numel() and not t_trusted():
            lo, hi = torch.stack([t.min(), t.max()]).tolist()  # one host sync for both bounds
            if lo < 0 or hi >= self.num_timesteps:
                raise ValueError(
                    f"t out of range: values must lie in [0, {self.num_timesteps}), got min {lo}, max {hi}"
                )
        return t

    def _table(self, name: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        # float64 tables cast once per (device, dtype) and cached, so gathers stay on the caller's device
        if device.type == "mps":  # no float64 there
            dtype = torch.float32
        key = (name, str(device), dtype)
        cache = self.__dict__.setdefault("_table_cache", {})
        if key not in cache:
            cache[key] = getattr(self, name).to(device=device, dtype=dtype)
        return cache[key]

    def coef(self, name: str, t: torch.Tensor, like: torch.Tensor | None = None) -> torch.Tensor:
        """Gather table ``name`` at ``t``; shaped (B, 1, ..., 1) to broadcast against ``like`` when given."""
        t = self.check_t(t)
        if like is None:
            return getattr(self, name)[t.cpu()]
        # gathered in float64 on like's device, then cast: identical values to casting after a CPU gather
        out = self._table(name, like.device, torch.float64)[t.to(like.device)].to(like.dtype)
        return out.reshape(t.shape + (1,) * (like.ndim - t.ndim))

    # ---- the difficulty axis ------------------------------------------------------------------------
    def snr(self, t: torch.Tensor) -> torch.Tensor:
        """SNR(t) = abar_t / (1 - abar_t), float64."""
        ab = self.coef("alphas_cumprod", t)
        return ab / (1.0 - ab)

    def log_snr(self, t: torch.Tensor) -> torch.Tensor:
        """log SNR(t) (natural log), float64."""
        ab = self.coef("alphas_cumprod", t)
        return torch.log(ab) - torch.log1p(-ab)

    # ---- forward process and targets ----------------------------------------------------------------
    def q_sample(self, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """Reference forward process: x_t = sqrt(abar_t) x0 + sqrt(1 - abar_t) eps (Ho et al. Eq. 4)."""
        if noise.shape != x0.shape:
            raise ValueError(f"noise shape {tuple(noise.shape)} does not match x0 shape {tuple(x0.shape)}")
        if t.ndim != 1 or t.shape[0] != x0.shape[0]:
            raise ValueError(f"t must have shape ({x0.shape[0]},), got {tuple(t.shape)}")
        return self.coef("sqrt_alphas_cumprod", t, x0) * x0 + self.coef("sqrt_one_minus_alphas_cumprod", t, x0) * noise

    def target(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor, prediction: str = "eps") -> torch.Tensor:
        """Regression target for ``prediction``: eps, x0, or v = sqrt(abar) eps - sqrt(1 - abar) x0 (Salimans & Ho)."""
        if prediction == "eps":
            return noise
        if prediction == "x0":
            return x0
        if prediction == "v":
            return (
                self.coef("sqrt_alphas_cumprod", t, x0) * noise - self.coef("sqrt_one_minus_alphas_cumprod", t, x0) * x0
            )
        raise ValueError(f"unknown prediction {prediction!r}; choose one of {PREDICTIONS}")

    # ---- Formulation interface ----------------------------------------------------------------------
    def coefficients(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-sample float64 (a, c) = (sqrt(abar_t), sqrt(1 - abar_t)) (Ho et al. Eq. 4)."""
        return self.coef("sqrt_alphas_cumprod", t), self.coef("sqrt_one_minus_alphas_cumprod", t)

    def target_coefficients(self, t: torch.Tensor, prediction: str = "eps") -> tuple[torch.Tensor, torch.Tensor]:
        """Per-sample float64 (p, q): eps (0, 1), x0 (1, 0), v (-sqrt(1 - abar_t), sqrt(abar_t))."""
        self.check_prediction(prediction)
        t = self.check_t(t)
        one, zero = torch.ones(t.shape, dtype=torch.float64), torch.zeros(t.shape, dtype=torch.float64)
        if prediction == "eps":
            return zero, one
        if prediction == "x0":
            return one, zero
        return -self.coef("sqrt_one_minus_alphas_cumprod", t), self.coef("sqrt_alphas_cumprod", t)

    # ---- training terms -----------------------------------------------------------------------------
    def training_draw(
        self,
        k: torch.Tensor,
        num_cells: int,
        prediction: str = "eps",
        weighting: str = "none",
        gamma: float = 5.0,
        generator: torch.Generator | None = None,
    ) -> TrainingDraw:
        """t = k; x_t = sqrt(abar_t) x0 + sqrt(1 - abar_t) eps (Ho et al. Eq. 4); target eps, x0 or v (Salimans &
        Ho 2022); w = ``loss_weights(SNR_t)`` (MinSNR: Hang et al. Eq. 5). Gathered from a (T, 5) table on k's
        device, so a step needs no host synchronisation. The cells are the timesteps (``num_cells`` = T)."""
        if num_cells != self.num_timesteps:
            raise ValueError(f"DDPM trains on its {self.num_timesteps} timesteps, got {num_cells} cells")
        row = self._terms_table(k.device, prediction, weighting, gamma)[k]  # (B, 5): a, c, p, q, w
        return TrainingDraw(t=k, t_in=k, a=row[:, 0], c=row[:, 1], p=row[:, 2], q=row[:, 3], w=row[:, 4])

    def _terms_table(self, device: torch.device, prediction: str, weighting: str, gamma: float) -> torch.Tensor:
        key = ("terms", str(device), prediction, weighting, float(gamma))
        cache = self.__dict__.setdefault("_table_cache", {})
        if key not in cache:
            t = torch.arange(self.num_timesteps)
            p, q = self.target_coefficients(t, prediction)
            w = loss_weights(self.snr(t), prediction, weighting, gamma, schedule=True)  # (T,) in timestep order
            table = torch.stack([self.sqrt_alphas_cumprod, self.sqrt_one_minus_alphas_cumprod, p, q, w], 1)
            cache[key] = table.to(device, torch.float32 if device.type == "mps" else torch.float64)
        return cache[key]

    def variance_loss(
        self, out: torch.Tensor, x0: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor, prediction: str
    ) -> torch.Tensor:
        """IDDPM's variational term L_vlb (Nichol & Dhariwal Eq. 16) on the learned variance, the mean detached."""
        c = x0.shape[1]
        frozen = torch.cat([out[:, :c].detach(), out[:, c:]], dim=1)  # (B, 2C, H, W): trains the variance only
        return vb_terms_bpd(self, frozen, x0, x_t, t, Readout(prediction, learn_sigma=True))["output"]

    def t_range(self) -> tuple[float, float]:
        """(0, T - 1): the index range."""
        return 0.0, float(self.num_timesteps - 1)

    def t_from_log_snr(self, log_snr: torch.Tensor) -> torch.Tensor:
        """Timestep index whose log SNR is nearest to ``log_snr`` (int64; monotone non-increasing)."""
        lam = torch.as_tensor(log_snr, dtype=torch.float64)
        if bool(torch.isnan(lam).any()):
            raise ValueError("log_snr must not be NaN")
        table = (torch.log(self.alphas_cumprod) - self.log_one_minus_alphas_cumprod).flip(0)  # increasing
        hi = torch.searchsorted(table, lam.reshape(-1).contiguous()).clamp(max=self.num_timesteps - 1)
        lo = (hi - 1).clamp(min=0)
        flat = lam.reshape(-1)
        pick = torch.where((flat - table[lo]).abs() <= (table[hi] - flat).abs(), lo, hi)
        return (self.num_timesteps - 1 - pick).reshape(lam.shape)

    # ---- posterior and reparameterisations (IDDPM gaussian_diffusion.py) ------------------------------
    def q_posterior_mean_variance(
        self, x0: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Mean, variance and clipped log-variance of q(x_{t-1} | x_t, x0) (IDDPM Eq. 10-12)."""
        if x0.shape != x_t.shape:
            raise ValueError(f"x0 shape {tuple(x0.shape)} does not match x_t shape {tuple(x_t.shape)}")
        mean = self.coef("posterior_mean_coef1", t, x_t) * x0 + self.coef("posterior_mean_coef2", t, x_t) * x_t
        var = self.coef("posterior_variance", t, x_t).expand_as(x_t)
        log_var = self.coef("posterior_log_variance_clipped", t, x_t).expand_as(x_t)
        return mean, var, log_var

    def predict_x0_from_eps(self, x_t: torch.Tensor, t: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
        """x0 = sqrt(1/abar_t) x_t - sqrt(1/abar_t - 1) eps (inverse of Ho et al. Eq. 4)."""
        return (
            self.coef("sqrt_recip_alphas_cumprod", t, x_t) * x_t
            - self.coef("sqrt_recipm1_alphas_cumprod", t, x_t) * eps
        )

    def predict_eps_from_x0(self, x_t: torch.Tensor, t: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
        """eps = (sqrt(1/abar_t) x_t - x0) / sqrt(1/abar_t - 1) (inverse of Ho et al. Eq. 4)."""
        return (self.coef("sqrt_recip_alphas_cumprod", t, x_t) * x_t - x0) / self.coef(
            "sqrt_recipm1_alphas_cumprod", t, x_t
        )

    def predict_x0_from_v(self, x_t: torch.Tensor, t: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """x0 = sqrt(abar_t) x_t - sqrt(1 - abar_t) v (Salimans & Ho 2022, Sec. 4)."""
        return self.coef("sqrt_alphas_cumprod", t, x_t) * x_t - self.coef("sqrt_one_minus_alphas_cumprod", t, x_t) * v

    def predict_eps_from_v(self, x_t: torch.Tensor, t: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """eps = sqrt(1 - abar_t) x_t + sqrt(abar_t) v (Salimans & Ho 2022, Sec. 4)."""
        return self.coef("sqrt_one_minus_alphas_cumprod", t, x_t) * x_t + self.coef("sqrt_alphas_cumprod", t, x_t) * v

    def predict_x0(self, model_out: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor, prediction: str) -> torch.Tensor:
        """Denoised estimate x0_hat from a network output of type ``prediction`` (eps, x0 or v)."""
        self.check_prediction(prediction)
        if prediction == "eps":
            return self.predict_x0_from_eps(x_t, t, model_out)
        if prediction == "v":
            return self.predict_x0_from_v(x_t, t, model_out)
        return model_out

    def p_mean_variance(
        self, model_out: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor, readout: Readout = Readout()
    ) -> dict[str, torch.Tensor]:
        """Mean and variance of p(x_{t-1} | x_t) from a network output (IDDPM ``p_mean_variance``).

        ``model_out`` is (B, C, ...) with C = x_t's channels, or 2 C when ``readout.learn_sigma`` (split along dim 1
        as DiT does: the first half is the ``readout.prediction``, the second the variance interpolation value v).
        With learned variance, log sigma^2 = frac log beta_t + (1 - frac) log beta_tilde_t, frac = (v + 1) / 2
        (IDDPM Eq. 15); otherwise ``readout.fixed_variance``: ``"large"`` (beta_t) or ``"small"`` (beta_tilde_t).
        Returns a dict with ``mean``, ``variance``, ``log_variance``, ``pred_x0`` and ``pred_eps``.
        """
        t = self.check_t(t)
        if t.ndim != 1 or t.shape[0] != x_t.shape[0]:
            raise ValueError(f"t must have shape ({x_t.shape[0]},), got {tuple(t.shape)}")
        prediction = readout.prediction
        self.check_prediction(prediction)
        channels = x_t.shape[1] if x_t.ndim > 1 else 1
        expected = readout.out_channels(channels)
        if model_out.ndim != x_t.ndim or model_out.shape[0] != x_t.shape[0] or model_out.shape[1] != expected:
            raise ValueError(
                f"model_out shape {tuple(model_out.shape)} does not fit x_t shape {tuple(x_t.shape)} "
                f"with learn_sigma={readout.learn_sigma} (expected {expected} channels along dim 1)"
            )
        if readout.learn_sigma:
            out, var_values = torch.split(model_out, channels, dim=1)  # (B, C, ...) each
            min_log = self.coef("posterior_log_variance_clipped", t, x_t)
            max_log = self.coef("betas", t, x_t).log()
            frac = (var_values + 1) / 2  # IDDPM Eq. 15: the network's v in [-1, 1] mapped to [0, 1]
            log_var = frac * max_log + (1 - frac) * min_log
            var = torch.exp(log_var)
        else:
            out = model_out
            large = readout.fixed_variance == "large"
            table_var = "large_variance" if large else "posterior_variance"
            table_log = "large_log_variance" if large else "posterior_log_variance_clipped"
            var = self.coef(table_var, t, x_t).expand_as(x_t)
            log_var = self.coef(table_log, t, x_t).expand_as(x_t)
        pred_x0 = self.predict_x0(out, x_t, t, prediction)
        if readout.clip_denoised:
            pred_x0 = pred_x0.clamp(-1, 1)
        # eps implied by (possibly clipped) x0_hat; for an unclipped eps network that is the output itself.
        pred_eps = (
            out if (prediction == "eps" and not readout.clip_denoised) else self.predict_eps_from_x0(x_t, t, pred_x0)
        )
        mean, _, _ = self.q_posterior_mean_variance(pred_x0, x_t, t)
        return {"mean": mean, "variance": var, "log_variance": log_var, "pred_x0": pred_x0, "pred_eps": pred_eps}
