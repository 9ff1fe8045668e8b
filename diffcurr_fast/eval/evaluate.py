"""Evaluation of generated images against reference statistics: FD, IS, precision/recall, extractor named; with the
labels the samples were generated for, the conditional accuracy (the extractor's classifier against those labels).

Sample files: ``.npz`` with ``images`` (N, C, H, W) float in [-1, 1], or ADM's ``arr_0`` (N, H, W, C) uint8; the
labels, when the file carries them, in ``y`` (beside ``x``, as ``diffcurr-fast sample`` writes them) or ``arr_1``.
Reference files: ``.npz`` with ``mu``, ``sigma`` and (optional, needed for precision/recall) ``features``,
plus the ``extractor`` that produced them; or the keyword ``digits`` / ``mnist5k`` for the built-in data (mnist5k:
its held-out split).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from diffcurr_fast._files import load_npz, npz_files
from diffcurr_fast.data.builtin import load_mnist5k_tensors
from diffcurr_fast.eval.features import FeatureExtractor, load_digits_data
from diffcurr_fast.eval.metrics import (
    conditional_accuracy,
    feature_statistics,
    frechet_distance,
    inception_score,
    precision_recall,
)
from diffcurr_fast.runs.checkpoint import load_checkpoint, resolve_checkpoint
from diffcurr_fast.runs.config import TrainConfig, config_from_dict
from diffcurr_fast.runs.posthoc_ema import reconstruct
from diffcurr_fast.runs.sampling import batch_slices, build_schedule, checkpoint_dit, sample_batch, sampling_readout
from diffcurr_fast.runs.sections import resolve_sampler


def load_images(path: str | os.PathLike, what: str = "samples file") -> torch.Tensor:
    """Images (N, C, H, W) float32 in [-1, 1] from a samples ``.npz`` (``what`` names it in errors, e.g.
    ``--samples``): ``images``, ``x`` (as written by ``diffcurr-fast sample``) or ADM's uint8 ``arr_0`` (N, H, W, C).
    Latents (``x`` of a latent model: not 1 or 3 channels, or values outside [-1, 1]) are refused with the flag that
    decodes them (``eval --vae``), and NaN or inf values with the first sample holding them."""
    return _images(path, load_npz(path, what))


def _images(path: str | os.PathLike, arrays: dict[str, np.ndarray]) -> torch.Tensor:
    """``load_images`` of the arrays already read from ``path``."""
    key, x = _sample_array(path, arrays)
    if key == "arr_0":
        return x
    if x.shape[1] not in (1, 3):
        raise ValueError(
            f"{path}: '{key}' holds {x.shape[1]}-channel latents, not 1- or 3-channel images; decode "
            "them with --vae DIR (the diffusers AutoencoderKL of the training data)"
        )
    if float(x.min()) < -1.001 or float(x.max()) > 1.001:
        raise ValueError(
            f"{path}: '{key}' must be in [-1, 1], got [{float(x.min()):.3g}, {float(x.max()):.3g}]; latents need "
            "--vae DIR to decode them"
        )
    return x.clamp(-1, 1)


LABEL_KEYS = {"x": "y", "images": "y", "arr_0": "arr_1"}  # a samples .npz: the labels beside each image array


def load_labels(path: str | os.PathLike, num: int, what: str = "samples file") -> torch.Tensor | None:
    """The labels (N,) int64 the samples of ``path`` were generated for (``LABEL_KEYS``), or None when the file
    carries none; ValueError naming the file when they are not ``num`` integers >= 0."""
    arrays = load_npz(path, what)
    key = next((LABEL_KEYS[k] for k in IMAGE_KEYS if k in arrays), None)
    if key not in arrays:
        return None
    y = arrays[key]
    if y.shape != (num,) or not np.issubdtype(y.dtype, np.integer) or (y.size and y.min() < 0):
        raise ValueError(
            f"{path}: '{key}' must hold one integer label >= 0 per sample ({num},), got {y.dtype} {y.shape}"
        )
    return torch.from_numpy(y.astype(np.int64))


def load_latents(path: str | os.PathLike, what: str = "samples file") -> torch.Tensor:
    """The unscaled latents z (N, C, H, W) float32 of a latent model's samples ``.npz`` (``x``, as
    ``diffcurr-fast sample`` writes them without ``--vae``), for ``eval --vae`` to decode."""
    key, x = _sample_array(path, load_npz(path, what))
    if key != "x":
        raise ValueError(
            f"{path}: --vae decodes the latents 'x' (N, C, H, W) of `diffcurr-fast sample`, but this "
            f"file holds '{key}' images; drop --vae"
        )
    return x


def _sample_array(path: str | os.PathLike, arrays: dict[str, np.ndarray]) -> tuple[str, torch.Tensor]:
    """(key, float32 array (N, C, H, W)) of the ``arrays`` of the samples ``.npz`` ``path``; ``arr_0`` already
    converted to [-1, 1]. ValueError naming the file for an array of no images, and the first sample for NaN or
    inf values."""
    key = next((k for k in IMAGE_KEYS if k in arrays), None)
    if key is None:
        raise ValueError(f"{path}: expected an array 'images' (N, C, H, W) or 'arr_0', found {sorted(arrays)}")
    a = arrays[key]
    if key == "arr_0" and (a.dtype != np.uint8 or a.ndim != 4):
        raise ValueError(f"{path}: 'arr_0' must be uint8 (N, H, W, C), got {a.dtype} {a.shape}")
    if a.ndim != 4:
        raise ValueError(f"{path}: '{key}' must be (N, C, H, W), got shape {a.shape}")
    if a.size == 0:
        raise ValueError(f"{path}: '{key}' holds no images (shape {a.shape}); give a file of samples to evaluate")
    if key == "arr_0":
        return key, torch.from_numpy(a).permute(0, 3, 1, 2).float() / 127.5 - 1.0  # (N, C, H, W)
    x = torch.from_numpy(np.asarray(a, dtype=np.float32))
    bad = (~torch.isfinite(x)).flatten(1).any(1).nonzero()
    if len(bad):
        raise ValueError(
            f"{path}: sample {int(bad[0])} of '{key}' holds NaN or inf values ({len(bad)} of {len(x)} "
            "samples); the model that made them is not usable"
        )
    return key, x


def checkpoint_model(
    ckpt: str | os.PathLike,
    *,
    weights: str = "ema",
    device: str | torch.device = "cpu",
    ema_length: float | None = None,
) -> tuple[torch.nn.Module, TrainConfig]:
    """(the model of a training checkpoint (file or run directory) with its ``weights``, on ``device`` in eval mode;
    its config). ``ema_length``: instead, the post-hoc EMA of that sigma_rel reconstructed from the run's snapshots
    (``runs.posthoc_ema.reconstruct``, at the newest snapshot up to the checkpoint's step). Only pixel-space models (1
    or 3 channels) qualify: latents would need the VAE decoder. A model with NaN or inf weights is refused."""
    if weights not in ("ema", "model"):
        raise ValueError(f"weights must be 'ema' or 'model', got {weights!r}")
    if ema_length is not None and weights != "ema":
        raise ValueError("--ema-length reconstructs EMA weights: drop --weights model")
    path = resolve_checkpoint(ckpt)
    state = load_checkpoint(path)
    cfg = config_from_dict(state["config"], record=True)
    m = cfg.model
    if m.in_channels not in (1, 3):
        raise ValueError(
            f"{ckpt}: the model generates {m.in_channels}-channel latents, not images; write them with "
            "`diffcurr-fast sample --out s.npz` and evaluate with --samples s.npz --vae DIR"
        )
    if ema_length is not None:  # the run directory holds checkpoints/ and phema/
        sd, _ = reconstruct(path.parent.parent, ema_length, step=int(state["step"]))
    else:
        sd = state["ema"]["module"] if weights == "ema" else state["model"]
    model = checkpoint_dit(state, cfg, sd, f"checkpoint {path} ({weights} weights)")
    return model.to(device).eval(), cfg


def check_draw(num: int, batch_size: int) -> None:
    """ValueError naming the option unless ``num`` >= 2 (the features' covariance needs two) and ``batch_size`` is
    a positive int; the commands check this before a checkpoint is read."""
    if num < 2:
        raise ValueError(f"--num-samples must be >= 2 to evaluate, got {num}")
    batch_slices(num, batch_size)


def samples_from_model(
    model: torch.nn.Module,
    cfg: TrainConfig,
    num: int,
    *,
    sampler: str = "auto",
    steps: int = 50,
    cfg_scale: float = 1.0,
    seed: int = 0,
    device: str | torch.device = "cpu",
    batch_size: int = 64,
    progress: bool = False,
    rank: int = 0,
    world: int = 1,
) -> torch.Tensor:
    """Images (N, C, H, W) in [-1, 1] sampled from ``model`` (trained with ``cfg``), labels cycled over the classes,
    in batches of ``batch_size`` (seeded as ``diffcurr-fast sample`` seeds them); ``sampler`` ``auto`` is the
    formulation's own (``resolve_sampler``). With ``world`` > 1 (a running process group) rank ``rank`` draws its
    share of the batches and every rank returns all N images: the same as one process draws."""

    check_draw(num, batch_size)
    m = cfg.model
    sampler = resolve_sampler(sampler, cfg.diffusion.formulation)
    slices = batch_slices(num, batch_size, rank, world)
    labels = torch.arange(num, dtype=torch.long) % m.num_classes
    schedule, parts = build_schedule(cfg), {}
    readout = replace(sampling_readout(cfg), clip_denoised=True)  # pixel models (checked above): x0 in [-1, 1]
    for b, sl in tqdm(slices, desc="sampling", unit="batch", disable=not progress, dynamic_ncols=True):
        x = sample_batch(
            model,
            schedule,
            labels=labels[sl],
            batch=b,
            seed=seed,
            sampler=sampler,
            steps=steps,
            channels=m.in_channels,
            size=m.input_size,
            num_classes=m.num_classes,
            readout=readout,
            cfg_scale=cfg_scale,
            device=device,
        )
        parts[b] = (x / cfg.data.scale).clamp(-1, 1).float().cpu()
    if world > 1:  # every rank gets every rank's batches
        shares: list[dict[int, torch.Tensor] | None] = [None] * world
        dist.all_gather_object(shares, parts)
        parts = {b: x for share in shares for b, x in share.items()}
    return torch.cat([parts[b] for b in sorted(parts)])  # (N, C, H, W)


@dataclass
class Reference:
    """Reference statistics: mean, covariance, optional features (for precision/recall), who made them."""

    mu: np.ndarray
    sigma: np.ndarray
    features: np.ndarray | None
    extractor: str
    source: str
    count: int

    def save(self, path: str | os.PathLike) -> None:
        """Write as ``.npz`` (pytorch-fid's ``mu``/``sigma`` keys plus ``features``, ``extractor``, ``source``)."""
        extra = {"features": self.features} if self.features is not None else {}
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as fh:  # written as named (np.savez of a name would append .npz), then renamed
            np.savez(
                fh,
                mu=self.mu,
                sigma=self.sigma,
                extractor=self.extractor,
                source=self.source,
                count=self.count,
                **extra,
            )
        os.replace(tmp, path)


def reference_from_images(images: torch.Tensor, extractor: FeatureExtractor, source: str) -> Reference:
    """Statistics and features of ``images`` (N, C, H, W) in [-1, 1] under ``extractor``."""
    feats, _ = extractor(images)
    mu, sigma = feature_statistics(feats)
    return Reference(mu, sigma, feats, extractor.name, source, len(feats))


IMAGE_KEYS = ("images", "x", "arr_0")  # a samples or images .npz: the first of these it holds (``_sample_array``)


def statistics_extractor(path: str | os.PathLike, what: str = "reference") -> str | None:
    """What the reference ``.npz`` ``path`` holds, read from its names (and its ``extractor`` entry) alone: the
    extractor of its statistics (``mu``, ``sigma``; ``inception`` when unnamed, as pytorch-fid writes them), or None
    for images; ValueError naming it when it holds neither. ``load_reference`` and the trainer's preflight read it."""
    names = npz_files(path, what)
    if {"mu", "sigma"} <= set(names):
        return str(load_npz(path, what, ("extractor",))["extractor"]) if "extractor" in names else "inception"
    if not set(IMAGE_KEYS) & set(names):
        raise ValueError(
            f"{what} {str(path)!r} holds neither statistics (mu, sigma) nor images ({', '.join(IMAGE_KEYS)}): it "
            f"holds {sorted(names)}"
        )
    return None


def load_reference(spec: str, extractor: FeatureExtractor, what: str = "reference") -> Reference:
    """A reference: ``"digits"`` (all 1,797 built-in digits), ``"mnist5k"`` (the 1,000 images of its held-out
    split) or a ``.npz`` of statistics or of images (``what`` names it in errors, e.g. ``--ref``)."""
    if spec == "digits":
        xtr, _, xte, _ = load_digits_data()
        return reference_from_images(torch.cat([xtr, xte]), extractor, "sklearn digits (1797 images)")
    if spec == "mnist5k":
        x, _ = load_mnist5k_tensors("heldout")
        return reference_from_images(x, extractor, f"mnist5k held-out split ({len(x)} images)")
    if not os.path.isfile(spec):
        raise FileNotFoundError(
            f"reference {spec} not found (a statistics .npz, an images .npz, 'digits' or 'mnist5k')"
        )
    made_by = statistics_extractor(spec, what)
    f = load_npz(spec, what)
    if made_by is None:
        return reference_from_images(_images(spec, f), extractor, spec)
    if made_by != extractor.name:
        raise ValueError(
            f"{spec} holds {made_by!r} statistics but the extractor is {extractor.name!r}; "
            f"use --extractor {made_by} or recompute the reference"
        )
    feats = np.asarray(f["features"], dtype=np.float64) if "features" in f else None
    src = str(f["source"]) if "source" in f else spec
    count = int(f["count"]) if "count" in f else (len(feats) if feats is not None else 0)
    return Reference(f["mu"].astype(np.float64), f["sigma"].astype(np.float64), feats, made_by, src, count)


@dataclass
class EvalResult:
    """Metric values of one evaluation; ``label`` says what the features are."""

    extractor: str
    label: str
    num_samples: int
    num_reference: int
    fd: float
    inception_score: float
    inception_score_std: float
    precision: float | None
    recall: float | None
    cond_acc: float | None = None  # the classifier's class against the requested label (``evaluate``'s labels)

    def as_dict(self) -> dict:
        return asdict(self)

    def lines(self) -> list[str]:
        """Human-readable report, extractor first."""
        name = "FID" if self.extractor == "inception" else "FD"
        out = [
            f"extractor: {self.extractor} ({self.label})",
            f"samples: {self.num_samples}, reference: {self.num_reference or 'unknown count'}",
            f"{name}: {self.fd:.4f}",
            f"IS: {self.inception_score:.4f} +- {self.inception_score_std:.4f}",
        ]
        if self.precision is None:
            out.append("precision/recall: n/a (reference has statistics only, no features)")
        else:
            out.append(f"precision: {self.precision:.4f}, recall: {self.recall:.4f}")
        if self.cond_acc is not None:
            out.append(
                f"conditional accuracy: {self.cond_acc:.4f} (the {self.extractor} classifier's class of each sample "
                "against the label it was generated for)"
            )
        return out


def evaluate(
    images: torch.Tensor,
    reference: Reference,
    extractor: FeatureExtractor,
    splits: int = 10,
    k: int = 3,
    labels: torch.Tensor | None = None,
) -> EvalResult:
    """FD/IS/precision/recall of ``images`` (N, C, H, W) in [-1, 1] against ``reference``; with ``labels`` (N,), the
    classes the images were generated for, and an extractor whose classes are a dataset's labels
    (``FeatureExtractor.classes``), their conditional accuracy too."""
    if reference.extractor != extractor.name:
        raise ValueError(f"reference made with {reference.extractor!r}, extractor is {extractor.name!r}")
    feats, probs = extractor(images)
    if feats.shape[0] < 2:
        raise ValueError(f"need at least 2 samples, got {feats.shape[0]}")
    if reference.mu.shape != (feats.shape[1],):
        raise ValueError(f"reference has dimension {reference.mu.shape}, features have {feats.shape[1]}")
    mu, sigma = feature_statistics(feats)
    fd = frechet_distance(mu, sigma, reference.mu, reference.sigma)
    is_mean, is_std = inception_score(probs, splits=min(splits, len(probs)))
    precision = recall = None
    if reference.features is not None:
        precision, recall = precision_recall(reference.features, feats, k=k)
    acc = conditional_accuracy(probs, labels) if labels is not None and extractor.classes else None
    return EvalResult(
        extractor.name, extractor.label, len(feats), reference.count, fd, is_mean, is_std, precision, recall, acc
    )
