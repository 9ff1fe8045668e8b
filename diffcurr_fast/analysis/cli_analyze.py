"""``diffcurr-fast analyze {kl,convergence,clusters}``: the difficulty analysis on the built-in digits data.

- ``kl``: KL(p_t || p_{t+1}) between consecutive forward marginals at evenly spaced t -> kl.csv, kl.png
- ``convergence``: a fresh small DiT per timestep interval -> convergence.csv, convergence_summary.csv,
  convergence.png (``--metric fd``: the FD of its one-step denoised images per interval as well as the loss)
- ``clusters``: the clustering of [0, T) by every method (printed) -> clusters.csv
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path
from typing import TYPE_CHECKING

from diffcurr_fast._files import check_writable

if TYPE_CHECKING:
    import torch

# torch and the analysis modules are imported in run(): `diffcurr-fast analyze --help` stays instant. The names of
# clustering.CLUSTER_METHODS (a test keeps the two equal):
CLUSTER_METHODS = ("uniform", "snr", "log_snr")

ANALYSES = ("kl", "convergence", "clusters")
OUTPUTS = {
    "kl": ("kl.csv", "kl.png"),
    "convergence": ("convergence.csv", "convergence_summary.csv", "convergence.png"),
    "clusters": ("clusters.csv",),
}


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-timesteps", "-T", type=_positive_int, default=1000, help="diffusion steps T (default 1000)")
    p.add_argument("--beta-schedule", choices=("linear", "cosine"), default="linear", help="DDPM beta schedule")
    p.add_argument("--out", type=Path, default=Path("analysis"), help="output directory (default ./analysis)")
    p.add_argument("--overwrite", action="store_true", help="replace existing result files in --out")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``analyze`` sub-commands and their options to ``parser``."""
    sub = parser.add_subparsers(dest="analysis", metavar="ANALYSIS", required=True)
    p = sub.add_parser("kl", help="relative entropy between consecutive marginals on the digits data")
    _common(p)
    p.add_argument("--points", type=_positive_int, default=40, help="timesteps evaluated, evenly spaced (default 40)")
    p.add_argument("--samples", type=_positive_int, default=1000, help="Monte Carlo samples per timestep")
    p.add_argument("--batch-size", type=_positive_int, default=250, help="samples per batch")

    p = sub.add_parser("convergence", help="convergence speed of a small DiT per timestep interval (digits)")
    _common(p)
    p.add_argument("--intervals", type=_positive_int, default=5, help="number of timestep intervals (default 5)")
    p.add_argument("--method", choices=CLUSTER_METHODS, default="uniform", help="how to form the intervals")
    p.add_argument("--steps", type=_positive_int, default=300, help="training steps per interval (default 300)")
    p.add_argument("--batch-size", type=_positive_int, default=64, help="training batch size (default 64)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    p.add_argument("--eval-every", type=_positive_int, default=10, help="steps between held-out evaluations")
    p.add_argument("--fraction", type=float, default=0.9, help="improvement fraction for steps-to-X (default 0.9)")
    p.add_argument(
        "--metric",
        choices=("loss", "fd"),
        default="loss",
        help="fd: also the Frechet distance (digits-classifier features) of the one-step denoised held-out "
        "images against the data, per interval (default: the loss only)",
    )

    p = sub.add_parser("clusters", help="print the timestep clustering for each method")
    _common(p)
    p.add_argument("--num-clusters", "-N", type=_positive_int, default=20, help="number of clusters (default 20)")


def _prepare_out(out: Path, names: tuple[str, ...], overwrite: bool) -> list[Path]:
    """The result files ``names`` in ``out``, created as a folder, after checking that none exists (unless
    ``overwrite``) and that each can be written (``check_writable``), before the analysis runs."""
    paths = [out / name for name in names]
    existing = [str(p) for p in paths if p.exists()]
    if existing and not overwrite:
        raise FileExistsError(f"refusing to overwrite {', '.join(existing)}; pass --overwrite to replace them")
    for path in paths:
        check_writable(path, "result file", "choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    return paths


def run(args: argparse.Namespace) -> int:
    """Run the analysis named by ``args.analysis``; returns 0 on success."""
    # imported here, not at the top: keeps --help free of torch
    import torch

    from diffcurr_fast.curriculum.clustering import cluster_timesteps
    from diffcurr_fast.diffusion.ddpm import DDPMSchedule
    from diffcurr_fast.runs.sampling import set_cpu_threads

    if args.analysis not in ANALYSES:
        raise ValueError(f"unknown analysis {args.analysis!r}; choose one of {ANALYSES}")
    if args.analysis == "clusters" and args.num_clusters > args.num_timesteps:
        raise ValueError(f"--num-clusters must lie in [1, {args.num_timesteps}], got {args.num_clusters}")
    if args.analysis == "convergence" and args.intervals > args.num_timesteps:
        raise ValueError(f"--intervals must lie in [1, {args.num_timesteps}], got {args.intervals}")
    if args.analysis == "kl" and args.num_timesteps < 2:
        raise ValueError(f"kl needs --num-timesteps >= 2, got {args.num_timesteps}")
    if args.beta_schedule == "linear" and args.num_timesteps < 20:  # its last beta, 0.02 * 1000 / T, would pass 1
        raise ValueError(
            f"--beta-schedule linear needs --num-timesteps >= 20 (its betas scale with 1000 / T), got "
            f"{args.num_timesteps}; give more timesteps or --beta-schedule cosine"
        )
    set_cpu_threads(args.threads)
    schedule = DDPMSchedule(args.num_timesteps, args.beta_schedule)
    paths = _prepare_out(Path(args.out), OUTPUTS[args.analysis], args.overwrite)
    if args.analysis == "clusters":
        return _run_clusters(args, schedule, paths[0])
    # imported here, not at the top: keeps --help free of torch
    from diffcurr_fast.analysis import difficulty
    from diffcurr_fast.data.builtin import load_digits_tensors

    x, y = load_digits_tensors()
    if args.analysis == "kl":
        points = min(args.points, args.num_timesteps - 1)
        ts = torch.linspace(0, args.num_timesteps - 2, points).round().long().unique()
        gen = torch.Generator().manual_seed(args.seed)
        result = difficulty.consecutive_kl(x, schedule, ts, args.samples, args.batch_size, generator=gen, progress=True)
        difficulty.write_kl_csv(result, paths[0])
        difficulty.plot_kl(result, paths[1])
        print(f"KL(p_t || p_t+1) at {ts.numel()} timesteps: {paths[0]} and {paths[1]}")
        return 0
    intervals = cluster_timesteps(schedule, args.intervals, args.method)
    result = difficulty.convergence_by_interval(
        None,
        x,
        schedule,
        intervals,
        args.steps,
        args.batch_size,
        args.lr,
        labels=y,
        eval_every=args.eval_every,
        fraction=args.fraction,
        seed=args.seed,
        progress=True,
        image_metric=digits_fd(x) if args.metric == "fd" else None,
    )
    difficulty.write_convergence_csv(result, paths[0], paths[1])
    difficulty.plot_convergence(result, paths[2])
    for rec in result.intervals:
        fd = (
            f", FD {rec.eval_fd[0]:.1f} -> {rec.eval_fd[-1]:.1f}, FD steps to {args.fraction:.0%} = "
            f"{rec.steps_to_fraction_fd}"
            if rec.eval_fd
            else ""
        )
        print(
            f"  t in [{rec.interval[0]:4d}, {rec.interval[1]:4d}): steps to {args.fraction:.0%} = "
            f"{rec.steps_to_fraction}{fd}"
        )
    print(f"convergence curves: {paths[0]}; summary: {paths[1]}; plot: {paths[2]}")
    return 0


def digits_fd(data: torch.Tensor):
    """images -> Frechet distance of their digits-classifier features to those of ``data`` (N, 1, 8, 8)."""
    # imported here, not at the top: keeps --help free of torch
    import torch

    from diffcurr_fast.eval.features import get_extractor
    from diffcurr_fast.eval.metrics import feature_statistics, frechet_distance

    with torch.random.fork_rng(devices=[]):  # building the extractor initialises a network
        extractor = get_extractor("digits")
    ref = feature_statistics(extractor(data)[0])

    def fd(images: torch.Tensor) -> float:
        return frechet_distance(*feature_statistics(extractor(images)[0]), *ref)

    return fd


def _run_clusters(args: argparse.Namespace, schedule, path: Path) -> int:
    # imported here, not at the top: keeps --help free of torch
    import torch

    from diffcurr_fast.curriculum.clustering import cluster_timesteps

    rows = []
    t_all = torch.arange(args.num_timesteps)
    log_snr = schedule.log_snr(t_all)
    print(f"{schedule}, N={args.num_clusters} (ranges are [lo, hi) in t; log SNR at lo..hi-1)")
    for method in CLUSTER_METHODS:
        clusters = cluster_timesteps(schedule, args.num_clusters, method)
        print(f"{method}:")
        for k, (lo, hi) in enumerate(clusters):
            print(
                f"  {k:3d}  [{lo:5d}, {hi:5d})  size {hi - lo:5d}  log SNR {log_snr[lo]:8.3f} .. {log_snr[hi - 1]:8.3f}"
            )
            rows.append([method, k, lo, hi, f"{float(log_snr[lo]):.6g}", f"{float(log_snr[hi - 1]):.6g}"])
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["method", "cluster", "t_lo", "t_hi", "log_snr_lo", "log_snr_last"])
        w.writerows(rows)
    print(f"clusters: {path}")
    return 0
