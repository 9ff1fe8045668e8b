"""Ctrl-C and SIGTERM during training: finish the current step, checkpoint, and stop with a non-zero status.

``StopRequest`` installs handlers for SIGINT and SIGTERM (main thread only) that only record the signal; the loop
asks ``should_stop(engine)`` at each step boundary, where every rank votes (a rank that saw the signal stops all
of them), so all ranks take part in the checkpoint. Launchers forward the signal to their workers, which then get
it twice (from the terminal and from torchrun, or SIGINT then deepspeed's SIGTERM): repeats within
``REPEAT_GRACE_S`` of the first are ignored; a later one restores the default handlers and raises
``KeyboardInterrupt`` at once (no checkpoint). The trainer then raises ``TrainingInterrupted``.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

import torch

__all__ = ["GridInterrupted", "StopRequest", "TrainingInterrupted"]

SIGNALS = (signal.SIGINT, signal.SIGTERM)
REPEAT_GRACE_S = 3.0


class TrainingInterrupted(Exception):
    """The run stopped on a signal after writing ``checkpoint`` at ``step``; ``exit_code`` is 128 + signal."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        self.exit_code = 128 + int(signum)
        name = signal.Signals(signum).name
        super().__init__(f"{name} received: stopped at step {step}, checkpoint {checkpoint}")


class GridInterrupted(TrainingInterrupted):
    """A signal stopped the end-of-run sample grid: training had finished and its last checkpoint is written."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None):
        super().__init__(signum, step, checkpoint)
        name = signal.Signals(signum).name
        self.args = (
            f"{name} received during the end-of-run sample grid: training finished at step {step} "
            f"(checkpoint {checkpoint}); no grid written (draw one with `diffcurr-fast sample --ckpt "
            f"{checkpoint} --out samples.png`)",
        )


class StopRequest:
    """Context manager recording SIGINT / SIGTERM; see the module doc."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._first = 0.0
        self._old: dict[int, Any] = {}

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum, self._first = signum, time.monotonic()
        elif time.monotonic() - self._first > REPEAT_GRACE_S:  # asked again: stop now, without a checkpoint
            self._restore()
            raise KeyboardInterrupt

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._old[s] = signal.signal(s, self._handler)
        return self

    def _restore(self) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old.clear()

    def __exit__(self, *exc: object) -> None:
        self._restore()

    def should_stop(self, engine: Any) -> bool:
        """Whether any rank received a signal (a collective vote: every rank must call it at the same step)."""
        return not engine.all_true(torch.tensor(self.signum is None))

    def vote_signal(self) -> int:
        """The signal to report (SIGTERM for a rank stopped by another rank's vote)."""
        return int(self.signum if self.signum is not None else signal.SIGTERM)
