"""Where a training step's time goes: a profile split into op categories, FLOPs, and the in-run GEMM rate.

- ``labelled(name, fn)``: ``fn`` inside a ``record_function(name)`` range, so the profile can name a part of the
  step (``timesteps``, ``forward process``, ``ema``); torch's optimizers already open ``Optimizer.step#...``.
- ``breakdown(step, steps)``: profiles ``steps`` calls of ``step()`` and returns milliseconds per step in each
  category: GEMMs (mm / addmm / bmm / convolutions), attention (SDPA and its backward, softmax), elementwise and
  reductions, norms, copies, the fused diffusion ops, the optimizer (with clipping and zero_grad), the EMA, the
  data and timestep pipeline, the kernels of ``torch.compile``d graphs (inductor's generated code reports as
  its graph), and what no op accounts for (Python, dispatch, autograd bookkeeping).
- ``step_flops(step)``: the FLOPs of one step (``torch.utils.flop_counter``) and the list of its GEMM calls.
- ``gemm_rate(calls)``: GFLOP/s of the step's own GEMM calls (same shapes, strides and ops) run alone into
  preallocated outputs: what the machine's GEMM library reaches at these shapes, in this run.
"""

from __future__ import annotations

import functools
import time
from collections import Counter
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

CATEGORIES = (
    "gemm",
    "attention",
    "elementwise",
    "norm",
    "copy",
    "fused ops",
    "compiled kernels",
    "optimizer",
    "ema",
    "data+timesteps",
    "other ops",
    "unattributed",
)
LABELS = {"timesteps": "data+timesteps", "forward process": "data+timesteps", "ema": "ema", "clip": "optimizer"}

_GEMM = {
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "addmv",
    "mv",
    "matmul",
    "linear",
    "mkldnn_convolution",
    "convolution_backward",
    "_convolution",
    "convolution",
    "mkldnn_linear",
}
_NORM = {"native_layer_norm", "native_layer_norm_backward", "layer_norm", "native_group_norm"}
_COPY = {
    "copy_",
    "clone",
    "_to_copy",
    "contiguous",
    "cat",
    "stack",
    "_unsafe_view_copy",
    "index_select",
    "constant_pad_nd",
    "as_strided_scatter",
    "slice_backward",
    "select_backward",
    "fill_",
    "zero_",
    "zeros",
    "zeros_like",
    "empty_like",
    "new_zeros",
    "full",
    "ones_like",
    "full_like",
}
_ELEMENTWISE = {
    "gelu",
    "gelu_backward",
    "silu",
    "silu_backward",
    "mul",
    "mul_",
    "add",
    "add_",
    "sub",
    "sub_",
    "div",
    "div_",
    "neg",
    "exp",
    "log",
    "pow",
    "sqrt",
    "rsqrt",
    "tanh",
    "tanh_backward",
    "sigmoid",
    "where",
    "clamp",
    "clamp_min",
    "abs",
    "sum",
    "mean",
    "lerp_",
    "addcmul_",
    "addcdiv_",
    "maximum",
    "minimum",
    "exp_",
    "expm1",
    "log1p",
    "erf",
    "erfc",
    "square",
    "reciprocal",
    "sign",
    "lt",
    "gt",
    "ge",
    "le",
    "eq",
    "ne",
    "logical_and",
    "logical_or",
    "bitwise_and",
    "isfinite",
    "isinf",
    "isnan",
    "any",
    "all",
    "max",
    "min",
    "softplus",
    "threshold_backward",
    "relu",
    "mse_loss",
    "mse_loss_backward",
    "norm",
    "linalg_vector_norm",
    "_foreach_norm",
    "floor",
    "round",
    "cos",
    "sin",
}


def labelled(name: str, fn: Callable) -> Callable:
    """``fn`` run inside ``torch.profiler.record_function(name)``."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with torch.profiler.record_function(name):
            return fn(*args, **kwargs)

    return wrapper


def _op_category(name: str) -> str:
    base = name.split("::", 1)[1] if "::" in name else name
    ns = name.split("::", 1)[0] if "::" in name else ""
    if ns in ("diffcurr_fast", "diffcurr_fast_C") or base.startswith("diffcurr"):  # custom ops and raw kernels
        return "fused ops"
    if (
        "scaled_dot_product" in base
        or "flash_attention" in base
        or "efficient_attention" in base
        or base in ("_softmax", "_softmax_backward_data", "softmax", "_safe_softmax")
    ):
        return "attention"
    if base in _GEMM:
        return "gemm"
    if base in _NORM:
        return "norm"
    if base in _COPY:
        return "copy"
    if base in _ELEMENTWISE or base.startswith("_foreach_"):
        return "elementwise"
    return "other ops"


def _range_category(name: str) -> str | None:
    if name.startswith("Optimizer.") or name in ("clip",):
        return "optimizer"
    return LABELS.get(name)


def breakdown(step: Callable[[], object], steps: int = 2, sync: Callable[[], None] = lambda: None) -> dict[str, float]:
    """Milliseconds per step in each of ``CATEGORIES`` over ``steps`` profiled calls (plus ``total``)."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=acts) as prof:
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        wall = time.perf_counter() - t0
    out = dict.fromkeys(CATEGORIES, 0.0)
    events = prof.events()
    # Every event counts its self time: in the innermost named range around it, else in its op's category.
    for ev in events:
        cat, node = None, ev
        while node is not None:  # the innermost named range decides (optimizer, ema, timesteps)
            c = _range_category(node.name)
            if c is not None:
                cat = c
                break
            node = node.cpu_parent
        if cat is None:
            if ev.name.startswith("## Call CompiledFxGraph"):  # inductor's own kernels report as their graph
                cat = "compiled kernels"
            else:
                op = ev.name.startswith(("aten::", "diffcurr_fast::", "diffcurr_fast_C::"))
                cat = _op_category(ev.name) if op else "unattributed"
        out[cat] += ev.self_cpu_time_total / 1e3
    top_level = sum(ev.cpu_time_total for ev in events if ev.cpu_parent is None) / 1e3
    out["unattributed"] += max(wall * 1e3 - top_level, 0.0)  # Python between the ops
    out = {k: v / steps for k, v in out.items()}
    out["total"] = wall * 1e3 / steps
    return out


class _GemmRecorder(TorchDispatchMode):
    """Records (op, shapes, strides, dtype) of every GEMM call (mm, addmm, bmm)."""

    OPS = {"aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.baddbmm.default"}

    def __init__(self):
        super().__init__()
        self.calls: Counter = Counter()
        self.attention_flops = 0.0  # CPU flash attention, which the flop counter does not know

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if name.startswith("aten._scaled_dot_product_flash_attention_for_cpu"):
            q, k = (args[1], args[2]) if "backward" in name else (args[0], args[1])  # backward: (grad_out, q, k, ...)
            b, h, n, d = q.shape
            fwd = 4.0 * b * h * n * k.shape[2] * d  # q k^T and p v
            self.attention_flops += 2 * fwd if "backward" in name else fwd  # dV, dP, dQ, dK
        if str(func) in self.OPS:
            sig = tuple(
                (tuple(a.shape), tuple(a.stride()), a.dtype, a.device.type) if isinstance(a, torch.Tensor) else a
                for a in args
            )
            self.calls[(str(func), sig, tuple(sorted(kwargs.items())))] += 1
        return func(*args, **kwargs)


def step_flops(step: Callable[[], object]) -> tuple[float, dict[str, float], Counter]:
    """(total FLOPs of one ``step()``, FLOPs per op, Counter of its GEMM calls)."""
    rec = _GemmRecorder()
    counter = FlopCounterMode(display=False)
    with counter, rec:
        step()
    per_op = {str(k): float(v) for k, v in counter.get_flop_counts().get("Global", {}).items()}
    if rec.attention_flops and not any("scaled_dot_product" in k for k in per_op):
        per_op["attention (counted here)"] = rec.attention_flops
    return float(sum(per_op.values())), per_op, rec.calls


def _gemm_flops(op: str, sig: tuple) -> float:
    if op == "aten.mm.default":
        (m, k), (_, n) = sig[0][0], sig[1][0]
        return 2.0 * m * k * n
    if op == "aten.addmm.default":
        (m, k), (_, n) = sig[1][0], sig[2][0]
        return 2.0 * m * k * n
    if op in ("aten.bmm.default", "aten.baddbmm.default"):
        a, b = (sig[0][0], sig[1][0]) if op == "aten.bmm.default" else (sig[1][0], sig[2][0])
        return 2.0 * a[0] * a[1] * a[2] * b[2]
    return 0.0


def _materialize(spec, device):
    if isinstance(spec, tuple) and len(spec) == 4 and isinstance(spec[2], torch.dtype):
        shape, stride, dtype, _ = spec
        size = 1 + sum((s - 1) * st for s, st in zip(shape, stride)) if all(shape) else 0
        return torch.randn(size, dtype=dtype, device=device).as_strided(shape, stride)
    return spec


def gemm_rate(
    calls: Counter, device: torch.device | str = "cpu", reps: int = 3, sync: Callable[[], None] = lambda: None
) -> tuple[float, float]:
    """(GFLOP/s, GEMM FLOPs) of the step's GEMM calls run alone (same shapes / strides) into preallocated outputs."""
    total_flops, total_s = 0.0, 0.0
    for (op, sig, kw), count in calls.items():
        args = [_materialize(s, device) for s in sig]
        kwargs = dict(kw)
        name = op.split(".")[1]
        fn = getattr(torch, name)
        out = fn(*args, **kwargs)  # warm-up, and the output buffer
        times = []
        for _ in range(reps):
            sync()
            t0 = time.perf_counter()
            fn(*args, **kwargs, out=out)
            sync()
            times.append(time.perf_counter() - t0)
        total_flops += _gemm_flops(op, sig) * count
        total_s += sorted(times)[len(times) // 2] * count
    return (total_flops / total_s / 1e9 if total_s else float("nan")), total_flops


def format_breakdown(
    name: str, br: dict[str, float], flops: float, rate: float, gemm_flops: float, step_ms: float
) -> str:
    """A few printed lines: ms and share per category (of the profiled step), the GEMMs' rate inside the step,
    and the achieved GFLOP/s of the timed step (``step_ms``) as a fraction of the in-run GEMM rate."""
    total = br["total"]
    parts = [f"{c} {br[c]:.1f} ms ({100 * br[c] / total:.1f}%)" for c in CATEGORIES]
    achieved = flops / (step_ms / 1e3) / 1e9
    limit_ms = flops / (rate * 1e9) * 1e3
    inside = gemm_flops / (br["gemm"] / 1e3) / 1e9 if br["gemm"] else float("nan")
    return (
        f"{name}: {flops / 1e9:.1f} GFLOP/step, {achieved:.1f} GFLOP/s achieved = {achieved / rate:.2f} of the "
        f"in-run GEMM rate {rate:.1f} GFLOP/s (limit {limit_ms:.0f} ms/step, {step_ms / limit_ms:.2f}x away); "
        f"GEMMs inside the step {inside:.1f} GFLOP/s\n  profiled {total:.1f} ms/step: " + ", ".join(parts)
    )
