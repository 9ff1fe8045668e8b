"""Evaluation during training: every ``logging.eval_every`` steps, FD (and IS, precision/recall, and the conditional
accuracy) of the EMA weights.

``Evaluator(cfg, run_dir, dataset, device)`` (rank 0 only) loads the feature extractor of ``eval.features`` and the
reference statistics once: from ``eval.reference`` (a statistics or images ``.npz``, or ``digits``), else from
the training data (at most ``eval.num_reference`` images). They are cached in the run directory as
``eval_reference.npz``, so a resumed run reuses them. ``evaluator(step, model, schedule)`` samples
``eval.num_samples`` images with ``eval.sampler`` / ``eval.steps`` / ``eval.cfg_scale`` from a fixed seed (the same
noise at every evaluation) and returns a metrics record (``{"step", "eval": True, "fd", "is", ...}``). When the
extractor is the classifier of the run's data (``eval.features`` digits on ``data.dataset`` digits, mnist5k on
mnist5k), the record has ``cond_acc``: the share of samples it assigns to the label they were generated for.

Sampling draws its noise from an explicit generator and runs inside ``torch.random.fork_rng``, so the global RNG
the training step uses (label dropout) is the same after an evaluation as before it: a run with evaluation on
trains exactly the weights of one without. The metrics come from ``diffcurr_fast.eval`` (features and metrics only,
which do not import the trainer).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from diffcurr_fast.eval.evaluate import evaluate, load_reference, reference_from_images, statistics_extractor
from diffcurr_fast.eval.features import get_extractor
from diffcurr_fast.runs.sampling import sample, sampling_readout
from diffcurr_fast.runs.sections import EVAL_SHAPES

if TYPE_CHECKING:
    from diffcurr_fast.runs.config import TrainConfig

REFERENCE_FILE = "eval_reference.npz"


def check_reference(cfg: TrainConfig) -> None:
    """What the evaluations will read exists and fits, checked before the run starts (the preflight): a file
    ``eval.reference`` holds statistics of ``eval.features``' extractor or images, a built-in reference has the
    extractor's image shape, and ``eval.inception_weights`` is a file. (The extractor against the model's images is
    the config's check.)"""
    e = cfg.eval
    if not cfg.logging.eval_every:
        return
    if e.features == "inception" and not Path(e.inception_weights).is_file():
        raise FileNotFoundError(f"eval.inception_weights {e.inception_weights!r} does not exist")
    if e.reference in EVAL_SHAPES:  # a built-in: its images go through the extractor
        if EVAL_SHAPES.get(e.features, EVAL_SHAPES[e.reference]) != EVAL_SHAPES[e.reference]:
            raise ValueError(
                f"eval.reference {e.reference!r} holds {'x'.join(map(str, EVAL_SHAPES[e.reference]))} images, "
                f"which eval.features {e.features!r} does not score; set eval.reference={e.features} or clear it"
            )
        return
    if not e.reference:
        return
    if not Path(e.reference).is_file():
        raise FileNotFoundError(
            f"eval.reference {e.reference!r} does not exist (a statistics or images .npz, digits or mnist5k, or '' "
            "for the training data)"
        )
    made_by = statistics_extractor(e.reference, "eval.reference")  # names only: the arrays are read at the start
    if made_by is not None and made_by != e.features:
        raise ValueError(
            f"eval.reference {e.reference!r} holds {made_by!r} statistics but eval.features is {e.features!r}; "
            f"set eval.features={made_by} or recompute the reference"
        )


def eval_due(step: int, cfg: TrainConfig) -> bool:
    """Whether the trainer evaluates after ``step`` steps: every ``logging.eval_every`` steps and at the end."""
    every = cfg.logging.eval_every
    return every > 0 and (step % every == 0 or step == cfg.engine.max_steps)


def _dataset_images(dataset: Any, limit: int, scale: float) -> torch.Tensor:
    """Up to ``limit`` images (N, C, H, W) in [-1, 1] from the head of ``dataset`` (the model sees ``scale`` times
    them; no RNG is used)."""
    n = min(len(dataset), limit)
    if hasattr(dataset, "batch"):
        x = dataset.batch(list(range(n)))[0].float()
    else:
        x = torch.stack([torch.as_tensor(dataset[i][0], dtype=torch.float32) for i in range(n)])
    return (x / scale).clamp(-1, 1)


class Evaluator:
    """FD / IS / precision-recall of a model's samples against the run's cached reference (module doc)."""

    def __init__(self, cfg: TrainConfig, run_dir: str | Path, dataset: Any = None, device: Any = "cpu"):
        self.cfg, self.device = cfg, torch.device(device)
        self._devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=self._devices):  # building an extractor initialises a network
            self._load(Path(run_dir), dataset)

    def _load(self, run_dir: Path, dataset: Any) -> None:
        cfg = self.cfg
        e = cfg.eval
        self.extractor = get_extractor(e.features, inception_weights=e.inception_weights or None, device=self.device)
        path = run_dir / REFERENCE_FILE
        if path.is_file():
            self.reference = load_reference(str(path), self.extractor)
        else:
            spec = e.reference or (cfg.data.dataset if cfg.data.dataset in ("digits", "mnist5k") else "")
            if spec:
                self.reference = load_reference(spec, self.extractor)
            else:
                if dataset is None:
                    raise ValueError("eval.reference is empty and no training dataset was given to compute it from")
                images = _dataset_images(dataset, e.num_reference, cfg.data.scale)
                self.reference = reference_from_images(images, self.extractor, f"training data ({len(images)} images)")
            tmp = path.with_name("eval_reference.tmp.npz")
            self.reference.save(tmp)
            tmp.replace(path)

    def labels(self) -> torch.Tensor:
        """The labels the evaluation's samples are generated for (N,): the classes in turn."""
        return torch.arange(self.cfg.eval.num_samples) % self.cfg.model.num_classes

    @torch.no_grad()
    def sample(self, model: torch.nn.Module, schedule: Any) -> torch.Tensor:
        """``eval.num_samples`` images (N, C, H, W) in [-1, 1] from ``model``; the global RNG is left as it was."""
        cfg, e, m = self.cfg, self.cfg.eval, self.cfg.model
        was_training = model.training
        model.eval()
        try:
            with torch.random.fork_rng(devices=self._devices):
                x = sample(
                    model,
                    schedule,
                    sampler=e.sampler,
                    steps=min(e.steps, cfg.diffusion.num_timesteps),
                    labels=self.labels(),
                    channels=m.in_channels,
                    size=m.input_size,
                    num_classes=m.num_classes,
                    readout=sampling_readout(cfg),
                    cfg_scale=e.cfg_scale,
                    seed=e.seed,
                    device=self.device,
                )
        finally:
            model.train(was_training)
        return (x / cfg.data.scale).clamp(-1, 1).float().cpu()

    def __call__(self, step: int, model: torch.nn.Module, schedule: Any) -> dict[str, Any]:
        """The metrics record of ``model`` at ``step``: fd, is, is_std, precision, recall (when the reference has
        features), cond_acc (when the extractor classifies the run's data), the extractor and the evaluation's wall
        time."""
        t0 = time.perf_counter()
        labels = self.labels() if self.cfg.data.dataset == self.extractor.classes else None
        res = evaluate(self.sample(model, schedule), self.reference, self.extractor, labels=labels)
        rec: dict[str, Any] = {
            "step": int(step),
            "eval": True,
            "fd": res.fd,
            "is": res.inception_score,
            "is_std": res.inception_score_std,
            "extractor": res.extractor,
        }
        if res.precision is not None:
            rec["precision"], rec["recall"] = res.precision, res.recall
        if res.cond_acc is not None:
            rec["cond_acc"] = res.cond_acc
        rec["eval_s"] = time.perf_counter() - t0
        return rec


__all__ = ["REFERENCE_FILE", "Evaluator", "check_reference", "eval_due"]
