"""The trainer's resumable state and its checkpoints (torchtitan's checkpoint manager, at this trainer's size).

A checkpoint holds everything a resumed run needs to repeat the uninterrupted one exactly: the step, the config
(``resume_mismatches`` refuses a resume that changes the model, the objective or the timestep draws), the model
(``model_config`` for a heterogeneous DiT), the EMA and the post-hoc EMA's averages, the optimizer (through the
engine: DeepSpeed keeps its own shards), the curriculum and the timestep sampler, the data position and every rank's
RNG streams (gathered: each rank continues its own), the skipped-step counts, the log window's loss so far and the
training wall time. Rank 0
writes it (``runs.checkpoint.save_checkpoint``: atomic, the last ``checkpoint.keep_last`` kept); every rank takes part.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from diffcurr_fast.runs import checkpoint as ckpt_io
from diffcurr_fast.runs.config import TrainConfig, resume_mismatches
from diffcurr_fast.train.data import TrainBatches
from diffcurr_fast.train.ema import EMA, PowerEMA
from diffcurr_fast.train.engine import Engine
from diffcurr_fast.train.rundir import config_drift
from diffcurr_fast.train.skips import Skips


class Checkpointer:
    """Builds and restores the checkpoint of a run from its parts (module doc)."""

    def __init__(
        self,
        cfg: TrainConfig,
        engine: Engine,
        *,
        model: torch.nn.Module,
        ema: EMA,
        opt: Any,
        curriculum: Any,
        timesteps: Any,
        loader: Any,
        gen: torch.Generator,
        skips: Skips,
        phema: PowerEMA | None = None,
    ):
        self.cfg, self.engine, self.run_dir = cfg, engine, Path(cfg.checkpoint.run_dir)
        self.model, self.ema, self.opt = model, ema, opt
        self.curriculum, self.timesteps, self.loader = curriculum, timesteps, loader
        self.gen, self.skips, self.phema = gen, skips, phema
        self.window: Any = None  # the open log window (train.report.LogWindow), set by the loop while it trains
        self.window_state: dict[str, Any] = {}  # the checkpoint's window, for the resumed run's first one

    def state_dict(self, step: int, train_s: float) -> dict[str, Any]:
        """The state of step ``step`` (every rank calls it: the engine may write its own optimizer shards, and the
        RNG states and data positions of every rank are gathered)."""
        with self.engine.full_params(self.model):  # ZeRO-3: gathered, copied out before they are released
            model_state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        return {
            "step": step,
            "config": self.cfg.to_dict(),
            **model_config_entry(self.model),
            "model": model_state,
            "ema": self.ema.state_dict(),
            **({"phema": self.phema.state_dict()} if self.phema is not None else {}),
            "optimizer": self.engine.optimizer_state(self.opt, self.run_dir, step),
            "curriculum": self.curriculum.state_dict(),
            "timesteps": self.timesteps.state_dict(),
            "data": self._data_state(),
            "rng": self.engine.gather_objects(self._rng_state()),
            **self.skips.state_dict(),
            "log_window": self.window.state_dict() if self.window is not None else {},
            "train_s": train_s,
            "world_size": self.engine.world_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> tuple[int, float]:
        """Restore ``state_dict()``; returns (step, training seconds). ValueError naming the differences for an
        incompatible config or world size."""
        diffs = resume_mismatches(state["config"], self.cfg)
        if diffs:
            locked = {d.split(":")[0] for d in diffs}  # "model.depth: checkpoint 2 vs now 3"
            edited = [d for d in config_drift(self.run_dir, state["config"]) if d.split(":")[0] in locked]
            hint = (
                f"; config.yaml was changed after the checkpoint ({'; '.join(edited)}): a resume cannot change these, "
                "restore the checkpoint's values there or start a new run"
                if edited
                else ""
            )
            raise ValueError(
                "cannot resume: the checkpoint was trained with a different config: " + "; ".join(diffs) + hint
            )
        if state["world_size"] != self.engine.world_size:
            raise ValueError(
                f"cannot resume: the checkpoint was written by {state['world_size']} ranks, this run has "
                f"{self.engine.world_size}"
            )
        with self.engine.full_params(self.model, modify=True):
            self.model.load_state_dict(state["model"])
        self.ema.load_state_dict(state["ema"])
        self._load_phema(state.get("phema"))
        self.engine.load_optimizer_state(self.opt, state["optimizer"], self.run_dir)
        self.curriculum.load_state_dict(state["curriculum"])
        self.timesteps.load_state_dict(state.get("timesteps", {}))  # a checkpoint of before the strategies: none
        self._load_data_state(state["data"])
        step = int(state["step"])
        self.skips.load_state_dict(state, step)
        self._load_rng_state(state["rng"][self.engine.rank])
        self.window_state = state.get("log_window", {})  # checkpoints from before it was kept: none
        return step, float(state.get("train_s", 0.0))  # checkpoints from before it was kept: 0

    def save(self, step: int, train_s: float) -> Path | None:
        """Write the checkpoint of step ``step`` (rank 0 writes; all ranks take part in the gathers). A run that a
        skip rule has stopped (counted on the device since the last read) raises instead."""
        self.skips.read()
        state = self.state_dict(step, train_s)
        path = None
        if self.engine.is_main:
            path = ckpt_io.save_checkpoint(self.run_dir, step, state, self.cfg.checkpoint.keep_last)
        self.engine.barrier()
        return path

    def _load_phema(self, state: dict[str, Any] | None) -> None:
        """The post-hoc EMA's averages (a run that keeps none ignores the checkpoint's); ValueError when this run
        keeps them but the checkpoint has none, or has them for other sigma_rels (they average the whole run)."""
        if self.phema is None:
            return
        if state is None:
            raise ValueError(
                "cannot resume: optim.phema_every is set but the checkpoint kept no post-hoc EMA averages (its run had "
                "optim.phema_every=0; they average the run from its first step); resume with optim.phema_every=0"
            )
        try:
            self.phema.load_state_dict(state)
        except ValueError as exc:
            raise ValueError(f"cannot resume: {exc}; set optim.phema_sigma_rels to the checkpoint's") from None

    # ---- the parts that differ per rank ------------------------------------------------------------------
    def _rng_state(self) -> dict[str, Any]:
        state = {"torch": torch.get_rng_state(), "gen": self.gen.get_state(), "python": random.getstate()}
        if self.engine.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.engine.device)
        return state

    def _load_rng_state(self, rng: dict[str, Any]) -> None:
        torch.set_rng_state(rng["torch"])
        self.gen.set_state(rng["gen"])
        random.setstate(_to_tuple(rng["python"]))
        if "cuda" in rng and self.engine.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], self.engine.device)

    def _data_state(self) -> dict[str, Any]:
        """The data position; the sharded loader's differs per rank, so every rank's is kept (gathered)."""
        if isinstance(self.loader, TrainBatches):
            return {"kind": "sharded", "ranks": self.engine.gather_objects(self.loader.state_dict())}
        return self.loader.state_dict()

    def _load_data_state(self, data: dict[str, Any]) -> None:
        if isinstance(self.loader, TrainBatches):  # every rank continues its own shard's position
            data = data["ranks"][self.engine.rank] if "ranks" in data else data
        elif "kind" in data:
            raise ValueError(
                "cannot resume: the checkpoint's data position is of data.dataset latents/images, this "
                f"run reads {self.cfg.data.dataset!r}"
            )
        self.loader.load_state_dict(data)


def model_config_entry(model: torch.nn.Module) -> dict[str, Any]:
    """``{"model_config": model.config()}`` for a model that can describe itself (rebuilds heterogeneous DiTs)."""
    return {"model_config": model.config()} if callable(getattr(model, "config", None)) else {}


def _to_tuple(obj: Any) -> Any:
    return tuple(_to_tuple(v) for v in obj) if isinstance(obj, (list, tuple)) else obj
