"""Replace a diffusers-style training step (add_noise + compute_snr + MinSNR-weighted MSE) by the fused ops.

The "before" half is the usual diffusers recipe written out in plain torch (no diffusers dependency):
``DDPMScheduler.add_noise``, ``training_utils.compute_snr`` and the MinSNR weighting of Hang et al. (2023) from
the diffusers training scripts. The "after" half is two calls: ``q_sample`` and ``diffusion_loss``. Both give
the same loss and gradients; the fused path does it in two passes over memory and, with ``seed=``, never
stores the noise at all.

    python examples/diffusers_drop_in.py            # trains a small denoiser on scikit-learn's 8x8 digits
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from diffcurr_fast.diffusion import DDPMSchedule
from diffcurr_fast.ops import diffusion_loss, q_sample


# ---- before: the diffusers recipe in plain torch -----------------------------------------------------------
def add_noise(x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor, alphas_cumprod: torch.Tensor) -> torch.Tensor:
    """DDPMScheduler.add_noise: sqrt(abar_t) x0 + sqrt(1 - abar_t) noise (Ho et al. Eq. 4)."""
    abar = alphas_cumprod.to(x0.device)[t].float().view(-1, *([1] * (x0.ndim - 1)))
    return abar.sqrt() * x0 + (1 - abar).sqrt() * noise


def compute_snr(t: torch.Tensor, alphas_cumprod: torch.Tensor) -> torch.Tensor:
    """training_utils.compute_snr: (alpha / sigma)^2 with alpha = sqrt(abar_t), sigma = sqrt(1 - abar_t)."""
    abar = alphas_cumprod.to(t.device)[t].float()
    return (abar.sqrt() / (1 - abar).sqrt()) ** 2


def diffusers_style_loss(
    model: torch.nn.Module,
    x0: torch.Tensor,
    noise: torch.Tensor,
    t: torch.Tensor,
    alphas_cumprod: torch.Tensor,
    prediction: str = "epsilon",
    snr_gamma: float = 5.0,
) -> torch.Tensor:
    """The MinSNR-weighted training loss of the diffusers text-to-image script, written out."""
    noisy = add_noise(x0, noise, t, alphas_cumprod)
    pred = model(noisy, t)
    if prediction == "epsilon":
        target = noise
    else:  # v_prediction: sqrt(abar) noise - sqrt(1 - abar) x0 (scheduler.get_velocity)
        abar = alphas_cumprod.to(x0.device)[t].float().view(-1, *([1] * (x0.ndim - 1)))
        target = abar.sqrt() * noise - (1 - abar).sqrt() * x0
    snr = compute_snr(t, alphas_cumprod)
    w = torch.stack([snr, snr_gamma * torch.ones_like(snr)], dim=1).min(dim=1)[0]  # min(SNR, gamma)
    w = w / snr if prediction == "epsilon" else w / (snr + 1)
    loss = F.mse_loss(pred.float(), target.float(), reduction="none")
    return (loss.mean(dim=list(range(1, loss.ndim))) * w).mean()


# ---- after: the fused ops -----------------------------------------------------------------------------------
def fused_loss(
    model: torch.nn.Module,
    x0: torch.Tensor,
    noise: torch.Tensor | None,
    t: torch.Tensor,
    schedule: DDPMSchedule,
    prediction: str = "epsilon",
    snr_gamma: float = 5.0,
    seed: int | None = None,
) -> torch.Tensor:
    """Same loss with ``q_sample`` + ``diffusion_loss``; pass ``noise=None, seed=s`` to never store the noise."""
    pred_kind = {"epsilon": "eps", "v_prediction": "v"}[prediction]
    noisy = q_sample(x0, t, schedule, noise, seed=seed)
    pred = model(noisy, t)
    return diffusion_loss(
        pred, x0, noise, t, schedule, prediction=pred_kind, weighting="min_snr", gamma=snr_gamma, seed=seed
    )


class TinyDenoiser(torch.nn.Module):
    """A small conv denoiser conditioned on t by a learned per-timestep bias."""

    def __init__(self, channels: int = 1, width: int = 32, num_timesteps: int = 1000):
        super().__init__()
        self.t_embed = torch.nn.Embedding(num_timesteps, width)
        self.conv_in = torch.nn.Conv2d(channels, width, 3, padding=1)
        self.conv_mid = torch.nn.Conv2d(width, width, 3, padding=1)
        self.conv_out = torch.nn.Conv2d(width, channels, 3, padding=1)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.conv_in(x) + self.t_embed(t)[:, :, None, None])  # (B, W, H, W)
        h = F.silu(self.conv_mid(h))  # (B, W, H, W)
        return self.conv_out(h)  # (B, C, H, W)


def load_digits_tensor() -> torch.Tensor:
    """scikit-learn's 8x8 digits as (N, 1, 8, 8) float32 in [-1, 1]."""
    from sklearn.datasets import load_digits

    images = torch.tensor(load_digits().images, dtype=torch.float32)
    return (images / 8.0 - 1.0).unsqueeze(1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prediction", default="epsilon", choices=("epsilon", "v_prediction"))
    args = parser.parse_args(argv)
    schedule = DDPMSchedule(1000)
    data = load_digits_tensor()
    torch.manual_seed(0)
    model_a = TinyDenoiser()
    model_b = TinyDenoiser()
    model_b.load_state_dict(model_a.state_dict())
    opt_a = torch.optim.AdamW(model_a.parameters(), lr=1e-3)
    opt_b = torch.optim.AdamW(model_b.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    for step in range(args.steps):
        idx = torch.randint(0, data.shape[0], (args.batch,), generator=gen)
        x0 = data[idx]
        t = torch.randint(0, schedule.num_timesteps, (args.batch,), generator=gen)
        noise = torch.randn(x0.shape, generator=gen)
        loss_a = diffusers_style_loss(model_a, x0, noise, t, schedule.alphas_cumprod, args.prediction)
        loss_b = fused_loss(model_b, x0, noise, t, schedule, args.prediction)
        for opt, loss in ((opt_a, loss_a), (opt_b, loss_b)):
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  diffusers-style {loss_a.item():.6f}  fused {loss_b.item():.6f}")


if __name__ == "__main__":
    main()
