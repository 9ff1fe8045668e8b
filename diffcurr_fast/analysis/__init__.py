"""Offline difficulty analysis of the denoising tasks (Kim et al., ICLR 2025): consecutive KL, convergence per
interval, cluster layouts. Above training: it trains small models and evaluates them; nothing at run time imports it."""

from diffcurr_fast._lazy import lazy_exports

# name -> module, imported on first use: importing one submodule does not import the whole package (torch)
_EXPORTS: dict[str, str] = {
    "consecutive_kl": "diffcurr_fast.analysis.difficulty",
    "convergence_by_interval": "diffcurr_fast.analysis.difficulty",
}
__getattr__ = lazy_exports(__name__, _EXPORTS)

__all__ = ["consecutive_kl", "convergence_by_interval"]
