"""Benchmark TDC multi-expert sampling against the base DiT at equal steps, both torch.compile'd, in one run.

The base DiT (random weights; speed does not depend on training) is grouped into N timestep groups with budgets
FLOPs(i) = (i/N + (N-i)/N k) F (TDC Eq. 2); each group's expert is the base pruned to its budget (magnitude
importance). Both models sample with DDIM at the same respaced steps (optionally with classifier-free guidance).
Reported: images/s of each (median with p20/p80), the measured speed-up, the FLOPs ratio from the routed steps
(``sampling_flops``) and the efficiency speed-up / FLOPs ratio (target >= 0.9). Rows are appended to
``benchmarks/results/tdc_sampling.csv`` and ``benchmarks/results/tdc_sampling.md`` is regenerated.

    python benchmarks/bench_sampling.py --quick          # small DiT, few steps and repeats
    python benchmarks/bench_sampling.py --groups 5 --k 0.5 --hidden 384 --depth 12 --steps 50
    python benchmarks/bench_sampling.py --device cuda --preset DiT-S/2 --compile-mode max-autotune-no-cudagraphs
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

from diffcurr_fast.diffusion import DDPMSchedule, ddim_sample, respace  # noqa: E402
from diffcurr_fast.models import DiT, create_dit  # noqa: E402
from diffcurr_fast.tdc import (  # noqa: E402
    COMPILE_MODES,
    MultiExpertDenoiser,
    dit_flops,
    importance_scores,
    make_groups,
    prune_to_budget,
    sampling_flops,
)

CSV = common.RESULTS_DIR / "tdc_sampling.csv"
MD = common.RESULTS_DIR / "tdc_sampling.md"
COLUMNS = ["machine", "date", "torch", "git_rev", "model", "groups", "k", "steps", "batch", "cfg", "compile"]
COLUMNS += ["base_img_s", "base_p20_p80", "tdc_img_s", "tdc_p20_p80", "speedup", "flops_ratio", "efficiency"]


def build_base(args: argparse.Namespace) -> DiT:
    common_kw = dict(num_classes=args.num_classes, learn_sigma=True, attn_backend=args.attn_backend)
    if args.preset:
        model = create_dit(args.preset, input_size=args.input_size, **common_kw)
    else:
        model = DiT(
            input_size=args.input_size, patch_size=args.patch_size, in_channels=4, hidden_size=args.hidden,
            depth=args.depth, num_heads=args.heads, **common_kw,
        )  # fmt: skip
    with torch.no_grad():  # non-zero adaLN / output weights so every layer does real work
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.02)
    return model.eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small DiT, 10 steps, 3 repeats")
    ap.add_argument("--preset", default=None, help="DiT preset name (e.g. DiT-S/2) instead of --hidden/--depth")
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--input-size", type=int, default=16)
    ap.add_argument("--patch-size", type=int, default=2)
    ap.add_argument("--num-classes", type=int, default=10)
    ap.add_argument("--attn-backend", default="sdpa")
    ap.add_argument("--groups", type=int, default=5)
    ap.add_argument("--k", type=float, default=0.5)
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--cfg", type=float, default=1.0, help="classifier-free guidance scale (1: off)")
    ap.add_argument("--compile-mode", default="default", choices=COMPILE_MODES)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, default=common.RESULTS_DIR, help="folder of tdc_sampling.csv / .md")
    args = ap.parse_args()
    if args.quick:
        args.hidden, args.depth, args.heads, args.steps, args.batch, args.reps = 192, 4, 6, 10, 4, 3
    device = torch.device(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    base = build_base(args).to(device)
    schedule = DDPMSchedule(1000)
    f = dit_flops(base)
    groups = make_groups(schedule, args.groups, args.k, f)
    importance = importance_scores(base, "magnitude")
    experts = [prune_to_budget(base, g.flops, importance).eval() for g in groups]
    multi = MultiExpertDenoiser(experts, [(g.lo, g.hi) for g in groups], groups=[g.to_dict() for g in groups])
    sched, tmap = respace(schedule, f"ddim{args.steps}")
    acct = sampling_flops(multi, f, tmap, cfg=args.cfg != 1.0)

    base_fn = base
    label = "eager"
    if not args.no_compile:
        base_fn = torch.compile(base, mode=args.compile_mode)
        multi.compile_experts(mode=args.compile_mode)
        label = args.compile_mode
    y = torch.arange(args.batch, device=device) % args.num_classes
    shape = (args.batch, base.in_channels, base.input_size, base.input_size)
    kw = dict(timestep_map=tmap, learn_sigma=True, cfg_scale=args.cfg, num_classes=args.num_classes, device=device)

    def run(model):
        with torch.inference_mode():
            return ddim_sample(model, sched, shape, y, seed=0, **kw)

    t1 = time.perf_counter()
    run(base_fn)  # warm-up: compiles the base and every expert outside the timed region
    run(multi)
    print(f"warm-up ({label}) took {time.perf_counter() - t1:.1f} s")
    times: dict[str, list[float]] = {"base": [], "tdc": []}
    for _ in range(args.reps):  # interleaved, so load changes on a shared machine hit both alike
        times["base"] += common.measure(lambda _: run(base_fn), device=device, warmup=0, reps=1)
        times["tdc"] += common.measure(lambda _: run(multi), device=device, warmup=0, reps=1)
    stats = {k: common.percentiles(v) for k, v in times.items()}
    speedup = stats["base"][0] / stats["tdc"][0]
    model_name = args.preset or f"DiT(D={args.hidden}, depth={args.depth}, H={args.heads})"
    row = {
        **common.run_info(device),
        "model": f"{model_name} {args.input_size}px/p{base.patch_size}",
        "groups": args.groups,
        "k": args.k,
        "steps": args.steps,
        "batch": args.batch,
        "cfg": args.cfg,
        "compile": label,
        "base_img_s": f"{args.batch / stats['base'][0]:.2f}",
        "base_p20_p80": f"{args.batch / stats['base'][2]:.2f}-{args.batch / stats['base'][1]:.2f}",
        "tdc_img_s": f"{args.batch / stats['tdc'][0]:.2f}",
        "tdc_p20_p80": f"{args.batch / stats['tdc'][2]:.2f}-{args.batch / stats['tdc'][1]:.2f}",
        "speedup": f"{speedup:.3f}",
        "flops_ratio": f"{acct['flops_ratio']:.3f}",
        "efficiency": f"{speedup / acct['flops_ratio']:.3f}",
    }
    csv_path, md_path = args.out / CSV.name, args.out / MD.name
    common.append_csv(csv_path, [row])
    table = common.markdown_table(common.read_csv(csv_path), COLUMNS)
    md_path.write_text(
        "# TDC multi-expert sampling vs the base DiT (equal DDIM steps)\n\n"
        "images/s median (p20-p80); speedup = base time / TDC time; flops_ratio = base FLOPs / TDC FLOPs per image;"
        " efficiency = speedup / flops_ratio (target >= 0.9).\n\n" + table + "\n"
    )
    print(f"expert FLOPs / F: {[round(e / f, 3) for e in acct['expert_flops']]}; steps per group: "
          f"{acct['steps_per_group']}")  # fmt: skip
    print(common.markdown_table([row], COLUMNS[4:]))


if __name__ == "__main__":
    main()
