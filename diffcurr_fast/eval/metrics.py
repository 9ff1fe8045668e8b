"""Sample-quality metrics on features: Frechet distance, Inception Score, k-NN precision/recall.

* ``frechet_distance`` follows pytorch-fid's ``calculate_frechet_distance`` step for step (Heusel et al. 2017,
  eq. (6)): ``scipy.linalg.sqrtm`` of ``sigma1 @ sigma2``; if that is not finite, ``eps`` is added to both
  diagonals and the square root retried; an imaginary part is dropped when the diagonal's is within 1e-3 of 0,
  and reported as an error otherwise.
* ``inception_score`` as in Salimans et al. 2016 (``exp E_x KL(p(y|x) || p(y))``), averaged over ``splits``.
* ``precision_recall``: improved precision and recall, Kynkaanniemi et al. 2019, eqs. (1)-(2), with k-NN
  hyperspheres (k = 3) around each feature of the reference set.
* ``conditional_accuracy``: the share of generated samples that the feature classifier assigns to the class they
  were generated for (FD cannot see a model that draws good images of the wrong class).
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import scipy.linalg
import torch

from diffcurr_fast._files import load_npz

ArrayLike = np.ndarray | torch.Tensor


def _np64(x: ArrayLike, name: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().to(torch.float64).numpy()
    arr = np.asarray(x, dtype=np.float64)
    if not np.isfinite(arr).all():
        raise ValueError(f"{name} contains NaN or Inf")
    return arr


def _sqrtm(a: np.ndarray) -> np.ndarray:
    """Principal square root via scipy, returning NaNs instead of raising when it does not converge."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return scipy.linalg.sqrtm(a)
        except (np.linalg.LinAlgError, ValueError):
            return np.full_like(a, np.nan)


def frechet_distance(mu1: ArrayLike, sigma1: ArrayLike, mu2: ArrayLike, sigma2: ArrayLike, eps: float = 1e-6) -> float:
    """Frechet distance between N(mu1, sigma1) and N(mu2, sigma2), numerically as pytorch-fid computes it.

    d^2 = ||mu1 - mu2||^2 + Tr(sigma1 + sigma2 - 2 (sigma1 sigma2)^(1/2))   # Heusel et al. 2017, eq. (6)
    """
    mu1, mu2 = np.atleast_1d(_np64(mu1, "mu1")), np.atleast_1d(_np64(mu2, "mu2"))
    sigma1, sigma2 = np.atleast_2d(_np64(sigma1, "sigma1")), np.atleast_2d(_np64(sigma2, "sigma2"))
    if mu1.ndim != 1 or mu1.shape != mu2.shape:
        raise ValueError(f"mu1 and mu2 must be vectors of one length, got {mu1.shape} and {mu2.shape}")
    d = mu1.shape[0]
    if sigma1.shape != (d, d) or sigma2.shape != (d, d):
        raise ValueError(f"sigma1 and sigma2 must be ({d}, {d}) to match mu, got {sigma1.shape} and {sigma2.shape}")
    diff = mu1 - mu2
    covmean = _sqrtm(sigma1.dot(sigma2))
    if not np.isfinite(covmean).all():
        warnings.warn(f"singular covariance product; adding {eps} to the diagonals", RuntimeWarning, stacklevel=2)
        offset = np.eye(d) * eps
        covmean = _sqrtm((sigma1 + offset).dot(sigma2 + offset))
    if np.iscomplexobj(covmean):
        if not np.allclose(np.diagonal(covmean).imag, 0, atol=1e-3):
            raise ValueError(f"sqrtm has an imaginary component of {np.max(np.abs(covmean.imag)):.3g}")
        covmean = covmean.real
    return float(diff.dot(diff) + np.trace(sigma1) + np.trace(sigma2) - 2 * np.trace(covmean))


def feature_statistics(features: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """(mean (D,), covariance (D, D)) of ``features`` (N, D) in float64, as pytorch-fid (``np.cov``, N - 1)."""
    f = _np64(features, "features")
    if f.ndim != 2 or f.shape[0] < 2:
        raise ValueError(f"features must be (N, D) with N >= 2, got shape {f.shape}")
    return f.mean(axis=0), np.cov(f, rowvar=False)


def save_statistics(path: str | os.PathLike, mu: ArrayLike, sigma: ArrayLike, **meta: str | int) -> None:
    """Write reference statistics as ``.npz`` with ``mu``, ``sigma`` (pytorch-fid's keys) and string metadata."""
    mu, sigma = _np64(mu, "mu"), _np64(sigma, "sigma")
    extra = {k: np.asarray(v) for k, v in meta.items()}
    np.savez(path, mu=mu, sigma=sigma, **extra)


def load_statistics(path: str | os.PathLike) -> tuple[np.ndarray, np.ndarray, dict[str, str]]:
    """(mu, sigma, metadata) from a statistics ``.npz`` (ours or pytorch-fid's); a file that is not one is named in
    one line (``_files.load_npz``)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"reference statistics {path} not found")
    f = load_npz(path, "reference statistics")
    if "mu" not in f or "sigma" not in f:
        raise ValueError(f"{path}: needs arrays 'mu' and 'sigma', found {sorted(f)}")
    meta = {k: str(v) for k, v in f.items() if k not in ("mu", "sigma")}
    return f["mu"].astype(np.float64), f["sigma"].astype(np.float64), meta


def inception_score(probs: ArrayLike, splits: int = 10) -> tuple[float, float]:
    """(mean, std) over ``splits`` of exp(E_x KL(p(y|x) || p(y)))   # Salimans et al. 2016, Sec. 4.

    ``probs`` (N, K) are class probabilities (rows sum to 1); split ``s`` takes rows ``[s N / splits, (s+1) N /
    splits)`` in order, as the reference implementation does.
    """
    p = _np64(probs, "probs")
    if p.ndim != 2:
        raise ValueError(f"probs must be (N, K), got shape {p.shape}")
    if splits < 1 or splits > p.shape[0]:
        raise ValueError(f"splits must be in [1, N={p.shape[0]}], got {splits}")
    if (p < 0).any() or not np.allclose(p.sum(axis=1), 1.0, atol=1e-3):
        raise ValueError("probs must be non-negative with rows summing to 1 (apply softmax to logits first)")
    scores = []
    n = p.shape[0]
    for s in range(splits):
        part = p[s * n // splits : (s + 1) * n // splits]
        py = part.mean(axis=0, keepdims=True)
        with np.errstate(divide="ignore", invalid="ignore"):
            kl = np.where(part > 0, part * (np.log(part) - np.log(py)), 0.0).sum(axis=1)
        scores.append(np.exp(kl.mean()))
    return float(np.mean(scores)), float(np.std(scores))


def knn_radii(features: torch.Tensor, k: int = 3, chunk: int = 1024) -> torch.Tensor:
    """Distance from each row to its k-th nearest other row (N,), float64."""
    f = features.to(torch.float64)
    n = f.shape[0]
    if not 1 <= k < n:
        raise ValueError(f"k must be in [1, N-1={n - 1}] for {n} features, got {k}")
    radii = torch.empty(n, dtype=torch.float64)
    for s in range(0, n, chunk):
        d = torch.cdist(f[s : s + chunk], f)  # (c, N)
        # The k+1-th smallest includes the zero distance to itself.
        radii[s : s + chunk] = d.kthvalue(k + 1, dim=1).values
    return radii


def _coverage(manifold: torch.Tensor, radii: torch.Tensor, queries: torch.Tensor, chunk: int = 1024) -> float:
    """Fraction of ``queries`` inside at least one hypersphere (centre ``manifold[i]``, radius ``radii[i]``)."""
    inside = 0
    for s in range(0, queries.shape[0], chunk):
        d = torch.cdist(queries[s : s + chunk], manifold)  # (c, M)
        inside += int((d <= radii[None, :]).any(dim=1).sum())
    return inside / queries.shape[0]


def precision_recall(real: ArrayLike, fake: ArrayLike, k: int = 3) -> tuple[float, float]:
    """Improved precision and recall of ``fake`` against ``real`` features (N, D), (M, D).

    precision = mean over fakes of 1[fake inside the real k-NN manifold]   # Kynkaanniemi et al. 2019, eq. (1)-(2)
    recall    = mean over reals of 1[real inside the fake k-NN manifold]
    """
    r = torch.from_numpy(_np64(real, "real"))
    g = torch.from_numpy(_np64(fake, "fake"))
    if r.ndim != 2 or g.ndim != 2 or r.shape[1] != g.shape[1]:
        raise ValueError(f"real and fake must be (N, D) with one D, got {tuple(r.shape)} and {tuple(g.shape)}")
    precision = _coverage(r, knn_radii(r, k), g)
    recall = _coverage(g, knn_radii(g, k), r)
    return precision, recall


def conditional_accuracy(probs: ArrayLike, labels: ArrayLike) -> float:
    """Share of samples whose most probable class under the classifier (``probs`` (N, K)) is the label they were
    generated for (``labels`` (N,) ints in [0, K)); ties go to the lower class, as ``argmax`` breaks them."""
    p = _np64(probs, "probs")
    y = labels.detach().cpu().numpy() if isinstance(labels, torch.Tensor) else np.asarray(labels)
    if p.ndim != 2 or y.shape != (p.shape[0],):
        raise ValueError(f"probs (N, K) and labels (N,) must match, got shapes {p.shape} and {y.shape}")
    if not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"labels must be integers, got dtype {y.dtype}")
    if y.size and (y.min() < 0 or y.max() >= p.shape[1]):
        raise ValueError(
            f"labels must be classes of the classifier, 0 to {p.shape[1] - 1}, got {int(y.min())} to {int(y.max())}"
        )
    return float((p.argmax(axis=1) == y).mean())
