"""Compute accounting of TDC training: sampling FLOPs per image and training FLOPs, as dicts written to JSON.

Training FLOPs use the usual 3 x forward FLOPs per sample per step (forward + backward ~ 2 x forward). TDC's total
is stage 1 (the base model, ``stage1_steps``) plus stage 2 (each expert fine-tuned on its group for its steps); the
reference is one base-size model trained for the same total number of steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from diffcurr_fast._files import write_json

__all__ = ["sampling_flops", "training_flops", "visited_input_times"]


def sampling_flops(
    multi,
    base_flops: float,
    timesteps: Sequence[int] | torch.Tensor,
    *,
    cfg: bool = False,
    path: str | Path | None = None,
) -> dict[str, Any]:
    """Per-image sampling FLOPs of a ``MultiExpertDenoiser`` vs the base model at the same steps.

    Args:
        multi: the multi-expert model (its ``expert_flops()`` and routing are used).
        base_flops: the base model's per-sample forward FLOPs.
        timesteps: the network input times the sampler visits: DDPM's ORIGINAL timesteps (``arange(T)``, a
            respaced ``timestep_map``, the fractional t of the ODE samplers) or a continuous formulation's t_in.
        cfg: classifier-free guidance doubles every forward.
        path: optional JSON output.
    """
    t = torch.as_tensor(timesteps).flatten()
    t = t if t.is_floating_point() else t.long()
    if t.numel() == 0:
        raise ValueError("timesteps must be non-empty")
    if multi.input_edges is None and (float(t.min()) < 0 or float(t.max()) >= multi.num_timesteps):
        raise ValueError(f"timesteps must lie in [0, {multi.num_timesteps}), got [{int(t.min())}, {int(t.max())}]")
    if not (math.isfinite(float(base_flops)) and base_flops > 0):
        raise ValueError(f"base_flops must be a finite number > 0, got {base_flops!r}")
    per_expert = multi.expert_flops()
    gid = multi.group_index(t)
    steps_per_group = torch.bincount(gid, minlength=len(per_expert)).tolist()
    mult = 2 if cfg else 1
    multi_total = mult * sum(n * f for n, f in zip(steps_per_group, per_expert, strict=True))
    base_total = mult * t.numel() * float(base_flops)
    out = {
        "steps": int(t.numel()),
        "cfg": bool(cfg),
        "steps_per_group": steps_per_group,
        "expert_flops": per_expert,
        "base_flops_per_forward": float(base_flops),
        "multi_expert_flops_per_image": float(multi_total),
        "base_flops_per_image": float(base_total),
        "flops_ratio": float(base_total / multi_total),  # > 1: the multi-expert sampler does less work
        "saving": float(1.0 - multi_total / base_total),
    }
    if path is not None:
        write_json(out, path)
    return out


def visited_input_times(multi, run_sampler: Callable[[Callable[..., torch.Tensor]], Any]) -> torch.Tensor:
    """The network input time of every evaluation a sampler makes: ``run_sampler(model)`` samples with ``model``
    (a recorder that forwards to ``multi``); one time per call (a call evaluates one time for the whole batch)."""
    seen: list[torch.Tensor] = []

    def record(x: torch.Tensor, t: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        seen.append(t.detach().reshape(-1)[:1].cpu())
        return multi(x, t, y)

    run_sampler(record)
    if not seen:
        raise ValueError("the sampler made no network evaluation")
    return torch.cat(seen)


def training_flops(
    base_flops: float,
    expert_flops: Sequence[float],
    stage1_steps: int,
    stage2_steps: int | Sequence[int],
    batch_size: int,
    *,
    path: str | Path | None = None,
) -> dict[str, Any]:
    """TDC training FLOPs (stage 1 + stage 2) vs one base model trained for the same total steps.

    stage 1 = 3 F B S1; stage 2 = sum_i 3 F_i B S2_i; reference = 3 F B (S1 + sum_i S2_i). ``stage2_steps`` is
    one count for every expert or one per expert.
    """
    if not (math.isfinite(float(base_flops)) and base_flops > 0):
        raise ValueError(f"base_flops must be a finite number > 0, got {base_flops!r}")
    experts = [float(f) for f in expert_flops]
    if not experts or any(not (math.isfinite(f) and f > 0) for f in experts):
        raise ValueError(f"expert_flops must be a non-empty list of positive numbers, got {list(expert_flops)}")
    s2 = [stage2_steps] * len(experts) if isinstance(stage2_steps, int) else list(stage2_steps)
    if len(s2) != len(experts):
        raise ValueError(f"stage2_steps must be one int or one per expert ({len(experts)}), got {len(s2)}")
    checks = [("stage1_steps", stage1_steps), ("batch_size", batch_size)]
    checks += [(f"stage2_steps[{i}]", v) for i, v in enumerate(s2)]
    for name, v in checks:
        if isinstance(v, bool) or not isinstance(v, int) or v < (1 if name == "batch_size" else 0):
            raise ValueError(f"{name} must be a non-negative int (batch_size >= 1), got {v!r}")
    stage1 = 3.0 * base_flops * batch_size * stage1_steps
    per_expert = [3.0 * f * batch_size * s for f, s in zip(experts, s2, strict=True)]
    stage2 = sum(per_expert)
    total_steps = stage1_steps + sum(s2)
    reference = 3.0 * base_flops * batch_size * total_steps
    out = {
        "batch_size": batch_size,
        "stage1_steps": stage1_steps,
        "stage2_steps": s2,
        "total_steps": total_steps,
        "stage1_flops": stage1,
        "stage2_flops": stage2,
        "stage2_flops_per_expert": per_expert,
        "tdc_flops": stage1 + stage2,
        "single_model_flops": reference,
        "ratio": (stage1 + stage2) / reference if reference else float("nan"),
        "saving": 1.0 - (stage1 + stage2) / reference if reference else float("nan"),
    }
    if path is not None:
        write_json(out, path)
    return out
