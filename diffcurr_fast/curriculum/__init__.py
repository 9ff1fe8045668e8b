"""Difficulty curriculum over timesteps (Kim et al., ICLR 2025): clustering, pacing, sampling weights."""

from diffcurr_fast._lazy import lazy_exports

# name -> module, imported on first use: importing one submodule does not import the whole package (torch)
_EXPORTS: dict[str, str] = {
    "CLUSTER_METHODS": "diffcurr_fast.curriculum.clustering",
    "DEFAULT_METHOD": "diffcurr_fast.curriculum.clustering",
    "check_clusters": "diffcurr_fast.curriculum.clustering",
    "cluster_snr": "diffcurr_fast.curriculum.clustering",
    "cluster_timesteps": "diffcurr_fast.curriculum.clustering",
    "uniform_clusters": "diffcurr_fast.curriculum.clustering",
    "ORDERS": "diffcurr_fast.curriculum.pacing",
    "PACINGS": "diffcurr_fast.curriculum.pacing",
    "Curriculum": "diffcurr_fast.curriculum.pacing",
}
__getattr__ = lazy_exports(__name__, _EXPORTS)

__all__ = [
    "CLUSTER_METHODS",
    "DEFAULT_METHOD",
    "ORDERS",
    "PACINGS",
    "Curriculum",
    "check_clusters",
    "cluster_snr",
    "cluster_timesteps",
    "uniform_clusters",
]
