"""Skipped steps: the one owner of the counts of non-finite steps and of the rules that stop a run on them.

A step whose loss or gradient norm is not finite on some rank is skipped by every rank (``Engine.step``). The
rules (``engine.nan_policy``, ``max_nan_skips``, ``max_skip_share``) stop the run with ``NonFiniteLossError`` when a
skipped step n breaks them: policy ``stop`` at the first one, more than ``max_nan_skips`` in a row, or more than
``max_skip_share * max_steps`` in all.

Two ways of counting, one set of counts:

- on the host (the default step): ``record`` gets the vote as a bool, counts at once and raises at the step that
  breaks a rule;
- on the device (``engine.cuda_graphs``): ``record`` gets the vote as a 0-d bool device tensor and updates one int64
  tensor without a host read; ``read`` (at a log step or a checkpoint) copies the counts to the host and raises, for
  a rule broken since the last read, the error the host path would have raised at that step.

The counts are ``total`` (skipped in all), ``in_a_row`` (at the end) and ``first`` (the first skipped step,
1-based as in metrics.jsonl; 0 = none); a checkpoint keeps them (``state_dict``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from diffcurr_fast.runs.config import TrainConfig


class NonFiniteLossError(RuntimeError):
    """Raised when the NaN/inf loss policy stops the run."""


class Skips:
    """The skipped-step counts and stop rules of a run (module doc); ``on_device``: count on ``device``."""

    # the device counts, one int64 tensor: steps seen, skipped in all, in a row, the first skipped step (0 = none),
    # the step that broke a rule (0 = none) and the counts in all and in a row at that step
    STEP, TOTAL, RUN, FIRST, BROKE, BROKE_TOTAL, BROKE_RUN = range(7)

    def __init__(self, cfg: TrainConfig, device: torch.device, on_device: bool):
        e = cfg.engine
        self.stop_at_once = e.nan_policy == "stop"
        self.max_in_a_row = int(e.max_nan_skips)
        self.max_share, self.max_steps = e.max_skip_share, e.max_steps
        # an int n of skips exceeds max_share * max_steps iff it exceeds its floor: the device compares integers
        self.max_total = math.floor(e.max_skip_share * e.max_steps)
        self.lr, self.data_scale = cfg.optim.lr, cfg.data.scale
        self.encoder = cfg.terms.repa_encoder if "repa" in cfg.terms.use else None  # a frozen network of the loss
        self.total = self.in_a_row = self.first = 0
        self.counts = torch.zeros(7, dtype=torch.int64, device=device) if on_device else None

    # ---- counting ------------------------------------------------------------------------------------
    def record(self, step: int, applied: bool | torch.Tensor) -> None:
        """Count step ``step`` (0-based) whose update was applied where ``applied`` holds; on the host,
        NonFiniteLossError when this skip breaks a rule."""
        if self.counts is not None:
            self._record_on_device(applied)
            return
        if applied:
            self.in_a_row = 0
            return
        n = step + 1  # steps count from 1, as in metrics.jsonl
        self.total += 1
        self.in_a_row += 1
        self.first = self.first or n
        if self._reason(self.total, self.in_a_row):
            raise self._error(n, self.total, self.in_a_row)

    def _record_on_device(self, applied: torch.Tensor) -> None:
        c = self.counts
        skip = (~applied).to(torch.int64)
        step = c[self.STEP] + 1
        total = c[self.TOTAL] + skip
        run = (c[self.RUN] + 1) * skip
        first = torch.where((c[self.FIRST] == 0) & (skip > 0), step, c[self.FIRST])
        rule = (run > self.max_in_a_row) | (total > self.max_total)
        if self.stop_at_once:
            rule = torch.ones_like(rule)
        broke = (skip > 0) & (c[self.BROKE] == 0) & rule
        now = torch.where(broke, torch.stack([step, total, run]), c[self.BROKE :])
        c.copy_(torch.cat([torch.stack([step, total, run, first]), now]))

    def read(self, check: bool = True) -> None:
        """The device counts into ``total``, ``in_a_row`` and ``first`` (one host read; nothing on the host path);
        with ``check``, NonFiniteLossError for a rule broken since, naming the step it broke at."""
        if self.counts is None:
            return
        _, self.total, self.in_a_row, self.first, broke, broke_total, broke_run = self.counts.tolist()
        if check and broke:
            raise self._error(broke, broke_total, broke_run)

    # ---- the rules -----------------------------------------------------------------------------------
    def _reason(self, total: int, in_a_row: int) -> str | None:
        if self.stop_at_once:
            return "engine.nan_policy is 'stop'"
        if in_a_row > self.max_in_a_row:
            return f"{in_a_row} in a row, more than engine.max_nan_skips={self.max_in_a_row}"
        if total > self.max_share * self.max_steps:
            return f"more than engine.max_skip_share={self.max_share:g} of the {self.max_steps} steps"
        return None

    def _error(self, n: int, total: int, in_a_row: int) -> NonFiniteLossError:
        if self.first == 1:  # the loss of step 1 is the initial model's: no update has been made
            advice = (
                "the first step already failed, before the learning rate could act: check the data and data.scale "
                f"(now {self.data_scale:g}; the model sees data.scale x the data)"
                + (f", and the REPA encoder terms.repa_encoder {self.encoder!r}" if self.encoder else "")
            )
        else:
            advice = f"the run diverges: lower optim.lr (now {self.lr:g}) or set optim.grad_clip"
        return NonFiniteLossError(
            f"non-finite loss or gradient at step {n}: {total} step(s) skipped, the first at step "
            f"{self.first} ({self._reason(total, in_a_row)}); {advice}"
        )

    # ---- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The counts as a checkpoint holds them (device counts read first, without applying the rules)."""
        self.read(check=False)
        return {"nan_skips": self.total, "nan_skip_run": [self.in_a_row, self.first]}

    def load_state_dict(self, state: dict[str, Any], step: int) -> None:
        """Continue from a checkpoint of step ``step``."""
        self.total = int(state["nan_skips"])
        self.in_a_row, self.first = (int(v) for v in state.get("nan_skip_run", (0, 0)))
        if self.counts is not None:
            self.counts.copy_(torch.tensor([step, self.total, self.in_a_row, self.first, 0, 0, 0]))
