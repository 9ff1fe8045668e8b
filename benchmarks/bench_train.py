"""Benchmark the full training step (timesteps, forward process, DiT, loss, backward, AdamW, EMA, curriculum).

Providers, same model and batch:

- ``reference``: ``diffusion.ops_backend=reference`` (the same objective in pure torch, Philox noise in torch);
- ``fused``: the fused ops (seeded Philox q_sample, fused diffusion_loss, on-device timestep sampling);
- ``fused+compile``: the fused ops with ``torch.compile`` of the model (``--compile``).

Each row is the median step time with p20/p80 over ``--reps`` steps after ``--warmup`` steps, as images per second;
rows are appended to ``benchmarks/results/train.csv`` and ``benchmarks/results/train.md`` is regenerated.

    python benchmarks/bench_train.py                          # the demo model on CPU
    python benchmarks/bench_train.py --quick                  # smoke run
    python benchmarks/bench_train.py --device cuda --set model.preset=DiT-B/2 --set model.input_size=32 \\
        --set model.in_channels=4 --set model.num_classes=1000 --batch 256 --precision bf16 --compile
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

from diffcurr_fast.data.loader import ArrayDataset  # noqa: E402
from diffcurr_fast.train.config import load_config  # noqa: E402
from diffcurr_fast.train.loop import Trainer  # noqa: E402

COLUMNS = ["provider", "model", "batch", "precision", "device", "ms_median", "ms_p20", "ms_p80", "img_per_s",
           "machine", "date", "torch", "git_rev"]  # fmt: skip


def bench(provider: str, args: argparse.Namespace) -> dict[str, object]:
    """Time ``args.reps`` training steps of ``provider`` on random data of the configured shape."""
    with tempfile.TemporaryDirectory() as tmp:
        overrides = [
            f"checkpoint.run_dir={tmp}/run", f"data.batch_size={args.batch}", f"engine.device={args.device}",
            f"engine.precision={args.precision}",
            "diffusion.ops_backend=" + ("reference" if provider == "reference" else "auto"),
            f"engine.compile={str(provider.endswith('compile')).lower()}", "logging.progress=false",
            *args.overrides,
        ]  # fmt: skip
        cfg = load_config(args.recipe, overrides)
        m = cfg.model
        n = max(args.batch * 4, 64)
        x = torch.randn(n, m.in_channels, m.input_size, m.input_size).clamp(-1, 1)
        y = torch.randint(0, m.num_classes, (n,))
        tr = Trainer(cfg, dataset=ArrayDataset(x, y))
        batches = [next(tr.loader) for _ in range(4)]
        batches = [(a.to(tr.device), b.to(tr.device)) for a, b in batches]
        state = {"i": 0}

        def step(_):
            a, b = batches[state["i"] % len(batches)]
            state["i"] += 1
            tr.train_step(a, b)

        times = common.measure(step, device=tr.device, warmup=args.warmup, reps=args.reps)
    med, p20, p80 = common.percentiles(times)
    return {
        "provider": provider, "model": m.preset if m.preset != "custom" else f"custom-{m.hidden_size}x{m.depth}",
        "batch": args.batch, "precision": args.precision, "device": args.device, "ms_median": round(med * 1e3, 3),
        "ms_p20": round(p20 * 1e3, 3), "ms_p80": round(p80 * 1e3, 3), "img_per_s": round(args.batch / med, 1),
        **common.run_info(args.device),
    }  # fmt: skip


def compiled_step(args: argparse.Namespace) -> list[dict[str, object]]:
    """The forward of a training step (q_sample, the model, a MinSNR eps loss) under ``torch.compile(fullgraph=True)``
    with our ops against the same step with the plain-torch loss; backward and AdamW run after it, eager.

    Both providers get the same model weights, batch, timesteps and noise (drawn by the user, outside the step);
    with a learned variance only the eps half of the output enters the loss, in both. Timings are interleaved.
    """
    import copy

    import diffcurr_fast.ops as ops
    from diffcurr_fast.diffusion import DDPMSchedule
    from diffcurr_fast.train.sampling import build_model

    cfg = load_config(args.recipe, [f"data.batch_size={args.batch}", f"engine.device={args.device}", *args.overrides])
    device, m, gamma = torch.device(args.device), cfg.model, 5.0
    sched = DDPMSchedule(cfg.diffusion.num_timesteps, cfg.diffusion.beta_schedule)
    abar = sched.alphas_cumprod.float().to(device)
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(args.batch, m.in_channels, m.input_size, m.input_size, generator=g).to(device)
    noise = torch.randn(x0.shape, generator=g).to(device)
    t = torch.randint(0, abar.shape[0], (args.batch,), generator=g).to(device)
    y = torch.randint(0, m.num_classes, (args.batch,), generator=g).to(device)
    C, dims, bshape = m.in_channels, (1, 2, 3), (-1, 1, 1, 1)
    torch.manual_seed(0)
    base = build_model(cfg).to(device)

    def plain_loss(net):
        def fwd(x0, t, y, noise):
            ab = abar[t]
            xt = ab.sqrt().view(bshape) * x0 + (1 - ab).sqrt().view(bshape) * noise
            pred = net(xt, t, y)[:, :C]  # (B, C, H, W)
            snr = ab / (1 - ab)
            return (((pred - noise) ** 2).mean(dim=dims) * (torch.clamp(snr, max=gamma) / snr)).mean()

        return fwd

    def ops_loss(net):
        def fwd(x0, t, y, noise):
            xt = ops.q_sample(x0, t, sched, noise, validate=False)
            pred = net(xt, t, y)[:, :C]  # (B, C, H, W)
            kw = dict(prediction="eps", weighting="min_snr", gamma=gamma, validate=False)
            return ops.diffusion_loss(pred, x0, noise, t, sched, **kw)

        return fwd

    steps = {}
    for name, make in (("compiled step, plain-torch loss", plain_loss), ("compiled step, our ops", ops_loss)):
        net = copy.deepcopy(base)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-4, weight_decay=0.0)
        make(net)(x0, t, y, noise)  # eager once: the schedule's coefficient tables are built and cached
        fwd = torch.compile(make(net), fullgraph=True)

        def step(fwd=fwd, net=net, opt=opt):
            opt.zero_grad(set_to_none=True)
            loss = fwd(x0, t, y, noise)
            loss.backward()
            opt.step()
            return loss

        t0 = time.perf_counter()
        step()
        steps[name] = (step, time.perf_counter() - t0)
    for step, _ in steps.values():
        for _ in range(args.warmup):
            step()
    times = {name: [] for name in steps}
    for _ in range(args.reps):
        for name, (step, _) in steps.items():
            common.synchronize(device)
            t0 = time.perf_counter()
            step()
            common.synchronize(device)
            times[name].append(time.perf_counter() - t0)
    rows = []
    model = m.preset if m.preset != "custom" else f"custom-{m.hidden_size}x{m.depth}"
    plain_med = common.percentiles(times["compiled step, plain-torch loss"])[0]
    for name, ts in times.items():
        med, p20, p80 = common.percentiles(ts)
        print(f"{name:>32}: {med * 1e3:.2f} ms/step (p20 {p20 * 1e3:.2f}, p80 {p80 * 1e3:.2f}), "
              f"x{plain_med / med:.3f} the plain-torch loss, first call {steps[name][1]:.1f} s")  # fmt: skip
        rows.append({
            "provider": name, "model": model, "batch": args.batch, "precision": "fp32", "device": args.device,
            "ms_median": round(med * 1e3, 3), "ms_p20": round(p20 * 1e3, 3), "ms_p80": round(p80 * 1e3, 3),
            "img_per_s": round(args.batch / med, 1), **common.run_info(args.device),
        })  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default=None, help="YAML recipe (default: the embedded demo config)")
    p.add_argument("--set", dest="overrides", action="append", default=[], help="config override a.b=value")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--compile", action="store_true", help="also time torch.compile of the model")
    p.add_argument(
        "--compiled-step",
        action="store_true",
        help="instead: the step's forward compiled whole (fullgraph), our ops against the plain-torch loss",
    )
    p.add_argument("--quick", action="store_true", help="smoke run: few steps, no CSV")
    p.add_argument("--out", default=str(common.RESULTS_DIR / "train.csv"))
    args = p.parse_args(argv)
    if args.quick:
        args.warmup, args.reps = 1, 3
    providers = ["reference", "fused"] + (["fused+compile"] if args.compile else [])
    rows = compiled_step(args) if args.compiled_step else []
    for provider in [] if args.compiled_step else providers:
        row = bench(provider, args)
        rows.append(row)
        print(f"{provider:>14}: {row['ms_median']:.2f} ms/step (p20 {row['ms_p20']:.2f}, p80 {row['ms_p80']:.2f}), "
              f"{row['img_per_s']:.0f} img/s")  # fmt: skip
    if not args.quick:
        out = Path(args.out)
        common.append_csv(out, rows)
        out.with_suffix(".md").write_text(
            "# Training step throughput\n\n" + common.markdown_table(common.read_csv(out), COLUMNS) + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
