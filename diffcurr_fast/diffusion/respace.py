"""Timestep respacing (IDDPM ``respace.py``): sample with a subset of a trained schedule's timesteps.

``space_timesteps(1000, "250")`` picks 250 evenly strided steps; ``"ddim50"`` picks the integer stride giving
exactly 50 steps; ``"10,15,20"`` splits [0, T) into three equal sections with 10, 15 and 20 steps. ``respace``
builds the shorter schedule whose cumulative alphas equal the kept ones, plus the map from new indices to the
original ones, so a network trained on the full schedule is always called with ORIGINAL timestep indices.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from diffcurr_fast.diffusion.ddpm import DDPMSchedule


def space_timesteps(num_timesteps: int, section_counts: str | int | Iterable[int]) -> list[int]:
    """Sorted original timestep indices to keep, following IDDPM's ``space_timesteps``.

    ``section_counts`` is an int, a comma-separated string of per-section counts ("250", "10,15,20"), a list of
    such counts, or "ddimN" for the DDIM-style fixed integer stride giving exactly N steps.
    """
    if not isinstance(num_timesteps, int) or num_timesteps < 1:
        raise ValueError(f"num_timesteps must be a positive int, got {num_timesteps!r}")
    if isinstance(section_counts, str):
        spec = section_counts.strip()
        if spec.startswith("ddim"):
            try:
                desired = int(spec[len("ddim") :])
            except ValueError:
                raise ValueError(f"bad respacing {section_counts!r}; expected 'ddimN' with an integer N") from None
            for stride in range(1, num_timesteps + 1):
                if len(range(0, num_timesteps, stride)) == desired:
                    return list(range(0, num_timesteps, stride))
            raise ValueError(f"cannot create exactly {desired} steps with an integer stride over {num_timesteps}")
        try:
            counts = [int(x) for x in spec.split(",")]
        except ValueError:
            raise ValueError(
                f"bad respacing {section_counts!r}; expected 'N', 'N1,N2,...' or 'ddimN' with integers"
            ) from None
    elif isinstance(section_counts, int):
        counts = [section_counts]
    else:
        counts = [int(x) for x in section_counts]
    if not counts or any(c < 1 for c in counts):
        raise ValueError(f"section counts must be positive integers, got {counts}")
    size_per, extra = divmod(num_timesteps, len(counts))
    if size_per == 0:
        raise ValueError(f"{len(counts)} sections do not fit in {num_timesteps} timesteps")
    start, steps = 0, []
    for i, count in enumerate(counts):
        size = size_per + (1 if i < extra else 0)
        if size < count:
            raise ValueError(f"cannot divide a section of {size} steps into {count} steps")
        stride = 1.0 if count <= 1 else (size - 1) / (count - 1)
        cur = 0.0
        for _ in range(count):
            steps.append(start + round(cur))
            cur += stride
        start += size
    return sorted(set(steps))


def respace(schedule: DDPMSchedule, use_timesteps: Iterable[int] | str | int) -> tuple[DDPMSchedule, torch.Tensor]:
    """Return ``(new_schedule, timestep_map)`` keeping ``use_timesteps`` of ``schedule`` (IDDPM SpacedDiffusion).

    ``use_timesteps`` is a collection of original indices or a ``space_timesteps`` spec ("250", "ddim50").
    The new betas are beta'_k = 1 - abar_{m_k} / abar_{m_{k-1}} so the new abar_k equals the original abar_{m_k};
    ``timestep_map[k] = m_k`` (int64) is the original index of new step k.
    """
    if isinstance(use_timesteps, (str, int)):
        use_timesteps = space_timesteps(schedule.num_timesteps, use_timesteps)
    keep = sorted({int(k) for k in use_timesteps})
    if not keep:
        raise ValueError("use_timesteps is empty")
    if keep[0] < 0 or keep[-1] >= schedule.num_timesteps:
        raise ValueError(f"use_timesteps must lie in [0, {schedule.num_timesteps}), got {keep[0]}..{keep[-1]}")
    abar = schedule.alphas_cumprod
    idx = torch.tensor(keep, dtype=torch.long)
    kept = abar[idx]
    prev = torch.cat([torch.ones(1, dtype=torch.float64), kept[:-1]])
    new_betas = 1.0 - kept / prev
    new = DDPMSchedule(betas=new_betas, beta_schedule=f"{schedule.beta_schedule}, respaced to {len(keep)}")
    return new, idx


class RespacedModel:
    """Call ``model(x, timestep_map[t], *args, **kwargs)``: a respaced sampler's indices mapped to the originals."""

    def __init__(self, model: Callable[..., torch.Tensor], timestep_map: torch.Tensor):
        self.model = model
        self.timestep_map = torch.as_tensor(timestep_map, dtype=torch.long)

    def __call__(self, x: torch.Tensor, t: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        t = torch.as_tensor(t)
        if t.dtype.is_floating_point or int(t.min()) < 0 or int(t.max()) >= self.timestep_map.numel():
            raise ValueError(f"respaced t must be int indices in [0, {self.timestep_map.numel()}), got {t.tolist()}")
        mapped = self.timestep_map.to(t.device)[t.long()]
        return self.model(x, mapped, *args, **kwargs)
