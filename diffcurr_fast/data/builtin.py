"""Built-in datasets that ship inside installed packages (no download): scikit-learn's handwritten digits.

``digits``: the 1,797 8x8 grey-level images of ``sklearn.datasets.load_digits`` (UCI optical digits, values
0..16). They are kept at their native 8x8 resolution (a DiT with patch size 2 sees 16 tokens) and mapped
linearly to [-1, 1] (x / 8 - 1), the data range DDPM's discretised decoder and sample clipping assume; labels
are the digit classes 0..9.
"""

from __future__ import annotations

import torch

BUILTIN_DATASETS = ("digits",)


def load_digits_tensors(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Digits as images (1797, 1, 8, 8) in [-1, 1] and labels (1797,) int64."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:  # pragma: no cover - scikit-learn is a declared dependency
        raise ImportError("the built-in digits dataset needs scikit-learn (pip install scikit-learn)") from exc
    d = load_digits()
    x = torch.as_tensor(d.images, dtype=torch.float64).unsqueeze(1)  # (N, 1, 8, 8), values 0..16
    x = (x / 8.0 - 1.0).to(dtype)  # [0, 16] -> [-1, 1]
    y = torch.as_tensor(d.target, dtype=torch.long)  # (N,)
    return x, y


def load_builtin(name: str, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Images and labels of the built-in dataset ``name``."""
    if name == "digits":
        return load_digits_tensors(dtype)
    raise ValueError(f"unknown built-in dataset {name!r}; choose one of {BUILTIN_DATASETS}")
