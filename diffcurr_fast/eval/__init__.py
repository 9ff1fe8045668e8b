"""Evaluation: Frechet distance, Inception Score, precision/recall, and pluggable feature extractors."""
