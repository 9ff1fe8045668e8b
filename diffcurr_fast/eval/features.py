"""Pluggable feature extractors for the metrics: the FID Inception (user-supplied weights) and two small CNNs.

* ``"inception"``: ``FIDInceptionV3`` with pytorch-fid's weights file; pool3 features (2048) and 1008-way
  class probabilities. This is the extractor whose Frechet distance is FID.
* ``"digits"``: a small CNN trained on scikit-learn's 8x8 digits (``load_digits``, scaled to [-1, 1]) and cached
  to a file; penultimate features (64) and 10-way probabilities. For the built-in digits data only: its
  numbers are labelled ``DIGITS_LABEL`` everywhere and are not comparable with Inception FID.
* ``"mnist5k"``: the same kind of CNN for the built-in 28x28 MNIST (``data.dataset=mnist5k``), trained once on its
  4,000-image training split (never on the held-out split the evaluator's reference comes from), its accuracy
  measured on the held-out 1,000, cached beside the digits one; penultimate features (64). Labelled
  ``MNIST5K_LABEL``.
"""

from __future__ import annotations

import abc
import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from diffcurr_fast.data.builtin import load_digits_tensors, load_mnist5k_tensors
from diffcurr_fast.eval.inception import load_fid_inception
from diffcurr_fast.runs.sections import EVAL_SHAPES

EXTRACTORS = ("digits", "mnist5k", "inception")
DIGITS_LABEL = "digits-classifier features: not Inception FID"
MNIST5K_LABEL = "mnist5k-classifier features: not Inception FID"
INCEPTION_LABEL = "FID Inception-v3 pool3 features (pytorch-fid weights)"
DIGITS_CACHE_VERSION = 2
MNIST5K_CACHE_VERSION = 1


def default_cache_dir() -> Path:
    """``$DIFFCURR_FAST_CACHE`` or ``~/.cache/diffcurr_fast``."""
    return Path(os.environ.get("DIFFCURR_FAST_CACHE", Path.home() / ".cache" / "diffcurr_fast"))


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """Run torch CPU ops on one thread (the digits network is tiny: a thread pool costs more than it gains)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def load_digits_data(seed: int = 0, test_fraction: float = 0.2) -> tuple[torch.Tensor, ...]:
    """scikit-learn digits as (x_train (N, 1, 8, 8) in [-1, 1], y_train, x_test, y_test), stratified split."""
    # optional dependency (scikit-learn, as the digits themselves): imported when they are split
    from sklearn.model_selection import train_test_split

    x, y = load_digits_tensors()
    xtr, xte, ytr, yte = train_test_split(
        x.numpy(), y.numpy(), test_size=test_fraction, random_state=seed, stratify=y.numpy()
    )
    return torch.from_numpy(xtr), torch.from_numpy(ytr), torch.from_numpy(xte), torch.from_numpy(yte)


class DigitsCNN(nn.Module):
    """Small CNN for 8x8 digits: features (N, 64) from ``features``, logits (N, 10) from ``forward``."""

    def __init__(self, width: int = 16, feature_dim: int = 64, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.proj = nn.Linear(2 * width * 16, feature_dim)
        self.head = nn.Linear(feature_dim, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        h = F.max_pool2d(F.relu(self.conv1(x)), 2)  # (N, w, 4, 4)
        h = F.relu(self.conv2(h))  # (N, 2w, 4, 4)
        return F.relu(self.proj(h.flatten(1)))  # (N, feature_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))  # (N, num_classes)


def _train_classifier(build, train, heldout, epochs: int, seed: int, lr: float) -> tuple[nn.Module, float]:
    """``build()`` (under ``seed``) trained on ``train`` = (x, y) with Adam and a cosine schedule, batches of 64 in
    an order drawn from ``seed``, on one thread; returns (model in eval mode, accuracy on ``heldout``)."""
    (xtr, ytr), (xte, yte) = train, heldout
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = build()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, epochs)
    with single_thread():
        for _ in range(epochs):
            model.train()
            perm = torch.randperm(len(xtr), generator=gen)
            for s in range(0, len(xtr), 64):
                b = perm[s : s + 64]
                loss = F.cross_entropy(model(xtr[b]), ytr[b])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            sched.step()
        model.eval()
        with torch.no_grad():
            acc = float((model(xte).argmax(1) == yte).float().mean())
    return model, acc


def train_digits_classifier(epochs: int = 12, seed: int = 0, lr: float = 3e-3) -> tuple[DigitsCNN, float]:
    """Train ``DigitsCNN`` on the digits training split; returns (model in eval mode, held-out accuracy)."""
    xtr, ytr, xte, yte = load_digits_data(seed)
    return _train_classifier(DigitsCNN, (xtr, ytr), (xte, yte), epochs, seed, lr)


class MnistCNN(nn.Module):
    """Small CNN for 28x28 MNIST: features (N, 64) from ``features``, logits (N, 10) from ``forward``."""

    def __init__(self, width: int = 16, feature_dim: int = 64, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.proj = nn.Linear(2 * width * 49, feature_dim)
        self.head = nn.Linear(feature_dim, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        h = F.max_pool2d(F.relu(self.conv1(x)), 2)  # (N, w, 14, 14)
        h = F.max_pool2d(F.relu(self.conv2(h)), 2)  # (N, 2w, 7, 7)
        return F.relu(self.proj(h.flatten(1)))  # (N, feature_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))  # (N, num_classes)


def train_mnist5k_classifier(epochs: int = 6, seed: int = 0, lr: float = 3e-3) -> tuple[MnistCNN, float]:
    """Train ``MnistCNN`` on mnist5k's training split; returns (model in eval mode, accuracy on the held-out split)."""
    train, heldout = load_mnist5k_tensors("train"), load_mnist5k_tensors("heldout")
    return _train_classifier(MnistCNN, train, heldout, epochs, seed, lr)


def _cached_classifier(
    name: str, version: int, build, train, cache, retrain: bool, overwrite: bool = False
) -> tuple[nn.Module, float]:
    """The classifier ``name`` from ``cache`` (default ``default_cache_dir()/<name>_classifier_v<version>.pt``),
    trained (``train()``) and saved there atomically first when missing or stale; (model, held-out accuracy). A
    file named by ``cache`` that is not a current cache (a user's file) is refused unless ``overwrite``; the default
    cache is retrained when stale. ``retrain``: train again and replace a current cache (named or default)."""
    path = Path(cache) if cache is not None else default_cache_dir() / f"{name}_classifier_v{version}.pt"
    ours = False  # a current cache of this classifier: loaded, or replaced when ``retrain``
    if path.exists():
        try:
            blob = torch.load(path, map_location="cpu", weights_only=True)
            model = build()
            model.load_state_dict(blob["state_dict"])
            ours = int(blob["version"]) == version
        except Exception:  # torch.load of a foreign file raises any of several types
            pass  # unreadable or stale cache: retrain below and replace it (only ours, or when asked)
        if ours and not retrain:
            return model.eval(), float(blob["accuracy"])
    if cache is not None and path.exists() and not ours and not overwrite:
        raise FileExistsError(
            f"--{name}-cache {str(path)!r} exists and is not a {name} classifier cache (version "
            f"{version}); pass --overwrite to replace it, or name another file"
        )
    model, acc = train()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    torch.save({"version": version, "accuracy": acc, "state_dict": model.state_dict()}, tmp)
    os.replace(tmp, path)
    return model, acc


def digits_classifier(
    cache: str | os.PathLike | None = None, retrain: bool = False, overwrite: bool = False
) -> tuple[DigitsCNN, float]:
    """The digits classifier from ``cache`` (default ``default_cache_dir()/digits_classifier_v2.pt``), trained and
    saved there first when missing; returns (model, held-out accuracy). ``overwrite``: see ``_cached_classifier``."""
    return _cached_classifier(
        "digits", DIGITS_CACHE_VERSION, DigitsCNN, train_digits_classifier, cache, retrain, overwrite
    )


def mnist5k_classifier(cache: str | os.PathLike | None = None, retrain: bool = False) -> tuple[MnistCNN, float]:
    """The mnist5k classifier from ``cache`` (default ``default_cache_dir()/mnist5k_classifier_v1.pt``), trained on
    the training split and saved there first when missing; returns (model, held-out accuracy)."""
    return _cached_classifier("mnist5k", MNIST5K_CACHE_VERSION, MnistCNN, train_mnist5k_classifier, cache, retrain)


class FeatureExtractor(abc.ABC):
    """Maps images (N, C, H, W) in [-1, 1] to features (N, D) and class probabilities (N, K). ``classes``: the
    built-in dataset whose labels its classes are ('' when they are no dataset's labels of ours), so that the
    conditional accuracy of samples generated for those labels can be read from its probabilities."""

    name: str
    label: str
    dim: int
    classes: str = ""

    @abc.abstractmethod
    def _forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(features, logits) of one batch."""

    @torch.no_grad()
    def __call__(self, images: torch.Tensor | np.ndarray, batch_size: int = 256) -> tuple[np.ndarray, np.ndarray]:
        """(features (N, D) float64, probabilities (N, K) float64) in batches of ``batch_size``."""
        x = torch.as_tensor(images)
        if x.ndim != 4:
            raise ValueError(f"images must be (N, C, H, W), got shape {tuple(x.shape)}")
        if x.is_floating_point() and x.numel() and (x.min() < -1.001 or x.max() > 1.001):
            raise ValueError(f"images must be in [-1, 1], got range [{float(x.min()):.3g}, {float(x.max()):.3g}]")
        feats, probs = [], []
        for s in range(0, x.shape[0], batch_size):
            f, logits = self._forward(x[s : s + batch_size].to(self.device, torch.float32))
            feats.append(f.double().cpu())
            probs.append(torch.softmax(logits.double(), dim=1).cpu())
        return torch.cat(feats).numpy(), torch.cat(probs).numpy()


class DigitsExtractor(FeatureExtractor):
    """Digits-classifier features of 1x8x8 images. Other shapes are refused unless ``convert`` (then the channels
    are averaged and the images resized to 8x8: the score is no longer one of digits-like samples)."""

    name, label, dim, classes = "digits", DIGITS_LABEL, 64, "digits"

    def __init__(
        self,
        cache: str | os.PathLike | None = None,
        device: str | torch.device = "cpu",
        convert: bool = False,
        overwrite: bool = False,
    ) -> None:
        self.convert = convert
        self.model, self.accuracy = digits_classifier(cache, overwrite=overwrite)
        self.device = torch.device(device)
        self.model.to(self.device)

    def __call__(self, images: torch.Tensor | np.ndarray, batch_size: int = 256) -> tuple[np.ndarray, np.ndarray]:
        if self.device.type != "cpu":
            return super().__call__(images, batch_size)
        with single_thread():
            return super().__call__(images, batch_size)

    def _forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if tuple(images.shape[1:]) != EVAL_SHAPES["digits"] and not self.convert:
            c, h, w = images.shape[1:]
            raise ValueError(
                f"the digits extractor takes 1x8x8 images, got {c}x{h}x{w}; pass --convert to average "
                "the channels and resize to 8x8 (or use --extractor inception)"
            )
        x = images.mean(dim=1, keepdim=True) if images.shape[1] != 1 else images  # (N, 1, H, W)
        if x.shape[-2:] != (8, 8):
            x = F.interpolate(x, size=(8, 8), mode="bilinear", antialias=True, align_corners=False)  # (N, 1, 8, 8)
        f = self.model.features(x)  # (N, 64)
        return f, self.model.head(f)


class Mnist5kExtractor(FeatureExtractor):
    """mnist5k-classifier features of 1x28x28 images (other shapes are refused)."""

    name, label, dim, classes = "mnist5k", MNIST5K_LABEL, 64, "mnist5k"

    def __init__(self, cache: str | os.PathLike | None = None, device: str | torch.device = "cpu") -> None:
        self.model, self.accuracy = mnist5k_classifier(cache)
        self.device = torch.device(device)
        self.model.to(self.device)

    def __call__(self, images: torch.Tensor | np.ndarray, batch_size: int = 256) -> tuple[np.ndarray, np.ndarray]:
        if self.device.type != "cpu":
            return super().__call__(images, batch_size)
        with single_thread():
            return super().__call__(images, batch_size)

    def _forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if tuple(images.shape[1:]) != EVAL_SHAPES["mnist5k"]:
            c, h, w = images.shape[1:]
            raise ValueError(
                f"the mnist5k extractor takes 1x28x28 images, got {c}x{h}x{w} (use --extractor "
                "inception for other images)"
            )
        f = self.model.features(images)  # (N, 64)
        return f, self.model.head(f)


class InceptionExtractor(FeatureExtractor):
    """FID Inception pool3 features and 1008-way probabilities from a user-supplied weights file (its classes are
    not a dataset's labels of ours: no conditional accuracy)."""

    name, label, dim = "inception", INCEPTION_LABEL, 2048

    def __init__(self, weights: str | os.PathLike | None, device: str | torch.device = "cpu") -> None:
        if weights is None:
            raise ValueError(
                "the inception extractor needs --inception-weights PATH (pytorch-fid's "
                "pt_inception-2015-12-05-6726825d.pth); it is never downloaded"
            )
        self.device = torch.device(device)
        self.model = load_fid_inception(weights, self.device)

    def _forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f = self.model(images)  # (N, 2048)
        return f, self.model.logits(f)


def get_extractor(
    name: str,
    *,
    inception_weights: str | os.PathLike | None = None,
    digits_cache: str | os.PathLike | None = None,
    device: str | torch.device = "cpu",
    convert: bool = False,
    overwrite: bool = False,
) -> FeatureExtractor:
    """The feature extractor called ``name`` (one of ``EXTRACTORS``); ``convert``, ``overwrite`` (of a
    ``digits_cache`` file that is not a cache): see ``DigitsExtractor`` and ``digits_classifier``."""
    if name == "digits":
        return DigitsExtractor(digits_cache, device, convert, overwrite)
    if name == "mnist5k":
        return Mnist5kExtractor(None, device)
    if name == "inception":
        return InceptionExtractor(inception_weights, device)
    raise ValueError(f"extractor must be one of {EXTRACTORS}, got {name!r}")
