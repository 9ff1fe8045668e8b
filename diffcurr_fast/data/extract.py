"""Latent extraction: encode an image folder with a VAE (diffusers ``AutoencoderKL``) into a latent layout.

Latents are ``scale * z`` with ``z ~ q(z | x)`` (or its mode), ``scale = 0.18215`` for the Stable Diffusion VAE
(as DiT and fast-DiT use). Images are read in folder order (classes sorted, files sorted) with the ADM centre
crop, so the n-th latent always comes from the n-th usable image; a rerun resumes after the latents already
written. Noise for ``sample=True`` comes from a generator seeded per batch from ``(seed, first index)``, so a
resumed run writes the same latents as an uninterrupted one. ``extract.json`` in the output records the options
(data, image size, layout, mode or sample, flip, seed, scale, dtype); a rerun with other options is refused rather
than appended to latents of another kind.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import os
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from torch.utils.data import DataLoader
from tqdm import tqdm

from diffcurr_fast._files import check_writable, read_json, write_json
from diffcurr_fast.data.errors import check_on_bad
from diffcurr_fast.data.images import ImageDataset, ImageFolder
from diffcurr_fast.data.latents import FastDiTLatentWriter, ShardedLatentWriter
from diffcurr_fast.data.order import flip_decisions
from diffcurr_fast.data.pipeline import ListSampler, _SkipCollate

SD_VAE_SCALE = 0.18215
LAYOUTS = ("sharded", "fastdit")
OPTIONS_FILE = "extract.json"  # the options the latents of a folder were extracted with
VAE_KEYS = ("vae", "vae_path")  # its record of the VAE: ``vae_fingerprint`` and the folder it was read from


class LatentEncoder(Protocol):
    """What extraction needs from a VAE: ``encode(x).latent_dist`` with ``sample(generator=)`` and ``mode()``."""

    def encode(self, x: torch.Tensor): ...


def check_vae_dir(path: str | os.PathLike) -> None:
    """FileNotFoundError / ValueError in one line naming ``path`` unless it is the folder of a diffusers
    ``AutoencoderKL`` (its ``config.json`` says so): diffusers would load another model's folder as a VAE of random
    weights, with a warning, and fail only when it encodes."""
    path = Path(path)
    if path.is_file():
        raise ValueError(
            f"VAE {str(path)!r} is a file; give the folder of a diffusers AutoencoderKL (saved with save_pretrained: "
            "its config.json and weights)"
        )
    if not path.is_dir():
        raise FileNotFoundError(
            f"VAE directory {path} not found (a diffusers AutoencoderKL saved with save_pretrained)"
        )
    config = path / "config.json"
    data = read_json(config, "the VAE's config") if config.is_file() else None
    kind = data.get("_class_name") if isinstance(data, dict) else None
    if kind != "AutoencoderKL":
        why = f"its config.json describes a {kind}" if kind else "it has no diffusers config.json naming one"
        inner = path / "vae" / "config.json"
        hint = f"; its VAE is the folder {str(inner.parent)!r}" if inner.is_file() else ""
        raise ValueError(f"VAE directory {str(path)!r} is not a diffusers AutoencoderKL ({why}){hint}")


def require_diffusers():
    """The ``diffusers`` module (an optional dependency), or ImportError saying how to install it."""
    try:
        return importlib.import_module("diffusers")
    except ImportError as exc:
        raise ImportError("extract-latents needs diffusers for the VAE: pip install diffusers") from exc


def load_vae(path: str | os.PathLike, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """A diffusers ``AutoencoderKL`` from a local directory (never downloaded, checked by ``check_vae_dir``), in
    eval mode."""
    diffusers = require_diffusers()
    check_vae_dir(path)
    # low_cpu_mem_usage=False: what diffusers falls back to without accelerate, without its warning on every load
    vae = diffusers.AutoencoderKL.from_pretrained(
        str(path), local_files_only=True, torch_dtype=dtype, low_cpu_mem_usage=False
    )
    return vae.eval().to(device)


def vae_fingerprint(path: str | os.PathLike) -> str:
    """What identifies the VAE in folder ``path`` in ``extract.json``: the SHA-256 of its ``config.json`` and weight
    files (their names and bytes), so that a rerun with another VAE (a different fine-tune has the same config) is
    refused, and the same VAE moved elsewhere is not. Read once per process for files unchanged since."""
    files = sorted(p for p in Path(path).iterdir() if p.name == "config.json" or p.suffix in (".safetensors", ".bin"))
    return _digest(tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files))


@functools.lru_cache(maxsize=8)
def _digest(files: tuple[tuple[str, int, int], ...]) -> str:
    digest = hashlib.sha256()
    for name, _, _ in files:
        digest.update(Path(name).name.encode())
        with open(name, "rb") as fh:
            while chunk := fh.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


def load_decoder(path: str, device):
    """The VAE of ``sample --vae`` / ``eval --vae``: a diffusers ``AutoencoderKL`` from a local directory."""
    try:
        return load_vae(path, device)
    except ImportError:
        raise ImportError("sample --vae needs diffusers to decode latents: pip install diffusers") from None


def decode_latents(vae, z, batch: int = 16):
    """Images (N, 3, 8H, 8W) in [-1, 1] from unscaled latents z (N, C, H, W): ``vae.decode(z).sample``, clipped."""
    if batch < 1:
        raise ValueError(f"--vae-batch must be >= 1, got {batch}")
    params = next(iter(vae.parameters()), None) if hasattr(vae, "parameters") else None
    dev, dt = (params.device, params.dtype) if params is not None else (z.device, z.dtype)
    outs = []
    with torch.no_grad():
        for chunk in z.split(batch):
            out = vae.decode(chunk.to(dev, dt))
            outs.append(getattr(out, "sample", out).float().clamp(-1, 1).cpu())  # (b, 3, 8H, 8W)
    return torch.cat(outs)


@torch.no_grad()
def encode_latents(
    vae: LatentEncoder,
    images: torch.Tensor,
    scale: float = SD_VAE_SCALE,
    sample: bool = True,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``scale * z`` for images (B, 3, H, W) in [-1, 1]; ``z`` sampled from the posterior or its mode."""
    dist = vae.encode(images).latent_dist
    z = dist.sample(generator=generator) if sample else dist.mode()  # (B, C, H/8, W/8)
    return z * scale


def check_same_options(out: str | os.PathLike, options: dict) -> None:
    """ValueError in one line when ``out`` holds latents extracted with other options than ``options`` (a rerun
    appends to them and resumes, so it must be the same extraction), or latents of the other layout."""
    out = Path(out)
    record = out / OPTIONS_FILE
    other = {"sharded": "fastdit", "fastdit": "sharded"}[options["layout"]]
    if (out / ("index.json" if other == "sharded" else "features")).exists():
        raise ValueError(f"{str(out)!r} holds latents of the {other} layout; give another --out for this layout")
    if not record.is_file():
        return
    try:
        old = json.loads(record.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{record}: unreadable ({exc}); remove it or give another --out") from None
    vae = options.get("vae"), old.get("vae")  # a record of before it was kept, or a call without one: not compared
    diffs = [f"{k} {old.get(k)!r} (now {v!r})" for k, v in options.items() if old.get(k) != v and k not in VAE_KEYS]
    if None not in vae and vae[0] != vae[1]:
        diffs.append(f"another VAE (--vae {options.get('vae_path')!r}; the latents are of {old.get('vae_path')!r})")
    if diffs:
        raise ValueError(
            f"{str(out)!r} holds latents extracted with other options: "
            + ", ".join(diffs)
            + "; a rerun only resumes the same extraction: give another --out"
        )


def check_extraction(
    data: str | os.PathLike | ImageFolder,
    out: str | os.PathLike,
    *,
    image_size: int = 256,
    batch_size: int = 32,
    layout: str = "sharded",
    scale: float = SD_VAE_SCALE,
    sample: bool = True,
    hflip: bool = False,
    seed: int = 0,
    dtype: str = "float16",
    on_bad: str = "stop",
    vae_dir: str | os.PathLike | None = None,
) -> tuple[ImageFolder, dict]:
    """(the image folder, the options record) of an extraction of ``data`` into ``out``, after every check that
    needs no VAE: the options, the images of ``data`` (read and checked as ``on_bad`` says), that ``out`` can be
    written (``check_writable``) and holds no latents of other options (``check_same_options``; ``vae_dir``, the
    VAE's folder, is one of them: ``vae_fingerprint``). ``extract-latents`` runs it before it loads the VAE;
    ``extract_latents`` runs it again (cheap with the folder it returns)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if image_size < 1:
        raise ValueError(f"image_size must be >= 1, got {image_size}")
    check_on_bad(on_bad)
    if not isinstance(data, ImageFolder) and not Path(data).is_dir():
        what = "is a file, not a folder" if Path(data).exists() else "does not exist"
        raise FileNotFoundError(f"--data {str(data)!r} {what}; give the image folder (ROOT/<class>/<image>)")
    folder = (
        data if isinstance(data, ImageFolder) else ImageFolder(data, on_bad, "full" if on_bad == "skip" else "header")
    )
    options = {
        "data": str(Path(folder.root).resolve()),
        "image_size": image_size,
        "layout": layout,
        "sample": sample,
        "hflip": hflip,
        "seed": seed,
        "scale": scale,
        "dtype": dtype if layout == "sharded" else "float32",
    }
    if vae_dir is not None:
        options.update(vae=vae_fingerprint(vae_dir), vae_path=str(Path(vae_dir).resolve()))
    check_writable(out, "--out", "give another --out", directory=True)
    check_same_options(out, options)
    return folder, options


def extract_latents(
    vae: LatentEncoder,
    data: str | os.PathLike | ImageFolder,
    out: str | os.PathLike,
    *,
    image_size: int = 256,
    batch_size: int = 32,
    layout: str = "sharded",
    scale: float = SD_VAE_SCALE,
    sample: bool = True,
    hflip: bool = False,
    seed: int = 0,
    shard_size: int = 4096,
    dtype: str = "float16",
    device: str | torch.device = "cpu",
    num_workers: int = 0,
    on_bad: str = "stop",
    progress: bool = True,
    vae_dir: str | os.PathLike | None = None,
) -> int:
    """Encode every usable image of ``data`` into ``out``; returns the number of latents now in ``out``.

    Under ``on_bad="skip"`` the folder is fully decoded once first (bad images are dropped deterministically,
    which keeps resuming exact); under ``"stop"`` the first bad image raises an error naming it.
    ``hflip`` flips each image with probability 1/2 (decided from ``seed``), as fast-DiT's extraction does.
    ``vae_dir``: the folder ``vae`` was loaded from, recorded in ``extract.json`` (a rerun with another is refused).
    The record is written with the first latents: a start that fails before them leaves none.
    """
    folder, options = check_extraction(
        data,
        out,
        image_size=image_size,
        batch_size=batch_size,
        layout=layout,
        scale=scale,
        sample=sample,
        hflip=hflip,
        seed=seed,
        dtype=dtype,
        on_bad=on_bad,
        vae_dir=vae_dir,
    )
    n = len(folder)
    dataset = ImageDataset(folder, image_size)
    flips = flip_decisions(np.arange(n), n, seed, 0) if hflip else np.zeros(n, dtype=bool)
    device = torch.device(device)
    writer: FastDiTLatentWriter | ShardedLatentWriter | None = None
    if layout == "fastdit":
        writer = FastDiTLatentWriter(out)
    elif (Path(out) / "index.json").is_file():
        meta = read_json(Path(out) / "index.json", "the latents index")
        writer = ShardedLatentWriter(out, tuple(meta["latent_shape"]), shard_size, meta["dtype"], scale)
    start = writer.num_written if writer is not None else 0
    Path(out).mkdir(parents=True, exist_ok=True)
    if start:  # what the latents in ``out`` are: a rerun must ask the same
        write_json(options, Path(out) / OPTIONS_FILE)
    if start > n:
        raise ValueError(f"{out} already holds {start} latents but {folder.root} has only {n} usable images")
    if start == n:
        return n
    # Restart at a batch boundary so every batch (and its noise seed) is the one an uninterrupted run would see;
    # rows already written are dropped from the first batch.
    first = (start // batch_size) * batch_size
    keys = [(i, bool(flips[i])) for i in range(first, n)]
    loader = DataLoader(
        dataset, batch_size=batch_size, sampler=ListSampler(keys), num_workers=num_workers, collate_fn=_SkipCollate()
    )
    bar = None
    if progress:
        bar = tqdm(total=n, initial=start, unit="img", desc="extract-latents")
    done = first
    for x, y, skipped in loader:
        if skipped:
            raise ValueError(f"{skipped} image(s) failed to decode after the folder check; rerun to resume")
        gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + done)
        param = next(iter(vae.parameters()), None) if hasattr(vae, "parameters") else None
        x = x.to(device, param.dtype if param is not None else torch.float32)  # (B, 3, S, S)
        z = encode_latents(vae, x, scale, sample, gen).float().cpu().numpy()  # (B, C, S/8, S/8)
        if writer is None:
            writer = ShardedLatentWriter(out, z.shape[1:], shard_size, dtype, scale)
        drop = max(start - done, 0)
        writer.write(z[drop:], y.numpy()[drop:])
        if not start and done == first:  # with the first latents, not before: a refused start leaves no record
            write_json(options, Path(out) / OPTIONS_FILE)
        done += len(z)
        if bar is not None:
            bar.update(len(z) - drop)
    if bar is not None:
        bar.close()
    writer.close()
    return writer.num_written
