"""The difficulty curriculum as a factor of the timestep sampler (Kim et al., ICLR 2025).

``CurriculumMask`` wraps a ``curriculum.Curriculum`` (its pacings ``patience`` (the paper), ``fixed`` (NaiveCL),
``none`` (vanilla) and ``adaptive``, and the anti-curriculum order ``hard_to_easy``): its weights are uniform over
the unlocked clusters (zero on every locked cluster), and it observes each step's loss for its pacing decisions. A
curriculum over a TDC group's cells [lo, hi) has its clusters on those cells and is placed at ``offset`` lo.
"""

from __future__ import annotations

from typing import Any

import torch

from diffcurr_fast.curriculum.pacing import Curriculum
from diffcurr_fast.timesteps.base import TimestepSampler


class CurriculumMask(TimestepSampler):
    """The curriculum's unlock mask (and ``adaptive`` pacing's progress weights) on ``num_cells`` cells.

    Its state is the curriculum's own (checkpointed by the trainer under ``curriculum``), so ``state_dict`` is
    None here. ``step`` passed to ``observe`` is the trainer's step (the unlock history records it).
    """

    name = "curriculum"

    def __init__(self, curriculum: Curriculum, num_cells: int | None = None, offset: int = 0):
        super().__init__(curriculum.num_timesteps if num_cells is None else num_cells)
        if not 0 <= offset <= self.num_cells - curriculum.num_timesteps:
            n = curriculum.num_timesteps
            raise ValueError(f"a curriculum on {n} cells does not fit at offset {offset} of {self.num_cells} cells")
        self.curriculum, self.offset = curriculum, int(offset)
        self._src: torch.Tensor | None = None
        self._w: torch.Tensor | None = None
        self._steps = 0

    @property
    def process_group(self) -> Any:
        """The curriculum's own: its window statistics are reduced over these ranks."""
        return self.curriculum.process_group

    @process_group.setter
    def process_group(self, group: Any) -> None:
        self.curriculum.process_group = group

    def weights(self) -> torch.Tensor:
        w = self.curriculum.timestep_weights()  # (T_c,) float32, the same object until the curriculum changes
        if self.offset == 0 and w.numel() == self.num_cells:
            return w
        if w is not self._src:
            full = torch.zeros(self.num_cells, dtype=torch.float32)
            full[self.offset : self.offset + w.numel()] = w
            self._src, self._w = w, full
        return self._w

    def observe(
        self, k: torch.Tensor, per_sample_loss: torch.Tensor, step: int | None = None, ok: torch.Tensor | None = None
    ) -> None:
        step = self._steps if step is None else int(step)
        self._steps = step + 1
        self.curriculum.observe_per_timestep(k - self.offset if self.offset else k, per_sample_loss, ok)
        self.curriculum.observe(step, per_sample_loss.mean(), ok)

    def state_dict(self) -> dict[str, Any] | None:
        return None

    def __repr__(self) -> str:
        return repr(self.curriculum)
