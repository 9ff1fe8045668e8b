"""Schedule-free AdamW (``optim.name=schedule_free``): ``schedulefree.AdamWScheduleFree`` (Defazio et al., "The Road
Less Scheduled", NeurIPS 2024, arXiv 2405.15682; the ``schedulefree`` extra).

It keeps z (the base sequence of AdamW steps) in its state and two points on the parameters: the gradient is taken at
y = (1 - beta1) z + beta1 x, and x, the average of the z with weights c_t = lr_t^2 / sum_i lr_i^2, is the point a run
evaluates, with no decay schedule (``optim.schedule`` constant). Between steps the parameters hold x:
``registry.at_train_point`` moves them to y for the step's forward, backward and update only (the optimizer's
``train()`` and ``eval()``), so everything that reads the weights between steps (the EMA and the post-hoc EMA
updates, evaluation during training, the sample grid, checkpoints, the EMA export, TDC's stages) reads x, and a
checkpoint (x, z and the moments) resumes bit-identically. The trainer's linear warmup (``optim.warmup_steps``) is
schedule-free's own: the ramp of the learning rate it is given enters the weights c_t through lr_t^2, as its
``warmup_steps`` would (``tests/train/test_train_optimizers.py``).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from diffcurr_fast.optim.adamw import adamw_kwargs, check_own_step
from diffcurr_fast.options import Options


@dataclass
class ScheduleFreeOptions(Options):
    """schedule_free's rules over the ``optim`` section (no fields of its own)."""

    def validate(self, cfg: Any) -> None:
        check_own_step(cfg)
        o = cfg.optim
        if o.schedule != "constant":
            raise ValueError(
                f"optim.name=schedule_free replaces the learning-rate decay by its average of the iterates; "
                f"optim.schedule={o.schedule} would decay it too: set optim.schedule=constant (optim.warmup_steps "
                "is its warmup)"
            )


class ScheduleFree:
    """Schedule-free AdamW (module doc)."""

    Options = ScheduleFreeOptions

    @staticmethod
    def check_device(cfg: Any, device: torch.device) -> None:
        """The schedulefree package is installed."""
        if importlib.util.find_spec("schedulefree") is None:
            raise ImportError(
                "optim.name=schedule_free needs the schedulefree package: pip install 'diffcurr-fast[schedulefree]'"
            )

    @staticmethod
    def build(model: nn.Module, cfg: Any, device: torch.device) -> Any:
        import schedulefree  # optional dependency (the schedulefree extra; check_device said how to install it)

        params = [p for p in model.parameters() if p.requires_grad]
        # warmup_steps=0: the trainer's warmup ramps the lr it sets every step, which the averaging weights see
        return schedulefree.AdamWScheduleFree(params, warmup_steps=0, **adamw_kwargs(cfg))
