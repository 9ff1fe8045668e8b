"""End-to-end TDC training (arXiv 2312.13307): stage 1, per-group proxy pruning and fine-tuning, the bundle.

``run_tdc(cfg, options, run_dir)``:

1. **Stage 1**: an ordinary ``Trainer`` run of the base model on all timesteps (the training config as given, so
   ``curriculum.pacing`` other than ``none`` combines the difficulty curriculum of Kim et al. with TDC).
2. **Stage 2**, per timestep group (``make_groups``: SNR_dB grouping, budgets of TDC Eq. 2): importance scores of the
   base for the group, ``proxy_search`` (rounds x candidates, each recovered for a few steps and scored on held-out
   batches), then the best candidate is fine-tuned on the group's timesteps through ``Trainer`` (EMA, checkpoints,
   metrics as any run; ``timestep_range`` restricts t, ``model`` passes the pruned expert).
3. The experts' EMA weights form a ``MultiExpertDenoiser`` saved as a bundle (plus the training config), a sample
   grid is drawn from it, and the compute accounting (training FLOPs of both stages and of the search vs one base
   model trained as long; sampling FLOPs per image) is printed and written as JSON.

Run directory::

    tdc.json                 resolved options, training config, groups
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
import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from diffcurr_fast.tdc.accounting import sampling_flops, training_flops, write_json
from diffcurr_fast.tdc.experts import MultiExpertDenoiser, load_bundle, save_bundle
from diffcurr_fast.tdc.flops import dit_flops
from diffcurr_fast.tdc.grouping import FULL_BUDGET_ENDS, GROUP_METHODS, make_groups
from diffcurr_fast.tdc.proxy import PROPOSERS, make_proposer, plot_history, proxy_search
from diffcurr_fast.tdc.prune import IMPORTANCE_METHODS, importance_scores
from diffcurr_fast.train.config import TrainConfig, config_from_dict

__all__ = [
    "BASE_WEIGHTS",
    "TDC_ARTIFACTS",
    "TDCOptions",
    "format_accounting",
    "load_bundle_with_config",
    "load_tdc_recipe",
    "options_from_dict",
    "run_tdc",
    "stage2_config",
]

BASE_WEIGHTS = ("ema", "model")
# What a TDC run writes into its directory (``overwrite`` removes exactly these).
TDC_ARTIFACTS = ("tdc.json", "stage1", "bundle", "accounting.json", "samples.png")


def _doc(default: Any, doc: str, choices: tuple | None = None) -> Any:
    meta = {"doc": doc, **({"choices": choices} if choices else {})}
    return field(default=default, metadata=meta)


@dataclass
class TDCOptions:
    """Stage-2 settings of a TDC run (stage 1 is the training config itself)."""

    num_groups: int = _doc(3, "N, the number of timestep groups (one expert each)")
    k: float = _doc(0.5, "budget anchor of TDC Eq. 2, in (0, 1]: FLOPs(i) = (i/N + (N-i)/N k) F")
    group_method: str = _doc("db", "grouping rule on the SNR axis", GROUP_METHODS)
    full_budget: str = _doc("hardest", "which end of t gets the full budget F", FULL_BUDGET_ENDS)
    base_weights: str = _doc("ema", "stage-1 weights that stage 2 prunes", BASE_WEIGHTS)
    importance: str = _doc("taylor", "unit importance for pruning", IMPORTANCE_METHODS)
    importance_batches: int = _doc(2, "batches of the Taylor importance (diffusion-loss gradients)")
    proposer: str = _doc("local", "candidate proposer of the proxy search", PROPOSERS)
    rounds: int = _doc(2, "proxy-search rounds")
    candidates: int = _doc(3, "candidates per round")
    recover_steps: int = _doc(10, "AdamW steps that recover each candidate before it is scored")
    recover_lr: float = _doc(1e-4, "learning rate of the recovery steps")
    search_batches: int = _doc(4, "training batches cycled by the recovery steps")
    heldout_batches: int = _doc(2, "held-out batches of the proxy score (disjoint from the search batches)")
    search_batch_size: int = _doc(0, "batch size of importance, recovery and proxy (0 = data.batch_size)")
    drop_empty_blocks: bool = _doc(False, "remove blocks left with no head and no channel")
    finetune_steps: int = _doc(200, "stage-2 fine-tuning steps of every expert")
    finetune_lr: float = _doc(0.0, "stage-2 peak learning rate (0 = optim.lr of the training config)")
    llm_url: str = _doc("", "llm proposer: OpenAI-compatible endpoint (https://host/v1)")
    llm_model: str = _doc("", "llm proposer: model name")
    llm_api_key_env: str = _doc("", "llm proposer: NAME of the environment variable holding the API key")
    seed: int = _doc(0, "seed of the data split, importance and search")

    def validate(self) -> TDCOptions:
        """Check every field; ValueError naming the bad value and what is valid. Returns self."""
        for f in dataclasses.fields(self):
            v, choices = getattr(self, f.name), f.metadata.get("choices")
            if choices and v not in choices:
                raise ValueError(f"tdc.{f.name} {v!r} is not valid; valid choices: {', '.join(choices)}")
            want = {"int": int, "float": (int, float), "bool": bool, "str": str}[str(f.type)]
            if isinstance(v, bool) != (want is bool) or not isinstance(v, want):
                raise ValueError(f"tdc.{f.name} must be of type {f.type}, got {v!r}")
        minimum = {"num_groups": 1, "importance_batches": 1, "rounds": 1, "candidates": 1, "recover_steps": 0,
                   "search_batches": 1, "heldout_batches": 1, "search_batch_size": 0, "finetune_steps": 1,
                   "seed": 0}  # fmt: skip
        for name, lo in minimum.items():
            if getattr(self, name) < lo:
                raise ValueError(f"tdc.{name} must be >= {lo}, got {getattr(self, name)!r}")
        if not (0.0 < float(self.k) <= 1.0):
            raise ValueError(f"tdc.k must lie in (0, 1], got {self.k!r}")
        if not (math.isfinite(self.recover_lr) and self.recover_lr > 0):
            raise ValueError(f"tdc.recover_lr must be a finite number > 0, got {self.recover_lr!r}")
        if not (math.isfinite(self.finetune_lr) and self.finetune_lr >= 0):
            raise ValueError(f"tdc.finetune_lr must be a finite number >= 0 (0 = optim.lr), got {self.finetune_lr!r}")
        if self.proposer == "llm" and not (self.llm_url and self.llm_model):
            raise ValueError("tdc.proposer 'llm' needs tdc.llm_url and tdc.llm_model")
        return self

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (JSON / YAML serialisable)."""
        return dataclasses.asdict(self)


def options_from_dict(data: dict[str, Any] | None, base: TDCOptions | None = None) -> TDCOptions:
    """``TDCOptions`` from ``data`` over ``base`` (default: the defaults); unknown keys raise ValueError listing
    the valid ones; ints are accepted for float fields."""
    opts = copy.deepcopy(base) if base is not None else TDCOptions()
    names = {f.name: f for f in dataclasses.fields(TDCOptions)}
    for key, value in (data or {}).items():
        if key not in names:
            raise ValueError(f"unknown tdc option {key!r}; valid keys: {', '.join(names)}")
        if names[key].type == "float" and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        setattr(opts, key, value)
    return opts.validate()


def load_tdc_recipe(path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(training sections, ``tdc`` section) of a YAML recipe, both plain dicts (validated when built)."""
    import yaml

    from diffcurr_fast.train.config import _fix_floats

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"recipe {str(p)!r} does not exist")
    data = _fix_floats(yaml.safe_load(p.read_text()) or {})
    if not isinstance(data, dict):
        raise ValueError(f"recipe {str(p)!r} must be a mapping of sections, got {type(data).__name__}")
    tdc = data.pop("tdc", None) or {}
    if not isinstance(tdc, dict):
        raise ValueError(f"the tdc section of {str(p)!r} must be a mapping, got {tdc!r}")
    return data, tdc


def stage2_config(cfg: TrainConfig, opts: TDCOptions, run_dir: Path) -> TrainConfig:
    """The fine-tuning config of one expert: ``cfg`` with ``finetune_steps`` steps, no curriculum (t is restricted
    to the group), no per-expert sample grid or plots, and ``run_dir``."""
    d = cfg.to_dict()
    d["engine"]["max_steps"] = opts.finetune_steps
    d["curriculum"]["pacing"] = "none"
    d["logging"]["num_samples"] = 0
    d["logging"]["plots"] = False
    d["logging"]["log_every"] = min(d["logging"]["log_every"], opts.finetune_steps)
    d["checkpoint"]["run_dir"] = str(run_dir)
    d["checkpoint"]["every"] = min(d["checkpoint"]["every"], opts.finetune_steps)
    d["optim"]["warmup_steps"] = min(d["optim"]["warmup_steps"], opts.finetune_steps // 10)
    if opts.finetune_lr > 0:
        d["optim"]["lr"] = opts.finetune_lr
    d["optim"]["min_lr"] = min(d["optim"]["min_lr"], d["optim"]["lr"])
    return config_from_dict(d).validate()


def _check_supported(cfg: TrainConfig) -> None:
    d = cfg.diffusion
    if d.formulation != "ddpm":
        raise ValueError(f"TDC runs on the ddpm formulation, got diffusion.formulation {d.formulation!r}")
    if d.prediction != "eps":
        raise ValueError(f"TDC's proxy and importance use the eps objective, got diffusion.prediction {d.prediction!r}")
    if cfg.model.dtr:
        raise ValueError("model.dtr=True is not supported by TDC pruning (DTR masks span the full width); use false")


def _split_batches(dataset: Any, opts: TDCOptions, batch_size: int, device: torch.device):
    """Disjoint (search, held-out) lists of (x0, y) batches drawn from ``dataset`` with ``opts.seed``."""
    n = len(dataset)
    need = (opts.search_batches + opts.heldout_batches) * batch_size
    if need > n:
        raise ValueError(
            f"tdc.search_batches + tdc.heldout_batches ({opts.search_batches} + {opts.heldout_batches}) batches of "
            f"{batch_size} need {need} samples, the dataset has {n}; lower them or tdc.search_batch_size"
        )
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


def _sampler_timesteps(schedule: Any, sampler: str, steps: int) -> torch.Tensor:
    """Original timesteps a DDPM / DDIM sampler with ``steps`` visits (the respacing ``sample`` uses)."""
    from diffcurr_fast.diffusion import respace

    spec = f"ddim{steps}" if sampler == "ddim" and schedule.num_timesteps % steps == 0 else str(steps)
    return respace(schedule, spec)[1]


def _prepare(run_dir: Path, overwrite: bool) -> None:
    if run_dir.exists() and not run_dir.is_dir():
        raise FileExistsError(f"run directory {str(run_dir)!r} exists and is not a directory")
    if run_dir.is_dir() and any(run_dir.iterdir()):
        if not overwrite:
            raise FileExistsError(f"run directory {str(run_dir)!r} is not empty; pass --overwrite to replace it")
        for p in run_dir.iterdir():
            if p.name in TDC_ARTIFACTS or p.name.startswith("group_"):
                if p.is_dir():
                    shutil.rmtree(p)
                else:
                    p.unlink()
    run_dir.mkdir(parents=True, exist_ok=True)


def _log(verbose: bool, msg: str) -> None:
    if verbose:
        print(msg, flush=True)


def run_tdc(
    cfg: TrainConfig | dict[str, Any] | str | Path,
    options: TDCOptions | dict[str, Any] | None,
    run_dir: str | Path,
    *,
    overwrite: bool = False,
    engine: Any = None,
    verbose: bool = True,
) -> dict[str, Any]:
    """Run the whole TDC pipeline (module doc) into ``run_dir``; returns a summary with every artefact's path.

    Args:
        cfg: the training config of stage 1 (its ``checkpoint.run_dir`` is replaced by ``run_dir/stage1``): a
            ``TrainConfig``, its dict, or a YAML recipe path (whose ``tdc:`` section gives default options).
        options: ``TDCOptions`` (replaces a recipe's ``tdc:`` section) or a dict of fields over it (None = it).
        run_dir: output directory; a non-empty one is refused unless ``overwrite`` (which removes TDC artefacts).
        engine: a single-process training engine (default: one created from ``cfg.engine``, closed at the end).
        verbose: print progress and the accounting.
    """
    from diffcurr_fast.train.engine import create_engine
    from diffcurr_fast.train.loop import Trainer
    from diffcurr_fast.train.sampling import sample, save_grid

    recipe_opts: dict[str, Any] = {}
    if isinstance(cfg, (str, Path)):
        cfg, recipe_opts = load_tdc_recipe(cfg)
    if isinstance(cfg, dict):
        cfg = config_from_dict(copy.deepcopy(cfg))
    opts = options if isinstance(options, TDCOptions) else options_from_dict({**recipe_opts, **(options or {})})
    opts.validate()
    cfg = copy.deepcopy(cfg).validate()
    _check_supported(cfg)
    run_dir = Path(run_dir)
    cfg.checkpoint.run_dir = str(run_dir / "stage1")
    own = engine is None
    engine = engine or create_engine(cfg.engine.kind, cfg.engine.device)
    try:
        if engine.world_size != 1:
            raise ValueError(f"run_tdc runs in one process, got world size {engine.world_size}; use engine.kind single")
        _prepare(run_dir, overwrite)
        write_json({"options": opts.to_dict(), "config": cfg.to_dict()}, run_dir / "tdc.json")
        t_start = time.perf_counter()
        timings: dict[str, Any] = {}

        # ---- stage 1: the base model on all timesteps ------------------------------------------------
        _log(verbose, f"tdc: stage 1, {cfg.engine.max_steps} steps (curriculum pacing {cfg.curriculum.pacing!r})")
        t0 = time.perf_counter()
        trainer = Trainer(cfg, engine)
        stage1 = trainer.fit()
        timings["stage1_s"] = time.perf_counter() - t0
        base = copy.deepcopy(trainer.ema.module if opts.base_weights == "ema" else trainer.model).float()
        base = base.to(trainer.device).eval().requires_grad_(True)  # Taylor importance needs its gradients
        schedule, dataset, device = trainer.schedule, trainer.dataset, trainer.device
        del trainer
        base_flops = dit_flops(base)
        groups = make_groups(schedule, opts.num_groups, opts.k, base_flops, method=opts.group_method,
                             full_budget=opts.full_budget)  # fmt: skip
        bsz = opts.search_batch_size or cfg.data.batch_size
        search_data, heldout = _split_batches(dataset, opts, bsz, device)
        proposer_kw = {}
        if opts.proposer == "llm":
            proposer_kw = {"url": opts.llm_url, "model": opts.llm_model, "api_key_env": opts.llm_api_key_env or None}

        # ---- stage 2: per group, prune by proxy search, then fine-tune on the group's timesteps ---------
        experts, per_group, search_flops = [], [], 0.0
        for g in groups:
            gdir = run_dir / f"group_{g.index}"
            _log(verbose, f"tdc: group {g.index} t in [{g.lo}, {g.hi}), budget {g.ratio:.3f} F: proxy search "
                          f"({opts.rounds} x {opts.candidates} candidates, proposer {opts.proposer!r})")  # fmt: skip
            t0 = time.perf_counter()
            imp_batches = [search_data[i % len(search_data)] for i in range(opts.importance_batches)]
            imp = importance_scores(base, opts.importance, schedule=schedule, group=g, batches=imp_batches,
                                    seed=opts.seed)  # fmt: skip
            res = proxy_search(
                base, g, g.flops, search_data, heldout, schedule=schedule, importance=imp,
                proposer=make_proposer(opts.proposer, **proposer_kw), rounds=opts.rounds,
                candidates_per_round=opts.candidates, recover_steps=opts.recover_steps, lr=opts.recover_lr,
                seed=opts.seed + g.index, drop_empty_blocks=opts.drop_empty_blocks, log_path=gdir / "search.json",
            )  # fmt: skip
            plot_history(res.history, gdir / "search.png", title=f"proxy-based pruning, group {g.index}")
            search_s = time.perf_counter() - t0
            # Search compute: Taylor importance (forward + backward of the base), each candidate's recovery
            # (3 x its FLOPs per sample) and held-out scoring (forward only).
            n_held = sum(int(x.shape[0]) for x, _ in heldout)
            imp_cost = 3.0 * base_flops * bsz * opts.importance_batches if opts.importance == "taylor" else 0.0
            cand_cost = sum(3.0 * c.flops * bsz * opts.recover_steps + c.flops * n_held for c in res.bank.entries)
            search_flops += imp_cost + cand_cost

            t0 = time.perf_counter()
            fcfg = stage2_config(cfg, opts, gdir / "finetune")
            ft = Trainer(fcfg, engine, model=copy.deepcopy(res.model).train(), timestep_range=(g.lo, g.hi),
                         dataset=dataset)  # fmt: skip
            summary = ft.fit()
            expert = copy.deepcopy(ft.ema.module).eval()
            del ft
            experts.append(expert)
            per_group.append({
                "group": g.to_dict(), "search": str(gdir / "search.json"), "search_plot": str(gdir / "search.png"),
                "best": dataclasses.asdict(res.best), "expert_flops": dit_flops(expert),
                "finetune_dir": str(gdir / "finetune"), "finetune_loss": summary["loss"],
                "search_s": search_s, "finetune_s": time.perf_counter() - t0,
            })  # fmt: skip
            _log(verbose, f"tdc: group {g.index}: expert {dit_flops(expert) / base_flops:.3f} F, proxy "
                          f"{res.best.score:.4f}, fine-tune loss {summary['loss']:.4f}")  # fmt: skip

        # ---- the bundle, its samples and the accounting ---------------------------------------------
        multi = MultiExpertDenoiser(experts, [(g.lo, g.hi) for g in groups], groups=[g.to_dict() for g in groups])
        bundle_dir = save_bundle(multi, run_dir / "bundle")
        write_json(cfg.to_dict(), bundle_dir / "train_config.json")
        lg, m = cfg.logging, cfg.model
        out: dict[str, Any] = {"run_dir": str(run_dir), "bundle": str(bundle_dir), "stage1": stage1,
                               "groups": per_group}  # fmt: skip
        sampler = lg.sampler if lg.sampler in ("ddpm", "ddim") else "ddim"
        steps = min(lg.sample_steps, cfg.diffusion.num_timesteps)
        if lg.num_samples > 0 and m.in_channels in (1, 3):
            labels = torch.arange(lg.num_samples) % m.num_classes
            x = sample(
                multi.to(device).eval(), schedule, sampler=lg.sampler, steps=steps, labels=labels,
                channels=m.in_channels, size=m.input_size, num_classes=m.num_classes,
                learn_sigma=cfg.diffusion.learn_sigma, prediction=cfg.diffusion.prediction, cfg_scale=lg.cfg_scale,
                clip_denoised=cfg.data.dataset == "digits", seed=cfg.engine.seed, device=device,
            )  # fmt: skip
            nrow = m.num_classes if m.num_classes <= 16 else None
            out["samples"] = str(save_grid(x / cfg.data.scale, run_dir / "samples.png", nrow=nrow,
                                           upscale=max(1, 32 // m.input_size)))  # fmt: skip
        s1_steps = int(stage1["step"])
        train_acc = training_flops(base_flops, multi.expert_flops(), s1_steps, opts.finetune_steps,
                                   cfg.data.batch_size)  # fmt: skip
        train_acc["search_flops"] = search_flops
        train_acc["tdc_flops_with_search"] = train_acc["tdc_flops"] + search_flops
        train_acc["ratio_with_search"] = train_acc["tdc_flops_with_search"] / train_acc["single_model_flops"]
        guided = lg.cfg_scale != 1.0
        accounting = {
            "base_flops_per_forward": base_flops,
            "expert_flops_ratio": [f / base_flops for f in multi.expert_flops()],
            "training": train_acc,
            "sampling": {
                f"{sampler}{steps}": sampling_flops(multi, base_flops, _sampler_timesteps(schedule, sampler, steps),
                                                    cfg=guided),  # fmt: skip
                f"ddpm{schedule.num_timesteps}": sampling_flops(multi, base_flops,
                                                                torch.arange(schedule.num_timesteps), cfg=guided),
            },
            "wall_time_s": {**timings,
                            "groups": [{"search": p["search_s"], "finetune": p["finetune_s"]} for p in per_group],
                            "total": time.perf_counter() - t_start},
        }  # fmt: skip
        out["accounting"] = str(write_json(accounting, run_dir / "accounting.json"))
        out["accounting_data"] = accounting
        if verbose:
            print(format_accounting(accounting), flush=True)
        return out
    finally:
        if own:
            engine.close()


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
