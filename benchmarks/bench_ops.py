"""Benchmark the fused diffusion ops against the pure-torch reference and torch.compile(reference).

For each op and for the full loss path (seeded q_sample + loss forward + backward; the model is excluded), fp32,
B=256, x0 4x32x32 by default, providers:

- ``torch-eager``: the plain-torch training step a script writes (``torch.randn_like`` noise kept in memory),
  and ``compile(torch-eager)``;
- ``reference``: the ops' pure-torch definition (counter-based Philox noise, as every backend computes it),
  and ``compile(reference)``;
- every ops backend available on the device (``cpu`` C++ kernels, ``cuda``, ``triton`` on CUDA).

Each timing is the median with p20/p80 over repeated runs after warmup; effective GB/s counts the minimal bytes
each op must move and is shown next to the copy bandwidth measured in the same run. Rows are appended to
``benchmarks/results/ops.csv`` and ``benchmarks/results/ops.md`` is regenerated.

    python benchmarks/bench_ops.py            # full run on CPU
    python benchmarks/bench_ops.py --quick    # smoke run (small sizes, few repeats, no torch.compile)
    python benchmarks/bench_ops.py --device cuda
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

import diffcurr_fast.ops as ops  # noqa: E402
from diffcurr_fast.diffusion import DDPMSchedule  # noqa: E402
from diffcurr_fast.ops import _backend  # noqa: E402
from diffcurr_fast.ops._common import schedule_table  # noqa: E402

SEED = 20250101
PREDICTION, WEIGHTING, GAMMA = "v", "min_snr", 5.0
MODES = ("fwd", "bwd", "fwd+bwd")
# Inductor does not finish compiling the int64 Philox emulation of the reference (its index/value-range
# analysis of the 10 multiply rounds runs for many minutes), so compile(reference) is measured only for the
# ops without noise; compile(torch-eager) (noise from torch.randn_like) is the compiled baseline for those.
PHILOX_CASES = ("full_loss_path", "q_sample", "diffusion_loss", "randn", "sample_timesteps")
BUDGET_S = 15.0  # seconds per measurement: slow providers get fewer repeats (at least 3)


class Case:
    """One benchmark: ``make(provider)`` returns (forward fn taking no args -> output, or None if unsupported)."""

    def __init__(self, name: str, numel: int, bytes_per_elem: dict[str, int], modes: tuple[str, ...]):
        self.name, self.numel, self.bytes_per_elem, self.modes = name, numel, bytes_per_elem, modes


def _providers(device: torch.device, compile_ok: bool) -> list[str]:
    names = ["torch-eager", "reference"]
    if compile_ok:
        names += ["compile(torch-eager)", "compile(reference)"]
    for b in ("cuda", "triton", "cpu"):
        if _backend.unavailable_reason(b, "diffusion_loss_fwd", device) is None:
            if b == "triton" and device.type == "cpu":
                continue  # the interpreter is a correctness tool, not a fast path
            names.append(b)
    return names


def _maybe_compile(fn: Callable, provider: str) -> Callable:
    return torch.compile(fn) if provider.startswith("compile(") else fn


def _base(provider: str) -> str:
    return provider[len("compile(") : -1] if provider.startswith("compile(") else provider


def build_cases(args, device: torch.device, sched: DDPMSchedule):
    """Inputs and the per-provider forward functions of every benchmarked op."""
    B, shape = args.batch, tuple(args.shape)
    x0 = torch.randn(B, *shape, device=device)
    pred0 = torch.randn(B, *shape, device=device)
    t = torch.randint(0, sched.num_timesteps, (B,), device=device)
    qtab = schedule_table(sched, "q_sample", device, torch.float32)
    ltab = schedule_table(sched, "loss", device, torch.float32, PREDICTION, WEIGHTING, GAMMA)
    bshape = (-1,) + (1,) * len(shape)
    n = x0.numel()
    weights = torch.rand(sched.num_timesteps, device=device)
    Bn, N, D = args.block
    xb = torch.randn(Bn, N, D, device=device)
    shift, scale, gate = (torch.randn(Bn, D, device=device) * 0.1 for _ in range(3))
    yb = torch.randn(Bn, N, D, device=device)

    def q_torch(x0, t):
        ac = qtab[t]
        noise = torch.randn_like(x0)
        return ac[:, 0].view(bshape) * x0 + ac[:, 1].view(bshape) * noise, noise

    def q_ref(x0, t):
        ac = qtab[t]
        return ops.q_sample_ref(x0, ac[:, 0], ac[:, 1], None, SEED)

    def loss_torch(pred, x0, t, noise):
        pqw = ltab[t]
        tgt = pqw[:, 0].view(bshape) * x0 + pqw[:, 1].view(bshape) * noise
        return (pqw[:, 2] * (pred - tgt).square().flatten(1).mean(1)).mean()

    def loss_ref(pred, x0, t):
        pqw = ltab[t]
        return ops.diffusion_loss_ref(pred, x0, None, pqw[:, 0], pqw[:, 1], pqw[:, 2], SEED).mean()

    def full_torch(pred, x0, t):
        xt, noise = q_torch(x0, t)
        return xt, loss_torch(pred, x0, t, noise)

    def full_ref(pred, x0, t):
        return q_ref(x0, t), loss_ref(pred, x0, t)

    def full_ops(pred, x0, t, backend):
        xt = ops.q_sample(x0, t, sched, seed=SEED, backend=backend, validate=False)
        loss = ops.diffusion_loss(
            pred,
            x0,
            None,
            t,
            sched,
            prediction=PREDICTION,
            weighting=WEIGHTING,
            gamma=GAMMA,
            seed=SEED,
            backend=backend,
            validate=False,
        )
        return xt, loss

    def adaln_torch(x, shift, scale):
        xn = torch.nn.functional.layer_norm(x, (D,), eps=1e-6)
        return xn * (1 + scale[:, None, :]) + shift[:, None, :]

    def gated_torch(x, gate, y):
        return x + gate[:, None, :] * y

    def make(case: str, provider: str):
        base = _base(provider)
        if provider == "compile(reference)" and case in PHILOX_CASES:
            return None, None
        native = base not in ("torch-eager", "reference")
        if case == "randn":
            if base == "torch-eager":
                fn = lambda: torch.randn(B, *shape, device=device)
            elif base == "reference":
                fn = lambda: ops.philox_randn_ref(SEED, (B, *shape), device)
            else:
                fn = lambda: ops.philox_randn(SEED, (B, *shape), device, backend=base)
            return _maybe_compile(fn, provider), None
        if case == "q_sample":
            if native:
                return (lambda: ops.q_sample(x0, t, sched, seed=SEED, backend=base, validate=False)), None
            f = _maybe_compile(q_torch if base == "torch-eager" else q_ref, provider)
            return (lambda: f(x0, t)), None
        if case == "diffusion_loss":
            noise = torch.randn_like(x0)
            if native:
                f = lambda p: ops.diffusion_loss(
                    p,
                    x0,
                    None,
                    t,
                    sched,
                    prediction=PREDICTION,
                    weighting=WEIGHTING,
                    seed=SEED,
                    backend=base,
                    validate=False,
                )
            elif base == "torch-eager":
                g = _maybe_compile(loss_torch, provider)
                f = lambda p: g(p, x0, t, noise)
            else:
                g = _maybe_compile(loss_ref, provider)
                f = lambda p: g(p, x0, t)
            return f, "pred"
        if case == "full_loss_path":
            if native:
                f = lambda p: full_ops(p, x0, t, base)[1]
            else:
                g = _maybe_compile(full_torch if base == "torch-eager" else full_ref, provider)
                f = lambda p: g(p, x0, t)[1]
            return f, "pred"
        if case == "sample_timesteps":
            if base == "torch-eager":
                fn = lambda: torch.multinomial(weights, B, replacement=True)
            elif base == "reference":
                fn = lambda: ops.sample_timesteps_ref(weights, B, SEED)
            else:
                fn = lambda: ops.sample_timesteps(B, weights, seed=SEED, validate=False, backend=base)
            return _maybe_compile(fn, provider), None
        if case == "adaln_modulate":
            if native:
                f = lambda x: ops.adaln_modulate(x, shift, scale, backend=base)
            elif base == "torch-eager":
                f = _maybe_compile(lambda x: adaln_torch(x, shift, scale), provider)
            else:
                f = _maybe_compile(lambda x: ops.adaln_modulate_ref(x, shift, scale)[0], provider)
            return f, "x"
        if case == "gated_residual":
            if native:
                f = lambda y: ops.gated_residual(xb, gate, y, backend=base)
            elif base == "torch-eager":
                f = _maybe_compile(lambda y: gated_torch(xb, gate, y), provider)
            else:
                f = _maybe_compile(lambda y: ops.gated_residual_ref(xb, gate, y), provider)
            return f, "y"
        raise ValueError(case)

    grad_inputs = {"pred": pred0, "x": xb, "y": yb}
    nb = xb.numel()
    cases = [
        Case("full_loss_path", n, {"fwd": 5, "bwd": 2, "fwd+bwd": 7}, MODES),
        Case("q_sample", n, {"fwd": 2}, ("fwd",)),
        Case("diffusion_loss", n, {"fwd": 3, "bwd": 2, "fwd+bwd": 5}, MODES),
        Case("randn", n, {"fwd": 1}, ("fwd",)),
        Case("sample_timesteps", B, {"fwd": 0}, ("fwd",)),
        Case("adaln_modulate", nb, {"fwd": 2, "bwd": 3, "fwd+bwd": 5}, MODES),
        Case("gated_residual", nb, {"fwd": 3, "bwd": 3, "fwd+bwd": 6}, MODES),
    ]
    return cases, make, grad_inputs


def time_case(fn, grad_name, mode, grad_inputs, device, warmup, reps):
    """Per-call seconds of ``mode`` for forward ``fn`` (``grad_name`` names its differentiable input)."""
    if grad_name is None:
        return common.measure(lambda _: fn(), device=device, warmup=warmup, reps=reps, budget_s=BUDGET_S)
    leaf = grad_inputs[grad_name].detach().clone().requires_grad_()

    def forward():
        out = fn(leaf)
        return out.sum() if out.ndim else out

    if mode == "fwd":
        return common.measure(lambda _: forward(), device=device, warmup=warmup, reps=reps, budget_s=BUDGET_S)
    if mode == "bwd":

        def setup():
            leaf.grad = None
            return forward()

        return common.measure(
            lambda out: out.backward(), setup, device=device, warmup=warmup, reps=reps, budget_s=BUDGET_S
        )

    def both(_):
        leaf.grad = None
        forward().backward()

    return common.measure(both, device=device, warmup=warmup, reps=reps, budget_s=BUDGET_S)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--quick", action="store_true", help="smoke run: small sizes, few repeats")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--shape", type=int, nargs="+", default=[4, 32, 32], help="per-sample shape of x0")
    parser.add_argument("--block", type=int, nargs=3, default=[32, 256, 384], help="B N D of the DiT block ops")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--ops", nargs="*", default=None, help="subset of ops to run")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile providers")
    parser.add_argument("--compile", action="store_true", help="keep the torch.compile providers with --quick")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=common.RESULTS_DIR)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda requested but CUDA is not available")
    if args.quick:
        args.batch = min(args.batch, 16)
        args.block = [4, 64, 96]
    reps = args.reps or (5 if args.quick else 20)
    warmup = args.warmup or (2 if args.quick else 5)
    warnings.simplefilter("ignore", RuntimeWarning)

    sched = DDPMSchedule(1000)
    cases, make, grad_inputs = build_cases(args, device, sched)
    providers = _providers(device, not (args.no_compile or (args.quick and not args.compile)))
    info = common.run_info(device)
    copy_gbps = common.copy_bandwidth(device, nbytes=(32 if args.quick else 512) * 2**20)
    print(f"{info['machine']} | torch {info['torch']} | {info['git_rev']} | copy bandwidth {copy_gbps:.1f} GB/s")
    print(f"providers: {', '.join(providers)}")
    rows = []
    run_id = time.strftime("%Y%m%d-%H%M%S")
    for case in cases:
        if args.ops and case.name not in args.ops:
            continue
        for provider in providers:
            fn, grad_name = make(case.name, provider)
            if fn is None:
                print(f"  {case.name:16s} {'-':8s} {provider:22s} not measured (int64 Philox does not compile)")
                continue
            for mode in case.modes:
                try:
                    times = time_case(fn, grad_name, mode, grad_inputs, device, warmup, reps)
                except Exception as exc:  # report and keep going: one broken provider must not hide the rest
                    print(f"  {case.name:16s} {mode:8s} {provider:22s} FAILED: {type(exc).__name__}: {exc}")
                    continue
                med, p20, p80 = common.percentiles(times)
                nbytes = case.bytes_per_elem[mode] * case.numel * 4
                gbps = nbytes / med / 1e9 if nbytes else float("nan")
                row = {
                    **info,
                    "run_id": run_id,
                    "device": device.type,
                    "op": case.name,
                    "mode": mode,
                    "provider": provider,
                    "dtype": "float32",
                    "size": f"B={args.batch} x {'x'.join(map(str, args.shape))}"
                    if case.name not in ("adaln_modulate", "gated_residual")
                    else "x".join(map(str, args.block)),
                    "median_ms": f"{med * 1e3:.4f}",
                    "p20_ms": f"{p20 * 1e3:.4f}",
                    "p80_ms": f"{p80 * 1e3:.4f}",
                    "gbps": f"{gbps:.2f}" if nbytes else "",
                    "copy_gbps": f"{copy_gbps:.2f}",
                    "pct_copy": f"{100 * gbps / copy_gbps:.1f}" if nbytes else "",
                    "quick": int(args.quick),
                }
                rows.append(row)
                print(
                    f"  {case.name:16s} {mode:8s} {provider:22s} {med * 1e3:10.3f} ms "
                    f"[{p20 * 1e3:.3f}, {p80 * 1e3:.3f}]  {row['gbps'] or '-':>8} GB/s  "
                    f"{row['pct_copy'] or '-':>5}% copy"
                )
    csv_path = args.out / "ops.csv"
    common.append_csv(csv_path, rows)
    write_markdown(csv_path, args.out / "ops.md")
    _print_targets(rows)
    return 0


def _speedups(rows: list[dict[str, str]]) -> None:
    base = {(r["op"], r["mode"], r["provider"]): float(r["median_ms"]) for r in rows}
    for r in rows:
        ref = base.get((r["op"], r["mode"], "reference"))
        comp = base.get((r["op"], r["mode"], "compile(reference)"))
        eager = base.get((r["op"], r["mode"], "torch-eager"))
        me = float(r["median_ms"])
        r["x_vs_reference"] = f"{ref / me:.2f}" if ref else ""
        r["x_vs_compile(reference)"] = f"{comp / me:.2f}" if comp else ""
        r["x_vs_torch-eager"] = f"{eager / me:.2f}" if eager else ""
        ceager = base.get((r["op"], r["mode"], "compile(torch-eager)"))
        r["x_vs_compile(torch-eager)"] = f"{ceager / me:.2f}" if ceager else ""


def write_markdown(csv_path: Path, md_path: Path) -> None:
    """Regenerate ``md_path`` from the latest run of each (machine, device) in the CSV."""
    rows = common.read_csv(csv_path)
    latest: dict[tuple[str, str], str] = {}
    for r in rows:
        key = (r["machine"], r["device"])
        latest[key] = max(latest.get(key, ""), r["run_id"])
    cols = [
        "op",
        "mode",
        "provider",
        "size",
        "median_ms",
        "p20_ms",
        "p80_ms",
        "gbps",
        "pct_copy",
        "x_vs_reference",
        "x_vs_compile(reference)",
        "x_vs_torch-eager",
        "x_vs_compile(torch-eager)",
    ]
    parts = [
        "# Fused ops benchmark",
        "",
        "Generated by `benchmarks/bench_ops.py` from `ops.csv` (latest run per machine). fp32. `gbps` counts the",
        "minimal bytes each op moves; `pct_copy` relates it to the copy bandwidth measured in the same run.",
        "`reference` is the ops' pure-torch definition (counter-based Philox noise); `torch-eager` is the plain",
        "training step with `torch.randn_like` noise. `x_vs_*` are speedups (higher is better).",
        "`compile(reference)` is absent for the ops that draw Philox noise: inductor does not finish compiling the",
        "int64 Philox emulation, so `compile(torch-eager)` is the compiled baseline there.",
    ]
    for (machine, device), run_id in sorted(latest.items()):
        sel = [dict(r) for r in rows if r["machine"] == machine and r["device"] == device and r["run_id"] == run_id]
        _speedups(sel)
        first = sel[0]
        parts += [
            "",
            f"## {machine} ({device})",
            "",
            f"Run {run_id}, {first['date']}, torch {first['torch']}, git {first['git_rev']}, copy bandwidth "
            f"{first['copy_gbps']} GB/s{' (quick run)' if first.get('quick') == '1' else ''}.",
            "",
            common.markdown_table(sel, cols),
        ]
    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text("\n".join(parts) + "\n", encoding="utf-8")


def _print_targets(rows: list[dict[str, object]]) -> None:
    rows = [dict(r) for r in rows]
    _speedups(rows)
    for r in rows:
        if (
            r["op"] == "full_loss_path"
            and r["mode"] == "fwd+bwd"
            and not str(r["provider"]).startswith(("compile(", "reference", "torch-eager"))
        ):
            print(
                f"full loss path fwd+bwd, {r['provider']}: {r['x_vs_reference']}x reference, "
                f"{r['x_vs_compile(reference)'] or '-'}x compile(reference), {r['x_vs_torch-eager']}x torch-eager, "
                f"{r['x_vs_compile(torch-eager)'] or '-'}x compile(torch-eager), "
                f"{r['pct_copy']}% of copy bandwidth"
            )


if __name__ == "__main__":
    raise SystemExit(main())
