"""Built-in studies (``diffcurr-fast study --preset NAME``): ``curriculum`` and ``tdc``, on the built-in digits.

The settings below were fixed before any of their results were seen; they are what the committed digits study
ran (docs/results/). Sizes are chosen so both presets finish in about an hour on two CPU cores (two
workers): 1,500 steps is where the digits samples start to be recognisable (the FD of a vanilla run falls steeply
between 1,000 and 1,500 steps); evaluations every 500 steps with 400 samples of 10 DDIM steps at guidance 2.

``curriculum`` (Kim et al., ICLR 2025, Tables 1-4 at digits scale). Shared: the demo DiT (width 64, depth 4) on
the 8x8 digits, cosine betas, eps prediction, no loss weighting (MinSNR is an arm), batch 64, AdamW 1e-3 after a
100-step warmup, EMA 0.995, 1,500 steps, N = 10 SNR clusters. Two regimes:

* the paper's (most arms): constant learning rate and a short curriculum phase (patience pacing with windows of 5
  steps and a maximum patience of 2 windows: tau = 10 steps without improvement per cluster, as tau = 200 of 400k
  iterations is short against the run; measured, the last cluster unlocked at step 250-300, as the loss kept
  improving: see docs/results);
* the demo's (``demo_*``): cosine decay to 1e-5 and the demo's slower pacing (patience 4, min_delta 0.02; its
  windows halved to 5 steps for a run half the demo's length), under which the last cluster unlocks around a
  third of the run, while the learning rate is high.

Arms: vanilla; easy-to-hard with uniform and with SNR clusters; NaiveCL (fixed 15 steps per stage: a
135-step phase); anti-curriculum (hard to easy, SNR clusters); MinSNR-5 with and without the curriculum; DTR with
and without; and the step-budget sweep: vanilla and the SNR curriculum at a quarter of the budget (375 steps; the
main arms are the 4x budget). Each arm is compared with the vanilla arm of its own regime and budget.

``tdc`` (arXiv 2312.13307 at digits scale): the base model trained 1,500 steps against TDC at about equal training
compute: stage 1 of 1,000 steps, then N = 3 groups (k = 0.5) with 2 x 3 candidate proxy searches and 250
fine-tuning steps per expert (expert FLOPs 2/3, 5/6 and 1 of the base's: 1,000 + 250 x 2.5 = 1,625 base-step
equivalents, reported exactly in the report with the proxy search counted separately, and the sampling FLOPs).

``--recipe R`` keeps a preset's arms and regimes but trains from ``R`` instead of the digits sizes: the digits
model, data, step and evaluation sizes are dropped (the recipe's own apply), so e.g. ``recipes/dit_b2_curriculum.yaml``
gives the paper's setting; set the evaluation features to inception with ``eval.inception_weights`` in the recipe.
"""

from __future__ import annotations

from typing import Any

from diffcurr_fast.study.spec import StudySpec, check_spec, spec_from_dict

STEPS, SHORT = 1500, 375
DIGITS_SET = [
    "diffusion.weighting=none", "optim.lr=1e-3", "optim.warmup_steps=100", "optim.ema_decay=0.995",
    "data.batch_size=64", f"engine.max_steps={STEPS}", "curriculum.num_clusters=10",
    "logging.num_samples=100", "logging.sample_steps=25", "logging.log_every=25", "checkpoint.every=500",
    "checkpoint.keep_last=1", "model.preset=custom",
]  # fmt: skip
DIGITS_EVAL = {"num_samples": 400, "steps": 10, "sampler": "ddim", "cfg_scale": 2.0, "features": "digits"}
PAPER = ["optim.schedule=constant", "optim.min_lr=0", "curriculum.eval_every=5", "curriculum.patience=2",
         "curriculum.ema=0.5", "curriculum.min_delta=0.02"]  # fmt: skip
DEMO = ["optim.schedule=cosine", "optim.min_lr=1e-5", "curriculum.eval_every=5", "curriculum.patience=4",
        "curriculum.ema=0.5", "curriculum.min_delta=0.02"]  # fmt: skip
NONE, SNR = ["curriculum.pacing=none"], ["curriculum.pacing=patience", "curriculum.method=snr"]


def _arm(name: str, *sets: list[str], reference: str = "", kind: str = "train") -> dict[str, Any]:
    return {"name": name, "kind": kind, "set": [s for group in sets for s in group], "reference": reference}


def curriculum_preset() -> dict[str, Any]:
    short = [f"engine.max_steps={SHORT}"]
    arms = [
        _arm("vanilla", PAPER, NONE),
        _arm("cl_uniform", PAPER, ["curriculum.pacing=patience", "curriculum.method=uniform"]),
        _arm("cl_snr", PAPER, SNR),
        _arm("naive_cl", PAPER, ["curriculum.pacing=fixed", "curriculum.method=snr", "curriculum.stage_iters=15"]),
        _arm("anti_cl", PAPER, SNR, ["curriculum.order=hard_to_easy"]),
        _arm("minsnr", PAPER, NONE, ["diffusion.weighting=min_snr", "diffusion.min_snr_gamma=5.0"]),
        _arm(
            "minsnr_cl", PAPER, SNR, ["diffusion.weighting=min_snr", "diffusion.min_snr_gamma=5.0"], reference="minsnr"
        ),
        _arm("dtr", PAPER, NONE, ["model.dtr=true"]),
        _arm("dtr_cl", PAPER, SNR, ["model.dtr=true"], reference="dtr"),
        _arm("demo_vanilla", DEMO, NONE),
        _arm("demo_cl", DEMO, SNR, reference="demo_vanilla"),
        _arm("vanilla_short", PAPER, NONE, short),
        _arm("cl_snr_short", PAPER, SNR, short, reference="vanilla_short"),
    ]
    return {
        "name": "curriculum",
        "recipe": None,
        "set": DIGITS_SET,
        "seeds": [0, 1, 2, 3, 4],
        "metric": "fd",
        "reference": "vanilla",
        "eval_every": 500,
        "eval": DIGITS_EVAL,
        "arms": arms,
        "notes": "Difficulty curriculum ablation on the built-in digits (settings: diffcurr_fast.study.presets).",
    }


def tdc_preset() -> dict[str, Any]:
    shared = ["optim.schedule=constant", "optim.min_lr=0", *NONE]
    tdc = ["engine.max_steps=1000", "tdc.num_groups=3", "tdc.k=0.5", "tdc.rounds=2", "tdc.candidates=3",
           "tdc.recover_steps=10", "tdc.finetune_steps=250", "tdc.finetune_lr=5e-4"]  # fmt: skip
    return {
        "name": "tdc",
        "recipe": None,
        "set": DIGITS_SET + shared,
        "seeds": [0, 1, 2],
        "metric": "fd",
        "reference": "base",
        "eval_every": 500,
        "eval": DIGITS_EVAL,
        "arms": [_arm("base"), _arm("tdc", tdc, kind="tdc")],
        "notes": "The base model against TDC at about equal training compute, on the built-in digits.",
    }


PRESETS = {"curriculum": curriculum_preset, "tdc": tdc_preset}
DIGITS_ONLY = ("diffusion.weighting", "optim.lr", "optim.warmup_steps", "optim.ema_decay", "data.", "engine.max_steps",
               "logging.", "checkpoint.", "model.", "curriculum.num_clusters")  # fmt: skip


def preset_spec(name: str, recipe: str | None = None) -> StudySpec:
    """The preset ``name`` as a checked spec; with ``recipe``, trained from that recipe (module doc)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    data = PRESETS[name]()
    if recipe is not None:
        data["recipe"] = recipe
        data["set"] = [s for s in data["set"] if not s.startswith(DIGITS_ONLY)]
        data["eval"] = {}
        for a in data["arms"]:
            a["set"] = [s for s in a["set"] if not s.startswith("engine.max_steps")]
        data["arms"] = [a for a in data["arms"] if not a["name"].endswith("_short")]
    return check_spec(spec_from_dict(data, f"preset {name}"))


__all__ = ["PRESETS", "preset_spec"]
