"""The training loop: sampled timesteps, fused forward process and loss, the optimizer, EMA, checkpoints.

One step (``Trainer.train_step``): cells k ~ the composed timestep sampler's weights (``timesteps.Product``: the
formulation's cell prior x the strategy of ``timesteps.sampler`` x the curriculum's unlock mask x a TDC range;
drawn by ``ops.sample_timesteps``), the per-sample loss of the ``Objective`` at k (the formulation's x_in = a x0 +
c eps with Philox noise from a per-step seed, the network output, the regression target p x0 + q eps with its
weight, plus IDDPM's variational term when the variance is learned; ``objective.py``), times the sampler's
importance correction when it has one, backward, a finiteness vote across ranks, clip, the optimizer's step
(``optim.name``: AdamW, Muon, schedule-free AdamW, whose step runs at its gradient point), EMA update (and
the post-hoc EMA's power-function averages, snapshot every ``optim.phema_every`` steps and at the end under
``phema/``), and the sampler observing the per-sample losses. Everything random comes from one per-rank generator
and torch's global RNG (label dropout), both checkpointed, so a resumed run repeats the uninterrupted one exactly.

With ``engine.cuda_graphs`` the vote stays on the device (``Engine.step`` returns it as a tensor): the optimizer, the
EMA and the sampler's statistics are masked by it instead of being skipped on the host, and the skip counts
(``train.skips``) and their stop rules are read at the next log step (or checkpoint). On a CUDA device the model is
then compiled with ``mode="reduce-overhead"`` (``engine.compile_mode``): its forward and backward run as CUDA graphs.

Beside the loop: the run's resumable state and checkpoints (``train.state``), the skipped steps and the rules on
them (``train.skips``), the log window, progress bar and metrics (``train.report``), the batches
(``train.data``) and the engines (``train.engine``).
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path
from typing import Any

import torch

from diffcurr_fast.diffusion import build_formulation
from diffcurr_fast.diffusion.axis import trusted_t
from diffcurr_fast.objective import Objective, draw_seed
from diffcurr_fast.ops import sample_timesteps
from diffcurr_fast.optim.registry import at_train_point, build_optimizer
from diffcurr_fast.runs import checkpoint as ckpt_io
from diffcurr_fast.runs.config import TrainConfig, config_from_dict
from diffcurr_fast.runs.posthoc_ema import remove_snapshots_after, write_snapshot
from diffcurr_fast.runs.recipes import config_to_yaml
from diffcurr_fast.runs.sampling import SamplingInterrupted, build_model, grid_unavailable, sample_grid
from diffcurr_fast.timesteps.build import build_curriculum, build_timesteps
from diffcurr_fast.train.data import build_loader, load_init_weights
from diffcurr_fast.train.ema import EMA, PowerEMA
from diffcurr_fast.train.engine import Engine, compile_mode, create_engine, unwrap
from diffcurr_fast.train.evaluation import Evaluator, eval_due
from diffcurr_fast.train.host_memory import retain_host_memory
from diffcurr_fast.train.interrupt import GridInterrupted, StopRequest, TrainingInterrupted
from diffcurr_fast.train.preflight import check_run
from diffcurr_fast.train.report import LogWindow, plot_cluster_losses, plot_curriculum_timeline, read_metrics
from diffcurr_fast.train.rundir import config_drift, lock_run_dir, open_run_dir, write_config
from diffcurr_fast.train.skips import Skips
from diffcurr_fast.train.state import Checkpointer, model_config_entry


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of ``step`` (0-based): linear warmup to ``lr``, then constant or cosine decay to ``min_lr``."""
    o = cfg.optim
    if o.warmup_steps and step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    if o.schedule == "constant":
        return o.lr
    span = max(cfg.engine.max_steps - o.warmup_steps, 1)
    frac = min(max(step - o.warmup_steps, 0) / span, 1.0)
    return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1.0 + math.cos(math.pi * frac))  # cosine annealing


class Trainer:
    """Builds everything from a ``TrainConfig`` and runs it; ``resume`` continues the newest checkpoint."""

    def __init__(
        self,
        cfg: TrainConfig,
        engine: Engine | None = None,
        *,
        resume: bool = False,
        overwrite: bool = False,
        dataset: Any = None,
        model: torch.nn.Module | None = None,
        timestep_range: tuple[int, int] | None = None,
    ):
        """``model``: train this module instead of building one from ``cfg.model`` (e.g. a pruned, heterogeneous
        DiT; its ``config()`` is stored in checkpoints as ``model_config``). ``timestep_range``: sample t only in
        [lo, hi) (a TDC group: the weights outside are zero; a curriculum's clusters partition the range). Rank 0
        holds the run directory's lock (``rundir.lock_run_dir``) from before its checks until ``fit`` returns."""
        self.cfg = cfg.validate()
        self.engine = engine or create_engine(cfg.engine.kind, cfg.engine.device)
        self.lock = lock_run_dir(cfg.checkpoint.run_dir, resume=resume) if self.engine.is_main else None
        try:
            self._init(cfg, resume, overwrite, dataset, model, timestep_range)
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        """Give back the run directory's lock (``fit`` does it when it returns)."""
        if self.lock is not None:
            self.lock.release()

    def _init(self, cfg, resume, overwrite, dataset, model, timestep_range) -> None:
        self.device = self.engine.device
        self.run_dir = Path(cfg.checkpoint.run_dir)
        # everything is checked before anything is written; the directory is opened at the end of __init__
        self.start = check_run(
            cfg, resume=resume, overwrite=overwrite, world_size=self.engine.world_size, read_inputs=False
        )  # the data and model.init_from: read below
        e, d, o = cfg.engine, cfg.diffusion, cfg.optim
        rank, world = self.engine.rank, self.engine.world_size
        _set_process(cfg, self.device, rank)
        self.gen = torch.Generator().manual_seed(e.seed * 7919 + rank)  # timesteps and noise seeds
        self.loader, self.dataset = build_loader(cfg, rank, world, self.device, dataset)
        self.formulation = build_formulation(d)
        self.objective = Objective.from_config(cfg, self.formulation)
        self.route = self.objective.route  # token routing's draw (None without routing)
        # Flow / EDM: the sampler works on G = num_timesteps cells of t in [0, 1] / of ln(sigma), and t is drawn
        # inside the sampled cell; EDM's log-normal sigma density (EDM Table 1) is the product's cell prior.
        self.curriculum = build_curriculum(cfg.curriculum, self.formulation, d.num_timesteps, timestep_range)
        self.timesteps = build_timesteps(
            cfg.timesteps,
            self.formulation,
            d.num_timesteps,
            self.curriculum,
            timestep_range=timestep_range,
            process_group=getattr(self.engine, "group", None),  # the ranks of this run
            device=self.device,
        )
        self.model = self._build_model(model, fine_tune=self.start.checkpoint is None)
        self.ema = EMA(self.model, o.ema_decay, o.ema_warmup)  # its copy keeps checking the values it samples with
        for _, term in self.objective.terms:  # a term's teacher is the run's EMA model itself (SRA)
            term.attach_teacher(self.ema.module)
        self.phema = PowerEMA(self.model, o.phema_sigma_rels) if o.phema_every else None  # post-hoc EMA (EDM2)
        if hasattr(self.model, "check_values"):  # t from the sampler, labels checked at load: no per-step host sync
            self.model.check_values = False
        self.opt = build_optimizer(self.model, cfg, self.device)  # optim.name: AdamW, Muon + AdamW, schedule-free
        self.net, self.opt = self.engine.setup(self.model, self.opt, cfg)  # DeepSpeed: its engine, ZeRO optimizer
        mode = compile_mode(cfg, self.device, world)
        if mode is not None:
            self.net = torch.compile(self.net, mode=mode)
        self.graphs = mode == "reduce-overhead"  # the model's CUDA graphs: each train_step begins a new replay
        self.backend = d.ops_backend
        self.step = 0
        self.skips = Skips(cfg, self.device, on_device=e.cuda_graphs)  # non-finite steps and the rules on them
        self.train_s, self._clock = 0.0, None  # training wall time without evaluations (train_time); checkpointed
        parts = dict(model=self.model, ema=self.ema, opt=self.opt, curriculum=self.curriculum)
        parts.update(timesteps=self.timesteps, loader=self.loader, gen=self.gen, skips=self.skips, phema=self.phema)
        self.checkpointer = Checkpointer(cfg, self.engine, **parts)
        self.resumed_from: Path | None = self.start.checkpoint
        trained = None  # the config the run trained with up to its checkpoint: the record's truth on a resume
        if self.resumed_from is not None:
            state = ckpt_io.load_resume_checkpoint(self.resumed_from, map_location="cpu")
            trained = state["config"]
            self.load_state_dict(state)
        self.engine.barrier()  # every rank has checked the run directory before rank 0 writes into it
        if self.engine.is_main and self.start.mode != "finished":
            open_run_dir(self.start)  # overwrite: clear the old run's files; resume: metrics cut to the checkpoint
            if self.start.mode == "resume":  # snapshots after the checkpoint: written again by the resumed run
                remove_snapshots_after(self.run_dir, self.step)
            resumed = self.start.mode == "resume"
            drift = config_drift(self.run_dir, trained) if resumed else []
            if drift:  # the file said otherwise than the checkpoint: the record keeps what was trained
                print(
                    f"resume: config.yaml differs from the config of the checkpoint at step {self.step} (edited by "
                    f"hand, or written by a resume that stopped before its first checkpoint): {'; '.join(drift)}; "
                    f"steps up to {self.step} trained with the checkpoint's values"
                )
            changes = write_config(self.run_dir, config_to_yaml(cfg), self.step if resumed else 0, trained)
            if changes:  # the earlier values stay in the run's record
                kept = f"config_until_step{self.step:08d}.yaml"
                print(f"resume: the config changed ({'; '.join(changes)}); the previous one is kept as {kept}")

    def _build_model(self, given: torch.nn.Module | None, fine_tune: bool) -> torch.nn.Module:
        """The model on the device: ``given``, or built from the config with rank 0's initialisation on every rank
        (the EMA copies it before DDP or DeepSpeed broadcast rank 0's weights to the model only; rank 0's own random
        stream is left as a single-process run has it); ``model.init_from`` loaded on a fresh start."""
        cfg, rank = self.cfg, self.engine.rank
        with torch.random.fork_rng(devices=[], enabled=rank > 0):
            if rank > 0:  # the host's generator only: the rank's CUDA stream (label dropout) keeps engine.seed + rank
                torch.default_generator.manual_seed(cfg.engine.seed)
            model = (build_model(cfg) if given is None else _check_given_model(given, cfg)).to(self.device)
        if cfg.model.init_from and fine_tune:  # a resumed run takes its checkpoint's weights
            load_init_weights(model, cfg.model.init_from)  # without term heads: theirs start fresh
        heads = {n: t for n, (_, t) in zip(cfg.terms.use, self.objective.terms) if any(True for _ in t.parameters())}
        if heads:  # the terms' trainable parts: optimised, averaged, checkpointed and synchronised with the model
            model.term_heads = torch.nn.ModuleDict(heads).to(self.device)
        return model

    # ---- one step (one screen) ------------------------------------------------------------------------
    def train_step(self, x0: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
        """One optimizer step on the per-rank batch (x0 (b, C, H, W), y (b,)); returns step statistics."""
        b, o = x0.shape[0], self.cfg.optim
        if self.graphs:  # the previous step's graph outputs are dead: the replay may overwrite them
            torch.compiler.cudagraph_mark_step_begin()
        k = sample_timesteps(
            b, self.timesteps.weights(), generator=self.gen, validate=False, backend=self.backend
        )  # (b,) cells of the composed sampler
        lw = self.timesteps.loss_weights(k)  # (b,) importance correction, or None
        probe = self.timesteps.probe(self.step)  # (cells, n, seed) whose loss decrease the sampler measures, or None
        before = None if probe is None else self._probe_loss(x0, y, *probe)
        seed, acc, pers = draw_seed(self.gen), o.grad_accum_steps, []
        routed = self.route is None or self.route.routed(self.step)  # token routing's full-token phase (routing_until)
        with at_train_point(self.opt):  # schedule-free: its gradient point y here, the averaged point x after
            self.engine.zero_grad(self.opt)
            chunks = zip(x0.chunk(acc), y.chunk(acc), k.chunk(acc), (k if lw is None else lw).chunk(acc))
            for i, (xi, yi, ki, wi) in enumerate(chunks):  # micro-batches
                with self.engine.accumulate(self.net, boundary=i == acc - 1), trusted_t():  # t from the sampler
                    per = self.objective(self.net, xi, yi, ki, seed=seed + i, generator=self.gen, routed=routed)
                    self.engine.backward(Objective.mean(per, None if lw is None else wi), acc)
                pers.append(per.detach())  # (m,)
            per = torch.cat(pers)  # (b,)
            loss = per.mean()
            stats: dict[str, Any] = {"k": k}
            ok = torch.isfinite(loss)
            grad_norm = self.engine.clip_grad_norm(self.model, o.grad_clip)  # None: the engine clips in its step
            if grad_norm is not None:  # a finite loss can still overflow a gradient: the norm votes too
                stats["grad_norm"] = grad_norm
                ok = ok & torch.isfinite(grad_norm)
            applied = self.engine.step(self.opt, lr_at(self.step, self.cfg), ok)  # every rank steps, or none
        mask = applied if isinstance(applied, torch.Tensor) else None  # engine.cuda_graphs: the vote, on the device
        if mask is not None or applied:  # the updates below are masked by it (no host read)
            with self.engine.full_params(self.model):  # ZeRO-3: gathered for the EMA
                self.ema.update(self.model, mask)
                if self.phema is not None:
                    self.phema.update(self.model, mask)
            self.timesteps.observe(k, per, self.step, mask)
            if probe is not None:
                self.timesteps.observe_probe(before, self._probe_loss(x0, y, *probe))
            stats["loss"] = loss.detach() if mask is None else torch.where(mask, loss.detach(), 0.0)
        if mask is not None:
            stats["applied"] = mask
        elif not applied:
            stats["skipped"] = True
        self.skips.record(self.step, applied)  # NonFiniteLossError when a skip breaks a rule (host path)
        self.step += 1
        return stats

    def _probe_loss(self, x0: torch.Tensor, y: torch.Tensor, cells: torch.Tensor, n: int, seed: int) -> torch.Tensor:
        """(P, n) loss at ``cells`` (P,) on the batch's first n samples with noise ``seed``, the model in eval mode
        and without gradients: the training streams are not touched."""
        n = min(x0.shape[0], n)
        xs, ys = x0[:n].repeat(len(cells), 1, 1, 1), y[:n].repeat(len(cells))  # (P n, C, H, W), (P n,)
        ks = cells.to(x0.device).repeat_interleave(n)  # (P n,)
        was = self.model.training
        self.model.eval()
        try:
            with torch.no_grad(), self.engine.full_params(self.model), trusted_t():
                gen = torch.Generator().manual_seed(seed)
                per = self.objective(self.model, xs, ys, ks, seed=seed, generator=gen)
        finally:
            self.model.train(was)
        return per.reshape(len(cells), n)

    # ---- the run --------------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """Train to ``engine.max_steps``, checkpointing and logging; then the end-of-run report (rank 0). The run
        directory's lock is given back when it returns or raises."""
        try:
            return self._fit()
        finally:
            self.release()

    def _fit(self) -> dict[str, Any]:
        cfg, main = self.cfg, self.engine.is_main
        if self.start.mode == "finished":  # resumed at or past max_steps: nothing to train, nothing rewritten
            return {**self._summary(math.nan), "finished": True}
        resumed = self.start.mode == "resume"
        # built before the first step: a reference or an extractor that cannot be read stops the run here, not
        # at its first evaluation with hours of training and no checkpoint behind it
        evaluator = Evaluator(cfg, self.run_dir, self.dataset, self.device) if main and cfg.logging.eval_every else None
        self.model.train()
        carried = self.checkpointer.window_state
        with StopRequest() as stop, LogWindow(cfg, self.run_dir, self.device, main, self.step, resumed, carried) as log:
            self._clock, self.checkpointer.window = time.perf_counter(), log
            try:
                while self.step < cfg.engine.max_steps:
                    x0, y = (t.to(self.device, non_blocking=True) for t in next(self.loader))
                    stats = self.train_step(x0, y)
                    log.add(stats, x0.shape[0] * self.engine.world_size)
                    if log.due(self.step):
                        self.skips.read()  # engine.cuda_graphs: the stop rules apply here
                        lr = lr_at(self.step - 1, cfg)
                        log.close_window(self.step, lr, self.skips.total, stats.get("grad_norm"), self.curriculum)
                    if main and eval_due(self.step, cfg):  # own RNG: the training stream is unchanged
                        self.train_s, self._clock = self.train_time(), None  # the clock stops while it evaluates
                        log.write({**evaluator(self.step, self.ema.module, self.formulation), "train_s": self.train_s})
                        self._clock = time.perf_counter()
                    if main and self.phema is not None and self._snapshot_due():
                        self.snapshot_phema()
                    if stop.should_stop(self.engine):  # SIGINT / SIGTERM on any rank: checkpoint this step, then stop
                        raise TrainingInterrupted(stop.vote_signal(), self.step, self.save())
                    if self.step % cfg.checkpoint.every == 0 and self.step < cfg.engine.max_steps:
                        self.save()
                self.save()
            finally:
                self.train_s, self._clock = self.train_time(), None
                self.checkpointer.window = None
        summary = self._summary(log.last_loss)
        if main:
            summary.update(self.finish())
        self.engine.barrier()
        return summary

    def _snapshot_due(self) -> bool:
        return self.step % self.cfg.optim.phema_every == 0 or self.step == self.cfg.engine.max_steps

    def snapshot_phema(self) -> list[Path]:
        """Write the post-hoc EMA's averages of this step (``runs.posthoc_ema.write_snapshot``, rank 0)."""
        meta = {"config": self.cfg.to_dict(), **model_config_entry(self.model)}
        t, buffers = self.phema.num_updates, self.phema.buffer_names()
        return [
            write_snapshot(self.run_dir, self.step, s, t, m.state_dict(), buffers, meta)
            for s, m in zip(self.phema.sigma_rels, self.phema.modules)
        ]

    def _summary(self, loss: float) -> dict[str, Any]:
        return {
            "step": self.step,
            "loss": loss,
            "nan_skips": self.skips.total,
            "first_nan_skip": self.skips.first,
            "stage": self.curriculum.stage,
            "run_dir": str(self.run_dir),
        }

    def train_time(self) -> float:
        """Seconds this run has trained (``fit``'s loop, resumed attempts added, evaluation time left out)."""
        return self.train_s + (time.perf_counter() - self._clock if self._clock is not None else 0.0)

    def finish(self) -> dict[str, Any]:
        """EMA export, sample grid and plots (rank 0). Returns the paths written."""
        cfg, out = self.cfg, {}
        meta = {"config": cfg.to_dict(), "step": self.step, **model_config_entry(self.model)}
        if cfg.checkpoint.export_ema:
            path = self.run_dir / "ema.safetensors"
            weights = ckpt_io.drop_term_heads(self.ema.module.state_dict())  # sampling never needs them
            out["ema"] = str(ckpt_io.export_safetensors(weights, path, meta))
        try:
            with StopRequest() as stop:  # Ctrl-C / SIGTERM during the grid: stop it (the final checkpoint is written)
                png = self.run_dir / "samples.png"
                grid = sample_grid(self.ema.module, self.formulation, cfg, png, self.device, lambda: stop.signum)
        except SamplingInterrupted as exc:
            raise GridInterrupted(exc.signum, self.step, ckpt_io.latest_checkpoint(self.run_dir)) from None
        if grid is not None:
            out["samples"] = str(grid)
        elif cfg.logging.num_samples:  # a grid was asked for: say why there is none
            out["no_samples"] = grid_unavailable(cfg)
        if cfg.logging.plots:
            records, cur = read_metrics(self.run_dir / "metrics.jsonl"), self.curriculum
            clusters = [list(c) for c in cur.clusters]
            out["cluster_loss_plot"] = str(plot_cluster_losses(records, clusters, self.run_dir / "cluster_loss.png"))
            timeline = (records, cur.history, cur.num_clusters, cfg.engine.max_steps, self.run_dir / "curriculum.png")
            out["curriculum_plot"] = str(plot_curriculum_timeline(*timeline))
        return out

    # ---- state (train.state) --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything a resume needs (``Checkpointer.state_dict``); every rank calls it."""
        return self.checkpointer.state_dict(self.step, self.train_time())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``; ValueError naming the differences for an incompatible config."""
        self.step, self.train_s = self.checkpointer.load_state_dict(state)

    def save(self) -> Path | None:
        """Write a checkpoint of the current step (rank 0 writes; all ranks take part in the gather)."""
        return self.checkpointer.save(self.step, self.train_time())


def _set_process(cfg: TrainConfig, device: torch.device, rank: int) -> None:
    """The process-wide settings of a run: TF32 on CUDA, the CPU threads and allocator, the global seeds."""
    e = cfg.engine
    if device.type == "cuda" and e.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if device.type == "cpu" and e.cpu_threads > 0:
        torch.set_num_threads(e.cpu_threads)
    if device.type == "cpu" and e.retain_host_memory:
        retain_host_memory()  # glibc: the step's tensors reuse mapped pages (train.host_memory)
    torch.manual_seed(e.seed + rank)
    random.seed(e.seed + rank)


def _check_given_model(model: torch.nn.Module, cfg: TrainConfig) -> torch.nn.Module:
    """A model passed to ``Trainer`` must see the data and objective of ``cfg``; ValueError naming a mismatch."""
    m, d = cfg.model, cfg.diffusion
    want = {
        "in_channels": m.in_channels,
        "input_size": m.input_size,
        "num_classes": m.num_classes,
        "learn_sigma": d.learn_sigma,
    }
    for name, value in want.items():
        have = getattr(model, name, value)
        if have != value:
            raise ValueError(f"the given model has {name}={have!r} but the config needs {value!r}")
    return model


def train(
    cfg: TrainConfig | dict[str, Any], *, resume: bool = False, overwrite: bool = False, engine: Engine | None = None
) -> dict[str, Any]:
    """Build a ``Trainer`` for ``cfg`` and run it; the engine is closed at the end when created here."""
    if isinstance(cfg, dict):
        cfg = config_from_dict(cfg)
    own = engine is None
    engine = engine or create_engine(cfg.engine.kind, cfg.engine.device)
    try:
        return Trainer(cfg, engine, resume=resume, overwrite=overwrite).fit()
    finally:
        if own:
            engine.close()


__all__ = ["GridInterrupted", "Trainer", "TrainingInterrupted", "lr_at", "train", "unwrap"]
