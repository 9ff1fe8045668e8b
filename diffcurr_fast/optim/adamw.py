"""AdamW (``optim.name=adamw``, the default; Loshchilov & Hutter, ICLR 2019): torch's ``AdamW`` with ``fused=True`` on
CUDA and CPU, or NVIDIA apex's FusedAdam in AdamW mode (``optim.impl=apex``, CUDA only). Torch's fused kernel (one
over all parameters) matches the per-parameter loop to float32 rounding (tests/train/test_train_sync.py), and a
resumed run repeats the uninterrupted one exactly.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from diffcurr_fast.options import Options


def apex_fused_adam():
    """NVIDIA apex's ``FusedAdam`` class, or None (apex absent, or the unrelated PyPI package of that name)."""
    try:
        from apex.optimizers import FusedAdam  # optional dependency (NVIDIA apex, CUDA builds only)
    except Exception:  # ImportError, or a broken apex build
        return None
    return FusedAdam


def adamw_kwargs(cfg: Any) -> dict[str, Any]:
    """AdamW's arguments from the ``optim`` section: lr, betas, eps, weight decay."""
    o = cfg.optim
    return dict(lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)


def torch_adamw(params: list[nn.Parameter], cfg: Any, device: torch.device) -> torch.optim.AdamW:
    """torch's AdamW over ``params``, fused on CUDA and CPU."""
    return torch.optim.AdamW(params, fused=device.type in ("cuda", "cpu"), **adamw_kwargs(cfg))


class AdamW:
    """The default optimizer (module doc)."""

    Options = Options

    @staticmethod
    def check_device(cfg: Any, device: torch.device) -> None:
        """``optim.impl=apex`` needs NVIDIA apex and a CUDA device."""
        if cfg.optim.impl != "apex":
            return
        if apex_fused_adam() is None:
            raise ValueError(
                "optim.impl=apex needs NVIDIA apex (apex.optimizers.FusedAdam, built from NVIDIA's "
                "sources; the PyPI package 'apex' is unrelated); use optim.impl=auto"
            )
        if device.type != "cuda":
            raise ValueError(f"optim.impl=apex runs on CUDA only, the trainer's device is {device}")

    @staticmethod
    def build(model: nn.Module, cfg: Any, device: torch.device) -> Any:
        params = [p for p in model.parameters() if p.requires_grad]
        if cfg.optim.impl == "apex":
            return apex_fused_adam()(params, adam_w_mode=True, **adamw_kwargs(cfg))
        return torch_adamw(params, cfg, device)


def check_own_step(cfg: Any) -> None:
    """The rules of an optimizer that steps with its own update instead of AdamW's kernel: not apex's kernel, not
    DeepSpeed's partitioned state, not a CUDA graph's skip on the device; ValueError in one line."""
    o, e = cfg.optim, cfg.engine
    if o.impl == "apex":
        raise ValueError(
            f"optim.impl=apex picks AdamW's kernel (apex FusedAdam); optim.name={o.name} steps with its own "
            "optimizer: use optim.impl=auto, or optim.name=adamw"
        )
    if e.kind == "deepspeed":
        raise ValueError(
            f"optim.name={o.name} does not run under engine.kind=deepspeed: DeepSpeed hands the optimizer flat "
            "partitions of the weights (ZeRO 1-3), where Muon finds no matrices and schedule-free's switch to "
            "the averaged point never reaches the model; use engine.kind=ddp, or optim.name=adamw"
        )
    if e.cuda_graphs:
        raise ValueError(
            f"engine.cuda_graphs skips a non-finite step on the device through torch's fused AdamW, which "
            f"optim.name={o.name} does not step with; set engine.cuda_graphs=false or optim.name=adamw"
        )
