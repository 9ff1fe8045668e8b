"""End-to-end TDC training (arXiv 2312.13307): stage 1, per-group proxy pruning and fine-tuning, the bundle.

``run_tdc(cfg, options, run_dir)`` runs these stages in turn (one function each below):

1. ``stage1``: an ordinary ``Trainer`` run of the base model on all timesteps (the training config as given, so
   ``curriculum.pacing`` other than ``none`` combines the difficulty curriculum of Kim et al. with TDC).
2. Per timestep group (``make_groups``: SNR_dB grouping, budgets of TDC Eq. 2):
   ``search_group``: importance scores of the base for the group, then ``proxy_search`` (rounds x candidates, each
   recovered for a few steps and scored on held-out batches); ``finetune_group``: the best candidate fine-tuned on
   the group's timesteps through ``Trainer`` (EMA, checkpoints, metrics as any run; ``timestep_range`` restricts t,
   ``model`` passes the pruned expert).
3. ``bundle``: the experts' EMA weights form a ``MultiExpertDenoiser`` saved as a bundle (plus the training
   config), and the end-of-run sample grid (``sample_grid``, as the trainer's) is drawn from it.
4. ``accounting``: training FLOPs of both stages and of the search vs one base model trained as long, and sampling
   FLOPs per image for the grid's sampler and steps, printed and written as JSON.

Under ``torchrun`` / ``deepspeed`` every rank runs the same stages: stage 1 and each fine-tune are data-parallel
through the training engine, the importance gradients are all-reduced, the search's candidates are spread over the
ranks (``proxy_search``); rank 0 writes the files. ``resume=True`` continues a killed run from the files above.

The options are the ``tdc`` section of the training config (``TDCConfig``): a recipe's ``tdc:`` section,
``--set tdc.num_groups=4``, or the ``options`` argument. Run directory::

    tdc.json                 the resolved config (tdc section included)
    stage1/                  the base model's run (checkpoints/, ema.safetensors, metrics.jsonl, samples.png)
    stage1/tdc_stage1.json   written when stage 1 finished (its summary and wall time)
    group_<i>/search_state.pt  the search after its last finished round (bank, history, proposer RNG, best weights)
    group_<i>/search.json    proxy search: memory bank, per-round history, rejections
    group_<i>/search.png     proxy mean +- std per round (TDC Fig. 5)
    group_<i>/finetune/      the expert's run (checkpoints/ record the expert's config() as model_config)
    group_<i>/expert.safetensors  the finished expert (EMA weights, config() and the group's record)
    bundle/                  bundle.json, weights.safetensors, train_config.json
    accounting.json          training and sampling FLOPs
    samples.png              grid sampled from the bundle
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from diffcurr_fast._files import read_safetensors, write_json
from diffcurr_fast.models import DiT
from diffcurr_fast.objective import Objective
from diffcurr_fast.runs.checkpoint import export_safetensors, latest_checkpoint
from diffcurr_fast.runs.config import TrainConfig, config_from_dict, resume_mismatches, upgrade_saved
from diffcurr_fast.runs.recipes import load_config
from diffcurr_fast.runs.sampling import build_model, grid_sampler, sample, sample_grid, sampling_readout
from diffcurr_fast.runs.sections import TDCConfig
from diffcurr_fast.tdc.accounting import sampling_flops, training_flops, visited_input_times
from diffcurr_fast.tdc.experts import MultiExpertDenoiser, load_bundle, save_bundle
from diffcurr_fast.tdc.flops import dit_flops
from diffcurr_fast.tdc.grouping import TimestepGroup, make_groups
from diffcurr_fast.tdc.preflight import check_tdc_run
from diffcurr_fast.tdc.proposers import make_proposer
from diffcurr_fast.tdc.prune import importance_scores
from diffcurr_fast.tdc.search import SearchResult, plot_history, proxy_search
from diffcurr_fast.train.data import SHARDED_DATASETS, build_dataset
from diffcurr_fast.train.engine import create_engine
from diffcurr_fast.train.loop import Trainer
from diffcurr_fast.train.rundir import RunStart, lock_run_dir, open_run_dir

__all__ = [
    "format_accounting",
    "load_bundle_with_config",
    "resolve_config",
    "run_tdc",
    "stage2_config",
]


def resolve_config(cfg: TrainConfig | dict[str, Any] | str | Path, options: TDCConfig | dict | None) -> TrainConfig:
    """The validated config of a TDC run: ``cfg`` (a ``TrainConfig``, its dict or a YAML recipe path) with
    ``options`` (a ``TDCConfig`` replacing its tdc section, or a dict of tdc keys over it); raises ValueError for
    what TDC cannot run, before anything trains."""
    if isinstance(cfg, (str, Path)):
        cfg = load_config(cfg)
    cfg = config_from_dict(copy.deepcopy(cfg)) if isinstance(cfg, dict) else copy.deepcopy(cfg)
    if isinstance(options, TDCConfig):
        cfg.tdc = copy.deepcopy(options)
    elif options:
        cfg = config_from_dict({"tdc": options}, cfg)
    return cfg.validate()


def stage2_config(cfg: TrainConfig, run_dir: Path) -> TrainConfig:
    """The fine-tuning config of one expert: ``cfg`` with ``tdc.finetune_steps`` steps, no curriculum (a short
    fine-tune of trained weights, restricted to the group: docs/tdc.md), no per-expert sample grid, plots or
    evaluation, and ``run_dir``."""
    d, steps = cfg.to_dict(), cfg.tdc.finetune_steps
    d["engine"]["max_steps"] = steps
    d["curriculum"]["pacing"] = "none"
    d["logging"]["num_samples"] = 0
    d["logging"]["plots"] = False
    d["logging"]["eval_every"] = 0  # an expert alone does not sample: the bundle is evaluated
    d["logging"]["log_every"] = min(d["logging"]["log_every"], steps)
    d["checkpoint"]["run_dir"] = str(run_dir)
    d["checkpoint"]["every"] = min(d["checkpoint"]["every"], steps)
    d["optim"]["warmup_steps"] = min(d["optim"]["warmup_steps"], steps // 10)
    if cfg.tdc.finetune_lr > 0:
        d["optim"]["lr"] = cfg.tdc.finetune_lr
    d["optim"]["min_lr"] = min(d["optim"]["min_lr"], d["optim"]["lr"])
    return config_from_dict(d, record=True).validate()


def _search_batch_size(cfg: TrainConfig) -> int:
    return cfg.tdc.search_batch_size or cfg.data.batch_size


def _check_split(opts: TDCConfig, batch_size: int, n: int) -> None:
    need = (opts.search_batches + opts.heldout_batches) * batch_size
    if need > n:
        raise ValueError(
            f"tdc.search_batches + tdc.heldout_batches ({opts.search_batches} + {opts.heldout_batches}) batches of "
            f"{batch_size} need {need} samples, the dataset has {n}; lower them or tdc.search_batch_size"
        )


def _split_batches(dataset: Any, opts: TDCConfig, batch_size: int, device: torch.device):
    """Disjoint (search, held-out) lists of (x0, y) batches drawn from ``dataset`` with ``opts.seed``."""
    n = len(dataset)
    _check_split(opts, batch_size, n)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(opts.seed)).tolist()

    def take(start: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for b in range(count):
            idx = perm[start + b * batch_size : start + (b + 1) * batch_size]
            if hasattr(dataset, "batch"):
                x, y = dataset.batch(idx)
            else:
                items = [dataset[i] for i in idx]
                x, y = torch.stack([it[0] for it in items]), torch.stack([torch.as_tensor(it[1]) for it in items])
            out.append((x.float().to(device), y.long().to(device)))
        return out

    held = take(0, opts.heldout_batches)
    return take(opts.heldout_batches * batch_size, opts.search_batches), held


@dataclass
class Stage1:
    """What stage 2 needs from stage 1: the base model (float32, eval, with gradients for Taylor importance), the
    schedule and the training objective (which importance, recovery and the proxy score use), the dataset and
    device of the run, the trainer's summary and the wall time."""

    model: torch.nn.Module
    schedule: Any
    objective: Objective
    dataset: Any
    device: torch.device
    summary: dict[str, Any]
    seconds: float

    @property
    def flops(self) -> float:
        return dit_flops(self.model)


def _log(verbose: bool, msg: str) -> None:
    if verbose:
        print(msg, flush=True)


def run_tdc(
    cfg: TrainConfig | dict[str, Any] | str | Path,
    options: TDCConfig | dict[str, Any] | None,
    run_dir: str | Path,
    *,
    overwrite: bool = False,
    resume: bool = False,
    engine: Any = None,
    verbose: bool = True,
) -> dict[str, Any]:
    """Run the whole TDC pipeline (module doc) into ``run_dir``; returns a summary with every artefact's path.

    Args:
        cfg: the training config of stage 1 (its ``checkpoint.run_dir`` is replaced by ``run_dir/stage1``): a
            ``TrainConfig``, its dict, or a YAML recipe path; its ``tdc`` section holds the TDC options.
        options: a ``TDCConfig`` replacing ``cfg.tdc``, or a dict of tdc keys over it (None: ``cfg.tdc`` as is).
        run_dir: output directory; a non-empty one is refused unless ``overwrite`` (which removes TDC artefacts) or
            ``resume``.
        resume: continue a killed run in ``run_dir`` (same config): stage 1 from its newest checkpoint, finished
            groups kept (``group_<i>/expert.safetensors``), a search from its state after the last finished round,
            a fine-tune from its newest checkpoint.
        engine: the training engine (default: one created from ``cfg.engine``, closed at the end). Under
            ``torchrun`` / ``deepspeed`` every rank calls ``run_tdc``: stage 1 and each fine-tune are data-parallel,
            importance is all-reduced, the search's candidates are spread over the ranks (``tdc.expert_parallel``:
            the ranks split into parts that take the groups in turn); rank 0 writes the files.
        verbose: print progress and the accounting (rank 0).

    Rank 0 holds the run directory's lock (``rundir.lock_run_dir``) from before the checks until it returns.
    """
    main = int(os.environ.get("RANK", "0")) == 0  # the engine is made after the checks
    lock = lock_run_dir(run_dir, resume=resume) if main else None
    try:
        return _run_tdc(cfg, options, run_dir, overwrite, resume, engine, verbose)
    finally:
        if lock is not None:
            lock.release()


def _run_tdc(cfg, options, run_dir, overwrite, resume, engine, verbose) -> dict[str, Any]:
    cfg, run_dir, t_start = resolve_config(cfg, options), Path(run_dir), time.perf_counter()
    start = check_tdc_run(cfg, cfg.tdc, run_dir, overwrite=overwrite, resume=resume)  # before anything is written
    cfg.checkpoint.run_dir = str(run_dir / "stage1")
    dataset = None if cfg.data.dataset in SHARDED_DATASETS else build_dataset(cfg)
    if dataset is not None:  # the search data must fit before stage 1 trains
        _check_split(cfg.tdc, _search_batch_size(cfg), len(dataset))
    own = engine is None
    engine = engine or create_engine(cfg.engine.kind, cfg.engine.device)
    try:
        verbose = verbose and engine.is_main
        _prepare(cfg, start, engine)
        base = stage1(cfg, engine, dataset, verbose, resume)
        groups = make_groups(
            base.schedule,
            cfg.tdc.num_groups,
            cfg.tdc.budget_floor,
            base.flops,
            method=cfg.tdc.group_method,
            full_budget=cfg.tdc.full_budget,
            num_cells=cfg.diffusion.num_timesteps,
        )
        data = _split_batches(base.dataset, cfg.tdc, _search_batch_size(cfg), base.device)
        parts = min(len(groups), engine.world_size) if cfg.tdc.expert_parallel else 1
        part = engine.split(parts)  # expert parallel: group i is searched and fine-tuned by part i mod parts
        finished = {}
        for g in groups:
            if g.index % parts != part.part:
                continue
            gdir = run_dir / f"group_{g.index}"
            done = _load_expert(gdir, base.device) if resume else None
            if done is None:
                res, record = search_group(cfg, base, g, data, gdir, verbose, part)
                done = finetune_group(cfg, part, base, g, res, record, verbose, resume)
                if part.is_main:
                    _save_expert(gdir, *done)
                part.barrier()
            finished[g.index] = done
        if parts > 1:  # every rank receives each expert from the first rank of the part that made it
            leaders = engine.part_leaders(parts)
            for g in groups:
                mine = finished.get(g.index) if engine.rank == leaders[g.index % parts] else None
                got = engine.broadcast_object(
                    None if mine is None else _expert_payload(*mine), src=leaders[g.index % parts]
                )
                finished[g.index] = _expert_from_payload(*got, base.device)
        experts, per_group = [finished[g.index][0] for g in groups], [finished[g.index][1] for g in groups]
        multi, out = bundle(cfg, base, experts, groups, run_dir, engine.is_main)
        acc = accounting(cfg, base, multi, per_group, time.perf_counter() - t_start)
        out.update(groups=per_group, accounting=str(run_dir / "accounting.json"), accounting_data=acc)
        if engine.is_main:
            write_json(acc, run_dir / "accounting.json")
        _log(verbose, format_accounting(acc))
        engine.barrier()
        return out
    finally:
        if own:
            engine.close()


def _prepare(cfg: TrainConfig, start: RunStart, engine: Any) -> None:
    """Set up the run directory (rank 0; ``start`` from ``check_tdc_run``); a resumed run must have the same
    config."""
    saved = start.run_dir / "tdc.json"
    if start.mode == "resume":
        old = upgrade_saved(json.loads(saved.read_text())["config"])
        diffs = resume_mismatches(old, cfg) + [
            f"tdc.{k}: run {old.get('tdc', {}).get(k)!r} vs now {v!r}"
            for k, v in cfg.to_dict()["tdc"].items()
            if old.get("tdc", {}).get(k) != v
        ]
        if diffs:
            raise ValueError("cannot resume the TDC run: its config differs: " + "; ".join(diffs))
    engine.barrier()  # every rank has checked before rank 0 writes
    if engine.is_main:
        if start.mode != "resume":
            open_run_dir(start)  # overwrite: only the files a TDC run writes are removed (TDC_LAYOUT)
        write_json({"config": cfg.to_dict()}, saved)
    engine.barrier()


def _sub_run(run_dir: Path, resume: bool) -> dict[str, bool]:
    """How a stage's trainer opens its folder: resumed from its newest checkpoint when the TDC run resumes and
    there is one, else started afresh over whatever the cleared folder still holds (a user's files)."""
    if resume and latest_checkpoint(run_dir) is not None:
        return {"resume": True}
    return {"overwrite": True}


def stage1(cfg: TrainConfig, engine: Any, dataset: Any, verbose: bool, resume: bool = False) -> Stage1:
    """Train the base model on all timesteps (``cfg`` as given) and take its ``tdc.base_weights``. ``resume``:
    continue from the newest checkpoint; a finished stage 1 (``stage1/tdc_stage1.json``) is loaded, not rerun."""
    marker = Path(cfg.checkpoint.run_dir) / "tdc_stage1.json"
    finished = resume and marker.is_file()
    _log(
        verbose,
        f"tdc: stage 1, {cfg.engine.max_steps} steps (curriculum pacing {cfg.curriculum.pacing!r})"
        + (" (finished: loaded)" if finished else ""),
    )
    t0 = time.perf_counter()
    trainer = Trainer(cfg, engine, dataset=dataset, **_sub_run(Path(cfg.checkpoint.run_dir), resume))
    if finished:
        done = json.loads(marker.read_text())
        was, now = str(done["summary"]["run_dir"]), cfg.checkpoint.run_dir  # differ when the run dir was moved
        summary = {
            k: now + v[len(was) :] if isinstance(v, str) and v.startswith(was) else v
            for k, v in done["summary"].items()
        }
        seconds = float(done["seconds"])
    else:
        summary = trainer.fit()
        seconds = time.perf_counter() - t0
        if engine.is_main:
            write_json({"summary": summary, "seconds": seconds}, marker)
    if cfg.tdc.base_weights == "ema":
        base = copy.deepcopy(trainer.ema.module)
    else:  # ZeRO-3 partitions the trained parameters: gathered, then copied into a plain model
        with engine.full_params(trainer.model):
            weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        base = build_model(cfg)
        base.load_state_dict(weights)
    base = base.float().to(trainer.device).eval().requires_grad_(True)  # Taylor importance needs its gradients
    return Stage1(base, trainer.formulation, trainer.objective, trainer.dataset, trainer.device, summary, seconds)


def search_group(
    cfg: TrainConfig,
    base: Stage1,
    g: TimestepGroup,
    data: tuple[list, list],
    gdir: Path,
    verbose: bool,
    engine: Any = None,
) -> tuple[SearchResult, dict[str, Any]]:
    """Importance and proxy search of group ``g`` into ``gdir`` (spread over the ranks of ``engine``; the search
    state is kept in ``gdir/search_state.pt`` after each round, and continued from it); the result and the group's
    record (with the search's FLOPs: Taylor importance, forward + backward of the base; each candidate's recovery,
    3 x its FLOPs per sample; held-out scoring, forward only)."""
    t, (search_data, heldout) = cfg.tdc, data
    fallback = ", falling back to local" if t.proposer == "llm" and t.llm_fallback == "local" else ""
    _log(
        verbose,
        f"tdc: group {g.index} t in [{g.lo}, {g.hi}), budget {g.ratio:.3f} F: proxy search "
        f"({t.rounds} x {t.candidates} candidates, proposer {t.proposer!r}{fallback})",
    )
    t0 = time.perf_counter()
    imp_batches = [search_data[i % len(search_data)] for i in range(t.importance_batches)]
    imp = importance_scores(
        base.model, t.importance, objective=base.objective, group=g, batches=imp_batches, seed=t.seed, engine=engine
    )
    llm = {
        "url": t.llm_url,
        "model": t.llm_model,
        "api_key_env": t.llm_api_key_env or None,
        "on_unreachable": "report" if t.llm_fallback == "local" else "raise",
    }
    res = proxy_search(
        base.model,
        g,
        g.flops,
        search_data,
        heldout,
        objective=base.objective,
        importance=imp,
        proposer=make_proposer(t.proposer, **(llm if t.proposer == "llm" else {})),
        fallback=make_proposer("local"),
        rounds=t.rounds,
        candidates_per_round=t.candidates,
        recover_steps=t.recover_steps,
        lr=t.recover_lr,
        seed=t.seed + g.index,
        drop_empty_blocks=t.drop_empty_blocks,
        log_path=gdir / "search.json",
        engine=engine,
        state_path=gdir / "search_state.pt",
    )
    if engine is None or engine.is_main:
        plot_history(res.history, gdir / "search.png", title=f"proxy-based pruning, group {g.index}")
    bsz, n_held = _search_batch_size(cfg), sum(int(x.shape[0]) for x, _ in heldout)
    imp_flops = 3.0 * base.flops * bsz * t.importance_batches if t.importance == "taylor" else 0.0
    cand_flops = sum(3.0 * c.flops * bsz * t.recover_steps + c.flops * n_held for c in res.bank.entries)
    record = {
        "group": g.to_dict(),
        **_group_paths(gdir),
        "best": dataclasses.asdict(res.best),
        "search_flops": imp_flops + cand_flops,
        "search_s": time.perf_counter() - t0,
    }
    return res, record


def finetune_group(
    cfg: TrainConfig,
    engine: Any,
    base: Stage1,
    g: TimestepGroup,
    res: SearchResult,
    record: dict,
    verbose: bool,
    resume: bool = False,
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Fine-tune the best candidate of ``res`` on the group's timesteps, data-parallel over the engine's ranks
    (``resume``: from its newest checkpoint); its EMA weights and the updated record."""
    t0 = time.perf_counter()
    ft = Trainer(
        stage2_config(cfg, Path(record["finetune_dir"])),
        engine,
        model=copy.deepcopy(res.model).train(),
        timestep_range=(g.lo, g.hi),
        dataset=base.dataset,
        **_sub_run(Path(record["finetune_dir"]), resume),
    )
    summary = ft.fit()
    expert = copy.deepcopy(ft.ema.module).eval()
    record = {
        **record,
        "expert_flops": dit_flops(expert),
        "finetune_loss": summary["loss"],
        "finetune_s": time.perf_counter() - t0,
    }
    _log(
        verbose,
        f"tdc: group {g.index}: expert {record['expert_flops'] / base.flops:.3f} F, proxy "
        f"{res.best.score:.4f}, fine-tune loss {summary['loss']:.4f}",
    )
    return expert, record


def bundle(
    cfg: TrainConfig, base: Stage1, experts: list, groups: list[TimestepGroup], run_dir: Path, write: bool = True
) -> tuple[MultiExpertDenoiser, dict[str, Any]]:
    """Save the experts as a ``MultiExpertDenoiser`` bundle (with the training config) and draw the end-of-run
    grid from it (when ``write``: rank 0); the model and the paths."""
    multi = MultiExpertDenoiser(
        experts,
        [(g.lo, g.hi) for g in groups],
        groups=[g.to_dict() for g in groups],
        input_edges=base.schedule.cell_input_edges(cfg.diffusion.num_timesteps),
    )
    bundle_dir = run_dir / "bundle"
    out: dict[str, Any] = {"run_dir": str(run_dir), "bundle": str(bundle_dir), "stage1": base.summary}
    if not write:
        return multi, out
    save_bundle(multi, bundle_dir)
    write_json(cfg.to_dict(), bundle_dir / "train_config.json")
    grid = sample_grid(multi.to(base.device).eval(), base.schedule, cfg, run_dir / "samples.png", base.device)
    if grid is not None:
        out["samples"] = str(grid)
    return multi, out


def _save_expert(gdir: Path, expert: torch.nn.Module, record: dict[str, Any]) -> Path:
    """A finished group: the expert's weights with its ``config()`` and record, one atomic file."""
    return export_safetensors(
        expert.state_dict(), gdir / "expert.safetensors", {"config": expert.config(), "record": record}
    )


def _expert_payload(expert: torch.nn.Module, record: dict[str, Any]) -> tuple[dict, dict, dict]:
    """(config, CPU weights, record) of a finished expert, to send to other ranks."""
    return expert.config(), {k: v.detach().cpu() for k, v in expert.state_dict().items()}, record


def _expert_from_payload(config: dict, weights: dict, record: dict, device: torch.device):
    """Inverse of ``_expert_payload``: (expert on ``device``, record)."""
    expert = DiT.from_config(config)
    expert.load_state_dict(weights, strict=True)
    return expert.to(device).eval(), record


def _load_expert(gdir: Path, device: torch.device) -> tuple[torch.nn.Module, dict[str, Any]] | None:
    """What ``_save_expert`` wrote (None when the group has not finished)."""
    path = gdir / "expert.safetensors"
    if not path.is_file():
        return None
    with safe_open(str(path), "pt") as fh:
        meta = {k: json.loads(v) for k, v in fh.metadata().items()}
    # the paths of the record are where the group is now (the run directory may have been moved since)
    record = {**meta["record"], **_group_paths(gdir)}
    return _expert_from_payload(meta["config"], read_safetensors(path), record, device)


def _group_paths(gdir: Path) -> dict[str, str]:
    """The files of group directory ``gdir`` that its record names."""
    return {
        "search": str(gdir / "search.json"),
        "search_plot": str(gdir / "search.png"),
        "finetune_dir": str(gdir / "finetune"),
    }


def accounting(
    cfg: TrainConfig, base: Stage1, multi: MultiExpertDenoiser, per_group: list[dict], wall_s: float
) -> dict[str, Any]:
    """Training FLOPs (both stages, and with the search) vs one base model trained as long; sampling FLOPs per
    image with the grid's sampler and steps (the network input times it visits, recorded from one sample) and,
    for DDPM, with full T-step ancestral sampling; wall times."""
    train = training_flops(
        base.flops, multi.expert_flops(), int(base.summary["step"]), cfg.tdc.finetune_steps, cfg.data.batch_size
    )
    train["search_flops"] = sum(p["search_flops"] for p in per_group)
    train["tdc_flops_with_search"] = train["tdc_flops"] + train["search_flops"]
    train["ratio_with_search"] = train["tdc_flops_with_search"] / train["single_model_flops"]
    sampler, steps = grid_sampler(cfg)
    guided, T = cfg.logging.cfg_scale != 1.0, cfg.diffusion.num_timesteps
    visited = visited_times(multi, base.schedule, cfg, base.device, sampler, steps)
    sampling = {f"{sampler}{steps}": sampling_flops(multi, base.flops, visited, cfg=guided)}
    if cfg.diffusion.formulation == "ddpm":
        sampling[f"ddpm{T}"] = sampling_flops(multi, base.flops, torch.arange(T), cfg=guided)
    return {
        "base_flops_per_forward": base.flops,
        "expert_flops_ratio": [f / base.flops for f in multi.expert_flops()],
        "training": train,
        "sampling": sampling,
        "wall_time_s": {
            "stage1_s": base.seconds,
            "total": wall_s,
            "groups": [{"search": p["search_s"], "finetune": p["finetune_s"]} for p in per_group],
        },
    }


def visited_times(
    multi: MultiExpertDenoiser, schedule: Any, cfg: TrainConfig, device: Any, sampler: str, steps: int
) -> torch.Tensor:
    """The network input time of every evaluation ``sampler`` at ``steps`` steps makes for one image (without
    guidance, which doubles the batch, not the evaluations)."""
    m = cfg.model
    return visited_input_times(
        multi,
        lambda model: sample(
            model,
            schedule,
            sampler=sampler,
            steps=steps,
            labels=torch.zeros(1, dtype=torch.long),
            channels=m.in_channels,
            size=m.input_size,
            num_classes=m.num_classes,
            readout=sampling_readout(cfg),
            seed=cfg.engine.seed,
            device=device,
        ),
    )


def equal_sampling_steps(
    multi: MultiExpertDenoiser, schedule: Any, cfg: TrainConfig, base_flops: float, sampler: str, steps: int
) -> tuple[int, dict[str, Any]]:
    """The most steps of ``sampler`` at which the multi-expert model costs no more sampling FLOPs per image than the
    base model at ``steps`` (at least ``steps``), and the multi-expert FLOPs accounting there."""

    def cost(n: int) -> dict[str, Any]:
        return sampling_flops(multi, base_flops, visited_times(multi, schedule, cfg, device, sampler, n))

    device = next(multi.parameters()).device
    budget = cost(steps)["base_flops_per_image"]
    n, acc = steps, cost(steps)
    while n < cfg.diffusion.num_timesteps:
        nxt = cost(n + 1)
        if nxt["multi_expert_flops_per_image"] > budget:
            break
        n, acc = n + 1, nxt
    return n, {**acc, "budget_base_steps": steps, "budget_flops_per_image": budget}


def format_accounting(acc: dict[str, Any]) -> str:
    """Human-readable lines of an accounting dict written by ``run_tdc``."""
    tr = acc["training"]
    lines = [
        "tdc accounting:",
        "  experts: "
        + ", ".join(f"{r:.3f} F" for r in acc["expert_flops_ratio"])
        + f" (F = {acc['base_flops_per_forward'] / 1e6:.2f} MFLOPs per forward)",
        f"  training: stage 1 {tr['stage1_flops']:.3e} + stage 2 {tr['stage2_flops']:.3e} = {tr['tdc_flops']:.3e} "
        f"FLOPs vs {tr['single_model_flops']:.3e} for one base model trained {tr['total_steps']} steps "
        f"(ratio {tr['ratio']:.3f}; with the proxy search {tr['ratio_with_search']:.3f})",
    ]
    for name, s in acc["sampling"].items():
        lines.append(
            f"  sampling {name}: {s['multi_expert_flops_per_image']:.3e} FLOPs per image vs "
            f"{s['base_flops_per_image']:.3e} for the base (x{s['flops_ratio']:.3f} fewer)"
        )
    return "\n".join(lines)


def load_bundle_with_config(
    path: str | Path, device: str | torch.device = "cpu"
) -> tuple[MultiExpertDenoiser, TrainConfig]:
    """A TDC bundle written by ``run_tdc`` and its training config (``train_config.json`` beside ``bundle.json``)."""
    path = Path(path)
    cfg_path = path / "train_config.json"
    if not cfg_path.is_file():
        raise ValueError(f"{str(path)!r} has no train_config.json; it is not a bundle written by `diffcurr-fast tdc`")
    cfg = config_from_dict(upgrade_saved(json.loads(cfg_path.read_text())), record=True)
    return load_bundle(path, device=device).eval(), cfg
