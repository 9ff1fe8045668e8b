"""``diffcurr-fast info [--check]``: what this installation can run, and a self-check of every fused op.

The report (like DeepSpeed's ``ds_report`` or ``python -m xformers.info``): versions of the libraries the
product uses, the devices, the attention and optimizer implementations, and for every fused op and device which
backends are available and, for each one that is not, why. ``--check`` runs every op on every available
backend of every device against the float64 reference (outputs and gradients, two shapes, fp32 and bf16) and
exits non-zero on any mismatch.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import os
import platform
import sys
import time
import warnings
from collections.abc import Callable

import torch

from diffcurr_fast import __version__, ops
from diffcurr_fast.models.attention import available_backends, flash_attn_reason
from diffcurr_fast.models.modern import rope2d_tables
from diffcurr_fast.ops import _backend
from diffcurr_fast.optim.adamw import apex_fused_adam

# public op -> the name its backends are registered under (diffcurr_fast.ops._backend)
OPS = {
    "philox_randn": "randn_like",
    "q_sample": "q_sample",
    "diffusion_loss": "diffusion_loss_fwd",
    "sample_timesteps": "sample_timesteps",
    "adaln_modulate": "adaln_modulate_fwd",
    "gated_residual": "gated_residual_fwd",
    "rmsnorm_modulate": "rmsnorm_modulate_fwd",
    "qk_norm_rope": "qk_norm_rope_fwd",
    "swiglu": "swiglu_fwd",
    "token_gather": "token_gather",
    "token_scatter": "token_scatter",
}
PACKAGES = {  # name shown -> distribution names tried
    "torch": ("torch",),
    "triton": ("triton",),
    "flash-attn": ("flash-attn", "flash_attn"),
    "nvidia-dali": ("nvidia-dali-cuda130", "nvidia-dali-cuda120", "nvidia-dali-cuda110", "nvidia-dali"),
    "deepspeed": ("deepspeed",),
    "numpy": ("numpy",),
    "nvidia-ml-py": ("nvidia-ml-py",),
    "schedulefree": ("schedulefree",),
}


def _version(names: tuple[str, ...]) -> str | None:
    for name in names:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            continue
    return None


def versions() -> dict[str, str]:
    """Library versions (``-`` when absent); NVIDIA apex only when it is NVIDIA's (has FusedAdam)."""
    out = {"python": platform.python_version(), "diffcurr_fast": _pkg_version()}
    for shown, names in PACKAGES.items():
        out[shown] = _version(names) or "-"
    out["torch CUDA"] = torch.version.cuda or "- (CPU build)"
    out["NVIDIA apex"] = (_version(("apex",)) or "installed") if apex_fused_adam() is not None else "-"
    return out


def _pkg_version() -> str:
    return __version__


def devices() -> list[torch.device]:
    """The CPU and every visible CUDA device."""
    out = [torch.device("cpu")]
    if torch.cuda.is_available():
        out += [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return out


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        mem = p.total_memory / 2**30
        return f"{device}: {p.name}, sm_{p.major}{p.minor}, {mem:.0f} GiB, {p.multi_processor_count} SMs"
    line = f"cpu: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    isa = _backend.cpu_isa()
    if isa is not None:  # DIFFCURR_CPU_ISA forces one of the supported sets
        line += f", C++ kernels {isa} (supported here: {', '.join(_backend.cpu_isas())})"
    return line


def backend_table() -> list[tuple[str, str, str, str]]:
    """(device, op, backend, 'available' or the reason it is not) for every op, device and backend."""
    rows = []
    for device in devices():
        for op, reg in OPS.items():
            for b in _backend.BACKENDS:
                reason = _backend.unavailable_reason(b, reg, device)
                rows.append((str(device), op, b, "available" if reason is None else f"no: {reason}"))
    return rows


def selected_backends() -> tuple[str, list[tuple[str, str, str]]]:
    """What a run would use for each op called without a backend argument, under ``DIFFCURR_OPS_BACKEND`` (or
    auto): (the request, rows (device, op, backend or why it cannot run))."""
    try:
        name = _backend.requested(None)
    except ValueError as exc:
        return f"{_backend.ENV_VAR} is invalid: {exc}", []
    rows = []
    for device in devices():
        for op, reg in OPS.items():
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # auto's fallback warning: the table says it
                    rows.append((str(device), op, _backend.resolve(reg, device)))
            except RuntimeError:
                rows.append((str(device), op, f"none: {_backend.unavailable_reason(name, reg, device)}"))
    src = f"{_backend.ENV_VAR}={name}" if _backend.ENV_VAR in os.environ else f"auto ({_backend.ENV_VAR} unset)"
    return src, rows


def implementations() -> dict[str, str]:
    """Attention backends and the AdamW implementation the trainer would use."""
    reason = flash_attn_reason()
    return {
        "attention": ", ".join(available_backends()) + ("" if reason is None else f" (flash_attn: {reason})"),
        "optim.impl=auto": "torch AdamW (fused=True on CUDA)",
        "optim.impl=apex": "available" if apex_fused_adam() is not None else "unavailable: NVIDIA apex not installed",
    }


# ---- self-check -------------------------------------------------------------------------------------------
_SCHEDULE = torch.linspace(0.9999, 0.02, 1000, dtype=torch.float64)  # alphas_cumprod, decreasing


def _close(got: torch.Tensor, want: torch.Tensor, tol: float) -> float:
    """Largest |got - want| / (tol * (1 + |want|)); <= 1 passes."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    if got.shape != want.shape:
        return float("inf")
    if got.numel() == 0:
        return 0.0
    return float(((got - want).abs() / (tol * (1 + want.abs()))).max())


def _run(fn: Callable, args: list[torch.Tensor], grad_out: torch.Tensor | None):
    """fn(*args) and the gradients of <out, grad_out> w.r.t. the floating args (None without grad_out)."""
    leaves = [a.detach().requires_grad_(grad_out is not None and a.dtype.is_floating_point) for a in args]
    out = fn(*leaves)
    if grad_out is None:
        return out, []
    out = out[0] if isinstance(out, tuple) else out
    (out.double() * grad_out.double()).sum().backward()
    return out, [a.grad if a.grad is not None else torch.zeros_like(a) for a in leaves if a.requires_grad]


def _cases(device: torch.device, dtype: torch.dtype, backend: str):
    """(op, shape label, fn(backend) -> callable, args, grad_out) of the check; args on ``device``."""
    g = torch.Generator().manual_seed(0)

    def r(*shape, dt=dtype):
        return torch.randn(*shape, generator=g).to(device, dt)

    for shape in ((3, 4, 5, 7), (2, 4, 16, 16)):
        B = shape[0]
        t = torch.randint(0, 1000, (B,), generator=g).to(device)
        yield ("philox_randn", shape, lambda b, s=shape: lambda: ops.philox_randn(7, s, device, backend=b), [], None)
        yield (
            "q_sample",
            shape,
            lambda b, t=t: lambda x0: ops.q_sample(x0, t, _SCHEDULE, seed=11, backend=b, validate=False),
            [r(*shape)],
            r(*shape, dt=torch.float32),
        )
        yield (
            "diffusion_loss",
            shape,
            lambda b, t=t: (
                lambda pred, x0: ops.diffusion_loss(
                    pred,
                    x0,
                    None,
                    t,
                    _SCHEDULE,
                    seed=11,
                    prediction="v",
                    weighting="min_snr",
                    reduction="none",
                    backend=b,
                    validate=False,
                )
            ),
            [r(*shape), r(*shape)],
            r(B, dt=torch.float32),
        )
    for B, N, D in ((2, 7, 24), (3, 16, 72)):
        yield (
            "adaln_modulate",
            (B, N, D),
            lambda b: lambda x, sh, sc: ops.adaln_modulate(x, sh, sc, backend=b),
            [r(B, N, D), r(B, D), r(B, D)],
            r(B, N, D, dt=torch.float32),
        )
        yield (
            "gated_residual",
            (B, N, D),
            lambda b: lambda x, gt, y: ops.gated_residual(x, gt, y, backend=b),
            [r(B, N, D), r(B, D), r(B, N, D)],
            r(B, N, D, dt=torch.float32),
        )
    for B, N, D in ((2, 7, 24), (3, 16, 72)):  # the modern block: RMSNorm-modulate with its weight, SwiGLU
        yield (
            "rmsnorm_modulate",
            (B, N, D),
            lambda b: lambda x, sh, sc, w: ops.rmsnorm_modulate(x, sh, sc, w, backend=b),
            [r(B, N, D), r(B, D), r(B, D), 1 + 0.1 * r(D, dt=torch.float32)],
            r(B, N, D, dt=torch.float32),
        )
        yield ("swiglu", (B, N, 2 * D), lambda b: lambda x: ops.swiglu(x, backend=b), [r(B, N, 2 * D)], r(B, N, D))
    for B, grid, heads, dh in ((2, 3, 2, 12), (3, 4, 3, 16)):  # QK-norm + 2-D RoPE of a grid x grid token map
        yield (
            "qk_norm_rope",
            (B, grid * grid, 3 * heads * dh),
            lambda b, g=grid, h=heads, d=dh: (
                lambda qkv, wq, wk: torch.cat(
                    [o.flatten() for o in ops.qk_norm_rope(qkv, h, wq, wk, *_tables(g, d, qkv), backend=b)]
                )
            ),
            [r(B, grid * grid, 3 * heads * dh), 1 + 0.1 * r(dh, dt=torch.float32), 1 + 0.1 * r(dh, dt=torch.float32)],
            r(3 * B * grid * grid * heads * dh, dt=torch.float32),
        )
    for B, T, K, D in ((2, 7, 3, 24), (3, 16, 8, 72)):  # token routing: K of T tokens, unsorted
        idx = torch.stack([torch.randperm(T, generator=g)[:K] for _ in range(B)]).to(device)
        yield (
            "token_gather",
            (B, T, K, D),
            lambda b, idx=idx: lambda x: ops.token_gather(x, idx, backend=b),
            [r(B, T, D)],
            r(B, K, D, dt=torch.float32),
        )
        yield (
            "token_scatter",
            (B, T, K, D),
            lambda b, idx=idx: lambda base, src: ops.token_scatter(base, idx, src, backend=b),
            [r(B, T, D), r(B, K, D)],
            r(B, T, D, dt=torch.float32),
        )
    w = torch.rand(1000, generator=g, dtype=torch.float64).to(device) * (torch.arange(1000, device=device) % 3 > 0)
    yield (
        "sample_timesteps",
        (4099,),
        lambda b: lambda: ops.sample_timesteps(4099, w, seed=5, return_importance=True, backend=b, validate=False),
        [],
        None,
    )


def _tables(grid: int, head_dim: int, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 2-D rotary tables the modern block uses (float64 for the float64 reference, float32 otherwise)."""
    dtype = torch.float64 if qkv.dtype == torch.float64 else torch.float32
    return rope2d_tables(grid, head_dim, dtype=dtype, device=qkv.device)


def _compare(op, got, want, ggot, gwant, tol) -> float:
    if op == "sample_timesteps":
        (t1, i1), (t2, i2) = got, want
        return 0.0 if torch.equal(t1.cpu(), t2.cpu()) and _close(i1, i2, 1e-5) <= 1 else float("inf")
    err = _close(got, want, tol)
    for a, b in zip(ggot, gwant):
        err = max(err, _close(a, b, tol))
    return err


def check(device_filter: str | None = None) -> tuple[list[tuple], bool]:
    """Run every op on every available non-reference backend of every device against the float64 reference.

    Returns (rows (device, op, backend, dtype, shapes, max error / tolerance, status), all passed)."""
    rows, ok = [], True
    for device in devices():
        if device_filter and not str(device).startswith(device_filter):
            continue
        for op, reg in OPS.items():
            for backend in _backend.BACKENDS:
                if backend == "reference" or _backend.unavailable_reason(backend, reg, device) is not None:
                    continue
                for dtype in (torch.float32, torch.bfloat16):
                    if op in ("philox_randn", "sample_timesteps") and dtype != torch.float32:
                        continue  # float32 / index outputs whatever the data dtype
                    if backend == "triton" and device.type == "cpu" and dtype == torch.bfloat16:
                        rows.append((str(device), op, backend, "bf16", "-", "-", "skipped: interpreter has no bf16"))
                        continue
                    tol = 2e-4 if dtype == torch.float32 else 4e-2
                    worst, shapes, status, t0 = 0.0, [], "ok", time.perf_counter()
                    for name, shape, make, args, grad_out in _cases(device, dtype, backend):
                        if name != op:
                            continue
                        shapes.append("x".join(map(str, shape)))
                        try:
                            got, ggot = _run(make(backend), args, grad_out)
                            ref_args = [a.double() if a.dtype.is_floating_point else a for a in args]
                            want, gwant = _run(make("reference"), ref_args, grad_out)
                            worst = max(worst, _compare(op, got, want, ggot, gwant, tol))
                        except Exception as exc:  # a crash is a failed check, reported in the table
                            status = f"ERROR {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                            worst = float("inf")
                    if status == "ok" and not worst <= 1.0:
                        status = "MISMATCH"
                    ok = ok and status == "ok"
                    dt = "fp32" if dtype == torch.float32 else "bf16"
                    took = f"{status} ({time.perf_counter() - t0:.2f} s)"
                    rows.append((str(device), op, backend, dt, ",".join(shapes), f"{worst:.3g}", took))
    return rows, ok


def _table(header: tuple[str, ...], rows: list[tuple]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda r: "  ".join(str(x).ljust(w) for x, w in zip(r, widths)).rstrip()
    return "\n".join([line(header), line(tuple("-" * w for w in widths)), *(line(r) for r in rows)])


def report() -> str:
    parts = ["diffcurr-fast info", "", "versions:"]
    parts += [f"  {k}: {v}" for k, v in versions().items()]
    parts += ["", "devices:"] + [f"  {describe_device(d)}" for d in devices()]
    parts += ["", "implementations:"] + [f"  {k}: {v}" for k, v in implementations().items()]
    parts += ["", "fused op backends:", _table(("device", "op", "backend", "status"), backend_table())]
    src, rows = selected_backends()
    parts += ["", f"backends a run uses (ops without a backend argument; {src}):"]
    if rows:
        parts.append(_table(("device", "op", "uses"), rows))
    return "\n".join(parts)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--check",
        action="store_true",
        help="run every op on every available backend against "
        "the float64 reference (outputs and gradients); exit 1 on a mismatch",
    )
    parser.add_argument("--device", default=None, help="check only devices whose name starts with this (cpu, cuda)")


def run(args: argparse.Namespace) -> int:
    print(report())
    if not args.check:
        return 0
    t0 = time.perf_counter()
    rows, ok = check(args.device)
    header = ("device", "op", "backend", "dtype", "shapes", "err/tol", "status")
    print("\nself-check against the float64 reference (err/tol <= 1 passes):")
    print(_table(header, rows))
    print(f"\nself-check: {'all passed' if ok else 'FAILED'} ({len(rows)} rows, {time.perf_counter() - t0:.1f} s)")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="diffcurr-fast info", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
