"""``diffcurr-fast sample --ckpt RUN --sampler auto|ddpm|ddim|heun|euler --steps N --cfg S --num-samples N --out F``.

Loads a training checkpoint (a ``ckpt_*.pt`` or a run directory: its newest checkpoint), rebuilds the model from
the config stored in it, and draws ``--num-samples`` samples in batches of ``--batch-size`` (a progress bar per batch).
Under ``torchrun --nproc_per_node N`` every rank draws its share of the batches (dealt round-robin, as ADM's
``sample_ddp.py``) and rank 0 writes the file; batch b is seeded with ``--seed`` and b, so the samples do not
depend on the number of ranks. Output: a PNG grid (1- or 3-channel data), or an ``.npz``: images in the layout
of the ADM evaluation suite (``arr_0`` uint8 (N, H, W, C), ``arr_1`` the labels), or, for a latent model
without ``--vae``, ``x`` (N, C, H, W) float32 in data units and ``y``. ``--vae DIR`` first decodes a latent
model's samples (divided by ``data.scale``) with a diffusers ``AutoencoderKL``. ``--bundle DIR`` samples a TDC
multi-expert bundle instead (each timestep routed to its group's expert; the bundle directory carries the
training config). ``--ema-length SIGMA_REL`` samples the post-hoc EMA of that length instead of the EMA weights,
reconstructed from the run's snapshots (``runs.posthoc_ema``; a run trained with ``optim.phema_every``). A model
with NaN or inf weights is refused.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from diffcurr_fast._files import OutputLock, check_writable, load_npz
from diffcurr_fast.runs.config import config_from_dict
from diffcurr_fast.runs.resources import check_fits, sampling_memory
from diffcurr_fast.runs.threads import check_threads

# torch is imported inside the functions, so --help stays instant; the names are runs.sampling's (tested)
SAMPLERS = ("ddpm", "ddim", "heun", "euler")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``sample``."""
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--ckpt", help="checkpoint file, or a run directory (newest checkpoint)")
    src.add_argument("--bundle", help="TDC multi-expert bundle directory (written by `diffcurr-fast tdc`)")
    parser.add_argument(
        "--sampler",
        default="auto",
        choices=("auto", *SAMPLERS),
        help="sampler (default auto: the formulation's own, ddim for ddpm, heun for flow and edm)",
    )
    parser.add_argument("--steps", type=int, default=50, help="sampling steps (default: 50)")
    parser.add_argument("--cfg", type=float, default=1.0, help="classifier-free guidance scale (1 = off)")
    # --num-samples first: under torchrun, "--num" is taken for an abbreviation of torchrun's own --numa-binding
    parser.add_argument(
        "--num-samples", "--num", dest="num", type=int, default=64, help="number of samples (default: 64)"
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=64,
        help="samples drawn per model batch (default: 64); under torchrun, per rank",
    )
    parser.add_argument("--labels", default=None, help="comma-separated class labels, cycled (default: 0, 1, ...)")
    parser.add_argument("--out", required=True, help="output file: .png (grid) or .npz")
    parser.add_argument("--weights", default="ema", choices=("ema", "model"), help="EMA (default) or raw weights")
    parser.add_argument(
        "--ema-length",
        type=float,
        default=None,
        metavar="SIGMA_REL",
        help="post-hoc EMA: the weights averaged with this EMA length (EDM2 sigma_rel, e.g. 0.07), reconstructed from "
        "the run's snapshots at the newest one up to the checkpoint (a run trained with optim.phema_every)",
    )
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="device")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output file")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: the run's engine.cpu_threads; 0: torch's default)",
    )
    parser.add_argument(
        "--vae", default=None, help="latent models: decode the samples with this diffusers AutoencoderKL directory"
    )
    parser.add_argument("--vae-batch", type=int, default=16, help="samples per VAE decode call (default: 16)")


def _distributed() -> tuple[int, int, Any]:
    """(rank, world, device) under torchrun (a process group is started), else (0, 1, None)."""
    # imported here, not at the top: keeps --help free of torch
    import torch
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1, None
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size(), device


def _save_npz(path: Path, arrays: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        np.savez(fh, **arrays)
    os.replace(tmp, path)


def _shard(out: Path, rank: int) -> Path:
    """The file beside ``out`` where rank ``rank`` of a torchrun draw writes its batches."""
    return out.with_name(f"{out.name}.rank{rank}.npz")


def merge_shards(out: Path, world: int) -> dict[int, Any]:
    """Rank 0 of a torchrun draw: the batches (index -> array) that ranks 1.. wrote beside ``out``, each shard read
    with ``load_npz`` (a damaged one is named in one line) and then removed."""
    parts: dict[int, Any] = {}
    for r in range(1, world):
        other = _shard(out, r)
        parts.update({int(k[1:]): a for k, a in load_npz(other, f"the samples of rank {r}").items()})
        other.unlink()
    return parts


def check_arguments(args: argparse.Namespace) -> tuple[Path, list[int] | None]:
    """(the output path, the ``--labels`` as ints or None) after checking every argument that does not need the
    checkpoint: the output's suffix, an existing output, that it can be written (``check_writable``), the counts, the
    labels' syntax, the thread count and the options that exclude each other. ``run`` calls it before reading
    anything."""
    out = Path(args.out)
    if out.suffix not in (".png", ".npz"):
        raise ValueError(f"--out must end in .png or .npz, got {str(out)!r}")
    if out.exists() and not args.overwrite:
        raise FileExistsError(f"{str(out)!r} exists; pass --overwrite to replace it")
    check_writable(out, "--out", "choose another --out")
    for flag, value in (("--num-samples", args.num), ("--batch-size", args.batch_size), ("--steps", args.steps)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if args.threads is not None:
        check_threads(args.threads)
    if args.vae and args.vae_batch < 1:
        raise ValueError(f"--vae-batch must be >= 1, got {args.vae_batch}")
    if not args.cfg >= 0:
        raise ValueError(f"--cfg must be >= 0 (1 = no guidance), got {args.cfg}")
    labels = None
    if args.labels:
        try:
            labels = [int(v) for v in args.labels.split(",")]
        except ValueError:
            raise ValueError(f"--labels must be comma-separated ints, got {args.labels!r}") from None
    if getattr(args, "ema_length", None) is not None and (args.weights != "ema" or getattr(args, "bundle", None)):
        raise ValueError("--ema-length reconstructs the EMA weights of a --ckpt run: drop --weights model / --bundle")
    if getattr(args, "bundle", None) and args.weights != "ema":
        raise ValueError(f"--weights {args.weights} is not available with --bundle (it holds EMA weights only)")
    return out, labels


def run(args: argparse.Namespace) -> int:
    """Sample from a checkpoint and write the grid or arrays. Returns the exit status. Rank 0 holds the lock of
    ``--out`` (``_files.OutputLock``) from before the checks until the file is written."""
    out, base = check_arguments(args)
    if int(os.environ.get("RANK", "0")) != 0:
        return _run(args, out, base)
    with OutputLock(out, "--out", "choose another --out"):
        check_arguments(args)  # again, under the lock: another command may have written --out meanwhile
        return _run(args, out, base)


def _run(args: argparse.Namespace, out: Path, base: list[int] | None) -> int:
    # imported here, not at the top: keeps --help free of torch
    import torch
    import torch.distributed as dist

    from diffcurr_fast.data.extract import decode_latents, load_decoder
    from diffcurr_fast.runs.checkpoint import check_finite_weights, load_checkpoint, resolve_checkpoint
    from diffcurr_fast.runs.posthoc_ema import list_snapshots, reconstruct, sigma_rel_to_gamma
    from diffcurr_fast.runs.sampling import (
        batch_slices,
        build_schedule,
        check_sampler,
        checkpoint_dit,
        pixel_range,
        sample_batch,
        sampling_readout,
        save_grid,
        set_cpu_threads,
        to_uint8_nhwc,
    )

    ema_length = getattr(args, "ema_length", None)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda requested but no CUDA device is available; use cpu or auto")
    rank, world, dist_device = _distributed()
    device = dist_device or torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else ("cpu" if args.device == "auto" else args.device)
    )
    if getattr(args, "bundle", None):  # a TDC bundle holds the experts' (EMA) weights and the training config
        # imported here, not at the top: keeps --help free of torch
        from diffcurr_fast.tdc.pipeline import load_bundle_with_config

        bundle = Path(args.bundle)
        if not (bundle / "train_config.json").is_file() and (bundle / "bundle" / "train_config.json").is_file():
            raise ValueError(
                f"--bundle {str(bundle)!r} is a TDC run directory: pass --bundle {str(bundle / 'bundle')!r}"
            )
        model, cfg = load_bundle_with_config(args.bundle, device)
        check_finite_weights(model.state_dict(), f"bundle {args.bundle}")
        state = {}
    else:
        path = resolve_checkpoint(args.ckpt)
        if ema_length is not None:  # the run's snapshots are checked before its checkpoint is read
            sigma_rel_to_gamma(ema_length)  # ValueError for a length out of range
            if not list_snapshots(path.parent.parent):
                reconstruct(path.parent.parent, ema_length)  # its one line: the run kept no snapshots
        state = load_checkpoint(path)
        cfg = config_from_dict(state["config"], record=True)
    # what needs the config, before the model is built or the VAE loaded
    set_cpu_threads(args.threads, cfg)
    m = cfg.model
    if base is not None:
        bad = [v for v in base if not 0 <= v < m.num_classes]
        if bad:
            raise ValueError(f"--labels {bad} out of range; valid labels are 0..{m.num_classes - 1}")
    else:
        base = list(range(m.num_classes))
    args.sampler = check_sampler(args.sampler, args.steps, cfg)
    if args.vae and cfg.data.dataset in ("digits", "images"):
        raise ValueError(f"--vae decodes latents, but this model was trained on data.dataset {cfg.data.dataset!r}")
    if out.suffix == ".png" and m.in_channels not in (1, 3) and not args.vae:
        raise ValueError(
            f"a PNG grid needs 1- or 3-channel data, this model has {m.in_channels}; write .npz or "
            "decode latents with --vae"
        )
    weights_of = state["model"].values() if "model" in state else model.parameters()
    params = sum(v.numel() for v in weights_of)
    fix = "lower --batch-size, and --num-samples (every sample is held until the file is written)"
    check_fits(sampling_memory(cfg, params, args.batch_size, args.num, args.cfg != 1), device, fix)
    vae = load_decoder(args.vae, device) if args.vae else None
    if "model" in state:
        if ema_length is not None:  # the run directory holds checkpoints/ and phema/
            weights, how = reconstruct(path.parent.parent, ema_length, step=int(state["step"]))
            note = f", post-hoc EMA sigma_rel {ema_length} at step {how.step} from {len(how.snapshots)} snapshots"
        else:
            weights, note = state["ema"]["module"] if args.weights == "ema" else state["model"], ""
        model = checkpoint_dit(state, cfg, weights, f"checkpoint {str(path)!r} ({args.weights} weights{note})")
    model = model.to(device).eval()
    labels = torch.tensor([base[i % len(base)] for i in range(args.num)], dtype=torch.long)
    images = vae is not None or (m.in_channels in (1, 3) and pixel_range(cfg))
    adm = out.suffix == ".npz" and images  # the ADM evaluation suite's layout: uint8 (N, H, W, C)
    schedule, readout = build_schedule(cfg), sampling_readout(cfg)
    mine = batch_slices(args.num, args.batch_size, rank, world)
    parts: dict[int, Any] = {}
    for b, sl in tqdm(mine, desc="sampling", unit="batch", disable=rank != 0, dynamic_ncols=True):
        x = sample_batch(
            model,
            schedule,
            labels=labels[sl],
            batch=b,
            seed=args.seed,
            sampler=args.sampler,
            steps=args.steps,
            channels=m.in_channels,
            size=m.input_size,
            num_classes=m.num_classes,
            readout=readout,
            cfg_scale=args.cfg,
            device=device,
        )
        x = (x / cfg.data.scale).cpu()  # data units: unscaled latents z for latent models
        if vae is not None:
            x = decode_latents(vae, x, args.vae_batch)  # (b, 3, H', W') in [-1, 1]
        parts[b] = (to_uint8_nhwc(x) if adm else x.float()).numpy()
    if world > 1:  # every rank writes its batches; rank 0 merges them in batch order
        out.parent.mkdir(parents=True, exist_ok=True)
        shard = _shard(out, rank)
        _save_npz(shard, {f"b{b}": a for b, a in parts.items()})
        dist.barrier()
        if rank == 0:
            parts.update(merge_shards(out, world))
            shard.unlink()
        dist.barrier()
        dist.destroy_process_group()
        if rank != 0:
            return 0
    arr = np.concatenate([parts[b] for b in sorted(parts)])
    out.parent.mkdir(parents=True, exist_ok=True)
    if adm:
        _save_npz(out, {"arr_0": arr, "arr_1": labels.numpy()})
    elif out.suffix == ".npz":
        _save_npz(out, {"x": arr, "y": labels.numpy()})
    else:
        nrow = m.num_classes if m.num_classes <= 16 and not args.labels else None
        save_grid(torch.from_numpy(arr), out, nrow=nrow, upscale=max(1, 32 // arr.shape[-1]))
    origin = f"step {state['step']}{note}" if "model" in state else f"bundle {args.bundle}"
    ranks = f", {world} ranks" if world > 1 else ""
    print(
        f"wrote {args.num} samples ({args.sampler}, {args.steps} steps, cfg {args.cfg}{ranks}) from {origin} to {out}"
    )
    return 0
