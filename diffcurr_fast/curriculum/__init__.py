"""Difficulty curriculum over timesteps (Kim et al., ICLR 2025): clustering, pacing, sampling weights, analysis."""

from diffcurr_fast.curriculum.clustering import (
    CLUSTER_METHODS,
    DEFAULT_METHOD,
    check_clusters,
    cluster_snr,
    cluster_timesteps,
    uniform_clusters,
)
from diffcurr_fast.curriculum.difficulty import (
    consecutive_kl,
    convergence_by_interval,
    load_digits_data,
)
from diffcurr_fast.curriculum.pacing import ORDERS, PACINGS, Curriculum

__all__ = [
    "CLUSTER_METHODS",
    "DEFAULT_METHOD",
    "ORDERS",
    "PACINGS",
    "Curriculum",
    "check_clusters",
    "cluster_snr",
    "cluster_timesteps",
    "consecutive_kl",
    "convergence_by_interval",
    "load_digits_data",
    "uniform_clusters",
]
