"""Evaluation: Frechet distance, Inception Score, precision/recall, and pluggable feature extractors."""

from diffcurr_fast._lazy import lazy_exports

# name -> module, imported on first use: importing one submodule does not import the whole package (torch)
_EXPORTS: dict[str, str] = {
    "EvalResult": "diffcurr_fast.eval.evaluate",
    "Reference": "diffcurr_fast.eval.evaluate",
    "evaluate": "diffcurr_fast.eval.evaluate",
    "load_images": "diffcurr_fast.eval.evaluate",
    "load_reference": "diffcurr_fast.eval.evaluate",
    "DIGITS_LABEL": "diffcurr_fast.eval.features",
    "EXTRACTORS": "diffcurr_fast.eval.features",
    "DigitsExtractor": "diffcurr_fast.eval.features",
    "Mnist5kExtractor": "diffcurr_fast.eval.features",
    "mnist5k_classifier": "diffcurr_fast.eval.features",
    "FeatureExtractor": "diffcurr_fast.eval.features",
    "InceptionExtractor": "diffcurr_fast.eval.features",
    "digits_classifier": "diffcurr_fast.eval.features",
    "get_extractor": "diffcurr_fast.eval.features",
    "FIDInceptionV3": "diffcurr_fast.eval.inception",
    "load_fid_inception": "diffcurr_fast.eval.inception",
    "feature_statistics": "diffcurr_fast.eval.metrics",
    "frechet_distance": "diffcurr_fast.eval.metrics",
    "inception_score": "diffcurr_fast.eval.metrics",
    "knn_radii": "diffcurr_fast.eval.metrics",
    "load_statistics": "diffcurr_fast.eval.metrics",
    "precision_recall": "diffcurr_fast.eval.metrics",
    "save_statistics": "diffcurr_fast.eval.metrics",
}
__getattr__ = lazy_exports(__name__, _EXPORTS)

__all__ = [
    "DIGITS_LABEL",
    "EXTRACTORS",
    "DigitsExtractor",
    "Mnist5kExtractor",
    "EvalResult",
    "FIDInceptionV3",
    "FeatureExtractor",
    "InceptionExtractor",
    "Reference",
    "digits_classifier",
    "mnist5k_classifier",
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
