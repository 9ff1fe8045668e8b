"""Difficulty curriculum over timesteps (Kim et al., ICLR 2025): clustering, pacing, sampling weights."""

from diffcurr_fast.curriculum.clustering import (
    CLUSTER_METHODS,
    DEFAULT_METHOD,
    check_clusters,
    cluster_snr,
    cluster_timesteps,
    uniform_clusters,
)
from diffcurr_fast.curriculum.pacing import ORDERS, PACINGS, Curriculum

__all__ = [
    "CLUSTER_METHODS",
    "Curriculum",
    "DEFAULT_METHOD",
    "ORDERS",
    "PACINGS",
    "check_clusters",
    "cluster_snr",
    "cluster_timesteps",
    "uniform_clusters",
]
