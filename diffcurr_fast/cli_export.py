"""``diffcurr-fast export RUN|CKPT --to diffusers OUT``: a trained DiT as a diffusers model.

Reads a training checkpoint (a ``ckpt_*.pt`` or a run directory: its newest checkpoint; EMA weights unless
``--weights model``) and writes, with diffusers' own ``save_pretrained``:

- ``OUT/transformer``: a ``DiTTransformer2DModel`` (``out_channels`` = 2C when the variance is learned);
- ``OUT/scheduler``: the run's schedule. DDPM: a ``DDIMScheduler`` with the run's betas (``trained_betas``), its
  prediction type (eps / x0 / v as epsilon / sample / v_prediction) and clipping; flow: a
  ``FlowMatchEulerDiscreteScheduler`` (the same linear interpolant, sigma = t); EDM: an ``EDMEulerScheduler``
  with the run's sigma_data, sigma range and Karras grid (its preconditioning is EDM's Table 1, as ours);
- with ``--vae DIR`` (a latent model's ``AutoencoderKL``): the whole ``DiTPipeline`` (``model_index.json``, the
  VAE with ``scaling_factor`` = ``data.scale``), loadable by ``DiTPipeline.from_pretrained(OUT)``.

``DiTPipeline`` itself can only run a DDPM export: it feeds ``scheduler.timesteps`` to the transformer and starts
from unit noise, while our flow model takes t in [0, 1] (not diffusers' 1000 t) and EDM starts at sigma_max. Those
two are written as transformer + scheduler for a loop of one's own (docs/training.md shows both).
An existing OUT is refused unless ``--overwrite`` (and then only a previous export is replaced).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from diffcurr_fast._files import check_writable, write_json
from diffcurr_fast.data.section import PIXEL_DATASETS
from diffcurr_fast.runs.config import config_from_dict
from diffcurr_fast.runs.sections import with_article

PREDICTION_TYPES = {"eps": "epsilon", "x0": "sample", "v": "v_prediction"}  # ours -> diffusers' prediction_type


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``export``."""
    parser.add_argument("source", metavar="RUN|CKPT", help="checkpoint file, or a run directory (newest checkpoint)")
    parser.add_argument("--to", required=True, choices=("diffusers",), help="target format")
    parser.add_argument("out", metavar="OUT", help="output directory (must not exist unless --overwrite)")
    parser.add_argument("--weights", default="ema", choices=("ema", "model"), help="EMA (default) or raw weights")
    parser.add_argument(
        "--vae", metavar="DIR", help="latent models: the diffusers AutoencoderKL directory; writes a whole DiTPipeline"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it is a previous export")


def _diffusers():
    try:  # optional dependency (the diffusers extra), imported when exporting
        import diffusers
    except ImportError:
        raise ImportError("export --to diffusers needs diffusers: pip install 'diffcurr-fast[diffusers]'") from None
    return diffusers


def scheduler_config(cfg: Any) -> tuple[str, dict[str, Any]]:
    """(diffusers scheduler class name, its config) describing the formulation of a ``TrainConfig``."""
    # imported here, not at the top: keeps --help free of torch
    from diffcurr_fast.runs.sampling import build_schedule, pixel_range

    d = cfg.diffusion
    if d.formulation == "ddpm":
        betas = build_schedule(cfg).betas  # (T,) float64
        return "DDIMScheduler", dict(
            num_train_timesteps=d.num_timesteps,
            trained_betas=betas.tolist(),
            prediction_type=PREDICTION_TYPES[d.prediction],
            clip_sample=pixel_range(cfg),
            clip_sample_range=1.0,
            set_alpha_to_one=True,
            steps_offset=0,
            timestep_spacing="leading",
        )
    if d.formulation == "flow":  # x_t = (1 - t) x0 + t eps, v = eps - x0: diffusers' flow matching with sigma = t
        return "FlowMatchEulerDiscreteScheduler", dict(num_train_timesteps=d.num_timesteps, shift=1.0)
    if d.formulation == "edm":  # EDM Table 1: c_in, c_skip, c_out, c_noise = ln(sigma) / 4; F is "epsilon" there
        return "EDMEulerScheduler", dict(
            sigma_min=d.sigma_min,
            sigma_max=d.sigma_max,
            sigma_data=d.sigma_data,
            sigma_schedule="karras",
            rho=7.0,
            prediction_type="epsilon",
            final_sigmas_type="zero",
        )
    raise ValueError(f"diffusion.formulation {d.formulation!r} has no diffusers scheduler")


def load_model(source: str, weights: str = "ema"):
    """(model on CPU with the checkpoint's weights, its TrainConfig, the checkpoint path)."""
    # imported here, not at the top: keeps --help free of torch
    from diffcurr_fast.runs.checkpoint import load_checkpoint, resolve_checkpoint
    from diffcurr_fast.runs.sampling import checkpoint_dit

    path = resolve_checkpoint(source)
    state = load_checkpoint(path)
    cfg = config_from_dict(state["config"], record=True)
    sd = state["ema"]["module"] if weights == "ema" else state["model"]
    model = checkpoint_dit(state, cfg, sd, f"checkpoint {str(path)!r} ({weights} weights)")
    return model.eval(), cfg, path


def to_diffusers_transformer(model):
    """A diffusers ``DiTTransformer2DModel`` holding ``model``'s weights (loaded strictly)."""
    # imported here, not at the top: keeps --help free of torch
    from diffcurr_fast.models.diffusers_dit import diffusers_config, to_diffusers_state

    diffusers = _diffusers()
    config = diffusers_config(model.config())
    config.pop("_class_name")
    net = diffusers.DiTTransformer2DModel(**config)
    net.load_state_dict(to_diffusers_state(model.state_dict(), model.config()), strict=True)
    return net.eval()


def _check_vae_fits(vae: str, cfg) -> None:
    """ValueError unless ``cfg`` is a latent model that the AutoencoderKL at ``vae`` decodes: the pixel-space datasets
    are refused by name, and any other model (``npz`` arrays) by its channels against the VAE's latent channels."""
    if cfg.data.dataset in PIXEL_DATASETS:
        raise ValueError(f"--vae is for latent models; this one was trained on pixels ({cfg.data.dataset!r})")
    path = Path(vae) / "config.json"
    try:
        latent = int(json.loads(path.read_text())["latent_channels"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"--vae {vae!r} is not a diffusers AutoencoderKL directory (reading {path}: {exc})") from None
    if latent != cfg.model.in_channels:
        raise ValueError(
            f"--vae {vae!r} makes {latent}-channel latents, but this model takes {cfg.model.in_channels} channels "
            "(a pixel-space model, or latents of another VAE)"
        )


def _check_out(out: Path, overwrite: bool) -> None:
    """FileExistsError / ValueError in one line unless ``out`` can be written: absent, or a previous export with
    ``overwrite``, and where it goes accepts new entries (``check_writable``); checked before the model is read."""
    if out.exists():
        if not overwrite:
            raise FileExistsError(f"{str(out)!r} exists; pass --overwrite to replace it (a previous export only)")
        if not (out.is_dir() and (out / "transformer" / "config.json").is_file()):
            raise FileExistsError(
                f"{str(out)!r} exists and is not a diffusers export (no transformer/config.json); "
                "--overwrite replaces only a previous export: choose another OUT"
            )
    check_writable(out, "OUT", "choose another OUT", directory=True)


def export_diffusers(
    source: str, out: str | Path, *, weights: str = "ema", vae: str | None = None, overwrite: bool = False
) -> dict[str, Any]:
    """Write the checkpoint ``source`` as a diffusers model directory ``out`` (see the module doc); returns a
    summary (``out``, ``scheduler``, ``pipeline``: whether a DiTPipeline was written)."""
    out = Path(out)
    _check_out(out, overwrite)
    diffusers = _diffusers()
    model, cfg, path = load_model(source, weights)
    if vae is not None and cfg.diffusion.formulation != "ddpm":
        raise ValueError(
            f"DiTPipeline runs DDPM models only; {with_article(cfg.diffusion.formulation)} model is written as "
            "transformer + scheduler: leave out --vae"
        )
    if cfg.data.dataset == "latents" and vae is None and cfg.diffusion.formulation == "ddpm":
        raise ValueError("this is a latent model: pass --vae DIR (its diffusers AutoencoderKL) to write a DiTPipeline")
    if vae is not None:
        _check_vae_fits(vae, cfg)
    net = to_diffusers_transformer(model)
    sched_name, sched_cfg = scheduler_config(cfg)
    scheduler = getattr(diffusers, sched_name)(**sched_cfg)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))  # written whole, then moved into place
    mask = os.umask(0o022)
    os.umask(mask)
    os.chmod(tmp, 0o777 & ~mask)  # mkdtemp makes it 0700; the export gets a directory's usual mode
    try:
        if vae is not None:
            autoencoder = diffusers.AutoencoderKL.from_pretrained(vae, local_files_only=True)
            autoencoder.register_to_config(scaling_factor=float(cfg.data.scale))  # the pipeline divides by it
            diffusers.DiTPipeline(transformer=net, vae=autoencoder, scheduler=scheduler).save_pretrained(tmp)
        else:
            net.save_pretrained(tmp / "transformer")
            scheduler.save_pretrained(tmp / "scheduler")
        info = {
            "checkpoint": str(path),
            "weights": weights,
            "formulation": cfg.diffusion.formulation,
            "prediction": cfg.diffusion.prediction,
            "num_classes": cfg.model.num_classes,
            "data_scale": cfg.data.scale,
        }
        write_json(info, tmp / "diffcurr_fast.json", indent=1)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"out": out, "scheduler": sched_name, "pipeline": vae is not None}


def run(args: argparse.Namespace) -> int:
    """Export and say what was written. Returns the exit status."""
    res = export_diffusers(args.source, args.out, weights=args.weights, vae=args.vae, overwrite=args.overwrite)
    what = "DiTPipeline" if res["pipeline"] else f"DiTTransformer2DModel + {res['scheduler']}"
    print(f"wrote {what} to {res['out']}")
    return 0
