"""Input checks and schedule coefficient tables shared by the fused ops."""

from __future__ import annotations

import torch

from diffcurr_fast.diffusion.ddpm import PREDICTIONS, DDPMSchedule
from diffcurr_fast.diffusion.weights import WEIGHTINGS, loss_weights
from diffcurr_fast.ops import _backend

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FLOAT_DTYPES = KERNEL_DTYPES + (torch.float64,)
REDUCTIONS = ("mean", "none")

_TABLE_CACHE: dict[tuple, tuple[object, torch.Tensor]] = {}
_TABLE_CACHE_SIZE = 64


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 inputs, float32 otherwise (statistics, coefficients and losses)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_float(x: torch.Tensor, name: str) -> None:
    """ValueError unless ``x`` is a tensor of a supported floating dtype."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} has dtype {x.dtype}; supported dtypes are {FLOAT_DTYPES}")


def check_batched(x: torch.Tensor, name: str) -> None:
    """ValueError unless ``x`` has a batch dimension (ndim >= 1)."""
    check_float(x, name)
    if x.ndim < 1:
        raise ValueError(f"{name} must have a leading batch dimension, got a 0-d tensor")


def check_like(y: torch.Tensor, x: torch.Tensor, yname: str, xname: str) -> None:
    """ValueError unless ``y`` matches ``x`` in shape, dtype and device."""
    check_float(y, yname)
    if y.shape != x.shape:
        raise ValueError(f"{yname} shape {tuple(y.shape)} does not match {xname} shape {tuple(x.shape)}")
    if y.dtype != x.dtype:
        raise ValueError(f"{yname} dtype {y.dtype} does not match {xname} dtype {x.dtype}")
    if y.device != x.device:
        raise ValueError(f"{yname} is on {y.device} but {xname} is on {x.device}")


def check_block(x: torch.Tensor, vecs: dict[str, torch.Tensor], mixed: bool = False) -> None:
    """Shapes (B, N, D) and (B, D); dtypes equal to x's, or with ``mixed`` any kernel dtype (float64 only with
    float64: it runs on the reference)."""
    check_float(x, "x")
    if x.ndim != 3:
        raise ValueError(f"x must have shape (B, N, D), got {tuple(x.shape)}")
    B, _, D = x.shape
    for name, v in vecs.items():
        check_float(v, name)
        if v.shape != (B, D):
            raise ValueError(f"{name} must have shape ({B}, {D}), got {tuple(v.shape)}")
        same = v.dtype == x.dtype or (mixed and torch.float64 not in (v.dtype, x.dtype))
        if not same or v.device != x.device:
            raise ValueError(f"{name} ({v.dtype}, {v.device}) must match x ({x.dtype}, {x.device})")


def check_eps(eps) -> float:
    """eps as a float; ValueError unless it is a positive number."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"eps must be a positive float, got {eps!r}")
    return float(eps)


def check_weight(weight: torch.Tensor | None, x: torch.Tensor, dim: int, name: str = "weight") -> None:
    """ValueError unless ``weight`` is None or a (dim,) float tensor on x's device (float64 only with float64 x)."""
    if weight is None:
        return
    check_float(weight, name)
    if weight.shape != (dim,):
        raise ValueError(f"{name} must have shape ({dim},), got {tuple(weight.shape)}")
    if weight.device != x.device or (torch.float64 in (weight.dtype, x.dtype) and weight.dtype != x.dtype):
        raise ValueError(f"{name} ({weight.dtype}, {weight.device}) must match x ({x.dtype}, {x.device})")


def sample_rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(x, batch stride) when each sample of ``x`` (B, ...) is contiguous and the samples do not overlap (e.g. the
    first C channels of a (B, 2C, H, W) output, read in place); otherwise (a contiguous copy, M)."""
    B = x.shape[0] if x.ndim else 0
    M = x.numel() // B if B else 0
    expect, rows = 1, B > 0 and M > 0
    for size, stride in zip(reversed(x.shape[1:]), reversed(x.stride()[1:])):
        rows = rows and (size == 1 or stride == expect)
        expect *= size
    if rows and (B == 1 or x.stride(0) >= M):
        return x, M if B == 1 else x.stride(0)
    return x.contiguous(), M


def per_sample(v: torch.Tensor | float, x: torch.Tensor, name: str, detach: bool = True) -> torch.Tensor:
    """Per-sample coefficient ``v`` (scalar or shape (B,)) as a contiguous compute-dtype (B,) tensor on x's device."""
    dtype = compute_dtype(x.dtype)
    batch = x.shape[0]
    if not isinstance(v, torch.Tensor):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"{name} must be a float or a ({batch},) tensor, got {type(v).__name__}")
        return torch.full((batch,), float(v), dtype=dtype, device=x.device)
    if not v.dtype.is_floating_point:
        raise ValueError(f"{name} must be a floating tensor, got dtype {v.dtype}")
    if v.device != x.device:
        raise ValueError(f"{name} is on {v.device} but the data is on {x.device}")
    if v.ndim == 0:
        v = v.expand(batch)
    if v.shape != (batch,):
        raise ValueError(f"{name} must have shape ({batch},), got {tuple(v.shape)}")
    return (v.detach() if detach else v).to(dtype).contiguous()


def alphas_cumprod(schedule: DDPMSchedule | torch.Tensor) -> torch.Tensor:
    """abar_t as a float64 CPU tensor from a ``DDPMSchedule`` or a 1-D ``alphas_cumprod`` tensor."""
    if isinstance(schedule, DDPMSchedule):
        return schedule.alphas_cumprod
    if isinstance(schedule, torch.Tensor):
        if schedule.ndim != 1 or schedule.numel() == 0 or not schedule.dtype.is_floating_point:
            raise ValueError(
                f"schedule tensor must be a non-empty 1-D floating alphas_cumprod, got shape "
                f"{tuple(schedule.shape)} dtype {schedule.dtype}"
            )
        return schedule.detach().to("cpu", torch.float64)
    raise ValueError(f"schedule must be a DDPMSchedule or a 1-D alphas_cumprod tensor, got {type(schedule).__name__}")


def num_timesteps(schedule: DDPMSchedule | torch.Tensor) -> int:
    """T of a ``DDPMSchedule`` or a 1-D ``alphas_cumprod`` tensor (no copy; the values are checked with the table)."""
    if isinstance(schedule, torch.Tensor) and schedule.ndim == 1:
        return schedule.shape[0]
    return alphas_cumprod(schedule).shape[0]


_ABAR_RANGE = "alphas_cumprod values must be finite and lie in (0, 1]"


def _check_abar(abar: torch.Tensor) -> None:
    ok = (torch.isfinite(abar) & (abar > 0) & (abar <= 1)).all()
    if torch.compiler.is_compiling():  # checked inside the graph: no host read, no graph break
        torch._assert_async(ok, _ABAR_RANGE)
    elif not bool(ok):
        raise ValueError(_ABAR_RANGE)


def _build_table(abar: torch.Tensor, kind: str, prediction: str, weighting: str, gamma: float) -> torch.Tensor:
    _check_abar(abar)
    if kind == "q_sample":  # (a, c) = (sqrt(abar), sqrt(1 - abar)), Ho et al. Eq. 4
        return torch.stack([abar.sqrt(), (1.0 - abar).sqrt()])
    # target coefficients (p, q) and weight w per timestep
    one, zero = torch.ones_like(abar), torch.zeros_like(abar)
    if prediction == "eps":
        p, q = zero, one
    elif prediction == "x0":
        p, q = one, zero
    else:  # v = sqrt(abar) eps - sqrt(1 - abar) x0 (Salimans & Ho 2022)
        p, q = -(1.0 - abar).sqrt(), abar.sqrt()
    snr = abar / (1.0 - abar)  # inf at abar = 1, handled by loss_weights
    w = loss_weights(snr, prediction, weighting, gamma, schedule=True)  # the (T,) table in timestep order
    return torch.stack([p, q, w])


def schedule_table(
    schedule: DDPMSchedule | torch.Tensor,
    kind: str,
    device: torch.device,
    dtype: torch.dtype,
    prediction: str = "eps",
    weighting: str = "none",
    gamma: float = 5.0,
) -> torch.Tensor:
    """(k, T) per-timestep coefficient table on ``device``: ``q_sample`` -> (a, c); ``loss`` -> (p, q, w).

    Built once in float64 on the CPU and cached per (schedule, device, dtype, options), so gathering by ``t``
    needs no host synchronisation; ``table.index_select(1, t)`` gathers every coefficient at once, each row a
    contiguous (B,) tensor. Under ``torch.compile(fullgraph=True)`` a ``DDPMSchedule``'s table must have
    been built by an eager call first (building validates on the host).
    """
    if prediction not in PREDICTIONS:
        raise ValueError(f"unknown prediction {prediction!r}; choose one of {PREDICTIONS}")
    if weighting not in WEIGHTINGS:
        raise ValueError(f"unknown weighting {weighting!r}; choose one of {WEIGHTINGS}")
    if isinstance(schedule, DDPMSchedule):
        # cached on the schedule object: torch.compile traces this lookup without a graph break once built
        store = getattr(schedule, "_ops_tables", None)
        if store is None:
            store = {}
            schedule._ops_tables = store
        key = (kind, prediction, weighting, float(gamma), str(device), dtype)
        table = store.get(key)
        if table is None:
            table = _build_table(schedule.alphas_cumprod, kind, prediction, weighting, gamma).to(device, dtype)
            store[key] = table
        return table
    if torch.compiler.is_compiling():  # traced into the graph, on the schedule's own device (no host round trip)
        abar = alphas_cumprod(schedule) if schedule.ndim != 1 else schedule.detach().to(torch.float64)
        return _build_table(abar, kind, prediction, weighting, gamma).to(device, dtype)
    key = (id(schedule), schedule._version, kind, prediction, weighting, float(gamma), str(device), dtype)
    hit = _TABLE_CACHE.get(key)
    if hit is not None and hit[0] is schedule:
        return hit[1]
    table = _build_table(alphas_cumprod(schedule), kind, prediction, weighting, gamma).to(device, dtype)
    if len(_TABLE_CACHE) >= _TABLE_CACHE_SIZE:
        _TABLE_CACHE.pop(next(iter(_TABLE_CACHE)))
    _TABLE_CACHE[key] = (schedule, table)
    return table


def check_timesteps(t: torch.Tensor, x: torch.Tensor, num_timesteps: int, validate: bool) -> torch.Tensor:
    """``t`` as int64 (B,) on x's device; the range check (a host sync) runs only when ``validate``."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"t must be an integer tensor of shape ({x.shape[0]},), got {type(t).__name__}")
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.is_complex():
        raise ValueError(f"t must be an integer tensor of timestep indices, got dtype {t.dtype}")
    if t.shape != (x.shape[0],):
        raise ValueError(f"t must have shape ({x.shape[0]},), got {tuple(t.shape)}")
    if t.device != x.device:
        raise ValueError(f"t is on {t.device} but the data is on {x.device}")
    if validate and not torch.compiler.is_compiling() and t.numel():
        span = torch.aminmax(t)
        lo, hi = int(span.min), int(span.max)
        if lo < 0 or hi >= num_timesteps:
            raise ValueError(f"t out of range: values must lie in [0, {num_timesteps}), got min {lo}, max {hi}")
    return t.long()


def check_reduction(reduction: str) -> None:
    """ValueError unless ``reduction`` is one of REDUCTIONS."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"unknown reduction {reduction!r}; choose one of {REDUCTIONS}")


def traced_under_compile(noise: torch.Tensor | None, backend: str | None) -> bool:
    """True under ``torch.compile`` with the noise given and the backend left to ``auto``: the op then hands
    inductor its definition (plain torch), which inductor fuses with the graph around it. In a compiled step the
    loss's input is the model's unpatchify (a permute) and its output feeds the backward: an opaque kernel makes
    inductor materialise that input first and adds two calls, so at any size it can only lose there. Philox
    noise (``seed``) stays in the kernels: traced, it would be inductor's slow CPU ``randn`` or the emulation."""
    if noise is None or not torch.compiler.is_compiling():
        return False
    return _backend.requested(backend) == "auto"


def backend_for(op: str, x: torch.Tensor, backend: str | None) -> str:
    """Resolve the backend for ``op`` on x's device; float64 data always runs on the reference."""
    name = _backend.resolve(op, x.device, backend)
    if x.dtype == torch.float64 and name != "reference":
        if backend not in (None, "auto"):
            raise ValueError(f"backend {backend!r} supports dtypes {KERNEL_DTYPES}; float64 runs on 'reference'")
        return "reference"
    return name
