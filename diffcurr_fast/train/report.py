"""Run telemetry and the end-of-run plots: the log window and progress bar, metrics.jsonl, optional TensorBoard and
wandb, GPU stats, matplotlib figures."""

from __future__ import annotations

import json
import math
import secrets
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from diffcurr_fast._lazy import pyplot
from diffcurr_fast.runs.config import TrainConfig

WANDB_ID = "wandb_id.txt"  # the run's wandb id, kept in the run directory so that a resume continues the same run


class MetricsWriter:
    """Appends one JSON object per line to ``metrics.jsonl``; mirrors the scalars to TensorBoard and to Weights &
    Biases when asked.

    ``resume_step``: the checkpoint step a resumed run continues from. ``metrics.jsonl`` has already been cut to it
    (``truncate_metrics``); TensorBoard is reopened with ``purge_step = resume_step + 1``, so readers drop the
    events of the steps after the checkpoint that the interrupted run had written. wandb (``wandb_mode`` offline:
    files under ``run_dir/wandb`` for ``wandb sync``; online: streamed) is initialised with ``resume="allow"`` and
    the id kept in ``run_dir/wandb_id.txt``, so the resumed run continues the same wandb run.
    """

    def __init__(
        self,
        run_dir: str | Path,
        tensorboard: bool = False,
        *,
        resume_step: int | None = None,
        wandb: dict[str, Any] | None = None,
    ):
        """``wandb``: None (off), or the keyword arguments of ``wandb.init`` to add (project, mode, config)."""
        run_dir = Path(run_dir)
        self.path = run_dir / "metrics.jsonl"
        self._tb = self._wandb = None
        if tensorboard:  # asked for by name: a missing package is an error, not a silent no-op
            try:  # optional dependency, imported when asked for
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ImportError(
                    "logging.tensorboard is true but tensorboard is not installed: pip install "
                    "tensorboard, or set logging.tensorboard=false"
                ) from None
        if wandb is not None:
            try:  # optional dependency, imported when asked for
                import wandb as wandb_module
            except ImportError:
                raise ImportError(
                    "logging.wandb is true but wandb is not installed: pip install "
                    "'diffcurr-fast[wandb]', or set logging.wandb=false"
                ) from None
        self._fh = open(self.path, "a")
        if tensorboard:
            purge = None if resume_step is None else resume_step + 1
            self._tb = SummaryWriter(str(run_dir / "tb"), purge_step=purge)
        if wandb is not None:
            id_file = run_dir / WANDB_ID
            run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)
            if not id_file.is_file():
                id_file.write_text(run_id + "\n")
            self._wandb = wandb_module.init(dir=str(run_dir), id=run_id, resume="allow", name=run_dir.name, **wandb)

    def write(self, record: dict[str, Any]) -> None:
        self._fh.write(json.dumps(record, allow_nan=True) + "\n")
        self._fh.flush()
        if self._tb is None and self._wandb is None:
            return
        step = int(record.get("step", 0))
        scalars = {
            k: v
            for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        }
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        self._fh.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


class LogWindow:
    """The training log between two log steps (``logging.log_every``, and the last step): the mean loss over the
    window's applied steps and the images per second, written as one record to metrics.jsonl (``MetricsWriter``,
    rank 0) and shown on the progress bar. Losses are summed on the device: the window is read once, at its end.
    A context manager: the bar and the writer close on exit. ``carried``: the ``state_dict`` of the window that a
    resumed run's checkpoint was written in, so that the window's record is the uninterrupted run's."""

    def __init__(
        self,
        cfg: TrainConfig,
        run_dir: Path,
        device: torch.device,
        main: bool,
        step: int,
        resumed: bool,
        carried: dict[str, Any] | None = None,
    ):
        lg = cfg.logging
        wandb = dict(project=lg.wandb_project, mode=lg.wandb_mode, config=cfg.to_dict()) if lg.wandb else None
        resume_step = step if resumed else None
        self.writer = MetricsWriter(run_dir, lg.tensorboard, resume_step=resume_step, wandb=wandb) if main else None
        self.bar = tqdm(
            total=cfg.engine.max_steps, initial=step, disable=not (main and lg.progress), dynamic_ncols=True
        )
        self.log_every, self.max_steps = lg.log_every, cfg.engine.max_steps
        self.curriculum_shown = cfg.curriculum.pacing != "none"
        self.device = device
        self.loss, self.applied, self.images = torch.zeros((), device=device), 0, 0
        if carried:  # the images and time before the checkpoint are not: the rate is of the steps since the resume
            self.loss.fill_(carried["loss"])
            self.applied = int(carried["applied"])
        self.t0, self.last_loss = time.perf_counter(), math.nan

    def __enter__(self) -> LogWindow:
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.close()
        if self.writer is not None:
            self.writer.close()

    def add(self, stats: dict[str, Any], images: int) -> None:
        """One step's statistics (``train_step``) and the images it trained on, over all ranks."""
        self.images += images
        if "loss" in stats:  # engine.cuda_graphs: 0 and a false flag for a skipped step, read at the log
            self.loss += stats["loss"]
            self.applied += stats.get("applied", 1)
        self.bar.update(1)

    def state_dict(self) -> dict[str, Any]:
        """The window's loss sum and applied steps so far, as a checkpoint keeps them (one host read)."""
        return {"loss": float(self.loss), "applied": int(self.applied)}

    def due(self, step: int) -> bool:
        return step % self.log_every == 0 or step == self.max_steps

    def close_window(self, step: int, lr: float, nan_skips: int, grad_norm: Any, curriculum: Any) -> None:
        """Write the window's record (step, its mean loss, the learning rate, images per second, the curriculum's
        stage and per-cluster losses, the skips so far, the last step's gradient norm, the GPU's telemetry) and
        show it on the bar; a new window starts."""
        dt, n = time.perf_counter() - self.t0, int(self.applied)
        self.last_loss = float(self.loss) / n if n else math.nan
        cl = curriculum.cluster_losses().tolist()
        rec = {
            "step": step,
            "loss": self.last_loss,
            "lr": lr,
            "img_per_s": self.images / max(dt, 1e-9),
            "stage": curriculum.stage,
            "unlocked": len(curriculum.unlocked_clusters),
            "nan_skips": nan_skips,
            "cluster_loss": [None if math.isnan(v) else v for v in cl],
        }
        if grad_norm is not None:
            rec["grad_norm"] = float(grad_norm)
        if self.device.type == "cuda":
            rec.update(gpu_stats(self.device.index or 0))
            rec["max_mem_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        postfix = dict(loss=f"{self.last_loss:.4f}", img_s=f"{rec['img_per_s']:.0f}")
        if self.curriculum_shown:
            postfix["clusters"] = f"{rec['unlocked']}/{curriculum.num_clusters}"
        self.bar.set_postfix(**postfix)
        self.write(rec)
        self.loss.zero_()
        self.applied, self.images, self.t0 = 0, 0, time.perf_counter()

    def write(self, record: dict[str, Any]) -> None:
        """A record of rank 0 (an evaluation's too); other ranks write nothing."""
        if self.writer is not None:
            self.writer.write(record)


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Records of a metrics.jsonl file; a line cut short by a killed process (and followed, in a study's rerun, by
    the resumed run's records) is skipped."""
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


_NVML: Any = None


def gpu_stats(device_index: int = 0) -> dict[str, Any]:
    """GPU utilisation and memory via NVML (``nvidia-ml-py``), or ``{"gpu": "no GPU"}`` when unavailable."""
    global _NVML
    try:
        if _NVML is None:
            # imported on first use, inside the try: no pynvml (or no driver) means "no GPU", not an error
            import pynvml

            pynvml.nvmlInit()
            _NVML = pynvml
        h = _NVML.nvmlDeviceGetHandleByIndex(device_index)
        util = _NVML.nvmlDeviceGetUtilizationRates(h)
        mem = _NVML.nvmlDeviceGetMemoryInfo(h)
        return {"gpu_util": float(util.gpu), "gpu_mem_gib": mem.used / 2**30}
    except Exception:  # no pynvml, no driver, no device
        _NVML = None
        return {"gpu": "no GPU"}


def plot_cluster_losses(records: list[dict[str, Any]], clusters: list[list[int]], path: str | Path) -> Path:
    """Per-cluster training loss (EMA) over steps, one line per cluster (ascending t)."""
    plt = pyplot()
    steps = [r["step"] for r in records if "cluster_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    cmap = plt.get_cmap("viridis")
    n = len(clusters)
    for k in range(n):
        vals = [r["cluster_loss"][k] for r in records if "cluster_loss" in r]
        vals = [v if v is not None else math.nan for v in vals]
        lo, hi = clusters[k]
        ax.plot(steps, vals, color=cmap(k / max(n - 1, 1)), lw=1, label=f"t in [{lo}, {hi})" if n <= 10 else None)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (EMA per cluster)")
    ax.set_yscale("log")
    ax.set_title("loss per timestep cluster (dark = low t / hard, light = high t / easy)")
    if n <= 10:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def plot_curriculum_timeline(
    records: list[dict[str, Any]], history: list[int], num_clusters: int, max_steps: int, path: str | Path
) -> Path:
    """Unlocked clusters over steps (a staircase with the unlock steps marked) and the training loss."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = [0] + list(history) + [max_steps]
    ys = list(range(1, len(history) + 2)) + [len(history) + 1]
    ax.step(xs, ys, where="post", color="C0", label="unlocked clusters")
    for h in history:
        ax.axvline(h, color="C0", alpha=0.15, lw=0.8)
    ax.set_ylim(0, num_clusters + 0.5)
    ax.set_xlabel("step")
    ax.set_ylabel("unlocked clusters", color="C0")
    steps = [r["step"] for r in records if "loss" in r]
    if steps:
        ax2 = ax.twinx()
        ax2.plot(steps, [r["loss"] for r in records if "loss" in r], color="C1", lw=0.8, label="loss")
        ax2.set_ylabel("training loss", color="C1")
    ax.set_title("curriculum timeline")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)
