"""Data: latent layouts, image folders with ADM preprocessing, one shared sample order, DALI and torch loaders.

DALI is optional and imported only when a DALI backend is used.
"""

from diffcurr_fast._lazy import lazy_exports

# name -> module, imported on first use: importing one submodule does not import the whole package (torch)
_EXPORTS: dict[str, str] = {
    "ON_BAD": "diffcurr_fast.data.errors",
    "BadDataError": "diffcurr_fast.data.errors",
    "BadDataReport": "diffcurr_fast.data.errors",
    "ImageDataset": "diffcurr_fast.data.images",
    "ImageFolder": "diffcurr_fast.data.images",
    "adm_crop_geometry": "diffcurr_fast.data.images",
    "center_crop_arr": "diffcurr_fast.data.images",
    "FastDiTLatents": "diffcurr_fast.data.latents",
    "FastDiTLatentWriter": "diffcurr_fast.data.latents",
    "LatentDataset": "diffcurr_fast.data.latents",
    "ShardedLatents": "diffcurr_fast.data.latents",
    "ShardedLatentWriter": "diffcurr_fast.data.latents",
    "detect_latent_format": "diffcurr_fast.data.latents",
    "open_latents": "diffcurr_fast.data.latents",
    "ShardedOrder": "diffcurr_fast.data.order",
    "epoch_permutation": "diffcurr_fast.data.order",
    "flip_decisions": "diffcurr_fast.data.order",
    "BACKENDS": "diffcurr_fast.data.pipeline",
    "ShardedLoader": "diffcurr_fast.data.pipeline",
}
__getattr__ = lazy_exports(__name__, _EXPORTS)

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
