"""Data: latent layouts, image folders with ADM preprocessing, one shared sample order, DALI and torch loaders.

DALI is optional and imported only when a DALI backend is used.
"""

from diffcurr_fast.data.errors import ON_BAD, BadDataError, BadDataReport
from diffcurr_fast.data.images import ImageDataset, ImageFolder, adm_crop_geometry, center_crop_arr
from diffcurr_fast.data.latents import (
    FastDiTLatents,
    FastDiTLatentWriter,
    LatentDataset,
    ShardedLatents,
    ShardedLatentWriter,
    detect_latent_format,
    open_latents,
)
from diffcurr_fast.data.order import ShardedOrder, epoch_permutation, flip_decisions
from diffcurr_fast.data.pipeline import BACKENDS, ShardedLoader

__all__ = [
    "BACKENDS",
    "ON_BAD",
    "BadDataError",
    "BadDataReport",
    "FastDiTLatentWriter",
    "FastDiTLatents",
    "ImageDataset",
    "ImageFolder",
    "LatentDataset",
    "ShardedLatentWriter",
    "ShardedLatents",
    "ShardedLoader",
    "ShardedOrder",
    "adm_crop_geometry",
    "center_crop_arr",
    "detect_latent_format",
    "epoch_permutation",
    "flip_decisions",
    "open_latents",
]
