"""Benchmark the full training step (timesteps, forward process, DiT, loss, backward, AdamW, EMA, curriculum).

Providers, same model and batch:

- ``reference``: ``diffusion.ops_backend=reference`` (the same objective in pure torch, Philox noise in torch);
- ``fused``: the fused ops (seeded Philox q_sample, fused diffusion_loss, on-device timestep sampling);
- ``fused+compile``: the fused ops with ``torch.compile`` of the model (``--compile``);
- ``fused+graphs``: the fused ops with ``engine.cuda_graphs`` (on CUDA the model compiled with mode
  reduce-overhead, its forward and backward replayed as CUDA graphs; on CPU the device-side step alone);
- ``fused+routed``: the fused ops with token routing (``models/routing.py``) at ``--routing [KIND,]KEEP,START,END``
  (KIND tread, the default, or sprint; default 0.5,2,-2: half the tokens through blocks 2 to depth - 2; SPRINT's
  fusion layer is not in the FLOP count); its row names the setting, and it has two
  FLOP rates: ``model_tflop_s`` / ``mfu_pct`` count the full model's FLOPs (what the unrouted step does: the rate
  at which the routed step gets through the model's work), ``step_tflop_s`` / ``step_mfu_pct`` the fewer FLOPs the
  routed step does (how busy the device is);
- ``official`` (``--peer-dit PATH``): the official DiT step (facebookresearch/DiT ``models.py``, its IDDPM
  ``training_losses``, AdamW(lr=1e-4, weight_decay=0) and ``update_ema``, as its ``train.py`` runs them), imported
  from the checkout at PATH (timm's three layers stubbed when timm is missing, see ``peer_dit.py``), at the
  same model (a DiT preset, or the official ``DiT`` class built with a custom model's sizes).
  ``official+malloc`` is the same step with the host allocator setting our trainer applies
  (``engine.retain_host_memory``), to show what that setting alone buys.

Each provider runs in its own process (``--isolate``, the default with several providers), so one provider's
allocator and thread-pool state cannot help or hurt the next. Each row is the median step time with p20/p80 over
``--reps`` steps after ``--warmup`` steps, as images per second; rows are appended to
``benchmarks/results/train.csv`` and ``benchmarks/results/train.md`` is regenerated.

``--peak-tflops`` (the device's peak rate at the step's precision) adds the model FLOP rate (3x the DiT's analytic
forward FLOPs, ``tdc.flops``, per median step) and the MFU to our providers' rows. Each provider's row is written
as soon as it is measured.

``--profile`` adds a breakdown per provider (``step_breakdown.py``): milliseconds and share per step of the GEMMs,
attention, elementwise ops, norms, copies, the fused ops, the optimizer, the EMA, the data and timestep pipeline
and unattributed time (Python and dispatch), the page faults per step, the FLOPs per step, the achieved GFLOP/s,
and that as a fraction of the GEMM rate measured in the same run at the step's own GEMM shapes.

    python benchmarks/bench_train.py                          # the demo model on CPU
    python benchmarks/bench_train.py --quick                  # smoke run
    python benchmarks/bench_train.py --recipe dit_b2_vanilla --set model.preset=DiT-S/2 --precision fp32 \\
        --batch 16 --peer-dit PATH/TO/DiT --profile           # DiT-S/2 against the official step
    python benchmarks/bench_train.py --device cuda --set model.preset=DiT-B/2 --set model.input_size=32 \\
        --set model.in_channels=4 --set model.num_classes=1000 --batch 256 --precision bf16 --compile
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import step_breakdown as sb  # noqa: E402

from diffcurr_fast.data.loader import ArrayDataset  # noqa: E402
from diffcurr_fast.models.routing import RoutingOptions, kept_tokens  # noqa: E402
from diffcurr_fast.runs.recipes import load_config  # noqa: E402
from diffcurr_fast.tdc.flops import dit_flops  # noqa: E402

COLUMNS = [
    "provider",
    "model",
    "batch",
    "precision",
    "device",
    "ms_median",
    "ms_p20",
    "ms_p80",
    "img_per_s",
    "model_tflop_s",
    "mfu_pct",
    "step_tflop_s",
    "step_mfu_pct",
    "machine",
    "date",
    "torch",
    "git_rev",
]
PROVIDERS = ("reference", "fused", "fused+compile", "fused+graphs", "fused+routed", "official", "official+malloc")


def _route(args: argparse.Namespace) -> tuple[str, float, int, int]:
    """``--routing [KIND,]KEEP,START,END`` as (kind, keep, start, end); KIND tread (default) or sprint."""
    parts = args.routing.split(",")
    kind = parts.pop(0) if parts[0] in ("tread", "sprint") else "tread"
    try:
        keep, start, end = parts
        return kind, float(keep), int(start), int(end)
    except ValueError:
        raise SystemExit(f"--routing {args.routing!r}: expected [tread|sprint,]KEEP,START,END, e.g. 0.5,2,-2") from None


def _routing(args: argparse.Namespace) -> list[str]:
    """The overrides of ``--routing`` (END < 0: counted from the model's depth)."""
    kind, keep, start, end = _route(args)
    sets = [f"model.routing={kind}", f"model.routing_keep={keep}", f"model.routing_start={start}"]
    return sets + ([f"model.routing_end={end}"] if end > 0 else [])


def _variant(args: argparse.Namespace, provider: str) -> list[str] | None:
    """The overrides of a ``--variant`` provider (``fused@I``: the I-th ``--variant``), None for the others."""
    if "@" not in provider:
        return None
    return [s.strip() for s in args.variants[int(provider.split("@")[1])].split(";") if s.strip()]


def _config(provider: str, args: argparse.Namespace, run_dir: str):
    overrides = [
        f"checkpoint.run_dir={run_dir}",
        f"data.batch_size={args.batch}",
        f"engine.device={args.device}",
        f"engine.precision={args.precision}",
        "diffusion.ops_backend=" + ("reference" if provider == "reference" else "auto"),
        f"engine.compile={str(provider.endswith('compile')).lower()}",
        f"engine.cuda_graphs={str(provider.endswith('graphs')).lower()}",
        "logging.progress=false",
        "data.dataset=digits",
        "data.path=",
        "data.num_workers=0",  # random data of the model's shape is passed in
        "optim.name=adamw",  # the plain step is AdamW's, whatever the recipe ships; a --set or --variant changes it
        *args.overrides,
        *(_routing(args) if "routed" in provider else []),
        *(_variant(args, provider) or []),
    ]
    cfg = load_config(args.recipe, overrides)
    if "routed" in provider and _route(args)[3] < 0:
        cfg = load_config(args.recipe, [*overrides, f"model.routing_end={cfg.model.depth + _route(args)[3]}"])
    return cfg


def _ours(provider: str, args: argparse.Namespace, tmp: str, profile: bool):
    """(step(), device, model name, labels applied) of our Trainer on random data of the configured shape."""
    import diffcurr_fast.objective as objective_mod
    import diffcurr_fast.train.loop as loop_mod
    from diffcurr_fast.train.loop import Trainer

    cfg = _config(provider, args, f"{tmp}/run")
    m = cfg.model
    if profile:  # name the parts of the step in the profile (the timed runs are not wrapped)
        loop_mod.sample_timesteps = sb.labelled("timesteps", loop_mod.sample_timesteps)
        loop_mod.draw_seed = sb.labelled("timesteps", loop_mod.draw_seed)
        objective_mod.q_sample_coef = sb.labelled("forward process", objective_mod.q_sample_coef)
    n = max(args.batch * 4, 64)
    x = torch.randn(n, m.in_channels, m.input_size, m.input_size).clamp(-1, 1)
    y = torch.randint(0, m.num_classes, (n,))
    tr = Trainer(cfg, dataset=ArrayDataset(x, y))
    if profile:
        tr.ema.update = sb.labelled("ema", tr.ema.update)
        tr.objective.draw = sb.labelled("timesteps", tr.objective.draw)
        tr.engine.clip_grad_norm = sb.labelled("clip", tr.engine.clip_grad_norm)
    batches = [next(tr.loader) for _ in range(4)]
    batches = [(a.to(tr.device), b.to(tr.device)) for a, b in batches]
    state = {"i": 0}

    def step():
        a, b = batches[state["i"] % len(batches)]
        state["i"] += 1
        tr.train_step(a, b)

    name = _label(cfg)
    step.model_flops = 3 * dit_flops(tr.model, args.batch)  # forward + backward (2x the forward)
    route = None
    if m.routing != "none":  # the FLOPs the routed step does: the span's blocks on the kept tokens
        tokens = (m.input_size // m.patch_size) ** 2
        route = (kept_tokens(tokens, m.routing_keep), *RoutingOptions.of(m).span(m.depth))
    step.step_flops = 3 * dit_flops(tr.model, args.batch, route)
    return step, tr.device, name


def _model_name(m) -> str:
    """The preset, or ``custom-WIDTHxDEPTH/PATCH on CxSxS``."""
    if m.preset != "custom":
        return m.preset
    return f"custom-{m.hidden_size}x{m.depth}/{m.patch_size} on {m.in_channels}x{m.input_size}x{m.input_size}"


def _label(cfg) -> str:
    """The row's model name (``_model_name``), then what differs from the plain DiT step: the routing with its
    share and span, the block options, the training terms and the optimizer."""
    m = cfg.model
    name = _model_name(m)
    if m.routing != "none":
        start, end = RoutingOptions.of(m).span(m.depth)
        name += f" {m.routing} keep {m.routing_keep:g} blocks [{start},{end})"
    options = {"norm": "layernorm", "qk_norm": False, "mlp": "gelu", "pos": "sincos"}
    changed = [k if isinstance(v, bool) else str(getattr(m, k)) for k, v in options.items() if getattr(m, k) != v]
    terms = list(cfg.terms.use) + (["immiscible"] if cfg.terms.immiscible else [])
    optim = [] if cfg.optim.name == "adamw" else [f"optim {cfg.optim.name}"]
    return " ".join([name, *changed, *(f"+{t}" for t in terms), *optim])


def _official(provider: str, args: argparse.Namespace, profile: bool):
    """(step(), device, model name) of the official DiT step (``peer_dit.official_step``)."""
    import peer_dit

    cfg = _config("fused", args, "unused")
    m, e = cfg.model, cfg.engine
    if args.precision != "fp32":
        raise SystemExit("the official provider runs fp32 only (its train.py has no autocast)")
    if provider == "official+malloc":
        from diffcurr_fast.train.host_memory import retain_host_memory

        retain_host_memory()
    if args.device == "cpu" and e.cpu_threads > 0:
        torch.set_num_threads(e.cpu_threads)
    device = torch.device(args.device)
    step_fn, info = peer_dit.official_step(
        args.peer_dit,
        preset=m.preset,
        input_size=m.input_size,
        in_channels=m.in_channels,
        num_classes=m.num_classes,
        seed=e.seed,
        label=sb.labelled if profile else None,
        dims=peer_dit.official_dims(m) if m.preset == "custom" else None,
    )
    info["model"].to(device)
    g = torch.Generator().manual_seed(0)
    batches = [
        (
            torch.randn(args.batch, m.in_channels, m.input_size, m.input_size, generator=g).to(device),
            torch.randint(0, m.num_classes, (args.batch,), generator=g).to(device),
        )
        for _ in range(4)
    ]
    state = {"i": 0}

    def step():
        a, b = batches[state["i"] % len(batches)]
        state["i"] += 1
        step_fn(a, b)

    if info["timm_stubbed"]:
        print(
            "official: timm is not installed; its PatchEmbed / Attention / Mlp are stubbed (peer_dit.py)",
            file=sys.stderr,
        )
    return step, device, _model_name(m)  # the official step has no routing, block options or terms


def bench(provider: str, args: argparse.Namespace) -> dict[str, object]:
    """Time ``args.reps`` training steps of ``provider``; with ``--profile`` also its breakdown."""
    with tempfile.TemporaryDirectory() as tmp:
        if provider.startswith("official"):
            step, device, model = _official(provider, args, args.profile)
        else:
            step, device, model = _ours(provider, args, tmp, args.profile)
        sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
        faults = []

        def timed(_):
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            step()
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)

        times = common.measure(timed, device=device, warmup=args.warmup, reps=args.reps)
        med, p20, p80 = common.percentiles(times)
        row = {
            "provider": provider,
            "model": model,
            "batch": args.batch,
            "precision": args.precision,
            "device": args.device,
            "ms_median": round(med * 1e3, 3),
            "ms_p20": round(p20 * 1e3, 3),
            "ms_p80": round(p80 * 1e3, 3),
            "img_per_s": round(args.batch / med, 1),
            **common.run_info(args.device),
        }
        flops = getattr(step, "model_flops", None)  # the DiT's analytic matmul FLOPs (tdc.flops), ours only
        row["model_tflop_s"] = round(flops / med / 1e12, 3) if flops else ""
        row["mfu_pct"] = round(100 * flops / med / 1e12 / args.peak_tflops, 2) if flops and args.peak_tflops else ""
        done = getattr(step, "step_flops", None)  # what the step does: fewer than the model's when routed
        row["step_tflop_s"] = round(done / med / 1e12, 3) if done else ""
        row["step_mfu_pct"] = round(100 * done / med / 1e12 / args.peak_tflops, 2) if done and args.peak_tflops else ""
        extra = {"faults_per_step": sorted(faults[args.warmup :])[len(faults[args.warmup :]) // 2]}
        if args.profile:
            extra["breakdown"] = sb.breakdown(step, args.profile_steps, sync)  # first: after a dispatch mode
            flops, _, calls = sb.step_flops(step)  # dynamo may leave a compiled frame to eager
            extra["flops"] = flops
            extra["gemm_rate"], extra["gemm_flops"] = sb.gemm_rate(calls, device, sync=sync)
    return {"row": row, **extra}


def _print(provider: str, res: dict[str, object]) -> None:
    row = res["row"]
    print(
        f"{provider:>15}: {row['ms_median']:.2f} ms/step (p20 {row['ms_p20']:.2f}, p80 {row['ms_p80']:.2f}), "
        f"{row['img_per_s']:.0f} img/s, {res['faults_per_step']} page faults/step"
        + (f", {row['model_tflop_s']} TFLOP/s" if row.get("model_tflop_s") else "")
        + (f", MFU {row['mfu_pct']}%" if row.get("mfu_pct") else ""),
        flush=True,
    )
    if "breakdown" in res:
        print(
            "  "
            + sb.format_breakdown(
                provider, res["breakdown"], res["flops"], res["gemm_rate"], res["gemm_flops"], row["ms_median"]
            ).replace("\n", "\n  "),
            flush=True,
        )


VARIANT_COLUMNS = [
    "option",
    "model",
    "batch",
    "threads",
    "ms_plain",
    "ms_option",
    "x_plain",
    "x_p20",
    "x_p80",
    "machine",
    "date",
    "torch",
    "git_rev",
]


def variant_costs(args: argparse.Namespace) -> list[dict[str, object]]:
    """The cost per step of each ``--variant`` (model options, routing, training terms) as a ratio to the plain
    fused step of the same model and batch.

    Every step is built in this process (one Trainer each, on the same random batches) and they are timed
    interleaved, in alternating order, after ``--warmup`` steps each; each ratio is paired per repetition, so a
    drift of the machine's speed cancels (separate processes drifted by up to 20% here). An empty variant
    (``--variant ''``) times the plain step against itself: the noise floor of the ratios.
    """
    names = ["fused", *(f"fused@{i}" for i in range(len(args.variants)))]
    with tempfile.TemporaryDirectory() as tmp:
        built = {n: _ours(n, args, f"{tmp}/{i}", False) for i, n in enumerate(names)}
        device = built["fused"][1]
        for step, _, _ in built.values():
            for _ in range(args.warmup):
                step()
        times = {n: [] for n in names}
        for rep in range(args.reps):
            for n in names if rep % 2 == 0 else names[::-1]:
                common.synchronize(device)
                t0 = time.perf_counter()
                built[n][0]()
                common.synchronize(device)
                times[n].append(time.perf_counter() - t0)
    plain, _, _ = common.percentiles(times["fused"])
    rows = []
    for n in names[1:]:
        label = built[n][2]
        med, _, _ = common.percentiles(times[n])
        r50, r20, r80 = common.percentiles([a / b for a, b in zip(times[n], times["fused"])])
        option = " ".join(args.variants[int(n.split("@")[1])].split(";")).strip() or "none (the plain step again)"
        print(
            f"{label}: {med * 1e3:.2f} ms/step, x{r50:.3f} the plain step {plain * 1e3:.2f} ms (p20 {r20:.3f}, "
            f"p80 {r80:.3f})",
            flush=True,
        )
        rows.append(
            {
                "option": option,
                "model": label,
                "batch": args.batch,
                "threads": torch.get_num_threads(),
                "ms_plain": round(plain * 1e3, 3),
                "ms_option": round(med * 1e3, 3),
                "x_plain": round(r50, 3),
                "x_p20": round(r20, 3),
                "x_p80": round(r80, 3),
                **common.run_info(args.device),
            }
        )
    return rows


def compiled_step(args: argparse.Namespace) -> list[dict[str, object]]:
    """The forward of a training step (q_sample, the model, a MinSNR eps loss) under ``torch.compile(fullgraph=True)``
    with our ops against the same step with the plain-torch loss; backward and AdamW run after it, eager.

    Two noise modes: ``given`` (drawn by the user outside the step, the same tensor for both) and ``seed`` (drawn
    inside the compiled step: plain torch's ``randn_like``, our in-kernel Philox). Both providers get the same
    model weights, batch and timesteps; with a learned variance only the eps half of the output enters the loss,
    in both. Each provider runs as two copies (below); all steps are interleaved, in alternating order, and each
    ratio is paired per repetition within its mode.
    """
    import copy

    import diffcurr_fast.ops as ops
    from diffcurr_fast.diffusion import DDPMSchedule
    from diffcurr_fast.runs.sampling import build_model
    from diffcurr_fast.train.host_memory import retain_host_memory

    cfg = load_config(args.recipe, [f"data.batch_size={args.batch}", f"engine.device={args.device}", *args.overrides])
    if cfg.engine.retain_host_memory:
        retain_host_memory()  # as the trainer does: neither provider faults its activations in anew each step
    device, m, gamma = torch.device(args.device), cfg.model, 5.0
    sched = DDPMSchedule(cfg.diffusion.num_timesteps, cfg.diffusion.beta_schedule)
    abar = sched.alphas_cumprod.float().to(device)
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(args.batch, m.in_channels, m.input_size, m.input_size, generator=g).to(device)
    given = torch.randn(x0.shape, generator=g).to(device)
    t = torch.randint(0, abar.shape[0], (args.batch,), generator=g).to(device)
    y = torch.randint(0, m.num_classes, (args.batch,), generator=g).to(device)
    C, dims, bshape = m.in_channels, (1, 2, 3), (-1, 1, 1, 1)
    torch.manual_seed(0)
    base = build_model(cfg).to(device)

    def plain_loss(net, mode):
        def fwd(x0, t, y):
            noise = given if mode == "given" else torch.randn_like(x0)
            ab = abar[t]
            xt = ab.sqrt().view(bshape) * x0 + (1 - ab).sqrt().view(bshape) * noise
            pred = net(xt, t, y)[:, :C]  # (B, C, H, W)
            snr = ab / (1 - ab)
            return (((pred - noise) ** 2).mean(dim=dims) * (torch.clamp(snr, max=gamma) / snr)).mean()

        return fwd

    def ops_loss(net, mode):
        noise, seed = (given, None) if mode == "given" else (None, 1234)

        def fwd(x0, t, y):
            xt = ops.q_sample(x0, t, sched, noise, seed=seed, validate=False)
            pred = net(xt, t, y)[:, :C]  # (B, C, H, W)
            kw = dict(prediction="eps", weighting="min_snr", gamma=gamma, seed=seed, validate=False)
            return ops.diffusion_loss(pred, x0, noise, t, sched, **kw)

        return fwd

    steps = {}
    # two copies of each, built plain, ours, ours, plain: where a model's memory lands moves its step by about 1 %
    # (measured with the build order swapped), and this order cancels that between the two
    makers = {"plain-torch loss": plain_loss, "our ops": ops_loss}
    order = [("plain-torch loss", 0), ("our ops", 0), ("our ops", 1), ("plain-torch loss", 1)]
    for mode in ("given", "seed"):
        for label, copy_i in order:
            make = makers[label]
            net = copy.deepcopy(base)
            opt = torch.optim.AdamW(net.parameters(), lr=1e-4, weight_decay=0.0)
            make(net, mode)(x0, t, y)  # eager once: the schedule's coefficient tables are built and cached
            fwd = torch.compile(make(net, mode), fullgraph=True)

            def step(fwd=fwd, opt=opt):
                opt.zero_grad(set_to_none=True)
                loss = fwd(x0, t, y)
                loss.backward()
                opt.step()
                return loss

            t0 = time.perf_counter()
            step()
            steps[(mode, label, copy_i)] = (step, time.perf_counter() - t0)
    for step, _ in steps.values():
        for _ in range(args.warmup):
            step()
    times = {key: [] for key in steps}
    for rep in range(args.reps):
        keys = list(steps) if rep % 2 == 0 else list(reversed(steps))  # alternate the order: no provider goes first
        for key in keys:
            step = steps[key][0]
            common.synchronize(device)
            t0 = time.perf_counter()
            step()
            common.synchronize(device)
            times[key].append(time.perf_counter() - t0)
    rows = []
    model = _model_name(m)  # the compiled step builds the model alone: no routing or terms
    for mode in ("given", "seed"):
        per_rep = {lab: [a + b for a, b in zip(times[(mode, lab, 0)], times[(mode, lab, 1)])] for lab in makers}
        plain = per_rep["plain-torch loss"]
        for label in makers:
            med, p20, p80 = common.percentiles([v / 2 for v in per_rep[label]])  # a step: the mean of the copies
            # paired: both copies of both ran back to back in each repetition, so the ratio cancels drift
            r50, r20, r80 = common.percentiles([a / b for a, b in zip(plain, per_rep[label])])
            name = f"compiled step, {label}, {mode} noise"
            first = max(steps[(mode, label, i)][1] for i in (0, 1))
            print(
                f"{name:>42}: {med * 1e3:.2f} ms/step (p20 {p20 * 1e3:.2f}, p80 {p80 * 1e3:.2f}), "
                f"x{r50:.3f} the plain-torch loss (paired, p20 {r20:.3f}, p80 {r80:.3f}), "
                f"first call {first:.1f} s"
            )
            rows.append(
                {
                    "provider": name,
                    "model": model,
                    "batch": args.batch,
                    "precision": "fp32",
                    "device": args.device,
                    "ms_median": round(med * 1e3, 3),
                    "ms_p20": round(p20 * 1e3, 3),
                    "ms_p80": round(p80 * 1e3, 3),
                    "img_per_s": round(args.batch / med, 1),
                    "x_vs_plain_paired": round(r50, 3),
                    **common.run_info(args.device),
                }
            )
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
    p.add_argument(
        "--peer-dit",
        default=None,
        metavar="PATH",
        help="a facebookresearch/DiT checkout: adds the official step (and official+malloc) as providers",
    )
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=0.0,
        help="the device's peak rate at this precision "
        "(TFLOP/s; e.g. 989 for an H100/H200 in dense bf16): adds the MFU column",
    )
    p.add_argument(
        "--routing", default="0.5,2,-2", help="fused+routed: [tread|sprint,]KEEP,START,END (END < 0: from the depth)"
    )
    p.add_argument(
        "--variant",
        dest="variants",
        action="append",
        default=[],
        metavar="SETS",
        help="instead: the fused step with these overrides (';'-separated, e.g. 'terms.use=[sra]') against the plain "
        "fused step, interleaved in one process; its cost per step as a paired ratio (repeatable)",
    )
    p.add_argument("--providers", default=None, help=f"comma-separated subset of {', '.join(PROVIDERS)}")
    p.add_argument("--profile", action="store_true", help="print the step-time breakdown of each provider")
    p.add_argument("--profile-steps", type=int, default=2, help="steps profiled per provider (--profile)")
    p.add_argument("--no-isolate", dest="isolate", action="store_false", help="run every provider in this process")
    p.add_argument("--quick", action="store_true", help="smoke run: few steps, no CSV")
    p.add_argument("--out", default=str(common.RESULTS_DIR / "train.csv"))
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # run one provider, print its JSON result
    args = p.parse_args(argv)
    if args.quick:
        args.warmup, args.reps = 1, 3
    if args.compiled_step:
        rows = compiled_step(args)
        if not args.quick:
            out = Path(args.out)
            common.append_csv(out, rows)
            out.with_suffix(".md").write_text(
                "# Training step throughput\n\n" + common.markdown_table(common.read_csv(out), COLUMNS) + "\n"
            )
        return 0
    if args.variants:
        rows = variant_costs(args)
        if not args.quick:
            out = Path(args.out).with_name("step_options.csv")
            common.append_csv(out, rows)
            out.with_suffix(".md").write_text(
                "# Cost per step of the model options and training terms\n\n"
                "Each option's step against the plain fused step of the same model and batch (`bench_train.py "
                "--variant`), built in one process and timed interleaved; `x_plain` is the median of the "
                "per-repetition ratios (p20-p80).\n\n"
                + common.markdown_table(common.read_csv(out), VARIANT_COLUMNS)
                + "\n"
            )
        return 0
    if args.child:
        res = bench(args.child, args)
        print("RESULT " + json.dumps(res), flush=True)
        return 0
    if args.providers:
        providers = [s.strip() for s in args.providers.split(",") if s.strip()]
        bad = sorted(set(providers) - set(PROVIDERS))
        if bad:
            p.error(f"unknown providers {bad}; choose from {', '.join(PROVIDERS)}")
    else:
        providers = ["reference", "fused"] + (["fused+compile"] if args.compile else [])
        providers += ["official", "official+malloc"] if args.peer_dit else []
    if any(pr.startswith("official") for pr in providers) and not args.peer_dit:
        p.error("the official providers need --peer-dit PATH (a facebookresearch/DiT checkout)")
    results = {}
    for provider in providers:
        if args.isolate and len(providers) > 1:
            cmd = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--child", provider]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            sys.stderr.write(proc.stderr)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode or not lines:
                print(proc.stdout)
                raise SystemExit(f"provider {provider} failed (exit {proc.returncode})")
            res = json.loads(lines[-1][len("RESULT ") :])
        else:
            res = bench(provider, args)
        results[provider] = res
        _print(provider, res)
        if not args.quick:  # written as soon as measured: a later provider's time-out keeps this one
            common.append_csv(Path(args.out), [res["row"]])
    base = results.get("official")
    if base is not None:
        for provider, res in results.items():
            if provider != "official":
                ratio = base["row"]["ms_median"] / res["row"]["ms_median"]
                print(f"speed-up of {provider} over official: {ratio:.2f}x")
    if not args.quick:
        out = Path(args.out)
        out.with_suffix(".md").write_text(
            "# Training step throughput\n\n" + common.markdown_table(common.read_csv(out), COLUMNS) + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
