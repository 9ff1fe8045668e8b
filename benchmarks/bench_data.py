"""Data-loading throughput: DALI pipelines vs the torch DataLoader fallback, on latents and on images.

Synthetic data is written to a temporary directory first (not timed): latents in both layouts (fast-DiT
per-sample ``.npy`` and our shards) and an ImageNet-layout folder of JPEGs. Each provider reads one full
epoch of the same sample order (``ShardedLoader``), repeated; the median epoch time with p20/p80 gives samples/s.
The ``ratio`` column is DALI / torch throughput for the same data and worker count.

Rows are appended to ``benchmarks/results/data.csv`` and ``benchmarks/results/data.md`` is regenerated.

    python benchmarks/bench_data.py            # default sizes
    python benchmarks/bench_data.py --quick    # smoke run
    python benchmarks/bench_data.py --device-id 0 --decoder mixed   # GPU decoding (needs CUDA)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

from diffcurr_fast.data.dali import dali_available  # noqa: E402
from diffcurr_fast.data.images import ImageFolder  # noqa: E402
from diffcurr_fast.data.latents import FastDiTLatentWriter, ShardedLatentWriter, open_latents  # noqa: E402
from diffcurr_fast.data.pipeline import ShardedLoader  # noqa: E402

COLUMNS = [
    "data",
    "provider",
    "workers",
    "samples",
    "batch",
    "samples_per_s",
    "p20",
    "p80",
    "ratio_vs_torch",
    "machine",
    "date",
    "git_rev",
]


def make_data(root: Path, n_latents: int, n_images: int, latent_hw: int, image_hw: tuple[int, int]) -> dict:
    """Write the synthetic datasets; returns name -> source for ``ShardedLoader``."""
    rng = np.random.default_rng(0)
    lat = rng.standard_normal((n_latents, 4, latent_hw, latent_hw)).astype(np.float32)
    lab = rng.integers(0, 1000, n_latents)
    FastDiTLatentWriter(root / "fastdit").write(lat, lab)
    w = ShardedLatentWriter(root / "sharded", lat.shape[1:], shard_size=1024, dtype="float32")
    w.write(lat, lab)
    w.close()
    h, w_ = image_hw
    yy, xx = np.mgrid[0:h, 0:w_]
    for i in range(n_images):
        cls = root / "images" / f"n{i % 10:08d}"
        cls.mkdir(parents=True, exist_ok=True)
        base = np.stack([np.sin(xx / (7 + i % 5) + c) + np.cos(yy / 9 - c) for c in range(3)], -1)
        pix = np.clip(127.5 + 60 * base + rng.normal(0, 8, (h, w_, 3)), 0, 255).astype(np.uint8)
        Image.fromarray(pix).save(cls / f"{i}.JPEG", quality=90)
    return {
        "latents/fastdit": open_latents(root / "fastdit"),
        "latents/sharded": open_latents(root / "sharded"),
        "images": ImageFolder(root / "images"),
    }


def time_epoch(loader: ShardedLoader, reps: int) -> list[float]:
    """Seconds per full epoch, ``reps`` times after one warmup epoch."""
    times = []
    for r in range(reps + 1):
        t0 = time.perf_counter()
        n = sum(len(x) for x, _ in loader.epoch_batches(r))
        if r:
            times.append(time.perf_counter() - t0)
        assert n == loader.samples_per_epoch
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small smoke run")
    ap.add_argument("--latents", type=int, default=4096, help="number of latents (4 x 32 x 32)")
    ap.add_argument("--images", type=int, default=512, help="number of JPEG images (256 x 320)")
    ap.add_argument("--image-size", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--workers", type=int, nargs="+", default=[2], help="DataLoader workers / DALI threads")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device-id", type=int, default=None, help="DALI GPU id (default: CPU-only pipelines)")
    ap.add_argument("--decoder", choices=["cpu", "mixed"], default="cpu", help="DALI image decoder device")
    args = ap.parse_args()
    if args.quick:
        args.latents, args.images, args.reps, args.image_size = 512, 64, 2, 128
    providers = ["torch"] + (["dali"] if dali_available() else [])
    if "dali" not in providers:
        print("NVIDIA DALI is not installed: measuring the torch DataLoader only")
    info = common.run_info("cuda" if args.device_id is not None else "cpu")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        image_hw = (args.image_size, args.image_size * 5 // 4)
        sources = make_data(Path(tmp), args.latents, args.images, 32, image_hw)
        for name, source in sources.items():
            size = args.image_size if name == "images" else None
            for workers in args.workers:
                rates = {}
                for provider in providers:
                    loader = ShardedLoader(
                        source,
                        args.batch,
                        image_size=size,
                        seed=0,
                        backend=provider,
                        num_workers=workers,
                        device_id=args.device_id if provider == "dali" else None,
                        decoder_device=args.decoder,
                    )
                    times = time_epoch(loader, args.reps)
                    med, p20, p80 = common.percentiles(times)
                    n = loader.samples_per_epoch
                    rates[provider] = n / med
                    rows.append(
                        {
                            "data": name,
                            "provider": provider if provider == "torch" else f"dali({args.decoder})",
                            "workers": workers,
                            "samples": n,
                            "batch": args.batch,
                            "samples_per_s": round(n / med, 1),
                            "p20": round(n / p80, 1),
                            "p80": round(n / p20, 1),
                            "ratio_vs_torch": round(rates[provider] / rates["torch"], 3),
                            **{k: info[k] for k in ("machine", "date", "git_rev")},
                        }
                    )
                    print(
                        f"{name:16s} {provider:6s} workers={workers}: {n / med:10.1f} samples/s "
                        f"(ratio vs torch {rates[provider] / rates['torch']:.2f})"
                    )
    out_csv = common.RESULTS_DIR / "data.csv"
    common.append_csv(out_csv, rows)
    table = common.markdown_table(common.read_csv(out_csv), COLUMNS)
    md = (
        "# Data loading throughput: DALI vs torch DataLoader\n\n"
        "Generated by `benchmarks/bench_data.py`; samples/s over full epochs (median, p20/p80 of the rate).\n"
        "`ratio_vs_torch` = provider throughput / DataLoader throughput on the same data and workers.\n\n"
        f"{table}\n"
    )
    (common.RESULTS_DIR / "data.md").write_text(md, encoding="utf-8")
    print(f"wrote {out_csv} and {common.RESULTS_DIR / 'data.md'}")


if __name__ == "__main__":
    main()
