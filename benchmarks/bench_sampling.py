"""Benchmark TDC multi-expert sampling against the base DiT at equal steps, both torch.compile'd, per formulation.

For each formulation (``--formulations``: DDPM with DDIM, the SiT flow with Euler, EDM with Heun; ``--samplers``
overrides) the base DiT (random weights; speed does not depend on training) is grouped into N groups of cells of
the formulation's difficulty axis with budgets FLOPs(i) = (i/N + (N-i)/N k) F (TDC Eq. 2); each group's expert is
the base pruned to its budget (magnitude importance) and the ``MultiExpertDenoiser`` routes the network's input
time (DDPM t, flow t, EDM c_noise) to it. Both models sample with the same sampler and steps (optionally with
classifier-free guidance). Reported per formulation: images/s of each (median with p20/p80), the measured
speed-up, the FLOPs ratio from the evaluations the sampler made (``visited_input_times`` + ``sampling_flops``) and
the efficiency speed-up / FLOPs ratio (target >= 0.9). The compile mode defaults to ``reduce-overhead`` (CUDA
graphs) on a GPU and ``default`` on the CPU. Rows are appended to ``--csv`` (default
``benchmarks/results/tdc_sampling.csv``) and its markdown table is regenerated beside it.

    python benchmarks/bench_sampling.py --quick --csv /tmp/smoke.csv    # small DiT, few steps, a smoke run
    python benchmarks/bench_sampling.py --groups 5 --k 0.5 --hidden 384 --depth 12 --steps 50
    python benchmarks/bench_sampling.py --device cuda --preset DiT-S/2 --formulations ddpm,flow
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

from diffcurr_fast.diffusion import DDPMSchedule, EDMFormulation, FlowFormulation, Readout  # noqa: E402
from diffcurr_fast.models import DiT, create_dit  # noqa: E402
from diffcurr_fast.runs.sampling import sample  # noqa: E402
from diffcurr_fast.tdc.accounting import sampling_flops, visited_input_times
from diffcurr_fast.tdc.experts import COMPILE_MODES, MultiExpertDenoiser
from diffcurr_fast.tdc.flops import dit_flops
from diffcurr_fast.tdc.grouping import make_groups
from diffcurr_fast.tdc.prune import importance_scores, prune_to_budget

CSV = common.RESULTS_DIR / "tdc_sampling.csv"
COLUMNS = ["machine", "date", "torch", "git_rev", "model", "formulation", "sampler", "groups", "k", "steps", "batch"]
COLUMNS += ["cfg", "compile", "base_img_s", "base_p20_p80", "tdc_img_s", "tdc_p20_p80", "speedup", "flops_ratio"]
COLUMNS += ["efficiency"]
# formulation -> (the formulation on G cells, its default sampler, its prediction, whether the DiT learns sigma)
FORMULATIONS = {
    "ddpm": (lambda: DDPMSchedule(1000), "ddim", "eps", True),
    "flow": (FlowFormulation, "euler", "velocity", False),
    "edm": (EDMFormulation, "heun", "x0", False),
}
NUM_CELLS = 1000  # G: DDPM's T, the cells of the continuous axes (the trainer's diffusion.num_timesteps)


def build_base(args: argparse.Namespace, learn_sigma: bool) -> DiT:
    common_kw = dict(num_classes=args.num_classes, learn_sigma=learn_sigma, attn_backend=args.attn_backend)
    if args.preset:
        model = create_dit(args.preset, input_size=args.input_size, **common_kw)
    else:
        model = DiT(
            input_size=args.input_size,
            patch_size=args.patch_size,
            in_channels=4,
            hidden_size=args.hidden,
            depth=args.depth,
            num_heads=args.heads,
            **common_kw,
        )
    with torch.no_grad():  # non-zero adaLN / output weights so every layer does real work
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 0.02)
    return model.eval()


def bench_formulation(name: str, sampler: str, args: argparse.Namespace, device: torch.device) -> dict:
    """One row: base vs multi-expert sampling of formulation ``name`` with ``sampler``."""
    make, _, prediction, learn_sigma = FORMULATIONS[name]
    form = make()
    torch.manual_seed(0)
    base = build_base(args, learn_sigma).to(device)
    f = dit_flops(base)
    groups = make_groups(form, args.groups, args.k, f, num_cells=NUM_CELLS)
    importance = importance_scores(base, "magnitude")
    experts = [prune_to_budget(base, g.flops, importance).eval() for g in groups]
    multi = MultiExpertDenoiser(
        experts,
        [(g.lo, g.hi) for g in groups],
        groups=[g.to_dict() for g in groups],
        input_edges=form.cell_input_edges(NUM_CELLS),
    )
    y = torch.arange(args.batch, device=device) % args.num_classes
    kw = dict(
        sampler=sampler,
        steps=args.steps,
        channels=base.in_channels,
        size=base.input_size,
        num_classes=args.num_classes,
        readout=Readout(prediction, learn_sigma=learn_sigma),
        seed=0,
        device=device,
    )

    def run(model, labels=y, cfg_scale=args.cfg):
        with torch.inference_mode():
            return sample(model, form, labels=labels, cfg_scale=cfg_scale, **kw)

    visited = visited_input_times(multi, lambda m: run(m, y[:1], 1.0))
    acct = sampling_flops(multi, f, visited, cfg=args.cfg != 1.0)
    base_fn, label = base, "eager"
    if not args.no_compile:
        base_fn = torch.compile(base, mode=args.compile_mode)
        multi.compile_experts(mode=args.compile_mode)
        label = args.compile_mode
    t1 = time.perf_counter()
    run(base_fn)  # warm-up: compiles the base and every expert outside the timed region
    run(multi)
    print(
        f"{name}/{sampler}: warm-up ({label}) took {time.perf_counter() - t1:.1f} s; expert FLOPs / F: "
        f"{[round(e / f, 3) for e in acct['expert_flops']]}; evaluations per group: {acct['steps_per_group']}"
    )
    times: dict[str, list[float]] = {"base": [], "tdc": []}
    for _ in range(args.reps):  # interleaved, so load changes on a shared machine hit both alike
        times["base"] += common.measure(lambda _: run(base_fn), device=device, warmup=0, reps=1)
        times["tdc"] += common.measure(lambda _: run(multi), device=device, warmup=0, reps=1)
    stats = {k: common.percentiles(v) for k, v in times.items()}
    speedup = stats["base"][0] / stats["tdc"][0]
    model_name = args.preset or f"DiT(D={args.hidden}, depth={args.depth}, H={args.heads})"
    b = args.batch
    return {
        **common.run_info(device),
        "model": f"{model_name} {args.input_size}px/p{base.patch_size}",
        "formulation": name,
        "sampler": sampler,
        "groups": args.groups,
        "k": args.k,
        "steps": args.steps,
        "batch": b,
        "cfg": args.cfg,
        "compile": label,
        "base_img_s": f"{b / stats['base'][0]:.2f}",
        "base_p20_p80": f"{b / stats['base'][2]:.2f}-{b / stats['base'][1]:.2f}",
        "tdc_img_s": f"{b / stats['tdc'][0]:.2f}",
        "tdc_p20_p80": f"{b / stats['tdc'][2]:.2f}-{b / stats['tdc'][1]:.2f}",
        "speedup": f"{speedup:.3f}",
        "flops_ratio": f"{acct['flops_ratio']:.3f}",
        "efficiency": f"{speedup / acct['flops_ratio']:.3f}",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small DiT, 10 steps, 3 repeats")
    ap.add_argument("--formulations", default="ddpm,flow,edm", help="comma-separated: ddpm, flow, edm")
    ap.add_argument(
        "--samplers",
        default="",
        help="comma-separated, one per formulation (default: ddim, euler, heun for ddpm, flow, edm)",
    )
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
    ap.add_argument(
        "--compile-mode",
        default=None,
        choices=COMPILE_MODES,
        help="default: reduce-overhead (CUDA graphs) on a GPU, default on the CPU",
    )
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--csv", type=Path, default=CSV, help="results CSV (its .md table is written beside it)")
    args = ap.parse_args()
    if args.quick:
        args.hidden, args.depth, args.heads, args.steps, args.batch, args.reps = 192, 4, 6, 10, 4, 3
    device = torch.device(args.device)
    if args.compile_mode is None:
        args.compile_mode = "reduce-overhead" if device.type == "cuda" else "default"
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    names = [n for n in args.formulations.split(",") if n]
    unknown = [n for n in names if n not in FORMULATIONS]
    if unknown or not names:
        ap.error(f"unknown formulation(s) {unknown or names}; valid choices: {', '.join(FORMULATIONS)}")
    samplers = [s for s in args.samplers.split(",") if s] or [FORMULATIONS[n][1] for n in names]
    if len(samplers) != len(names):
        ap.error(f"--samplers needs one sampler per formulation ({len(names)}), got {len(samplers)}")
    rows = [bench_formulation(n, s, args, device) for n, s in zip(names, samplers)]
    common.append_csv(args.csv, rows)
    table = common.markdown_table(common.read_csv(args.csv), COLUMNS)
    args.csv.with_suffix(".md").write_text(
        "# TDC multi-expert sampling vs the base DiT (equal sampler and steps, per formulation)\n\n"
        "images/s median (p20-p80); speedup = base time / TDC time; flops_ratio = base FLOPs / TDC FLOPs per image "
        "over the evaluations the sampler made; efficiency = speedup / flops_ratio (target >= 0.9).\n\n" + table + "\n"
    )
    print(common.markdown_table(rows, COLUMNS[4:]))


if __name__ == "__main__":
    main()
