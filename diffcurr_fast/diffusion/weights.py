"""Per-sample loss weights as functions of SNR.

All weights are expressed relative to the plain MSE on the prediction target, so ``loss = w(SNR) * mse``.
SNR = 0 (pure noise) and SNR = inf (clean data) are handled without NaN.
"""

from __future__ import annotations

import torch

WEIGHTINGS = ("none", "min_snr", "p2", "speed")
SPEED_LAMBDA = 0.5  # half-width of SpeeD's change-aware weight interval [1 - lambda, 1 + lambda]


def loss_weights(
    snr: torch.Tensor,
    prediction: str = "eps",
    weighting: str = "none",
    gamma: float = 5.0,
    *,
    p2_k: float = 1.0,
    p2_gamma: float = 1.0,
    schedule: bool = False,
) -> torch.Tensor:
    """Loss weight per sample for ``weighting`` in {"none", "min_snr", "p2", "speed"}.

    - ``min_snr`` (Hang et al. 2023, Eq. 5 and its eps/v forms): the x0-space weight min(SNR, gamma), carried to
      the prediction's space: eps -> min(SNR, gamma) / SNR, x0 -> min(SNR, gamma), v -> min(SNR, gamma) / (SNR + 1).
    - ``p2`` (Choi et al. 2022, Eq. 8): 1 / (k + SNR)^gamma_p2 on the eps loss (defaults k=1, gamma_p2=1), carried
      to x0 by * SNR and to v by * SNR / (SNR + 1).
    - ``speed`` (SpeeD's change-aware weighting, Wang et al. 2024, arXiv 2405.17403, Sec. 4): a weight on the eps
      loss that grows with how fast the noise variance 1 - abar = 1 / (1 + SNR) changes along t: g = |d(1 - abar) /
      dt|, rescaled to [0, 1] (min-max) and mapped to [1 - lambda, 1 + lambda] (lambda = ``SPEED_LAMBDA``); carried
      to x0 and v as ``p2``. It needs the whole (T,) SNR table in timestep order, said by ``schedule=True`` (the
      DDPM formulation and the ops tables pass it so). Choices made here: the rescaled interval is centred on 1
      (the loss keeps its scale) with lambda 0.5; the official code's weighting is P2's, and the paper's exact
      rescaling could not be read.

    Returns a tensor with ``snr``'s shape and floating dtype (float32 for integer input).
    """
    snr = torch.as_tensor(snr)
    if not snr.dtype.is_floating_point:
        snr = snr.float()
    if prediction not in ("eps", "x0", "v"):
        raise ValueError(f"unknown prediction {prediction!r}; choose one of ('eps', 'x0', 'v')")
    bad = (snr < 0) | torch.isnan(snr)
    if torch.compiler.is_compiling():  # checked inside the graph: no host read, no graph break
        torch._assert_async(~bad.any(), "snr must be non-negative and not NaN")
    elif bool(bad.any()):
        raise ValueError("snr must be non-negative and not NaN")
    if weighting == "none":
        return torch.ones_like(snr)
    inf = torch.isinf(snr)
    if weighting == "min_snr":
        if gamma <= 0:
            raise ValueError(f"min_snr gamma must be positive, got {gamma}")
        clipped = snr.clamp(max=gamma)  # min(SNR, gamma)
        if prediction == "x0":
            return clipped
        if prediction == "eps":
            # min(SNR, gamma)/SNR: 1 while SNR <= gamma (also at SNR = 0), gamma/SNR above, 0 at SNR = inf.
            w = torch.where(snr <= gamma, torch.ones_like(snr), gamma / snr.clamp(min=gamma))
            return torch.where(inf, torch.zeros_like(snr), w)
        # v: min(SNR, gamma) / (SNR + 1), 0 at SNR = inf
        return torch.where(inf, torch.zeros_like(snr), clipped / (snr.where(~inf, torch.zeros_like(snr)) + 1.0))
    if weighting == "p2":
        w_eps = 1.0 / (p2_k + snr) ** p2_gamma  # 0 at SNR = inf
        if prediction == "eps":
            return w_eps
        finite = snr.where(~inf, torch.zeros_like(snr))
        if prediction == "x0":
            # SNR / (k + SNR)^g: at SNR = inf this is 1 for g = 1 and 0 for g > 1
            limit = torch.full_like(snr, 1.0 if p2_gamma == 1.0 else (0.0 if p2_gamma > 1 else float("inf")))
            return torch.where(inf, limit, finite / (p2_k + finite) ** p2_gamma)
        return torch.where(inf, torch.zeros_like(snr), w_eps * finite / (finite + 1.0))
    if weighting == "speed":
        if not schedule or snr.ndim != 1 or snr.numel() < 2:
            raise ValueError(
                "the speed weighting is a function of the whole schedule: pass its (T,) SNR table in "
                "timestep order with schedule=True"
            )
        finite = snr.where(~inf, torch.zeros_like(snr))
        var = torch.where(inf, torch.zeros_like(snr), 1.0 / (1.0 + finite))  # 1 - abar_t
        g = torch.gradient(var)[0].abs()
        g = (g - g.min()) / (g.max() - g.min()).clamp(min=torch.finfo(g.dtype).tiny)
        w_eps = 1.0 + SPEED_LAMBDA * (2.0 * g - 1.0)  # in [1 - lambda, 1 + lambda]
        if prediction == "eps":
            return w_eps
        return w_eps * (finite if prediction == "x0" else finite / (finite + 1.0))
    raise ValueError(f"unknown weighting {weighting!r}; choose one of {WEIGHTINGS}")
