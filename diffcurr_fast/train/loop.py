"""The training loop: sampled timesteps, fused forward process and loss, AdamW, EMA, checkpoints.

One step (``Trainer.train_step``): cells k ~ the composed timestep sampler's weights (``timesteps.Product``: the
formulation's cell prior x the strategy of ``timesteps.sampler`` x the curriculum's unlock mask x a TDC range;
drawn by ``ops.sample_timesteps``), the per-sample loss of the ``Objective`` at k (the formulation's x_in = a x0 +
c eps with Philox noise from a per-step seed, the network output, the regression target p x0 + q eps with its
weight, plus IDDPM's variational term when the variance is learned; ``objective.py``), times the sampler's
importance correction when it has one, backward, a finiteness vote across ranks, clip, AdamW step, EMA update, and
the sampler observing the per-sample losses. Everything random comes from one per-rank generator and torch's global
RNG (label dropout), both checkpointed, so a resumed run repeats the uninterrupted one exactly.

With ``engine.cuda_graphs`` the vote stays on the device (``Engine.step`` returns it as a tensor): the optimizer, the
EMA and the sampler's statistics are masked by it instead of being skipped on the host, and the skip counts
(``SkipCounts``) and their stop rules are read at the next log step (or checkpoint). On a CUDA device the model is
then compiled with ``mode="reduce-overhead"`` (``compile_mode``): its forward and backward run as CUDA graphs.
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from diffcurr_fast.data.builtin import BUILTIN_DATASETS, load_builtin
from diffcurr_fast.data.loader import ArrayDataset, ResumableLoader, load_npz
from diffcurr_fast.diffusion import build_formulation
from diffcurr_fast.diffusion.axis import trusted_t
from diffcurr_fast.objective import Objective, draw_seed
from diffcurr_fast.ops import sample_timesteps
from diffcurr_fast.runs import checkpoint as ckpt_io
from diffcurr_fast.runs.config import TrainConfig, config_from_dict, config_to_yaml, resume_mismatches
from diffcurr_fast.runs.sampling import SamplingInterrupted, build_model, grid_unavailable, sample_grid
from diffcurr_fast.timesteps.build import build_curriculum, build_timesteps
from diffcurr_fast.train.data import SHARDED_DATASETS, TrainBatches, build_train_batches, load_init_weights
from diffcurr_fast.train.ema import EMA
from diffcurr_fast.train.engine import Engine, SkipCounts, build_optimizer, create_engine, unwrap
from diffcurr_fast.train.evaluation import Evaluator, eval_due
from diffcurr_fast.train.host_memory import retain_host_memory
from diffcurr_fast.train.interrupt import GridInterrupted, StopRequest, TrainingInterrupted
from diffcurr_fast.train.preflight import check_run
from diffcurr_fast.train.report import (
    MetricsWriter,
    gpu_stats,
    plot_cluster_losses,
    plot_curriculum_timeline,
    read_metrics,
)
from diffcurr_fast.train.rundir import open_run_dir


class NonFiniteLossError(RuntimeError):
    """Raised when the NaN/inf loss policy stops the run."""


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


def build_dataset(cfg: TrainConfig):
    """The training dataset of ``cfg.data``, checked against the model's input shape and classes."""
    d, m = cfg.data, cfg.model
    if d.dataset in BUILTIN_DATASETS:  # mnist5k: its training split (the held-out one is the evaluator's)
        x, y = load_builtin(d.dataset)
        ds = ArrayDataset(x, y, d.scale, source=f"built-in {d.dataset}")
    else:
        ds = load_npz(d.path, d.scale)
    c, h, w = (int(s) for s in ds.x.shape[1:])
    if (c, h, w) != (m.in_channels, m.input_size, m.input_size):
        raise ValueError(
            f"data.dataset {d.dataset!r} has images {c}x{h}x{w} but model.in_channels x model.input_size^2 is "
            f"{m.in_channels}x{m.input_size}x{m.input_size}; set the model fields to match"
        )
    ymax = int(ds.y[:].max()) if len(ds) else 0
    if ymax >= m.num_classes:
        raise ValueError(f"data has label {ymax} but model.num_classes is {m.num_classes}")
    return ds


def compile_mode(cfg: TrainConfig, device: torch.device, world_size: int) -> str | None:
    """The model's ``torch.compile`` mode: None (eager), ``"default"`` (``engine.compile``) or ``"reduce-overhead"``
    (``engine.cuda_graphs`` on a CUDA device, with or without ``engine.compile``): inductor captures the model's
    forward and backward passes as CUDA graphs and replays them, and the step around them (the fused forward
    process and loss, the clip, fused AdamW, the EMA, the sampler statistics) reads nothing back to the host. On
    CPU there are no CUDA graphs: ``engine.cuda_graphs`` is the device-side step alone. ValueError for what the
    capture does not cover: gradient accumulation (a micro-batch's replay would overwrite the gradients of the one
    before it, which ``.grad`` still holds) and more than one rank (DDP's gradient hooks run between the graphs)."""
    e = cfg.engine
    if not (e.cuda_graphs and device.type == "cuda"):
        return "default" if e.compile else None
    if cfg.optim.grad_accum_steps > 1:
        raise ValueError(
            f"engine.cuda_graphs on CUDA captures the model's backward, which gradient accumulation cannot replay "
            f"(optim.grad_accum_steps={cfg.optim.grad_accum_steps}); set optim.grad_accum_steps=1 or "
            "engine.cuda_graphs=false"
        )
    if world_size > 1:
        raise ValueError(
            f"engine.cuda_graphs on CUDA captures the model on one process only ({world_size} ranks here: DDP's "
            "gradient hooks run between the captured graphs); set engine.cuda_graphs=false"
        )
    return "reduce-overhead"


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
        [lo, hi) (a TDC group: the weights outside are zero; a curriculum's clusters partition the range)."""
        self.cfg = cfg.validate()
        self.engine = engine or create_engine(cfg.engine.kind, cfg.engine.device)
        self.device = self.engine.device
        self.run_dir = Path(cfg.checkpoint.run_dir)
        # everything is checked before anything is written; the directory is opened at the end of __init__
        self.start = check_run(cfg, resume=resume, overwrite=overwrite, world_size=self.engine.world_size)
        e, d, o = cfg.engine, cfg.diffusion, cfg.optim
        rank, world = self.engine.rank, self.engine.world_size
        if cfg.data.batch_size % (world * o.grad_accum_steps):
            raise ValueError(
                f"data.batch_size {cfg.data.batch_size} is not divisible by the world size {world} x "
                f"optim.grad_accum_steps {o.grad_accum_steps}"
            )
        if self.device.type == "cuda" and e.tf32:
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        if self.device.type == "cpu" and e.cpu_threads > 0:
            torch.set_num_threads(e.cpu_threads)
        if self.device.type == "cpu" and e.retain_host_memory:
            retain_host_memory()  # glibc: the step's tensors reuse mapped pages (train.host_memory)
        torch.manual_seed(e.seed + rank)
        random.seed(e.seed + rank)
        self.gen = torch.Generator().manual_seed(e.seed * 7919 + rank)  # timesteps and noise seeds
        self.loader: Any
        if dataset is None and cfg.data.dataset in SHARDED_DATASETS:  # through diffcurr_fast.data's ShardedLoader
            self.loader = build_train_batches(cfg, rank, world, self.device)
            self.dataset = self.loader.source
        else:
            self.dataset = dataset if dataset is not None else build_dataset(cfg)
            self.loader = ResumableLoader(
                self.dataset,
                cfg.data.batch_size,
                rank=rank,
                world=world,
                seed=e.seed,
                num_workers=cfg.data.num_workers,
                pin_memory=self.device.type == "cuda",
            )
        self.formulation = build_formulation(d)
        self.objective = Objective.from_config(cfg, self.formulation)
        # Flow / EDM: the sampler works on G = num_timesteps cells of t in [0, 1] / of ln(sigma), and t is drawn
        # inside the sampled cell; EDM's log-normal sigma density (EDM Table 1) is the product's cell prior.
        group = getattr(self.engine, "group", None)  # the ranks of this run
        self.curriculum = build_curriculum(cfg.curriculum, self.formulation, d.num_timesteps, timestep_range)
        self.timesteps = build_timesteps(
            cfg.timesteps,
            self.formulation,
            d.num_timesteps,
            self.curriculum,
            timestep_range=timestep_range,
            process_group=group,
            device=self.device,
        )
        latest = self.start.checkpoint
        # One initialisation on every rank, rank 0's (the EMA copies it before DDP or DeepSpeed broadcast rank 0's
        # weights to the model only); rank 0's own random stream is left as a single-process run has it.
        with torch.random.fork_rng(devices=[], enabled=rank > 0):
            if rank > 0:
                torch.manual_seed(e.seed)
            self.model = (build_model(cfg) if model is None else _check_given_model(model, cfg)).to(self.device)
        if cfg.model.init_from and latest is None:  # fine-tuning start; a resumed run takes its checkpoint's weights
            load_init_weights(self.model, cfg.model.init_from)
        self.ema = EMA(self.model, o.ema_decay, o.ema_warmup)
        if hasattr(self.model, "check_values"):  # t from the sampler, labels checked at load: no per-step host sync
            self.model.check_values = False
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = build_optimizer(params, o, self.device)  # torch's fused AdamW (CUDA, CPU) or apex FusedAdam
        self.net, self.opt = self.engine.setup(self.model, self.opt, cfg)  # DeepSpeed: its engine, ZeRO optimizer
        mode = compile_mode(cfg, self.device, self.engine.world_size)
        if mode is not None:
            self.net = torch.compile(self.net, mode=mode)
        self.graphs = mode == "reduce-overhead"  # the model's CUDA graphs: each train_step begins a new replay
        self.backend = d.ops_backend
        self.step = 0
        self.nan_skips = 0  # skipped (non-finite) steps in all, in a row, and the first one (1-based, 0 = none)
        self.skips_in_a_row = 0
        self.first_nan_skip = 0
        stop_rules = (e.max_nan_skips, e.max_skip_share * e.max_steps, e.nan_policy == "stop")
        self.skips = SkipCounts(self.device, *stop_rules) if e.cuda_graphs else None  # counted on the device
        self.train_s, self._clock = 0.0, None  # training wall time without evaluations (train_time); checkpointed
        self.resumed_from: Path | None = latest
        if latest is not None:
            self.load_state_dict(ckpt_io.load_resume_checkpoint(latest, map_location="cpu"))
        self.engine.barrier()  # every rank has checked the run directory before rank 0 writes into it
        if self.engine.is_main and self.start.mode != "finished":
            open_run_dir(self.start)  # overwrite: clear the old run's files; resume: metrics cut to the checkpoint
            (self.run_dir / "config.yaml").write_text(config_to_yaml(cfg))

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
        self.engine.zero_grad(self.opt)
        chunks = zip(x0.chunk(acc), y.chunk(acc), k.chunk(acc), (k if lw is None else lw).chunk(acc))
        for i, (xi, yi, ki, wi) in enumerate(chunks):  # micro-batches
            with self.engine.accumulate(self.net, boundary=i == acc - 1), trusted_t():  # t from the sampler
                per = self.objective(self.net, xi, yi, ki, seed=seed + i, generator=self.gen)  # (m,)
                self.engine.backward(Objective.mean(per, None if lw is None else wi), acc)
            pers.append(per.detach())
        per = torch.cat(pers)  # (b,)
        loss = per.mean()
        stats: dict[str, Any] = {"k": k}
        ok = torch.isfinite(loss)
        grad_norm = self.engine.clip_grad_norm(self.model, o.grad_clip)  # None: the engine clips in its step
        if grad_norm is not None:  # a finite loss can still overflow a gradient: the norm votes too
            stats["grad_norm"] = grad_norm
            ok = ok & torch.isfinite(grad_norm)
        applied = self.engine.step(self.opt, lr_at(self.step, self.cfg), ok)  # every rank steps, or every rank skips
        mask = applied if isinstance(applied, torch.Tensor) else None  # engine.cuda_graphs: the vote, on the device
        if mask is not None or applied:  # the updates below are masked by it (no host read)
            with self.engine.full_params(self.model):  # ZeRO-3: gathered for the EMA
                self.ema.update(self.model, mask)
            self.timesteps.observe(k, per, self.step, mask)
            if probe is not None:
                self.timesteps.observe_probe(before, self._probe_loss(x0, y, *probe))
            stats["loss"] = loss.detach() if mask is None else torch.where(mask, loss.detach(), 0.0)
        self._count_skip(applied, stats)
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

    def _count_skip(self, applied: bool | torch.Tensor, stats: dict[str, Any]) -> None:
        """Count a skipped (non-finite) step; NonFiniteLossError when the policy says stop: ``nan_policy`` stop,
        more than ``max_nan_skips`` in a row, or more than ``max_skip_share`` of ``max_steps`` in all. A device
        flag (``engine.cuda_graphs``) is counted on the device; ``_read_skips`` applies the rules later."""
        if isinstance(applied, torch.Tensor):
            self.skips.record(applied)
            stats["applied"] = applied
            return
        if applied:
            self.skips_in_a_row = 0
            return
        stats["skipped"] = True
        n = self.step + 1  # steps count from 1, as in metrics.jsonl
        self.nan_skips += 1
        self.skips_in_a_row += 1
        self.first_nan_skip = self.first_nan_skip or n
        if self._stop_reason(self.nan_skips, self.skips_in_a_row):
            raise self._diverged(n, self.nan_skips, self.skips_in_a_row)

    def _read_skips(self, check: bool = True) -> None:
        """The device-side step's skip counts into ``nan_skips``, ``skips_in_a_row`` and ``first_nan_skip`` (one
        host read); with ``check``, NonFiniteLossError for a stop rule broken since, naming the step it broke at."""
        if self.skips is None:
            return
        (self.nan_skips, self.skips_in_a_row, self.first_nan_skip), broke = self.skips.read()
        if check and broke is not None:
            raise self._diverged(*broke)

    def _stop_reason(self, skips: int, in_a_row: int) -> str | None:
        e = self.cfg.engine
        if e.nan_policy == "stop":
            return "engine.nan_policy is 'stop'"
        if in_a_row > e.max_nan_skips:
            return f"{in_a_row} in a row, more than engine.max_nan_skips={e.max_nan_skips}"
        if skips > e.max_skip_share * e.max_steps:
            return f"more than engine.max_skip_share={e.max_skip_share:g} of the {e.max_steps} steps"
        return None

    def _diverged(self, n: int, skips: int, in_a_row: int) -> NonFiniteLossError:
        return NonFiniteLossError(
            f"non-finite loss or gradient at step {n}: {skips} step(s) skipped, the first at step "
            f"{self.first_nan_skip} ({self._stop_reason(skips, in_a_row)}); the run diverges: lower optim.lr (now "
            f"{self.cfg.optim.lr:g}) or set optim.grad_clip"
        )

    # ---- the run --------------------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        """Train to ``engine.max_steps``, checkpointing and logging; then the end-of-run report (rank 0)."""
        cfg, main = self.cfg, self.engine.is_main
        if self.start.mode == "finished":  # resumed at or past max_steps: nothing to train, nothing rewritten
            return {
                "step": self.step,
                "loss": math.nan,
                "nan_skips": self.nan_skips,
                "finished": True,
                "first_nan_skip": self.first_nan_skip,
                "stage": self.curriculum.stage,
                "run_dir": str(self.run_dir),
            }
        lg = cfg.logging
        wandb = dict(project=lg.wandb_project, mode=lg.wandb_mode, config=cfg.to_dict()) if lg.wandb else None
        resumed = self.start.step if self.start.mode == "resume" else None
        writer = MetricsWriter(self.run_dir, lg.tensorboard, resume_step=resumed, wandb=wandb) if main else None
        bar = tqdm(
            total=cfg.engine.max_steps,
            initial=self.step,
            disable=not (main and cfg.logging.progress),
            dynamic_ncols=True,
        )
        self.model.train()
        win_loss, win_n, t0, seen = torch.zeros((), device=self.device), 0, time.perf_counter(), 0
        last_loss, evaluator = math.nan, None
        stop = StopRequest()
        try:
            stop.__enter__()
            self._clock = time.perf_counter()
            while self.step < cfg.engine.max_steps:
                x0, y = next(self.loader)
                x0 = x0.to(self.device, non_blocking=True)
                y = y.to(self.device, non_blocking=True)
                stats = self.train_step(x0, y)
                seen += x0.shape[0] * self.engine.world_size
                if "loss" in stats:  # engine.cuda_graphs: 0 and a false flag for a skipped step, read at the log
                    win_loss += stats["loss"]
                    win_n += stats.get("applied", 1)
                bar.update(1)
                if self.step % cfg.logging.log_every == 0 or self.step == cfg.engine.max_steps:
                    self._read_skips()  # engine.cuda_graphs: the stop rules apply here
                    dt, n = time.perf_counter() - t0, int(win_n)
                    last_loss = float(win_loss) / n if n else math.nan
                    rec = self._record(last_loss, seen / max(dt, 1e-9), stats)
                    bar.set_postfix(
                        loss=f"{last_loss:.4f}",
                        img_s=f"{rec['img_per_s']:.0f}",
                        clusters=f"{rec['unlocked']}/{self.curriculum.num_clusters}",
                    )
                    if writer is not None:
                        writer.write(rec)
                    win_loss.zero_()
                    win_n, seen, t0 = 0, 0, time.perf_counter()
                if main and eval_due(self.step, cfg):  # own RNG: the training stream is unchanged
                    self.train_s, self._clock = self.train_time(), None  # the clock stops while it evaluates
                    evaluator = evaluator or Evaluator(cfg, self.run_dir, self.dataset, self.device)
                    writer.write({**evaluator(self.step, self.ema.module, self.formulation), "train_s": self.train_s})
                    self._clock = time.perf_counter()
                if stop.should_stop(self.engine):  # SIGINT / SIGTERM on any rank: checkpoint this step, then stop
                    raise TrainingInterrupted(stop.vote_signal(), self.step, self.save())
                if self.step % cfg.checkpoint.every == 0 and self.step < cfg.engine.max_steps:
                    self.save()
            self.save()
        finally:
            self.train_s, self._clock = self.train_time(), None
            stop.__exit__()
            bar.close()
            if writer is not None:
                writer.close()
        summary: dict[str, Any] = {
            "step": self.step,
            "loss": last_loss,
            "nan_skips": self.nan_skips,
            "first_nan_skip": self.first_nan_skip,
            "stage": self.curriculum.stage,
            "run_dir": str(self.run_dir),
        }
        if main:
            summary.update(self.finish())
        self.engine.barrier()
        return summary

    def train_time(self) -> float:
        """Seconds this run has trained (``fit``'s loop, resumed attempts added, evaluation time left out)."""
        return self.train_s + (time.perf_counter() - self._clock if self._clock is not None else 0.0)

    def _record(self, loss: float, img_per_s: float, stats: dict[str, Any]) -> dict[str, Any]:
        cl = self.curriculum.cluster_losses().tolist()
        rec = {
            "step": self.step,
            "loss": loss,
            "lr": lr_at(self.step - 1, self.cfg),
            "img_per_s": img_per_s,
            "stage": self.curriculum.stage,
            "unlocked": len(self.curriculum.unlocked_clusters),
            "nan_skips": self.nan_skips,
            "cluster_loss": [None if math.isnan(v) else v for v in cl],
        }
        if "grad_norm" in stats:
            rec["grad_norm"] = float(stats["grad_norm"])
        if self.device.type == "cuda":
            rec.update(gpu_stats(self.device.index or 0))
            rec["max_mem_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        return rec

    def finish(self) -> dict[str, Any]:
        """EMA export, sample grid and plots (rank 0). Returns the paths written."""
        cfg, out = self.cfg, {}
        meta = {"config": cfg.to_dict(), "step": self.step, **_model_config_entry(self.model)}
        if cfg.checkpoint.export_ema:
            out["ema"] = str(
                ckpt_io.export_safetensors(self.ema.module.state_dict(), self.run_dir / "ema.safetensors", meta)
            )
        stop = StopRequest()  # Ctrl-C / SIGTERM during the grid: stop it (the final checkpoint is written)
        try:
            with stop:
                grid = sample_grid(
                    self.ema.module,
                    self.formulation,
                    cfg,
                    self.run_dir / "samples.png",
                    self.device,
                    should_stop=lambda: stop.signum,
                )
        except SamplingInterrupted as exc:
            raise GridInterrupted(exc.signum, self.step, ckpt_io.latest_checkpoint(self.run_dir)) from None
        if grid is not None:
            out["samples"] = str(grid)
        elif cfg.logging.num_samples:  # a grid was asked for: say why there is none
            out["no_samples"] = grid_unavailable(cfg)
        if cfg.logging.plots:
            records = read_metrics(self.run_dir / "metrics.jsonl")
            clusters = [list(c) for c in self.curriculum.clusters]
            out["cluster_loss_plot"] = str(plot_cluster_losses(records, clusters, self.run_dir / "cluster_loss.png"))
            out["curriculum_plot"] = str(
                plot_curriculum_timeline(
                    records,
                    self.curriculum.history,
                    self.curriculum.num_clusters,
                    cfg.engine.max_steps,
                    self.run_dir / "curriculum.png",
                )
            )
        return out

    # ---- state ----------------------------------------------------------------------------------------
    def _rng_state(self) -> dict[str, Any]:
        state = {"torch": torch.get_rng_state(), "gen": self.gen.get_state(), "python": random.getstate()}
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def state_dict(self) -> dict[str, Any]:
        """Everything a resume needs; RNG states of every rank (gathered). Every rank calls it (the engine may
        write its own optimizer shards, e.g. DeepSpeed ZeRO)."""
        with self.engine.full_params(self.model):  # ZeRO-3: gathered, copied out before they are released
            model_state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self._read_skips(check=False)
        return {
            "step": self.step,
            "config": self.cfg.to_dict(),
            **_model_config_entry(self.model),
            "model": model_state,
            "ema": self.ema.state_dict(),
            "optimizer": self.engine.optimizer_state(self.opt, self.run_dir, self.step),
            "curriculum": self.curriculum.state_dict(),
            "timesteps": self.timesteps.state_dict(),
            "data": self._data_state(),
            "rng": self.engine.gather_objects(self._rng_state()),
            "nan_skips": self.nan_skips,
            "nan_skip_run": [self.skips_in_a_row, self.first_nan_skip],
            "train_s": self.train_time(),
            "world_size": self.engine.world_size,
        }

    def _data_state(self) -> dict[str, Any]:
        """The data position; the sharded loader's differs per rank, so every rank's is kept (gathered)."""
        if isinstance(self.loader, TrainBatches):
            return {"kind": "sharded", "ranks": self.engine.gather_objects(self.loader.state_dict())}
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``; ValueError naming the differences for an incompatible config."""
        diffs = resume_mismatches(state["config"], self.cfg)
        if diffs:
            raise ValueError("cannot resume: the checkpoint was trained with a different config: " + "; ".join(diffs))
        if state["world_size"] != self.engine.world_size:
            raise ValueError(
                f"cannot resume: the checkpoint was written by {state['world_size']} ranks, this run has "
                f"{self.engine.world_size}"
            )
        with self.engine.full_params(self.model, modify=True):
            self.model.load_state_dict(state["model"])
        self.ema.load_state_dict(state["ema"])
        self.engine.load_optimizer_state(self.opt, state["optimizer"], self.run_dir)
        self.curriculum.load_state_dict(state["curriculum"])
        self.timesteps.load_state_dict(state.get("timesteps", {}))  # a checkpoint of before the strategies: none
        data = state["data"]
        if isinstance(self.loader, TrainBatches):  # every rank continues its own shard's position
            data = data["ranks"][self.engine.rank] if "ranks" in data else data
        elif "kind" in data:
            raise ValueError(
                "cannot resume: the checkpoint's data position is of data.dataset latents/images, this "
                f"run reads {self.cfg.data.dataset!r}"
            )
        self.loader.load_state_dict(data)
        self.step = int(state["step"])
        self.nan_skips = int(state["nan_skips"])
        self.skips_in_a_row, self.first_nan_skip = (int(v) for v in state.get("nan_skip_run", (0, 0)))
        if self.skips is not None:
            self.skips.reset(self.step, self.nan_skips, self.skips_in_a_row, self.first_nan_skip)
        self.train_s = float(state.get("train_s", 0.0))  # checkpoints from before it was kept: 0
        rng = state["rng"][self.engine.rank]
        torch.set_rng_state(rng["torch"])
        self.gen.set_state(rng["gen"])
        random.setstate(_to_tuple(rng["python"]))
        if "cuda" in rng and self.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], self.device)

    def save(self) -> Path | None:
        """Write a checkpoint of the current step (rank 0 writes; all ranks take part in the gather)."""
        self._read_skips()  # engine.cuda_graphs: no checkpoint of a run a stop rule has stopped
        state = self.state_dict()
        path = None
        if self.engine.is_main:
            path = ckpt_io.save_checkpoint(self.run_dir, self.step, state, self.cfg.checkpoint.keep_last)
        self.engine.barrier()
        return path


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


def _model_config_entry(model: torch.nn.Module) -> dict[str, Any]:
    """``{"model_config": model.config()}`` for a model that can describe itself (rebuilds heterogeneous DiTs)."""
    return {"model_config": model.config()} if callable(getattr(model, "config", None)) else {}


def _to_tuple(obj: Any) -> Any:
    return tuple(_to_tuple(v) for v in obj) if isinstance(obj, (list, tuple)) else obj


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


__all__ = ["GridInterrupted", "NonFiniteLossError", "Trainer", "TrainingInterrupted", "lr_at", "train", "unwrap"]
