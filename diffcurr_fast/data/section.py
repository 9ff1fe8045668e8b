"""The ``data`` section of the run config: the datasets and loaders a run can use (``data.dataset``,
``data.backend``) and the options of each. Light (no torch): a command's ``--help`` reads its choices.
"""

from __future__ import annotations

from dataclasses import dataclass

from diffcurr_fast.data.errors import ON_BAD
from diffcurr_fast.options import nonneg, option, positive

BACKENDS = ("auto", "dali", "torch")  # the latents / images loader (``pipeline.py``)
SHARDED_DATASETS = ("latents", "images")
DATASETS = ("digits", "mnist5k", "npz", *SHARDED_DATASETS)  # data.dataset: built-in, arrays, or ShardedLoader
PIXEL_DATASETS = ("digits", "mnist5k", "images")  # images in [-1, 1]; npz and latents may hold latents


@dataclass
class DataOptions:
    """Training data."""

    dataset: str = option(
        "digits",
        "digits (built in, 8x8), mnist5k (built in, 28x28, the mnist extra), npz (arrays x (N, C, H, W) and y "
        "(N,)), latents (a fast-DiT or sharded latent directory) or images (an ImageNet-layout folder)",
        DATASETS,
    )
    path: str = option("", "npz: a .npz file or a directory of x.npy and y.npy; latents / images: the directory")
    scale: float = option(
        1.0,
        "the model trains on scale * data (0.18215 for Stable Diffusion VAE latents; see docs)",
        lo=0.0,
        lo_open=True,
    )
    batch_size: int = positive(128, "global batch size (split evenly across ranks)")
    num_workers: int = nonneg(0, "DataLoader worker processes (0 = load in the training process); DALI CPU threads")
    image_size: int = nonneg(0, "images: ADM centre-crop size (0 = model.input_size)")
    hflip: bool = option(True, "images: random horizontal flips (decided per sample and epoch)")
    backend: str = option(
        "auto", "latents / images loader: auto (DALI on a GPU when importable), dali or torch", BACKENDS
    )
    dali_py_workers: int = nonneg(
        0, "images with DALI: forked Python workers reading the files (0: read in the pipeline's thread)"
    )
    on_bad: str = option("stop", "latents / images: a corrupt or unreadable file stops the run or is skipped", ON_BAD)

    def validate(self) -> None:
        if self.dataset in ("npz", "latents", "images") and not self.path:
            what = {"npz": "a .npz file or a directory", "latents": "a latent directory", "images": "an image folder"}
            raise ValueError(f"data.path is required when data.dataset is {self.dataset!r} ({what[self.dataset]})")
        if self.dataset in ("digits", "mnist5k") and self.path:
            raise ValueError(
                f"data.path {self.path!r} is set but data.dataset is {self.dataset!r} (built in, reads no "
                "file); set data.dataset to npz, latents or images to train on it"
            )
