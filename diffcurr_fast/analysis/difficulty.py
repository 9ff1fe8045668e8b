"""Task-difficulty analysis across timesteps (Kim et al., ICLR 2025: the observational study).

Two measurements, both runnable on the built-in digits data in minutes on a CPU:

- ``consecutive_kl``: the relative entropy KL(p_t || p_{t+1}) between consecutive marginals of the forward process
  (the paper's relative-entropy view of difficulty). With the empirical data distribution, p_t is the Gaussian mixture
  (1/N) sum_i N(a_t x_i, c_t^2 I), a_t = sqrt(abar_t), c_t = sqrt(1 - abar_t); the KL is estimated by Monte Carlo
  over x ~ p_t with exact mixture log-densities (logsumexp over the N components, in float64, chunked).
- ``convergence_by_interval``: a fresh small model trained on timesteps of one interval only, for each interval;
  loss curves normalised by their initial value and the steps needed to reach a fraction (default 90 %) of the
  final loss improvement (the paper's convergence view: slower convergence = harder task). With ``image_metric``
  (e.g. the Frechet distance of digits-classifier features, ``analyze convergence --metric fd``) the same is
  recorded for the images the model denoises in one step from the held-out batch noised into its interval: the
  paper's second convergence measure (FID per interval) at digits scale, without sampling the other intervals.

``write_*_csv`` and ``plot_*`` save the results (matplotlib with the Agg backend).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from diffcurr_fast._lazy import pyplot
from diffcurr_fast.models.dit import DiT
from diffcurr_fast.objective import Objective, batch_loss, fit_steps
from diffcurr_fast.ops import sample_timesteps
from diffcurr_fast.timesteps.build import build_timesteps


def _sqrt_coefficients(schedule: Any, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 (a_t, c_t) with x_t = a_t x0 + c_t eps, from a DDPMSchedule or any ``coefficients(t)`` formulation."""
    if hasattr(schedule, "sqrt_alphas_cumprod"):
        t = schedule.check_t(t)
        return schedule.sqrt_alphas_cumprod[t].double(), schedule.sqrt_one_minus_alphas_cumprod[t].double()
    a, c = schedule.coefficients(t)
    return torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(c, dtype=torch.float64)


# ---------------------------------------------------------------------------------------------------------------
# relative entropy between consecutive marginals


@dataclass
class KLEstimate:
    """Monte Carlo estimates of KL(p_t || p_{t+1}), one per timestep ``t``."""

    t: torch.Tensor  # (K,) int64
    kl: torch.Tensor  # (K,) float64, nats
    stderr: torch.Tensor  # (K,) float64, standard error of the MC mean
    num_samples: int


KL_ESTIMATORS = ("auto", "direct", "ratio")

# Terms more than this many nats below a row's maximum are clamped there before exp: their total share is below
# N * exp(-80) (about 1e-29 relative for a million components), and it keeps exp off its slow underflow path.
_LSE_FLOOR = -80.0


def _logsumexp_rows(z: torch.Tensor) -> torch.Tensor:
    """Row-wise logsumexp of a (B, n) float64 matrix, in place on ``z``."""
    m = z.amax(dim=1, keepdim=True)  # (B, 1)
    return z.sub_(m).clamp_(min=_LSE_FLOOR).exp_().sum(dim=1).log_() + m.squeeze(1)


def mixture_log_densities(
    x: torch.Tensor, centres: torch.Tensor, params: Sequence[tuple[float, float]], chunk_size: int = 4096
) -> list[torch.Tensor]:
    """log (1/N) sum_i N(x; a * centres_i, c^2 I) for each (a, c) in ``params``; x (B, D), centres (N, D).

    Float64. Squared distances are |x|^2 - 2 a x.m_i + a^2 |m_i|^2 with the products x.m_i shared by every
    (a, c); ``chunk_size`` components at a time, the chunks combined by logsumexp, so memory is O(B * chunk_size).
    Returns one (B,) tensor per (a, c).
    """
    x = x.to(torch.float64)
    centres = centres.to(device=x.device, dtype=torch.float64)
    n, d = centres.shape
    x_sq = (x * x).sum(1, keepdim=True)  # (B, 1)
    parts: list[list[torch.Tensor]] = [[] for _ in params]
    for start in range(0, n, chunk_size):
        c = centres[start : start + chunk_size]  # (n_c, D)
        c_sq = (c * c).sum(1)  # (n_c,)
        dot = x @ c.T  # (B, n_c)
        for j, (a, std) in enumerate(params):
            dist2 = (x_sq + (a * a) * c_sq).sub_(dot, alpha=2.0 * a).clamp_(min=0.0)  # (B, n_c)
            parts[j].append(_logsumexp_rows(dist2.mul_(-0.5 / (std * std))))  # (B,)
    out = []
    for j, (_, std) in enumerate(params):
        log_sum = parts[j][0] if len(parts[j]) == 1 else torch.logsumexp(torch.stack(parts[j], 1), dim=1)
        out.append(log_sum - math.log(n) - 0.5 * d * math.log(2.0 * math.pi * std * std))
    return out


def consecutive_kl(
    data: torch.Tensor,
    schedule: Any,
    timesteps: Sequence[int] | torch.Tensor,
    num_samples: int = 1000,
    batch_size: int = 250,
    *,
    estimator: str = "auto",
    chunk_size: int = 4096,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
    progress: bool = False,
) -> KLEstimate:
    """KL(p_t || p_{t+1}) for each ``t`` in ``timesteps`` between consecutive forward marginals of ``data`` (N, ...).

    KL = E_{x ~ p_t}[r(x)], r = log p_t(x) - log p_{t+1}(x) (Kim et al., relative entropy), from ``num_samples`` draws
    x = a_t x_i + c_t eps, i uniform, per ``t``, ``batch_size`` at a time. Needs 0 <= t <= T - 2. Estimators:

    - ``direct``: the mean of r. Its variance is about 2 KL per sample, so tiny KLs drown in noise.
    - ``ratio``: the mean of r + exp(-r) - 1 (E_p[exp(-r)] = 1, so still unbiased; every term is >= 0 and the
      variance is O(KL^2)). Its variance is finite only when c_{t+1}^2 < 2 c_t^2 (the tails of p_{t+1}/p_t).
    - ``auto`` (default): ``ratio`` where c_{t+1}^2 <= 1.5 c_t^2, else ``direct`` (in practice only the first
      few steps of a schedule use ``direct``).
    """
    data = torch.as_tensor(data)
    if data.ndim < 2 or data.shape[0] < 1:
        raise ValueError(f"data must have shape (N, ...) with N >= 1, got {tuple(data.shape)}")
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 2:
        raise ValueError(f"num_samples must be an int >= 2, got {num_samples!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown estimator {estimator!r}; choose one of {KL_ESTIMATORS}")
    ts = torch.as_tensor(timesteps).flatten()
    if ts.numel() == 0 or ts.dtype.is_floating_point or ts.dtype == torch.bool:
        raise ValueError("timesteps must be a non-empty sequence of integer timesteps")
    ts = ts.long()
    num_timesteps = getattr(schedule, "num_timesteps", None)
    if num_timesteps is not None and (int(ts.min()) < 0 or int(ts.max()) > num_timesteps - 2):
        raise ValueError(
            f"timesteps must lie in [0, {num_timesteps - 2}] so that t + 1 exists; got {int(ts.min())}..{int(ts.max())}"
        )
    device = torch.device(device) if device is not None else data.device
    x0 = data.reshape(data.shape[0], -1).to(device=device, dtype=torch.float64)  # (N, D)
    n, d = x0.shape
    a_t, c_t = _sqrt_coefficients(schedule, ts)
    a_n, c_n = _sqrt_coefficients(schedule, ts + 1)
    kl, se = [], []
    iterator = range(ts.numel())
    if progress:
        iterator = tqdm(iterator, desc="KL(p_t || p_t+1)", unit="t")
    for k in iterator:
        use_ratio = estimator == "ratio" or (estimator == "auto" and float(c_n[k] ** 2) <= 1.5 * float(c_t[k] ** 2))
        params = [(float(a_t[k]), float(c_t[k])), (float(a_n[k]), float(c_n[k]))]
        terms = []
        for start in range(0, num_samples, batch_size):
            b = min(batch_size, num_samples - start)
            idx = torch.randint(n, (b,), generator=generator).to(device)
            eps = torch.randn(b, d, generator=generator, dtype=torch.float64).to(device)
            x = params[0][0] * x0[idx] + params[0][1] * eps  # (b, D) ~ p_t
            log_p, log_q = mixture_log_densities(x, x0, params, chunk_size)
            r = log_p - log_q  # (b,)
            terms.append((r + torch.expm1(-r) if use_ratio else r).cpu())
        term = torch.cat(terms)  # (num_samples,)
        kl.append(float(term.mean()))
        se.append(float(term.std(unbiased=True)) / math.sqrt(num_samples))
    return KLEstimate(
        t=ts.cpu(),
        kl=torch.tensor(kl, dtype=torch.float64),
        stderr=torch.tensor(se, dtype=torch.float64),
        num_samples=num_samples,
    )


def gaussian_consecutive_kl(schedule: Any, t: int, point: torch.Tensor) -> float:
    """Closed-form KL(p_t || p_{t+1}) for a single-point dataset {point}: both marginals are isotropic Gaussians.

    KL(N(m0, s0^2 I) || N(m1, s1^2 I)) = D/2 (s0^2/s1^2 - 1 - ln(s0^2/s1^2)) + |m0 - m1|^2 / (2 s1^2).
    """
    p = torch.as_tensor(point, dtype=torch.float64).flatten()
    a, c = _sqrt_coefficients(schedule, torch.tensor([t, t + 1]))
    ratio = float(c[0] ** 2 / c[1] ** 2)
    mean_term = float(((a[0] - a[1]) * p).pow(2).sum()) / (2.0 * float(c[1] ** 2))
    return 0.5 * p.numel() * (ratio - 1.0 - math.log(ratio)) + mean_term


# ---------------------------------------------------------------------------------------------------------------
# convergence speed per timestep interval


def small_dit(num_classes: int = 10) -> nn.Module:
    """The default analysis model: a 2-block DiT on 8x8 single-channel images (16 tokens of width 64)."""
    return DiT(
        input_size=8,
        patch_size=2,
        in_channels=1,
        hidden_size=64,
        depth=2,
        num_heads=4,
        num_classes=num_classes,
        learn_sigma=False,
    )


@dataclass
class IntervalConvergence:
    """Training record of one model trained only on timesteps in ``interval``."""

    interval: tuple[int, int]
    eval_steps: list[int]  # steps at which the held-out loss was measured (0 = before training)
    eval_loss: list[float]  # held-out loss at those steps
    train_loss: list[float]  # per-step training loss
    steps_to_fraction: int | None  # first eval step reaching ``fraction`` of the final improvement
    eval_fd: list[float] = field(default_factory=list)  # image metric at eval_steps (with ``image_metric``)
    steps_to_fraction_fd: int | None = None  # the same as steps_to_fraction, of eval_fd

    @property
    def normalised(self) -> list[float]:
        """Held-out loss divided by its value before training."""
        return [v / self.eval_loss[0] for v in self.eval_loss]


@dataclass
class ConvergenceResult:
    """Per-interval convergence records plus the settings that produced them."""

    intervals: list[IntervalConvergence]
    fraction: float
    settings: dict[str, Any] = field(default_factory=dict)


def steps_to_fraction(eval_steps: Sequence[int], eval_loss: Sequence[float], fraction: float) -> int | None:
    """First step where L_0 - L_k >= fraction * (L_0 - L_final); L_final = mean of the last tenth of the curve.

    Returns None when the loss did not improve at all.
    """
    if not eval_loss:
        return None
    tail = max(1, len(eval_loss) // 10)
    final = sum(eval_loss[-tail:]) / tail
    gain = eval_loss[0] - final
    if not gain > 0:
        return None
    for s, v in zip(eval_steps, eval_loss):
        if eval_loss[0] - v >= fraction * gain:
            return int(s)
    return int(eval_steps[-1])


def convergence_by_interval(
    model_factory: Callable[[], nn.Module] | None,
    data: torch.Tensor,
    schedule: Any,
    intervals: Sequence[tuple[int, int]],
    steps: int = 300,
    batch_size: int = 64,
    lr: float = 1e-3,
    *,
    labels: torch.Tensor | None = None,
    prediction: str = "eps",
    eval_every: int = 10,
    eval_size: int = 256,
    fraction: float = 0.9,
    seed: int = 0,
    device: torch.device | str = "cpu",
    progress: bool = False,
    objective: Objective | None = None,
    image_metric: Callable[[torch.Tensor], float] | None = None,
) -> ConvergenceResult:
    """Train a fresh model on each timestep interval for ``steps`` AdamW steps and record its convergence.

    ``model_factory()`` builds the network, called as ``model(x_t, t, y)``; None uses ``small_dit``. Every model
    is built under the same seed (inside a forked RNG, so the global RNG is untouched); each interval has a fixed
    held-out batch (``eval_size`` images, timesteps and noise drawn once) evaluated every ``eval_every`` steps.
    ``labels`` (N,) default to zeros. Training and evaluation use the training ``objective`` (default: the
    plain ``prediction`` MSE on ``schedule``), so the analysis measures what the trainer optimises.
    ``image_metric(images)`` (lower is better, e.g. an FD against the data): also evaluated at every evaluation on
    the one-step x0 predictions of the held-out batch noised to fixed timesteps in the interval (``one_step_x0``;
    DDPM schedules), recorded as ``eval_fd``.
    """
    data = torch.as_tensor(data)
    if data.ndim < 2 or data.shape[0] < 1:
        raise ValueError(f"data must have shape (N, ...) with N >= 1, got {tuple(data.shape)}")
    for name, v in (("steps", steps), ("batch_size", batch_size), ("eval_every", eval_every), ("eval_size", eval_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must lie in (0, 1], got {fraction!r}")
    if not lr > 0:
        raise ValueError(f"lr must be positive, got {lr!r}")
    num_timesteps = getattr(schedule, "num_timesteps", None)
    checked = []
    for lo, hi in intervals:
        lo, hi = int(lo), int(hi)
        if not (0 <= lo < hi and (num_timesteps is None or hi <= num_timesteps)):
            raise ValueError(f"interval ({lo}, {hi}) must be a non-empty half-open range inside [0, {num_timesteps})")
        checked.append((lo, hi))
    if not checked:
        raise ValueError("intervals must not be empty")
    factory = model_factory if model_factory is not None else small_dit
    device = torch.device(device)
    x_all = data.to(device=device, dtype=torch.float32)
    n = x_all.shape[0]
    y_all = (
        torch.zeros(n, dtype=torch.long, device=device) if labels is None else torch.as_tensor(labels).to(device).long()
    )
    if y_all.shape != (n,):
        raise ValueError(f"labels must have shape ({n},), got {tuple(y_all.shape)}")

    if objective is None:
        objective = Objective(schedule, num_cells=num_timesteps, prediction=prediction)

    records = []
    bar = None
    if progress:
        bar = tqdm(total=steps * len(checked), desc="convergence", unit="step")
    for k, (lo, hi) in enumerate(checked):
        # t ~ U[lo, hi): the timesteps component's uniform strategy on the interval (EDM: times its cell prior)
        weights = build_timesteps(None, objective.formulation, objective.num_cells, timestep_range=(lo, hi)).weights()
        gen = torch.Generator().manual_seed(seed * 1_000_003 + k)
        eval_idx = torch.randint(n, (eval_size,), generator=gen).to(device)
        eval_batch = (x_all[eval_idx], y_all[eval_idx])
        eval_seed = int(torch.randint(0, 2**62, (1,), generator=gen))
        # the same initial weights (and, on a GPU, the same CUDA stream) for every interval; the host RNG untouched
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = factory().to(device)

        def evaluate(model: nn.Module = model, batch: tuple = eval_batch, w=weights, s=eval_seed) -> float:
            model.eval()  # the same images, cells, noise and in-cell points at every evaluation
            with torch.no_grad():
                value = float(batch_loss(objective, model, *batch, w, torch.Generator().manual_seed(s)))
            model.train()
            return value

        def evaluate_fd(model: nn.Module = model, batch: tuple = eval_batch, w=weights, s=eval_seed) -> float:
            if image_metric is None:
                return math.nan
            model.eval()
            x0 = one_step_x0(model, schedule, *batch, w, torch.Generator().manual_seed(s + 1), prediction)
            model.train()
            return float(image_metric(x0))

        eval_steps, eval_loss, eval_fd = [0], [evaluate()], [evaluate_fd()]

        def on_step(
            step: int,
            loss: float,
            evaluate=evaluate,
            eval_steps=eval_steps,
            eval_loss=eval_loss,
            cells=(lo, hi),
            evaluate_fd=evaluate_fd,
            eval_fd=eval_fd,
        ) -> None:
            if not math.isfinite(loss):
                raise ValueError(f"non-finite training loss {loss} at step {step} of interval {cells}")
            if step % eval_every == 0 or step == steps:
                eval_steps.append(step)
                eval_loss.append(evaluate())
                eval_fd.append(evaluate_fd())
            if bar is not None:
                bar.update(1)

        def batch(step: int, gen=gen) -> tuple[torch.Tensor, torch.Tensor]:
            idx = torch.randint(n, (batch_size,), generator=gen).to(device)
            return x_all[idx], y_all[idx]

        train_loss = fit_steps(model, objective, batch, weights, steps, lr=lr, generator=gen, on_step=on_step)
        records.append(
            IntervalConvergence(
                interval=(lo, hi),
                eval_steps=eval_steps,
                eval_loss=eval_loss,
                train_loss=train_loss,
                steps_to_fraction=steps_to_fraction(eval_steps, eval_loss, fraction),
                eval_fd=eval_fd if image_metric is not None else [],
                steps_to_fraction_fd=steps_to_fraction(eval_steps, eval_fd, fraction) if image_metric else None,
            )
        )
    if bar is not None:
        bar.close()
    settings = {"steps": steps, "batch_size": batch_size, "lr": lr, "prediction": prediction, "seed": seed}
    return ConvergenceResult(intervals=records, fraction=fraction, settings=settings)


@torch.no_grad()
def one_step_x0(
    model: Callable[..., torch.Tensor],
    schedule: Any,
    x0: torch.Tensor,
    y: torch.Tensor,
    weights: torch.Tensor,
    generator: torch.Generator,
    prediction: str = "eps",
) -> torch.Tensor:
    """The model's one-step estimate of x0 (N, C, H, W), clipped to [-1, 1], from x_t = sqrt(abar_t) x0 +
    sqrt(1 - abar_t) eps with t drawn from ``weights`` (T,) by ``ops.sample_timesteps`` and eps from
    ``generator`` (a DDPM schedule; the network predicts ``prediction``: eps, x0 or v; extra output channels, a
    learned variance, are dropped)."""
    if not hasattr(schedule, "alphas_cumprod"):
        raise ValueError("one_step_x0 needs a DDPM schedule (alphas_cumprod)")
    t = sample_timesteps(x0.shape[0], weights, generator=generator, device=x0.device)
    eps = torch.randn(x0.shape, generator=generator).to(x0.device, x0.dtype)
    abar = schedule.alphas_cumprod.to(x0.device)[t].to(torch.float64).reshape(-1, *([1] * (x0.ndim - 1)))
    a, c = abar.sqrt(), (1.0 - abar).sqrt()
    xt = (a * x0.double() + c * eps.double()).to(x0.dtype)
    out = model(xt, t, y)[:, : x0.shape[1]].double()  # (N, C, H, W)
    if prediction == "eps":
        est = (xt.double() - c * out) / a
    elif prediction == "x0":
        est = out
    elif prediction == "v":  # v = a eps - c x0, so x0 = a x_t - c v (Salimans & Ho 2022)
        est = a * xt.double() - c * out
    else:
        raise ValueError(f"prediction must be eps, x0 or v, got {prediction!r}")
    return est.clamp(-1, 1).to(x0.dtype)


# ---------------------------------------------------------------------------------------------------------------
# CSV and plots


def write_kl_csv(result: KLEstimate, path: str | Path) -> Path:
    """Write columns t, kl, stderr, num_samples to ``path``."""
    path = Path(path)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["t", "kl", "stderr", "num_samples"])
        for t, kl, se in zip(result.t.tolist(), result.kl.tolist(), result.stderr.tolist()):
            w.writerow([t, f"{kl:.10g}", f"{se:.10g}", result.num_samples])
    return path


def write_convergence_csv(result: ConvergenceResult, curves_path: str | Path, summary_path: str | Path) -> None:
    """Curves (interval, step, eval_loss, normalised[, eval_fd]) and a per-interval summary with steps-to-fraction
    (of the FD too when it was measured)."""
    fd = any(rec.eval_fd for rec in result.intervals)
    pct = f"steps_to_{int(round(result.fraction * 100))}pct"
    with Path(curves_path).open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["t_lo", "t_hi", "step", "eval_loss", "normalised_loss", *(["eval_fd"] if fd else [])])
        for rec in result.intervals:
            fds = rec.eval_fd or [None] * len(rec.eval_steps)
            for s, v, nv, d in zip(rec.eval_steps, rec.eval_loss, rec.normalised, fds):
                w.writerow(
                    [rec.interval[0], rec.interval[1], s, f"{v:.8g}", f"{nv:.8g}", *([f"{d:.8g}"] if fd else [])]
                )
    with Path(summary_path).open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            [
                "t_lo",
                "t_hi",
                "initial_loss",
                "final_loss",
                pct,
                *(["initial_fd", "final_fd", f"{pct}_fd"] if fd else []),
            ]
        )
        for rec in result.intervals:
            steps = "" if rec.steps_to_fraction is None else rec.steps_to_fraction
            extra = []
            if fd:
                sfd = "" if rec.steps_to_fraction_fd is None else rec.steps_to_fraction_fd
                extra = [f"{rec.eval_fd[0]:.8g}", f"{rec.eval_fd[-1]:.8g}", sfd]
            w.writerow(
                [rec.interval[0], rec.interval[1], f"{rec.eval_loss[0]:.8g}", f"{rec.eval_loss[-1]:.8g}", steps, *extra]
            )


def plot_kl(result: KLEstimate, path: str | Path) -> Path:
    """Plot KL(p_t || p_{t+1}) against t (log scale) with +-2 standard-error bands."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    t = result.t.numpy()
    kl = result.kl.numpy()
    se = result.stderr.numpy()
    ax.plot(t, kl, marker="o", ms=3)
    ax.fill_between(t, kl - 2 * se, kl + 2 * se, alpha=0.3)
    if (kl > 0).all():
        ax.set_yscale("log")
    ax.set_xlabel("timestep t")
    ax.set_ylabel("KL(p_t || p_t+1) [nats]")
    ax.set_title("Relative entropy between consecutive marginals")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def plot_convergence(result: ConvergenceResult, path: str | Path) -> Path:
    """Normalised held-out loss curves per interval, and steps-to-fraction per interval."""
    plt = pyplot()
    fd = any(rec.eval_fd for rec in result.intervals)
    fig, axes = plt.subplots(1, 3 if fd else 2, figsize=(16 if fd else 11, 4))
    ax0, ax1 = axes[0], axes[-1]
    cmap = plt.get_cmap("viridis")
    m = len(result.intervals)
    if fd:
        for k, rec in enumerate(result.intervals):
            axes[1].plot(rec.eval_steps, rec.eval_fd, color=cmap(k / max(m - 1, 1)))
        axes[1].set_yscale("log")
        axes[1].set_xlabel("training step")
        axes[1].set_ylabel("FD of one-step x0 predictions")
        axes[1].set_title("FD convergence per interval")
    for k, rec in enumerate(result.intervals):
        ax0.plot(
            rec.eval_steps,
            rec.normalised,
            color=cmap(k / max(m - 1, 1)),
            label=f"t in [{rec.interval[0]}, {rec.interval[1]})",
        )
    ax0.set_xlabel("training step")
    ax0.set_ylabel("held-out loss / initial loss")
    ax0.legend(fontsize=7)
    ax0.set_title("Convergence per timestep interval")
    labels = [f"{r.interval[0]}-{r.interval[1]}" for r in result.intervals]
    values = [r.steps_to_fraction if r.steps_to_fraction is not None else 0 for r in result.intervals]
    if fd:
        values_fd = [r.steps_to_fraction_fd if r.steps_to_fraction_fd is not None else 0 for r in result.intervals]
        ax1.bar([i - 0.2 for i in range(m)], values, width=0.4, label="loss")
        ax1.bar([i + 0.2 for i in range(m)], values_fd, width=0.4, label="FD")
        ax1.legend(fontsize=7)
    else:
        ax1.bar(range(m), values)
    ax1.set_xticks(range(m), labels, rotation=45, fontsize=7)
    ax1.set_xlabel("timestep interval")
    ax1.set_ylabel(f"steps to {int(round(result.fraction * 100))}% of final improvement")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)
