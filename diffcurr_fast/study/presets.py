"""Built-in studies (``diffcurr-fast study --preset NAME``): ``curriculum`` and ``tdc`` on the built-in digits, and
the time-to-quality benchmark ``speedrun`` (digits, every arm) with its second stage ``speedrun_mnist5k`` and its
companions ``speedrun_plateau`` and ``speedrun_tdc``; the tuned comparisons (``speedrun_tuned``, ``speedrun_levers``,
``speedrun_edge``, ``speedrun_tuned_mnist5k``) and ``speedrun_optim`` on both datasets (the optimizer as a lever,
QK-norm, both readings of a speed-up, 2-seed picks) with its stacked stage (``stacked_levers``).

Each preset's settings, why they were chosen and when they were fixed (before any of their results were seen), and
what ``--recipe R`` drops, are in docs/study.md ("The presets").
"""

from __future__ import annotations

import math
from typing import Any

from diffcurr_fast.study.spec import StudySpec, check_spec, spec_from_dict
from diffcurr_fast.study.speedrun import best_arms

STEPS, SHORT = 1500, 375
DIGITS_SET = [
    "diffusion.weighting=none",
    "optim.lr=1e-3",
    "optim.name=adamw",  # the demo ships Muon now; these studies ran AdamW (see SR_SHARED)
    "optim.warmup_steps=100",
    "optim.ema_decay=0.995",
    "data.batch_size=64",
    f"engine.max_steps={STEPS}",
    "curriculum.num_clusters=10",
    "logging.num_samples=100",
    "logging.sample_steps=25",
    "logging.log_every=25",
    "checkpoint.every=500",
    "checkpoint.keep_last=1",
    "model.preset=custom",
]
DIGITS_EVAL = {"num_samples": 400, "steps": 10, "sampler": "ddim", "cfg_scale": 2.0, "features": "digits"}
PAPER = [
    "optim.schedule=constant",
    "optim.min_lr=0",
    "curriculum.eval_every=5",
    "curriculum.patience=2",
    "curriculum.ema=0.5",
    "curriculum.min_delta=0.02",
]
DEMO = [
    "optim.schedule=cosine",
    "optim.min_lr=1e-5",
    "curriculum.eval_every=5",
    "curriculum.patience=4",
    "curriculum.ema=0.5",
    "curriculum.min_delta=0.02",
]
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
    tdc = [
        "engine.max_steps=1000",
        "tdc.num_groups=3",
        "tdc.budget_floor=0.5",
        "tdc.rounds=2",
        "tdc.candidates=3",
        "tdc.recover_steps=10",
        "tdc.finetune_steps=250",
        "tdc.finetune_lr=5e-4",
    ]
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


# ---- speedrun ---------------------------------------------------------------------------------------------------
HALF_LIFE_SHARE = math.log(0.5) / math.log(0.9999) / 400_000  # the official EMA's half-life / the DiT paper's run


def ema_decay_for(steps: int) -> float:
    """The EMA decay whose half-life is ``HALF_LIFE_SHARE`` of a run of ``steps`` steps (rounded to 6 digits)."""
    return round(0.5 ** (1.0 / (HALF_LIFE_SHARE * steps)), 6)


SR_SHARED = [
    # the embedded demo's learning rate when these studies were set (the demo now ships the tuned rate, 8e-3): fixed
    # here so that their committed specs still resolve to what ran; a tuned arm's trials and pick replace it
    "optim.lr=1e-3",
    # the embedded demo's optimizer when they ran (the demo now ships Muon, the winner of speedrun_optim on both
    # datasets): fixed for the same reason; an arm that sets optim.name (minsnr_muon) comes after and replaces it
    "optim.name=adamw",
    "data.batch_size=64",
    "optim.ema_warmup=false",
    "diffusion.num_timesteps=1000",
    "diffusion.prediction=eps",
    "diffusion.learn_sigma=true",
    "curriculum.num_clusters=10",
    "logging.num_samples=100",
    "logging.sample_steps=25",
    "logging.log_every=50",
    "checkpoint.every=2000",
    "checkpoint.keep_last=1",
    "model.preset=custom",
]
SR_DIGITS_STEPS, SR_DIGITS_EVERY, SR_MNIST_STEPS, SR_MNIST_EVERY = 12_000, 400, 10_000, 500
SR_DIGITS = [
    "data.dataset=digits",
    "model.input_size=8",
    "model.patch_size=2",
    "model.hidden_size=64",
    "model.depth=4",
    "model.num_heads=4",
    f"engine.max_steps={SR_DIGITS_STEPS}",
    f"optim.ema_decay={ema_decay_for(SR_DIGITS_STEPS)}",
]
SR_MNIST = [
    "data.dataset=mnist5k",
    "model.input_size=28",
    "model.patch_size=4",
    "model.hidden_size=64",
    "model.depth=4",
    "model.num_heads=4",
    f"engine.max_steps={SR_MNIST_STEPS}",
    f"optim.ema_decay={ema_decay_for(SR_MNIST_STEPS)}",
]
SR_EVAL = {"num_samples": 400, "steps": 10, "sampler": "ddim", "cfg_scale": 2.0}
OFFICIAL = [
    "diffusion.beta_schedule=linear",
    "diffusion.weighting=none",
    "curriculum.pacing=none",
    "optim.lr=1e-4",
    "optim.schedule=constant",
    "optim.warmup_steps=0",
    "optim.min_lr=0",
    "optim.weight_decay=0",
    "optim.grad_clip=0",
]
VANILLA = ["curriculum.pacing=none", "diffusion.weighting=none"]
MINSNR = ["diffusion.weighting=min_snr", "diffusion.min_snr_gamma=5.0"]
CL = ["curriculum.pacing=patience", "curriculum.method=snr"]
PLAIN = ["model.fused_adaln=false", "diffusion.ops_backend=reference"]
TIMESTEP_ARMS = {
    "lognormal": ["timesteps.sampler=lognormal"],
    "importance": ["timesteps.sampler=importance"],
    "speed": ["timesteps.sampler=speed", "diffusion.weighting=speed"],
    "anuts": ["timesteps.sampler=anuts"],
}
SPEEDRUN = {
    "official_arm": "official",
    "threshold": "reference",
    "smooth": 3,
    "plateau_share": 0.2,
    "plateau_tol": 0.03,
}


def speedrun_arms() -> list[dict[str, Any]]:
    """Every arm of the screening."""
    arms = [
        _arm("official", OFFICIAL),
        _arm("vanilla", VANILLA),
        _arm("vanilla_plain", VANILLA, PLAIN),
        _arm("minsnr", VANILLA, MINSNR),
        _arm("cl", VANILLA, CL),
        _arm("cl_minsnr", VANILLA, CL, MINSNR),
        _arm("anti_cl", VANILLA, CL, ["curriculum.order=hard_to_easy"]),
        _arm("adaptive_pacing", VANILLA, ["curriculum.pacing=adaptive", "curriculum.method=snr"]),
        *(_arm(name, VANILLA, sets) for name, sets in TIMESTEP_ARMS.items()),
    ]
    return [{**a, "reference": "official"} for a in arms]


def _speedrun_notes(dataset: str) -> str:
    return (
        f"Time to quality on {dataset} against the official DiT recipe (settings: diffcurr_fast.study.presets; "
        "definitions: diffcurr_fast.study.speedrun)."
    )


def speedrun_preset() -> dict[str, Any]:
    return {
        "name": "speedrun",
        "recipe": None,
        "set": SR_SHARED + SR_DIGITS,
        "seeds": [0, 1, 2, 3, 4],
        "metric": "fd",
        "reference": "official",
        "eval_every": SR_DIGITS_EVERY,
        "eval": {**SR_EVAL, "features": "digits"},
        "arms": speedrun_arms(),
        "notes": _speedrun_notes("the built-in digits"),
        "speedrun": dict(SPEEDRUN),
    }


def speedrun_mnist5k_preset(screen: str | None = None) -> dict[str, Any]:
    """The second stage: the official arm, the best 4 arms of the screening at ``screen`` and the plain-step twin
    of the best (its fused/plain pair splits the speed-up), on mnist5k with 3 seeds."""
    if screen is None:
        raise ValueError(
            "preset speedrun_mnist5k runs the best arms of the digits screening: pass --screen DIR (a "
            "finished 'study --preset speedrun' folder with its report)"
        )
    every = {a["name"]: a for a in speedrun_arms()}
    best = best_arms(screen, 4)
    unknown = [n for n in best if n not in every]
    if unknown:
        raise ValueError(f"the screening at {screen!r} has arms {unknown} that this build does not define")
    top = every[best[0]]
    plain = [] if "_plain" in top["name"] else [{**top, "name": f"{top['name']}_plain", "set": top["set"] + PLAIN}]
    arms = [every["official"], *(every[n] for n in best), *plain]
    return {
        "name": "speedrun_mnist5k",
        "recipe": None,
        "set": SR_SHARED + SR_MNIST,
        "seeds": [0, 1, 2],
        "metric": "fd",
        "reference": "official",
        "eval_every": SR_MNIST_EVERY,
        "eval": {**SR_EVAL, "features": "mnist5k"},
        "arms": arms,
        "notes": _speedrun_notes("the built-in mnist5k") + f" Arms screened from {screen}.",
        "speedrun": dict(SPEEDRUN),
    }


SR_PLATEAU_STEPS, SR_PLATEAU_EVERY = 48_000, 1_600


def speedrun_plateau_preset() -> dict[str, Any]:
    """The official arm of ``speedrun`` trained 4x as long (its EMA scaled to the longer run), 3 seeds: where the
    official recipe's FD stops falling on the digits (``study report DIR --official-from`` this folder)."""
    digits = [s for s in SR_DIGITS if not s.startswith(("engine.max_steps=", "optim.ema_decay="))]
    return {
        "name": "speedrun_plateau",
        "recipe": None,
        "set": SR_SHARED
        + digits
        + [f"engine.max_steps={SR_PLATEAU_STEPS}", f"optim.ema_decay={ema_decay_for(SR_PLATEAU_STEPS)}"],
        "seeds": [0, 1, 2],
        "metric": "fd",
        "reference": "official",
        "eval_every": SR_PLATEAU_EVERY,
        "eval": {**SR_EVAL, "features": "digits"},
        "arms": [{**_arm("official", OFFICIAL), "reference": "official"}],
        "notes": "The official DiT recipe on the built-in digits, 4x the speedrun's steps, until its FD stops "
        "falling (settings: diffcurr_fast.study.presets).",
        "speedrun": dict(SPEEDRUN),
    }


SR_TDC_BASE_STEPS = 9_600  # vanilla's smoothed FD stopped falling by then in the speedrun (docs/study.md)
SR_TDC = [
    "tdc.num_groups=3",
    "tdc.budget_floor=0.5",
    "tdc.rounds=2",
    "tdc.candidates=3",
    "tdc.recover_steps=10",
    "tdc.finetune_lr=1e-4",
]


def tdc_finetune_steps(total: int, base: int, num_groups: int, k: float) -> int:
    """Fine-tuning steps per expert that bring stage 1 (``base`` steps) and the experts to ``total`` base-model
    steps of training FLOPs: expert i of N costs (i/N + (N-i)/N k) of the base model (TDC Eq. 2)."""
    share = sum(i / num_groups + (num_groups - i) / num_groups * k for i in range(1, num_groups + 1))
    return round((total - base) / share)


def speedrun_tdc_preset() -> dict[str, Any]:
    """TDC against vanilla on the digits at equal training FLOPs (12,000 base-model steps): stage 1 is vanilla for
    ``SR_TDC_BASE_STEPS`` steps, then 3 experts fine-tuned for the rest; the report adds the bundle at the base
    model's sampling FLOPs."""
    steps = tdc_finetune_steps(SR_DIGITS_STEPS, SR_TDC_BASE_STEPS, 3, 0.5)
    tdc = [f"engine.max_steps={SR_TDC_BASE_STEPS}", *SR_TDC, f"tdc.finetune_steps={steps}"]
    return {
        "name": "speedrun_tdc",
        "recipe": None,
        "set": SR_SHARED + SR_DIGITS,
        "seeds": [0, 1, 2],
        "metric": "fd",
        "reference": "vanilla",
        "eval_every": SR_DIGITS_EVERY,
        "eval": {**SR_EVAL, "features": "digits"},
        "arms": [_arm("vanilla", VANILLA), _arm("tdc", VANILLA, tdc, kind="tdc")],
        "notes": "TDC against vanilla at equal training FLOPs on the built-in digits (settings: "
        "diffcurr_fast.study.presets).",
    }


# ---- speedrun_tuned: the references tuned by the protocol (run first: they set what every lever must beat) -------
SR_TUNED_STEPS, SR_TUNED_TRIAL = 4_000, 2_000
LR_GRID = [5e-4, 1e-3, 2e-3, 4e-3]  # x2 apart around the official recipe's best of the hand-tuned 3,000-step runs
OFFICIAL_DECAY = ["optim.schedule=cosine"]  # OFFICIAL has min_lr 0 and no warmup: cosine to zero in the budget
REFERENCES = ("official_tuned", "official_tuned_decay")  # the headline divides by the stronger of these two


def speedrun_tuned_preset() -> dict[str, Any]:
    """The official recipe as released, tuned (learning rate) and tuned with decay to zero, against our base recipe
    with uniform t and with MinSNR (the last screening's lowest final FD), every tuned arm with the same 4-point
    learning-rate grid of 2,000-step trials at a seed outside the study's; the runs keep post-hoc EMA snapshots."""
    digits = [s for s in SR_DIGITS if not s.startswith(("engine.max_steps=", "optim.ema_decay="))]
    tune = {"optim.lr": list(LR_GRID)}
    arms = [
        _arm("official", OFFICIAL),
        {**_arm("official_tuned", OFFICIAL), "tune": tune},
        {**_arm("official_tuned_decay", OFFICIAL, OFFICIAL_DECAY), "tune": tune},
        {**_arm("vanilla", VANILLA), "tune": tune},
        {**_arm("minsnr", VANILLA, MINSNR), "tune": tune},
    ]
    return {
        "name": "speedrun_tuned",
        "recipe": None,
        "set": SR_SHARED
        + digits
        + [
            f"engine.max_steps={SR_TUNED_STEPS}",
            f"optim.ema_decay={ema_decay_for(SR_TUNED_STEPS)}",
            f"optim.phema_every={SR_DIGITS_EVERY}",
        ],
        "seeds": [0, 1, 2],
        "metric": "fd",
        "reference": "official_tuned",
        "eval_every": SR_DIGITS_EVERY,
        "eval": {**SR_EVAL, "features": "digits"},
        "arms": [{**a, "reference": "official_tuned"} for a in arms],
        "tuning": {"budget": SR_TUNED_TRIAL, "pick": "final", "seed": 10},
        "notes": "Time to quality on the built-in digits against the official DiT recipe with its learning rate "
        "tuned, constant and decayed to zero (settings: diffcurr_fast.study.presets; definitions: "
        "diffcurr_fast.study.speedrun). Every arm runs on this trainer's step.",
        "speedrun": {**SPEEDRUN, "official_arm": "official_tuned"},
    }


# ---- speedrun_levers: each new lever alone on top of the best timestep strategy, tuned as the references were ----
LEVERS = {
    "tread": ["model.routing=tread", "model.routing_keep=0.5", "model.routing_start=1", "model.routing_end=3"],
    # SPRINT's setting (75% of the tokens dropped over the middle blocks), then its full-token fine-tune over the
    # last tenth (the official code's 200k of 2.2M steps); the tuning trials (SR_TUNED_TRIAL) end before it
    "sprint": [
        "model.routing=sprint",
        "model.routing_keep=0.25",
        "model.routing_start=1",
        "model.routing_end=3",
        f"model.routing_until={SR_TUNED_STEPS * 9 // 10}",
    ],
    "modern": ["model.norm=rmsnorm", "model.qk_norm=true", "model.mlp=swiglu", "model.pos=rope2d"],
    "contrastive": ["terms.use=[contrastive]"],
    "dispersive": ["terms.use=[dispersive]"],
    "sra": ["terms.use=[sra]"],
    "immiscible": ["terms.immiscible=true"],
}


LEVERS_LR_GRID = [1e-3, 2e-3, 4e-3, 8e-3]  # LR_GRID one step up: every speedrun_tuned arm picked its top, 4e-3


def speedrun_levers_preset() -> dict[str, Any]:
    """The best timestep strategy (MinSNR) and each lever alone on top of it, at ``speedrun_tuned``'s sizes, every
    arm with the same learning-rate grid (``LEVERS_LR_GRID``) and trials."""
    data = speedrun_tuned_preset()
    tune = {"optim.lr": list(LEVERS_LR_GRID)}
    base = [*VANILLA, *MINSNR]
    arms = [{**_arm("minsnr", VANILLA, MINSNR), "tune": tune}]
    arms += [{**_arm(name, base, sets), "tune": tune} for name, sets in LEVERS.items()]
    return {
        **data,
        "name": "speedrun_levers",
        "reference": "minsnr",
        "arms": [{**a, "reference": "minsnr"} for a in arms],
        "notes": "Each lever alone on top of MinSNR on the built-in digits, at speedrun_tuned's sizes and tuning "
        "(settings: diffcurr_fast.study.presets; definitions: diffcurr_fast.study.speedrun).",
        "speedrun": {**SPEEDRUN, "official_arm": "minsnr"},
    }


# ---- speedrun_edge: the grid's top edge, for the strongest reference and our two best arms ----
EDGE_LR_GRID = [4e-3, 8e-3, 1.6e-2, 3.2e-2]  # from the top both grids picked, two steps further up the same ladder
# a diverged trial is a result (it loses the pick), not a failure that stops its arm: runs go on over skipped steps
DIVERGED_IS_A_RESULT = ["engine.max_nan_skips=4000", "engine.max_skip_share=1.0"]


def speedrun_edge_preset() -> dict[str, Any]:
    """``official_tuned_decay`` (``speedrun_tuned``'s strongest reference), ``minsnr`` and ``immiscible`` tuned
    again over ``EDGE_LR_GRID`` (every arm of the two studies before picked the top of its grid), the same four
    trials each, at ``speedrun_tuned``'s sizes."""
    data = speedrun_tuned_preset()
    tune = {"optim.lr": list(EDGE_LR_GRID)}
    ref = "official_tuned_decay"
    arms = [
        _arm(ref, OFFICIAL, OFFICIAL_DECAY),
        _arm("minsnr", VANILLA, MINSNR),
        _arm("immiscible", VANILLA, MINSNR, LEVERS["immiscible"]),
    ]
    return {
        **data,
        "name": "speedrun_edge",
        "set": data["set"] + DIVERGED_IS_A_RESULT,
        "reference": ref,
        "arms": [{**a, "reference": ref, "tune": tune} for a in arms],
        "notes": "The learning-rate grid's top edge: every arm of speedrun_tuned and speedrun_levers picked the top "
        "of its grid, so the strongest reference (official_tuned_decay), MinSNR and immiscible noise are tuned again "
        "over a grid that goes two steps higher (4e-3 to 3.2e-2), the same four trials each; everything else is "
        "speedrun_tuned's (settings: diffcurr_fast.study.presets; definitions: diffcurr_fast.study.speedrun). A trial "
        "that diverges is a result, not a failure: every run keeps going over skipped non-finite steps "
        f"({', '.join(DIVERGED_IS_A_RESULT)}), so a diverged learning rate loses the pick instead of stopping the arm.",
        "speedrun": {**SPEEDRUN, "official_arm": ref},
    }


# ---- speedrun_tuned_mnist5k: the tuned comparison's second dataset, sized to fit the machine ----
# patch 2 (196 tokens) at batch 32: 146 ms a step at 1 thread (batch 64: 306 ms), so 4 arms x (3 seeds + 3 trials)
# fit about 70 minutes of 2 workers. The first grid, {2e-3, 4e-3, 8e-3}, had every arm pick its top with the FD
# falling steeply; moved one step up before any seed run finished (docs/study.md), the shared trials kept
SR_TM_STEPS, SR_TM_TRIAL, SR_TM_EVERY = 2_400, 1_200, 400
SR_TM_LR_GRID = [4e-3, 8e-3, 1.6e-2]
SR_MNIST_P2 = [
    "data.dataset=mnist5k",
    "data.batch_size=32",
    "model.input_size=28",
    "model.patch_size=2",
    "model.hidden_size=64",
    "model.depth=4",
    "model.num_heads=4",
    f"engine.max_steps={SR_TM_STEPS}",
    f"optim.ema_decay={ema_decay_for(SR_TM_STEPS)}",
    f"optim.phema_every={SR_TM_EVERY}",
]


def speedrun_tuned_mnist5k_preset() -> dict[str, Any]:
    """The strongest digits reference (``official_tuned_decay``), uniform t, the best strategy (MinSNR) and
    ``stacked`` (= ``immiscible``, the one lever that beat MinSNR on the digits) on mnist5k at patch 2, every arm
    tuned over ``SR_TM_LR_GRID`` with the same three trials."""
    tune = {"optim.lr": list(SR_TM_LR_GRID)}
    ref = "official_tuned_decay"
    arms = [
        _arm(ref, OFFICIAL, OFFICIAL_DECAY),
        _arm("vanilla", VANILLA),
        _arm("minsnr", VANILLA, MINSNR),
        _arm("immiscible", VANILLA, MINSNR, LEVERS["immiscible"]),
    ]
    return {
        "name": "speedrun_tuned_mnist5k",
        "recipe": None,
        "set": [s for s in SR_SHARED if not s.startswith("data.batch_size=")] + SR_MNIST_P2 + DIVERGED_IS_A_RESULT,
        "seeds": [0, 1, 2],
        "metric": "fd",
        "reference": ref,
        "eval_every": SR_TM_EVERY,
        "eval": {**SR_EVAL, "features": "mnist5k"},
        "arms": [{**a, "reference": ref, "tune": tune} for a in arms],
        "tuning": {"budget": SR_TM_TRIAL, "pick": "final", "seed": 10},
        "notes": "Time to quality on the built-in mnist5k (patch 2, 196 tokens) against the official DiT recipe with "
        "its learning rate tuned and decayed to zero, the strongest reference on the digits; uniform t, MinSNR and "
        "stacked (immiscible noise on MinSNR), the same three trials each (settings: diffcurr_fast.study.presets; "
        "definitions: diffcurr_fast.study.speedrun). A trial that diverges is a result, not a failure "
        f"({', '.join(DIVERGED_IS_A_RESULT)}).",
        "speedrun": {**SPEEDRUN, "official_arm": ref},
    }


# ---- speedrun_optim: the optimizer as a lever, QK-norm, both readings and 2-seed picks, on both datasets ----------
# Every arm tuned over the same grid with 2-seed trials (a rate is scored by its worse seed), 3 seeds at the pick, the
# reference also trained LONG_FACTOR x the budget (the field's reading, study.long_reference); settings in
# docs/study.md, fixed before any run. The stacked arm is stage 2 (``speedrun_optim_stacked``): its levers come from
# the finished stage 1 of both datasets by the rule of ``stacked_levers``.
OPTIM_TRIAL_SEEDS, LONG_FACTOR = [10, 11], 8
OPTIM_LEVERS = {  # each on MinSNR: the optimizer (optim.name) and QK-norm
    "minsnr_muon": ["optim.name=muon"],
    "minsnr_schedule_free": ["optim.name=schedule_free", "optim.schedule=constant"],  # it refuses a decay
    "minsnr_qk_norm": ["model.qk_norm=true"],
}
OPTIMIZER_ARMS = ("minsnr_muon", "minsnr_schedule_free")  # one optimizer at a time: the stacked arm keeps one
LEVER_REFERENCE = "minsnr"  # a lever's share: its speed-up over MinSNR with AdamW, at MinSNR's final FD


def _optim_preset(name: str, base: dict[str, Any], lr_grid: list[float], long_folder: str, of: str) -> dict[str, Any]:
    """``base`` (the preset ``of``, a tuned study of the dataset: its sizes, budget and trials' budget) with the
    stage-1 arms of ``speedrun_optim``, each tuned over ``lr_grid`` on the trial seeds, and the reference's long
    runs."""
    tune = {"optim.lr": list(lr_grid)}
    ref = "official_tuned_decay"
    arms = [
        _arm(ref, OFFICIAL, OFFICIAL_DECAY),
        _arm(LEVER_REFERENCE, VANILLA, MINSNR),
        *(_arm(arm, VANILLA, MINSNR, sets) for arm, sets in OPTIM_LEVERS.items()),
    ]
    steps = int(next(s for s in base["set"] if s.startswith("engine.max_steps=")).split("=")[1])
    return {
        **base,
        "name": name,
        "reference": ref,
        "arms": [{**a, "reference": ref, "tune": tune} for a in arms],
        "tuning": {**base["tuning"], "seeds": list(OPTIM_TRIAL_SEEDS)},
        "speedrun": {**SPEEDRUN, "official_arm": ref},
        "long_reference": {
            "folder": long_folder,
            "factor": LONG_FACTOR,
            "set": [f"optim.ema_decay={ema_decay_for(LONG_FACTOR * steps)}"],
        },
        "notes": f"The optimizer as a lever and QK-norm, stage 1 of speedrun_optim, at {of}'s sizes, budget and "
        f"trials' budget: against the tuned reference ({ref}), MinSNR with AdamW, with Muon and with schedule-free "
        f"AdamW, and MinSNR with QK-norm, every arm tuned over the same grid ({lr_grid[0]:g} to {lr_grid[-1]:g}) on "
        f"trial seeds {OPTIM_TRIAL_SEEDS}, a rate scored by its worse seed; the reference also trained {LONG_FACTOR}x "
        f"longer ({long_folder}) for the field's reading (settings: diffcurr_fast.study.presets; definitions: "
        "diffcurr_fast.study.speedrun). A trial that diverges is a result, not a failure "
        f"({', '.join(DIVERGED_IS_A_RESULT)}).",
    }


def _seed_of(base: dict[str, Any]) -> dict[str, Any]:
    """``base`` without its one trial seed (the optim presets give two)."""
    return {**base, "tuning": {k: v for k, v in base["tuning"].items() if k != "seed"}}


def speedrun_optim_preset() -> dict[str, Any]:
    """Stage 1 on the digits, at ``speedrun_edge``'s sizes, budget, trials' budget and grid (``EDGE_LR_GRID``)."""
    base = _seed_of(speedrun_edge_preset())
    return _optim_preset("speedrun_optim", base, EDGE_LR_GRID, "../long_reference_digits", "speedrun_edge")


def speedrun_optim_mnist5k_preset() -> dict[str, Any]:
    """Stage 1 on mnist5k, at ``speedrun_tuned_mnist5k``'s sizes, budget, trials' budget and grid
    (``SR_TM_LR_GRID``)."""
    base = _seed_of(speedrun_tuned_mnist5k_preset())
    return _optim_preset(
        "speedrun_optim_mnist5k", base, SR_TM_LR_GRID, "../long_reference_mnist5k", "speedrun_tuned_mnist5k"
    )


def stacked_levers(readings: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    """The lever arms the stacked arm combines, by the rule of docs/study.md, from ``readings`` ({dataset: {lever
    arm: {"wall": (speed-up, lo, hi) over ``LEVER_REFERENCE`` or None, "lowers_accuracy": bool}}}): every lever whose
    interval's lower end is above 1 on every dataset and whose conditional accuracy is not lower on any; of the
    optimizers that qualify, the one with the larger lower end on its weaker dataset (ties: the first listed)."""
    lows: dict[str, float] = {}
    for arm in OPTIM_LEVERS:
        per = [readings[d].get(arm) or {} for d in readings]
        ends = [r["wall"][1] if r.get("wall") and math.isfinite(r["wall"][1]) else -math.inf for r in per]
        if per and all(lo > 1 for lo in ends) and not any(r.get("lowers_accuracy") for r in per):
            lows[arm] = min(ends)
    optimizers = [a for a in OPTIMIZER_ARMS if a in lows]
    keep = max(optimizers, key=lambda a: (lows[a], -OPTIMIZER_ARMS.index(a)), default=None)
    return [a for a in OPTIM_LEVERS if a in lows and (a not in OPTIMIZER_ARMS or a == keep)]


def lever_readings(study_dir: str) -> dict[str, dict[str, Any]]:
    """Each lever arm's reading in a finished stage 1 (its folder): its wall-time speed-up over ``LEVER_REFERENCE``
    at ``LEVER_REFERENCE``'s worst final smoothed FD (the tracked EMA; ``study report DIR --against minsnr``) and
    whether its final conditional accuracy is below ``LEVER_REFERENCE``'s by more than its 95% paired interval."""
    # imported here, not at the top: keeps --help free of torch
    from diffcurr_fast.study.report import collect, lower_accuracy, read_step_time
    from diffcurr_fast.study.speedrun import analyse

    spec, rows, status = collect(study_dir)
    res = analyse(spec, rows, read_step_time(study_dir), reference=LEVER_REFERENCE)

    def accuracy(arm: str) -> dict[int, float]:
        return {s: st["final"]["cond_acc"] for (a, s), st in status.items() if a == arm and "cond_acc" in st["final"]}

    return {
        arm: {
            "wall": res["arms"][arm]["speedup"]["wall_s"],
            "lowers_accuracy": lower_accuracy(accuracy(arm), accuracy(LEVER_REFERENCE)),
        }
        for arm in OPTIM_LEVERS
        if arm in res["arms"]
    }


def speedrun_optim_stacked_preset(
    screen: str | None = None, base: Any = None, name: str = "speedrun_optim_stacked"
) -> dict[str, Any]:
    """Stage 2 on the digits (``base``: the dataset's stage-1 preset): the reference and ``stacked``, MinSNR with
    the levers of ``stacked_levers`` over the finished stage-1 folders named by ``screen`` ("DIGITS_DIR,MNIST5K_DIR"),
    at stage 1's sizes, trials and seeds; its long reference is stage 1's (the same folder, the same runs)."""
    dirs = [d for d in (screen or "").split(",") if d]
    if len(dirs) != 2:
        raise ValueError(
            "the stacked stage takes its levers from the finished speedrun_optim studies of both datasets: pass "
            "--screen DIGITS_DIR,MNIST5K_DIR (their folders, with their reports)"
        )
    levers = stacked_levers({d: lever_readings(d) for d in dirs})
    if len(levers) < 2:
        arm = levers[0] if levers else LEVER_REFERENCE
        raise ValueError(
            f"the stacked rule chose {levers or 'no lever'} from {', '.join(dirs)}: stacked is arm {arm!r} of stage 1, "
            "so no stacked stage is run (docs/study.md)"
        )
    data = base or speedrun_optim_preset()
    ref = data["reference"]
    stacked = _arm("stacked", VANILLA, MINSNR, *(OPTIM_LEVERS[a] for a in levers))
    return {
        **data,
        "name": name,
        "arms": [a for a in data["arms"] if a["name"] == ref]
        + [{**stacked, "reference": ref, "tune": data["arms"][0]["tune"]}],
        "notes": f"{data['notes']} Stage 2: stacked = MinSNR with {', '.join(levers)}, chosen by the stacked rule from "
        f"{', '.join(dirs)}.",
    }


def speedrun_optim_stacked_mnist5k_preset(screen: str | None = None) -> dict[str, Any]:
    """Stage 2 on mnist5k (``speedrun_optim_stacked_preset`` on ``speedrun_optim_mnist5k``)."""
    return speedrun_optim_stacked_preset(screen, speedrun_optim_mnist5k_preset(), "speedrun_optim_stacked_mnist5k")


PRESETS = {
    "curriculum": curriculum_preset,
    "tdc": tdc_preset,
    "speedrun": speedrun_preset,
    "speedrun_mnist5k": speedrun_mnist5k_preset,
    "speedrun_plateau": speedrun_plateau_preset,
    "speedrun_tdc": speedrun_tdc_preset,
    "speedrun_tuned": speedrun_tuned_preset,
    "speedrun_levers": speedrun_levers_preset,
    "speedrun_edge": speedrun_edge_preset,
    "speedrun_tuned_mnist5k": speedrun_tuned_mnist5k_preset,
    "speedrun_optim": speedrun_optim_preset,
    "speedrun_optim_mnist5k": speedrun_optim_mnist5k_preset,
    "speedrun_optim_stacked": speedrun_optim_stacked_preset,
    "speedrun_optim_stacked_mnist5k": speedrun_optim_stacked_mnist5k_preset,
}
SCREENED = ("speedrun_mnist5k", "speedrun_optim_stacked", "speedrun_optim_stacked_mnist5k")  # they take --screen
DIGITS_ONLY = (
    "diffusion.weighting",
    "optim.lr",
    "optim.warmup_steps",
    "optim.ema_decay",
    "data.",
    "engine.max_steps",
    "logging.",
    "checkpoint.",
    "model.",
    "curriculum.num_clusters",
)


def preset_spec(name: str, recipe: str | None = None, screen: str | None = None) -> StudySpec:
    """The preset ``name`` as a checked spec; with ``recipe``, trained from that recipe (docs/study.md); ``screen``:
    the finished screening a second-stage preset picks its arms from."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    if screen is not None and name not in SCREENED:
        raise ValueError(f"--screen picks the arms of presets {', '.join(SCREENED)}, not of {name!r}")
    data = PRESETS[name](screen) if name in SCREENED else PRESETS[name]()
    if recipe is not None:
        data["recipe"] = recipe
        data["set"] = [s for s in data["set"] if not s.startswith(DIGITS_ONLY)]
        data["eval"] = {}
        for a in data["arms"]:
            a["set"] = [s for s in a["set"] if not s.startswith("engine.max_steps")]
        if data.get("long_reference"):  # its EMA was scaled to the digits budget: the recipe's own applies
            data["long_reference"]["set"] = [s for s in data["long_reference"]["set"] if not s.startswith(DIGITS_ONLY)]
        data["arms"] = [a for a in data["arms"] if not a["name"].endswith("_short")]
    return check_spec(spec_from_dict(data, f"preset {name}"))


__all__ = ["PRESETS", "preset_spec"]
