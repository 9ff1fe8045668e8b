"""``diffcurr-fast eval``: FD / IS / precision / recall of generated samples against a reference, and the conditional
accuracy when the samples carry the labels they were generated for (``--samples`` with ``y`` or ``arr_1``; ``--ckpt``
draws its own) and the extractor is the classifier of the model's data (digits, mnist5k).

Examples::

    diffcurr-fast eval --samples samples.npz --ref digits --extractor digits
    diffcurr-fast eval --ckpt runs/digits --num-samples 500 --ref digits --extractor digits
    diffcurr-fast eval --samples samples.npz --ref imagenet256_ref.npz --extractor inception \\
        --inception-weights pt_inception-2015-12-05-6726825d.pth
    diffcurr-fast eval --ref real.npz --save-ref ref_stats.npz --extractor digits   # cache a reference
    diffcurr-fast eval --samples latents.npz --vae sd-vae --ref ref.npz --inception-weights W.pth  # latent model

A file named by --save-ref, --json or --digits-cache that exists is refused unless --overwrite (as ``sample``).

Under ``torchrun`` with ``--ckpt`` every rank draws its share of the batches (as ``diffcurr-fast sample`` does,
so the samples and the metrics are those of one process) and rank 0 evaluates and writes; without ``--ckpt``
rank 0 does everything.
"""

from __future__ import annotations

import argparse
import os

from diffcurr_fast._files import check_writable, write_json
from diffcurr_fast.runs.resources import check_fits, sampling_memory
from diffcurr_fast.runs.threads import check_threads

# The evaluation modules (torch) are imported in run(): `diffcurr-fast eval --help` stays instant. The names of
# features.EXTRACTORS (a test keeps the two equal):
EXTRACTORS = ("digits", "mnist5k", "inception")
SAMPLERS = ("auto", "ddpm", "ddim", "heun", "euler")  # auto and runs.sampling.SAMPLERS (tested)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``eval``."""
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--samples", help="samples .npz: 'images' or 'x' (N, C, H, W) in [-1, 1], or ADM's uint8 'arr_0'")
    src.add_argument("--ckpt", help="training checkpoint (file or run directory) to sample from")
    parser.add_argument(
        "--ref",
        help="reference: statistics .npz (mu, sigma[, features]), an images .npz, 'digits' (built-in data) or "
        "'mnist5k' (its held-out split)",
    )
    parser.add_argument("--save-ref", metavar="PATH", help="write the reference statistics (+ features) to PATH")
    parser.add_argument(
        "--extractor",
        choices=EXTRACTORS,
        default=None,
        help="feature extractor (default: digits / mnist5k with --ref digits / mnist5k, the one a statistics file "
        "written by --save-ref names, else inception)",
    )
    parser.add_argument("--inception-weights", metavar="PATH", help="pytorch-fid pt_inception-2015-12-05 weights")
    parser.add_argument("--digits-cache", metavar="PATH", help="digits classifier cache file (trained if missing)")
    parser.add_argument(
        "--convert",
        action="store_true",
        help="digits extractor: average the channels and resize samples that are not 1x8x8 (refused otherwise)",
    )
    parser.add_argument("--splits", type=int, default=10, help="Inception Score splits")
    parser.add_argument("--k", type=int, default=3, help="k of the k-NN manifolds for precision/recall")
    parser.add_argument("--device", default="cpu", help="torch device for feature extraction")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: the --ckpt run's engine.cpu_threads, else torch's; 0: torch's default)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace existing files named by --save-ref, --json and --digits-cache"
    )
    parser.add_argument(
        "--vae",
        metavar="DIR",
        default=None,
        help="--samples of a latent model ('x' latents): decode them with this diffusers "
        "AutoencoderKL directory first, as `sample --vae` does",
    )
    parser.add_argument("--vae-batch", type=int, default=16, help="samples per VAE decode call (default: 16)")
    ckpt = parser.add_argument_group("sampling with --ckpt")
    # --num-samples first: under torchrun, "--num" is taken for an abbreviation of torchrun's own --numa-binding
    ckpt.add_argument("--num-samples", "--num", dest="num", type=int, default=1000, help="number of samples")
    ckpt.add_argument(
        "--sampler",
        default="auto",
        choices=SAMPLERS,
        help="sampler (default auto: the formulation's own, ddim for ddpm, heun for flow and edm)",
    )
    ckpt.add_argument("--steps", type=int, default=50, help="sampling steps")
    ckpt.add_argument("--cfg", type=float, default=1.0, help="classifier-free guidance scale")
    ckpt.add_argument("--seed", type=int, default=0, help="sampling seed")
    ckpt.add_argument("--weights", default="ema", choices=("ema", "model"), help="EMA or raw weights")
    ckpt.add_argument(
        "--ema-length",
        type=float,
        default=None,
        metavar="SIGMA_REL",
        help="post-hoc EMA: the weights averaged with this EMA length (EDM2 sigma_rel, e.g. 0.07), reconstructed from "
        "the run's snapshots (a run trained with optim.phema_every)",
    )
    ckpt.add_argument("--batch-size", type=int, default=64, help="samples drawn per model batch (default: 64)")


BUILTIN_REFERENCES = ("digits", "mnist5k")  # the references evaluate.load_reference builds from built-in data


def _check_outputs(args: argparse.Namespace) -> None:
    """The files the command writes by name: an existing one is refused unless ``--overwrite`` (as ``sample``), and
    one that cannot be written (a folder that refuses new files, a path under a file) is refused before the work."""
    for flag, path in (("--save-ref", args.save_ref), ("--json", args.json)):
        if path is None:
            continue
        if os.path.exists(path) and not args.overwrite:
            raise FileExistsError(f"{flag} {path!r} exists; pass --overwrite to replace it")
        check_writable(path, flag, f"choose another {flag} PATH")
    if args.vae is not None and args.samples is None:
        raise ValueError(
            "--vae decodes the latents of --samples; with --ckpt, write them first with "
            "`diffcurr-fast sample --out s.npz` and pass --samples s.npz"
        )
    if args.ref not in (None, *BUILTIN_REFERENCES) and not os.path.isfile(args.ref):
        raise FileNotFoundError(
            f"--ref {args.ref!r} not found (a statistics .npz, an images .npz, 'digits' or 'mnist5k')"
        )
    if args.samples is not None and not os.path.isfile(args.samples):
        raise FileNotFoundError(f"--samples {args.samples!r} not found")
    if args.threads is not None:
        check_threads(args.threads)


def run(args: argparse.Namespace) -> int:
    """Evaluate; prints one metric per line with the extractor named first."""
    if args.ref is None:
        raise ValueError("--ref is required: a statistics .npz, an images .npz, 'digits' or 'mnist5k'")
    if args.samples is None and args.ckpt is None and args.save_ref is None:
        raise ValueError("nothing to do: give --samples or --ckpt to evaluate, and/or --save-ref")
    _check_outputs(args)  # before the extractor is built (a digits cache trained) or anything written
    rank, world = _ranks(args) if args.ckpt is not None else (int(os.environ.get("RANK", "0")), 1)
    try:
        return _run(args, rank, world)
    finally:
        if world > 1:
            # imported here, not at the top: keeps --help free of torch
            import torch.distributed as dist

            dist.destroy_process_group()


def _ranks(args: argparse.Namespace) -> tuple[int, int]:
    """(rank, world) under torchrun, with the process group started and ``args.device`` this rank's GPU; else
    (0, 1)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return 0, 1
    # imported here, not at the top: keeps --help free of torch
    import torch
    import torch.distributed as dist

    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        args.device = str(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size()


def _run(args: argparse.Namespace, rank: int, world: int) -> int:
    # imported here, not at the top: keeps --help free of torch
    import torch

    from diffcurr_fast.eval.evaluate import (
        check_draw,
        checkpoint_model,
        evaluate,
        load_images,
        load_labels,
        load_latents,
        load_reference,
        samples_from_model,
        statistics_extractor,
    )
    from diffcurr_fast.eval.features import get_extractor
    from diffcurr_fast.runs.sampling import set_cpu_threads
    from diffcurr_fast.runs.sections import EVAL_SHAPES, resolve_sampler

    cfg = None
    if args.ckpt is not None:  # every rank loads the model; --sampler auto is its formulation's own, as in `sample`
        check_draw(args.num, args.batch_size)
        model, cfg = checkpoint_model(args.ckpt, weights=args.weights, device=args.device, ema_length=args.ema_length)
        args.sampler = resolve_sampler(args.sampler, cfg.diffusion.formulation)
        est = sampling_memory(cfg, sum(p.numel() for p in model.parameters()), args.batch_size, args.num, args.cfg != 1)
        check_fits(est, args.device, "lower --batch-size, and --num-samples (the samples are held to be scored)")
    set_cpu_threads(args.threads, cfg)

    def draw():  # under torchrun: this rank's share of the batches, then all of them
        return samples_from_model(
            model,
            cfg,
            args.num,
            sampler=args.sampler,
            steps=args.steps,
            cfg_scale=args.cfg,
            seed=args.seed,
            device=args.device,
            batch_size=args.batch_size,
            progress=rank == 0,
            rank=rank,
            world=world,
        )

    if rank != 0:  # a worker rank only draws its share of the samples
        if args.ckpt is not None:
            draw()
        return 0
    labels = None
    if args.samples is not None:  # read first: a bad file is named before the extractor and reference are made
        samples = load_latents(args.samples, "--samples") if args.vae else load_images(args.samples, "--samples")
        labels = load_labels(args.samples, len(samples), "--samples")
    if args.extractor is None:  # a statistics file written by --save-ref names its own
        builtin = args.ref if args.ref in BUILTIN_REFERENCES else None
        args.extractor = builtin or statistics_extractor(args.ref, "--ref") or "inception"
    extractor = get_extractor(
        args.extractor,
        inception_weights=args.inception_weights,
        digits_cache=args.digits_cache,
        device=args.device,
        convert=args.convert,
        overwrite=args.overwrite,
    )
    reference = load_reference(args.ref, extractor, "--ref")
    if args.save_ref is not None:
        reference.save(args.save_ref)
        print(f"reference statistics ({extractor.name}: {extractor.label}) written to {args.save_ref}")
    if args.samples is not None and args.vae is not None:
        # imported here, not at the top: keeps --help free of torch
        from diffcurr_fast.data.extract import decode_latents, load_decoder

        # samples: (N, C, h, w) unscaled latents -> images (N, 3, H, W) in [-1, 1]
        images = decode_latents(load_decoder(args.vae, args.device), samples, args.vae_batch)
        print(f"decoded {len(images)} latents of {args.samples} with {args.vae}")
    elif args.samples is not None:
        images = samples
    elif args.ckpt is not None:
        images = draw()
        labels = torch.arange(args.num) % cfg.model.num_classes  # as samples_from_model cycles them
        ranks = f", {world} ranks" if world > 1 else ""
        phema = f", post-hoc EMA sigma_rel {args.ema_length}" if args.ema_length is not None else ""
        print(f"sampled {len(images)} images from {args.ckpt} ({args.sampler}, {args.steps} steps{ranks}{phema})")
    else:
        return 0
    why = labels is not None and _no_accuracy(
        extractor, tuple(images.shape[1:]) == EVAL_SHAPES.get(extractor.classes), cfg
    )
    result = evaluate(images, reference, extractor, splits=args.splits, k=args.k, labels=None if why else labels)
    for line in result.lines():
        print(line)
    if why:
        print(f"conditional accuracy: n/a ({why})")
    if args.json is not None:
        write_json(result.as_dict(), args.json, indent=1)
    return 0


def _no_accuracy(extractor, own_images: bool, cfg) -> str | None:
    """Why the extractor's classes cannot score the samples' labels (None when they can): its classes are no
    dataset's labels (inception), the images are not its own (converted to its input), or the model learnt the labels
    of other data."""
    if not extractor.classes:
        return f"the {extractor.name} classifier's classes are not the samples' labels"
    if not own_images:
        return f"the images were converted to the {extractor.name} classifier's input; its classes need its own images"
    if cfg is not None and cfg.data.dataset != extractor.classes:
        return f"the model learnt the labels of data.dataset {cfg.data.dataset!r}, not the {extractor.classes} classes"
    return None
