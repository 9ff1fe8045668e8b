"""Evaluation: Frechet distance, Inception Score, precision/recall, and pluggable feature extractors."""

from diffcurr_fast.eval.evaluate import EvalResult, Reference, evaluate, load_images, load_reference
from diffcurr_fast.eval.features import (
    DIGITS_LABEL,
    EXTRACTORS,
    DigitsExtractor,
    FeatureExtractor,
    InceptionExtractor,
    digits_classifier,
    get_extractor,
)
from diffcurr_fast.eval.inception import FIDInceptionV3, load_fid_inception
from diffcurr_fast.eval.metrics import (
    feature_statistics,
    frechet_distance,
    inception_score,
    knn_radii,
    load_statistics,
    precision_recall,
    save_statistics,
)

__all__ = [
    "DIGITS_LABEL",
    "EXTRACTORS",
    "DigitsExtractor",
    "EvalResult",
    "FIDInceptionV3",
    "FeatureExtractor",
    "InceptionExtractor",
    "Reference",
    "digits_classifier",
    "evaluate",
    "feature_statistics",
    "frechet_distance",
    "get_extractor",
    "inception_score",
    "knn_radii",
    "load_fid_inception",
    "load_images",
    "load_reference",
    "load_statistics",
    "precision_recall",
    "save_statistics",
]
