"""Post-hoc EMA (Karras et al. 2024, EDM2, "Analyzing and Improving the Training Dynamics of Diffusion Models",
Section 3 and Appendix C): the maths of power-function averages, their snapshots, and the reconstruction of an
average of any length from them after training.

A power-function average of exponent gamma at training time t weighs theta(tau) by the profile
p_{t,gamma}(tau) = (gamma + 1) tau^gamma / t^(gamma + 1) on [0, t] (EDM2 eq. 2); its update after optimizer step t,
beta(t) = (1 - 1/t)^(gamma + 1) (EDM2 eq. 4), averages exactly the weights held constant over each step
(theta(tau) = theta_t for tau in (t - 1, t]). Its width is the relative standard deviation
sigma_rel = ((gamma + 1) / ((gamma + 2)^2 (gamma + 3)))^(1/2) (EDM2 eq. 3), the EMA length the user chooses.

During training (``optim.phema_every``) the run writes the averages it tracks (``train.ema.PowerEMA``) as
``phema/phema-<step>-<sigma_rel>.safetensors``. ``reconstruct`` then finds the combination of the snapshots whose
profile is closest, in least squares over tau, to the profile of any sigma_rel at the last snapshot's time (EDM2
Appendix C.2, Algorithm 3): the Gram matrix of the snapshots' profiles and their products with the target profile
have a closed form (``profile_dot``), the coefficients solve that linear system in float64, and the weights are
sum_i x_i theta_hat_i.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from diffcurr_fast.optim.registry import PHEMA_SIGMA_REL_MAX
from diffcurr_fast.runs.checkpoint import export_safetensors

SNAPSHOT_DIR = "phema"
_NAME = re.compile(r"^phema-(\d{8,})-([0-9.e+-]+)\.safetensors$")


# ---- the profiles (EDM2 Section 3.1, Appendix C.1) --------------------------------------------------------------
def gamma_to_sigma_rel(gamma: float) -> float:
    """The relative standard deviation of the power-function profile of exponent ``gamma`` (EDM2 eq. 3)."""
    g = float(gamma)
    return math.sqrt((g + 1.0) / ((g + 2.0) ** 2 * (g + 3.0)))


def sigma_rel_to_gamma(sigma_rel: float) -> float:
    """The exponent gamma >= 0 whose profile has relative standard deviation ``sigma_rel`` in (0, 12^-1/2]: the root
    of the cubic (gamma + 2)^2 (gamma + 3) - (gamma + 1) / sigma_rel^2 (EDM2 eq. 3; its Algorithm 2 takes the
    largest real root), found by bisection in float64 (sigma_rel decreases in gamma >= 0) until the bracket's ends
    are adjacent floats; of the two, the one whose sigma_rel^2 is nearer the target (that difference's rounding can
    leave it off the float nearest the exact root). ValueError
    for a value out of range (``PHEMA_SIGMA_REL_MAX``: gamma = 0, the running mean)."""
    s = float(sigma_rel)
    if not 0.0 < s <= PHEMA_SIGMA_REL_MAX:  # NaN fails too
        raise ValueError(
            f"sigma_rel must lie in (0, {PHEMA_SIGMA_REL_MAX:.6f}] (an exponent gamma >= 0; 12^-1/2 is the running "
            f"mean), got {sigma_rel!r}"
        )
    target = s * s

    def excess(g: float) -> float:  # sigma_rel(g)^2 - sigma_rel^2: positive below the root, negative above
        return (g + 1.0) / ((g + 2.0) ** 2 * (g + 3.0)) - target

    lo, hi = 0.0, 1.0
    if excess(lo) <= 0.0:  # sigma_rel = 12^-1/2 (rounded)
        return 0.0
    while excess(hi) > 0.0:
        lo, hi = hi, 2.0 * hi
    while True:
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            return lo if abs(excess(lo)) <= abs(excess(hi)) else hi
        if excess(mid) > 0.0:
            lo = mid
        else:
            hi = mid


def power_beta(t: int, gamma: float) -> float:
    """The decay of the power-function average at update ``t`` >= 1, (1 - 1/t)^(gamma + 1) (EDM2 eq. 4): 0 at the
    first update, which takes the weights as they are."""
    return (1.0 - 1.0 / t) ** (gamma + 1.0)


def profile_dot(t_a: Any, gamma_a: Any, t_b: Any, gamma_b: Any) -> torch.Tensor:
    """The inner product of the profiles p_{t_a,gamma_a} and p_{t_b,gamma_b} over tau (float64, broadcast):
    int_0^min(t_a, t_b) p_a p_b dtau = (g_a + 1)(g_b + 1) / ((g_a + g_b + 1) max(t_a, t_b)) times (t_a / t_b)^g_b when
    t_a <= t_b, (t_b / t_a)^g_a otherwise (EDM2 Appendix C.2, Algorithm 3's p_dot_p)."""
    ta, ga, tb, gb = (torch.as_tensor(v, dtype=torch.float64) for v in (t_a, gamma_a, t_b, gamma_b))
    ratio = torch.where(ta <= tb, (ta / tb) ** gb, (tb / ta) ** ga)
    return (ga + 1.0) * (gb + 1.0) * ratio / ((ga + gb + 1.0) * torch.maximum(ta, tb))


def solve_coefficients(t_i: Any, gamma_i: Any, t_target: float, gamma_target: float) -> torch.Tensor:
    """(N,) float64 coefficients x of the snapshots (times ``t_i``, exponents ``gamma_i``) whose combination
    sum_i x_i p_i is the least-squares fit of the target profile p_{t_target, gamma_target}: the normal equations
    A x = b with A_ij = <p_i, p_j>, b_i = <p_i, p_target> (``profile_dot``), solved by ``torch.linalg.lstsq`` (SVD;
    a rank-deficient set, such as one profile listed twice, gets the minimum-norm solution), then scaled to sum to
    1 so that the result stays an average (as EDM2's ``solve_posthoc_coefficients``)."""
    t = torch.as_tensor(t_i, dtype=torch.float64).reshape(-1)
    g = torch.as_tensor(gamma_i, dtype=torch.float64).reshape(-1)
    if t.numel() == 0 or t.shape != g.shape:
        raise ValueError(f"solve_coefficients needs as many times as exponents (>= 1), got {t.numel()} and {g.numel()}")
    a = profile_dot(t[:, None], g[:, None], t[None, :], g[None, :])  # (N, N) Gram matrix
    b = profile_dot(t, g, float(t_target), float(gamma_target))  # (N,)
    x = torch.linalg.lstsq(a, b[:, None], driver="gelsd").solution[:, 0]
    return x / x.sum()


# ---- snapshots -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Snapshot:
    """One snapshot file: the run's ``step``, the average's time ``t`` (its updates: steps that were applied) and
    profile (``sigma_rel``, ``gamma``)."""

    path: Path
    step: int
    t: int
    sigma_rel: float
    gamma: float


def snapshot_path(run_dir: str | Path, step: int, sigma_rel: float) -> Path:
    """``run_dir/phema/phema-<step:08d>-<sigma_rel>.safetensors`` (sigma_rel as Python writes it: 0.05, 0.1)."""
    return Path(run_dir) / SNAPSHOT_DIR / f"phema-{step:08d}-{float(sigma_rel)!r}.safetensors"


def write_snapshot(
    run_dir: str | Path,
    step: int,
    sigma_rel: float,
    t: int,
    state_dict: dict[str, torch.Tensor],
    buffers: list[str],
    meta: dict[str, Any],
) -> Path:
    """Write one average (``state_dict``, float32, the model's keys; ``buffers`` names the entries that are copied,
    not averaged) atomically (``runs.checkpoint.export_safetensors``) with its step, time and profile beside
    ``meta`` (the config, as ``ema.safetensors`` holds it)."""
    path = snapshot_path(run_dir, step, sigma_rel)
    path.parent.mkdir(parents=True, exist_ok=True)
    info = {"step": step, "t": t, "sigma_rel": float(sigma_rel), "gamma": sigma_rel_to_gamma(sigma_rel)}
    return export_safetensors(state_dict, path, {**meta, **info, "buffers": buffers})


def list_snapshots(run_dir: str | Path) -> list[Snapshot]:
    """The snapshots under ``run_dir/phema``, by step then sigma_rel (each read from the file's metadata)."""
    d = Path(run_dir) / SNAPSHOT_DIR
    out = []
    for p in sorted(d.iterdir()) if d.is_dir() else []:
        if not (_NAME.match(p.name) and p.is_file()):
            continue
        meta = _metadata(p)
        out.append(Snapshot(p, int(meta["step"]), int(meta["t"]), float(meta["sigma_rel"]), float(meta["gamma"])))
    return sorted(out, key=lambda s: (s.step, s.sigma_rel))


def remove_snapshots_after(run_dir: str | Path, step: int) -> list[Path]:
    """Delete the snapshots of steps after ``step`` (a resume from the checkpoint of ``step`` writes them again);
    returns them."""
    d = Path(run_dir) / SNAPSHOT_DIR
    gone = [p for p in (d.iterdir() if d.is_dir() else ()) if (m := _NAME.match(p.name)) and int(m.group(1)) > step]
    for p in gone:
        p.unlink(missing_ok=True)
    return gone


def _metadata(path: Path) -> dict[str, Any]:
    with safe_open(str(path), "pt") as f:
        return {k: json.loads(v) for k, v in (f.metadata() or {}).items()}


# ---- reconstruction (EDM2 Appendix C.2) --------------------------------------------------------------------------
@dataclass(frozen=True)
class Reconstruction:
    """What ``reconstruct`` combined: the target ``step`` (its time ``t``), the snapshots and their coefficients."""

    step: int
    t: int
    sigma_rel: float
    snapshots: list[Snapshot]
    coefficients: torch.Tensor  # (N,) float64


def reconstruct(
    run_dir: str | Path, sigma_rel: float, step: int | None = None
) -> tuple[dict[str, torch.Tensor], Reconstruction]:
    """(state dict, how) of the power-function average of ``sigma_rel`` at the newest snapshot step (at or before
    ``step`` when given), combined from every snapshot up to it. The parameters are summed in float64 and returned
    in float32; the buffers (named in the files) are the target step's. ValueError in one line when the run kept no
    snapshots (naming ``optim.phema_every``) or none at or before ``step``, or for a sigma_rel out of range."""
    gamma = sigma_rel_to_gamma(sigma_rel)
    snaps = list_snapshots(run_dir)
    if not snaps:
        raise ValueError(
            f"run directory {str(run_dir)!r} has no post-hoc EMA snapshots under {SNAPSHOT_DIR}/: --ema-length needs "
            "a run trained with optim.phema_every > 0"
        )
    upto = [s for s in snaps if step is None or s.step <= step]
    if not upto:
        raise ValueError(
            f"run directory {str(run_dir)!r} has no post-hoc EMA snapshot at or before step {step} (the first is of "
            f"step {snaps[0].step})"
        )
    last = upto[-1]
    used = [s for s in upto if 0 < s.t <= last.t]
    coef = solve_coefficients([s.t for s in used], [s.gamma for s in used], last.t, gamma)
    acc: dict[str, torch.Tensor] = {}
    buffers = set(_metadata(last.path).get("buffers", []))
    for snap, x in zip(used, coef.tolist()):
        with safe_open(str(snap.path), "pt") as f:
            for key in f.keys():
                v = f.get_tensor(key)
                if key in buffers or not v.is_floating_point():
                    if snap is last:
                        acc[key] = v
                    continue
                acc[key] = acc.get(key, 0.0) + x * v.to(torch.float64)
    state = {k: v.to(torch.float32) if k not in buffers and v.is_floating_point() else v for k, v in acc.items()}
    return state, Reconstruction(last.step, last.t, float(sigma_rel), used, coef)
