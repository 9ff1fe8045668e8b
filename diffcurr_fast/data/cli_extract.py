"""``diffcurr-fast extract-latents``: encode an ImageNet-layout folder with a local diffusers VAE.

Example::

    diffcurr-fast extract-latents --vae ./sd-vae-ft-ema --data ./imagenet/train --out ./latents256 \\
        --image-size 256 --batch-size 64 --layout sharded

Rerunning the same command resumes after the latents already written.
"""

from __future__ import annotations

import argparse
import os
import sys

from diffcurr_fast._files import OutputLock
from diffcurr_fast.data.errors import ON_BAD

# torch and the encoder are imported in run(): `diffcurr-fast extract-latents --help` stays instant. The values of
# extract.LAYOUTS, extract.SD_VAE_SCALE and latents.LATENT_DTYPES (a test keeps them equal):
LAYOUTS = ("sharded", "fastdit")
SD_VAE_SCALE = 0.18215
LATENT_DTYPES = ("float16", "float32")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``extract-latents``."""
    parser.add_argument("--vae", required=True, help="local directory of a diffusers AutoencoderKL")
    parser.add_argument("--data", required=True, help="image folder in ImageNet layout (ROOT/<class>/<image>)")
    parser.add_argument("--out", required=True, help="output directory for the latents")
    parser.add_argument("--image-size", type=int, default=256, help="ADM centre-crop size")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--layout", choices=LAYOUTS, default="sharded", help="latent layout on disk")
    parser.add_argument("--shard-size", type=int, default=4096, help="samples per shard (sharded layout)")
    parser.add_argument("--dtype", choices=LATENT_DTYPES, default="float16", help="latent dtype (sharded layout)")
    parser.add_argument("--scale", type=float, default=SD_VAE_SCALE, help="latent scale factor")
    parser.add_argument("--mode", action="store_true", help="store the posterior mode instead of a sample")
    parser.add_argument("--hflip", action="store_true", help="random horizontal flips (seeded), as fast-DiT")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    parser.add_argument(
        "--num-workers",
        type=int,
        default=None,
        help="DataLoader processes that decode the images (default: half the CPUs, at most 4: the encoder needs the "
        "others)",
    )
    parser.add_argument("--on-bad", choices=ON_BAD, default="stop", help="bad images: stop with an error or skip")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _cuda() -> bool:
    # imported here, not at the top: keeps --help free of torch
    import torch

    return torch.cuda.is_available()


def run(args: argparse.Namespace) -> int:
    """Run the extraction; prints how many latents the output now holds. Everything that needs no VAE (the VAE
    folder's config, --data, --out and its options record) is checked before the VAE is loaded."""
    # imported here, not at the top: keeps --help free of torch
    from diffcurr_fast.data.extract import (
        check_extraction,
        check_vae_dir,
        extract_latents,
        load_vae,
        require_diffusers,
    )

    if args.device is None:
        args.device = "cuda" if _cuda() else "cpu"
    try:
        require_diffusers()
    except ImportError as exc:
        print(f"diffcurr-fast extract-latents: error: {exc}", file=sys.stderr)
        return 2
    check_vae_dir(args.vae)
    if args.num_workers is None:
        args.num_workers = min(4, len(os.sched_getaffinity(0)) // 2)
    if args.num_workers < 0:
        raise ValueError(f"--num-workers must be >= 0 (0: decode in this process), got {args.num_workers}")
    options = dict(
        image_size=args.image_size,
        batch_size=args.batch_size,
        layout=args.layout,
        scale=args.scale,
        sample=not args.mode,
        hflip=args.hflip,
        seed=args.seed,
        dtype=args.dtype,
        on_bad=args.on_bad,
        vae_dir=args.vae,
    )
    # taken before the checks (a folder it creates for a refused start is removed again), held to the end
    with OutputLock(args.out, "--out", "give another --out", directory=True):
        folder, _ = check_extraction(args.data, args.out, **options)
        vae = load_vae(args.vae, args.device)
        n = extract_latents(
            vae,
            folder,
            args.out,
            **options,
            shard_size=args.shard_size,
            device=args.device,
            num_workers=args.num_workers,
            progress=not args.no_progress,
        )
    print(f"{n} latents in {args.out} ({args.layout} layout)")
    return 0
