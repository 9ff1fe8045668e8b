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

The options are the ``tdc`` section of the training config (``TDCConfig``): a recipe's ``tdc:`` section,
``--set tdc.num_groups=4``, or the ``options`` argument. Run directory::

    tdc.json                 the resolved config (tdc section included)
    stage1/                  the base model's run (checkpoints/, ema.safetensors, metrics.jsonl, samples.png)
    group_<i>/search.json    proxy search: memory bank, per-round history, rejections
    group_<i>/search.png     proxy mean +- std per round (TDC Fig. 5)
    group_<i>/finetune/      the expert's run (checkpoints/ record the expert's config() as model_config)
    bundle/                  bundle.json, weights.safetensors, train_config.json
    accounting.json          training and sampling FLOPs
    samples.png              grid sampled from the bundle
"""

from __future__ import annotations

import copy
import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from diffcurr_fast.objective import Objective
from diffcurr_fast.tdc.accounting import sampling_flops, training_flops, write_json
from diffcurr_fast.tdc.experts import MultiExpertDenoiser, load_bundle, save_bundle
from diffcurr_fast.tdc.flops import dit_flops
from diffcurr_fast.tdc.grouping import TimestepGroup, make_groups
from diffcurr_fast.tdc.proposers import make_proposer
from diffcurr_fast.tdc.prune import importance_scores
from diffcurr_fast.tdc.search import SearchResult, plot_history, proxy_search
from diffcurr_fast.train.config import TDCConfig, TrainConfig, config_from_dict, load_config
from diffcurr_fast.train.data import SHARDED_DATASETS
from diffcurr_fast.train.engine import create_engine
from diffcurr_fast.train.loop import Trainer, build_dataset, clear_artifacts, prepare_run_dir
from diffcurr_fast.train.sampling import grid_sampler, respaced, sample_grid

__all__ = [
    "TDC_ARTIFACTS",
    "TDCOptions",
    "format_accounting",
    "load_bundle_with_config",
    "options_from_dict",
    "resolve_config",
    "run_tdc",
    "stage2_config",
]

# What a TDC run writes into its directory (``overwrite`` removes exactly these; glob patterns).
TDC_ARTIFACTS = ("tdc.json", "stage1", "group_*", "bundle", "accounting.json", "samples.png")
TDCOptions = TDCConfig  # the tdc section of the training config, under its former name


def options_from_dict(data: dict[str, Any] | None, base: TDCConfig | None = None) -> TDCConfig:
    """``TDCConfig`` from ``data`` over ``base`` (default: the defaults), parsed and validated as the ``tdc``
    section of a training config (unknown keys, wrong types and invalid values raise ValueError)."""
    cfg = TrainConfig(tdc=copy.deepcopy(base) if base is not None else TDCConfig())
    return config_from_dict({"tdc": data or {}}, cfg).tdc


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
    cfg.validate()
    d = cfg.diffusion
    if d.formulation != "ddpm":
        raise ValueError(f"TDC runs on the ddpm formulation, got diffusion.formulation {d.formulation!r}")
    if cfg.model.dtr:
        raise ValueError("model.dtr=True is not supported by TDC pruning (DTR masks span the full width); use false")
    if cfg.logging.sampler not in ("ddpm", "ddim"):
        raise ValueError(f"TDC's grid and sampling accounting use a ddpm or ddim sampler, got logging.sampler "
                         f"{cfg.logging.sampler!r}")  # fmt: skip
    return cfg


def stage2_config(cfg: TrainConfig, run_dir: Path) -> TrainConfig:
    """The fine-tuning config of one expert: ``cfg`` with ``tdc.finetune_steps`` steps, no curriculum (t is
    restricted to the group), no per-expert sample grid, plots or evaluation, and ``run_dir``."""
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
    return config_from_dict(d).validate()


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
    engine: Any = None,
    verbose: bool = True,
) -> dict[str, Any]:
    """Run the whole TDC pipeline (module doc) into ``run_dir``; returns a summary with every artefact's path.

    Args:
        cfg: the training config of stage 1 (its ``checkpoint.run_dir`` is replaced by ``run_dir/stage1``): a
            ``TrainConfig``, its dict, or a YAML recipe path; its ``tdc`` section holds the TDC options.
        options: a ``TDCConfig`` replacing ``cfg.tdc``, or a dict of tdc keys over it (None: ``cfg.tdc`` as is).
        run_dir: output directory; a non-empty one is refused unless ``overwrite`` (which removes TDC artefacts).
        engine: a single-process training engine (default: one created from ``cfg.engine``, closed at the end).
        verbose: print progress and the accounting.
    """
    cfg, run_dir, t_start = resolve_config(cfg, options), Path(run_dir), time.perf_counter()
    cfg.checkpoint.run_dir = str(run_dir / "stage1")
    dataset = None if cfg.data.dataset in SHARDED_DATASETS else build_dataset(cfg)
    if dataset is not None:  # the search data must fit before stage 1 trains
        _check_split(cfg.tdc, _search_batch_size(cfg), len(dataset))
    own = engine is None
    engine = engine or create_engine(cfg.engine.kind, cfg.engine.device)
    try:
        if engine.world_size != 1:
            raise ValueError(f"run_tdc runs in one process, got world size {engine.world_size}; use engine.kind single")
        prepare_run_dir(run_dir, resume=False, overwrite=overwrite)
        if overwrite:
            clear_artifacts(run_dir, TDC_ARTIFACTS)
        run_dir.mkdir(parents=True, exist_ok=True)
        write_json({"config": cfg.to_dict()}, run_dir / "tdc.json")
        base = stage1(cfg, engine, dataset, verbose)
        groups = make_groups(base.schedule, cfg.tdc.num_groups, cfg.tdc.k, base.flops, method=cfg.tdc.group_method,
                             full_budget=cfg.tdc.full_budget)  # fmt: skip
        data = _split_batches(base.dataset, cfg.tdc, _search_batch_size(cfg), base.device)
        experts, per_group = [], []
        for g in groups:
            res, record = search_group(cfg, base, g, data, run_dir / f"group_{g.index}", verbose)
            expert, record = finetune_group(cfg, engine, base, g, res, record, verbose)
            experts.append(expert)
            per_group.append(record)
        multi, out = bundle(cfg, base, experts, groups, run_dir)
        acc = accounting(cfg, base, multi, per_group, time.perf_counter() - t_start)
        out.update(groups=per_group, accounting=str(write_json(acc, run_dir / "accounting.json")), accounting_data=acc)
        _log(verbose, format_accounting(acc))
        return out
    finally:
        if own:
            engine.close()


def stage1(cfg: TrainConfig, engine: Any, dataset: Any, verbose: bool) -> Stage1:
    """Train the base model on all timesteps (``cfg`` as given) and take its ``tdc.base_weights``."""
    _log(verbose, f"tdc: stage 1, {cfg.engine.max_steps} steps (curriculum pacing {cfg.curriculum.pacing!r})")
    t0 = time.perf_counter()
    trainer = Trainer(cfg, engine, dataset=dataset)
    summary = trainer.fit()
    base = copy.deepcopy(trainer.ema.module if cfg.tdc.base_weights == "ema" else trainer.model).float()
    base = base.to(trainer.device).eval().requires_grad_(True)  # Taylor importance needs its gradients
    return Stage1(base, trainer.schedule, trainer.objective, trainer.dataset, trainer.device, summary,
                  time.perf_counter() - t0)  # fmt: skip


def search_group(
    cfg: TrainConfig, base: Stage1, g: TimestepGroup, data: tuple[list, list], gdir: Path, verbose: bool
) -> tuple[SearchResult, dict[str, Any]]:
    """Importance and proxy search of group ``g`` into ``gdir``; the result and the group's record (with the
    search's FLOPs: Taylor importance, forward + backward of the base; each candidate's recovery, 3 x its FLOPs per
    sample; held-out scoring, forward only)."""
    t, (search_data, heldout) = cfg.tdc, data
    _log(verbose, f"tdc: group {g.index} t in [{g.lo}, {g.hi}), budget {g.ratio:.3f} F: proxy search "
                  f"({t.rounds} x {t.candidates} candidates, proposer {t.proposer!r})")  # fmt: skip
    t0 = time.perf_counter()
    imp_batches = [search_data[i % len(search_data)] for i in range(t.importance_batches)]
    imp = importance_scores(base.model, t.importance, objective=base.objective, group=g, batches=imp_batches,
                            seed=t.seed)  # fmt: skip
    llm = {"url": t.llm_url, "model": t.llm_model, "api_key_env": t.llm_api_key_env or None}
    res = proxy_search(
        base.model, g, g.flops, search_data, heldout, objective=base.objective, importance=imp,
        proposer=make_proposer(t.proposer, **(llm if t.proposer == "llm" else {})), fallback=make_proposer("local"),
        rounds=t.rounds, candidates_per_round=t.candidates, recover_steps=t.recover_steps, lr=t.recover_lr,
        seed=t.seed + g.index, drop_empty_blocks=t.drop_empty_blocks, log_path=gdir / "search.json",
    )  # fmt: skip
    plot_history(res.history, gdir / "search.png", title=f"proxy-based pruning, group {g.index}")
    bsz, n_held = _search_batch_size(cfg), sum(int(x.shape[0]) for x, _ in heldout)
    imp_flops = 3.0 * base.flops * bsz * t.importance_batches if t.importance == "taylor" else 0.0
    cand_flops = sum(3.0 * c.flops * bsz * t.recover_steps + c.flops * n_held for c in res.bank.entries)
    record = {"group": g.to_dict(), "search": str(gdir / "search.json"), "search_plot": str(gdir / "search.png"),
              "best": dataclasses.asdict(res.best), "search_flops": imp_flops + cand_flops,
              "search_s": time.perf_counter() - t0, "finetune_dir": str(gdir / "finetune")}  # fmt: skip
    return res, record


def finetune_group(
    cfg: TrainConfig, engine: Any, base: Stage1, g: TimestepGroup, res: SearchResult, record: dict, verbose: bool
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Fine-tune the best candidate of ``res`` on the group's timesteps; its EMA weights and the updated record."""
    t0 = time.perf_counter()
    ft = Trainer(stage2_config(cfg, Path(record["finetune_dir"])), engine, model=copy.deepcopy(res.model).train(),
                 timestep_range=(g.lo, g.hi), dataset=base.dataset)  # fmt: skip
    summary = ft.fit()
    expert = copy.deepcopy(ft.ema.module).eval()
    record = {**record, "expert_flops": dit_flops(expert), "finetune_loss": summary["loss"],
              "finetune_s": time.perf_counter() - t0}  # fmt: skip
    _log(verbose, f"tdc: group {g.index}: expert {record['expert_flops'] / base.flops:.3f} F, proxy "
                  f"{res.best.score:.4f}, fine-tune loss {summary['loss']:.4f}")  # fmt: skip
    return expert, record


def bundle(
    cfg: TrainConfig, base: Stage1, experts: list, groups: list[TimestepGroup], run_dir: Path
) -> tuple[MultiExpertDenoiser, dict[str, Any]]:
    """Save the experts as a ``MultiExpertDenoiser`` bundle (with the training config) and draw the end-of-run
    grid from it; the model and the paths written."""
    multi = MultiExpertDenoiser(experts, [(g.lo, g.hi) for g in groups], groups=[g.to_dict() for g in groups])
    bundle_dir = save_bundle(multi, run_dir / "bundle")
    write_json(cfg.to_dict(), bundle_dir / "train_config.json")
    out: dict[str, Any] = {"run_dir": str(run_dir), "bundle": str(bundle_dir), "stage1": base.summary}
    grid = sample_grid(multi.to(base.device).eval(), base.schedule, cfg, run_dir / "samples.png", base.device)
    if grid is not None:
        out["samples"] = str(grid)
    return multi, out


def accounting(
    cfg: TrainConfig, base: Stage1, multi: MultiExpertDenoiser, per_group: list[dict], wall_s: float
) -> dict[str, Any]:
    """Training FLOPs (both stages, and with the search) vs one base model trained as long; sampling FLOPs per
    image with the grid's sampler and steps and with full T-step ancestral sampling; wall times."""
    train = training_flops(base.flops, multi.expert_flops(), int(base.summary["step"]), cfg.tdc.finetune_steps,
                           cfg.data.batch_size)  # fmt: skip
    train["search_flops"] = sum(p["search_flops"] for p in per_group)
    train["tdc_flops_with_search"] = train["tdc_flops"] + train["search_flops"]
    train["ratio_with_search"] = train["tdc_flops_with_search"] / train["single_model_flops"]
    sampler, steps = grid_sampler(cfg)
    guided, T = cfg.logging.cfg_scale != 1.0, base.schedule.num_timesteps
    return {
        "base_flops_per_forward": base.flops,
        "expert_flops_ratio": [f / base.flops for f in multi.expert_flops()],
        "training": train,
        "sampling": {
            f"{sampler}{steps}": sampling_flops(multi, base.flops, respaced(base.schedule, sampler, steps)[1],
                                                cfg=guided),  # fmt: skip
            f"ddpm{T}": sampling_flops(multi, base.flops, torch.arange(T), cfg=guided),
        },
        "wall_time_s": {"stage1_s": base.seconds, "total": wall_s,
                        "groups": [{"search": p["search_s"], "finetune": p["finetune_s"]} for p in per_group]},
    }  # fmt: skip


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
        lines.append(f"  sampling {name}: {s['multi_expert_flops_per_image']:.3e} FLOPs per image vs "
                     f"{s['base_flops_per_image']:.3e} for the base (x{s['flops_ratio']:.3f} fewer)")  # fmt: skip
    return "\n".join(lines)


def load_bundle_with_config(
    path: str | Path, device: str | torch.device = "cpu"
) -> tuple[MultiExpertDenoiser, TrainConfig]:
    """A TDC bundle written by ``run_tdc`` and its training config (``train_config.json`` beside ``bundle.json``)."""
    path = Path(path)
    cfg_path = path / "train_config.json"
    if not cfg_path.is_file():
        raise ValueError(f"{str(path)!r} has no train_config.json; it is not a bundle written by `diffcurr-fast tdc`")
    cfg = config_from_dict(json.loads(cfg_path.read_text()))
    return load_bundle(path, device=device).eval(), cfg
