"""Networks: the DiT family (official-compatible), attention backends and Denoising Task Routing."""

from diffcurr_fast.models.attention import ATTENTION_BACKENDS, BackendUnavailableError, attention, available_backends
from diffcurr_fast.models.dit import DIT_PRESETS, DiT, DiT_models, create_dit
from diffcurr_fast.models.dtr import DTRConfig, dtr_mask

__all__ = [
    "ATTENTION_BACKENDS",
    "DIT_PRESETS",
    "BackendUnavailableError",
    "DTRConfig",
    "DiT",
    "DiT_models",
    "attention",
    "available_backends",
    "create_dit",
    "dtr_mask",
]
