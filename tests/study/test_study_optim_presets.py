"""The speedrun_optim presets (study/presets.py): stage 1 on both datasets at the sizes of the tuned studies before
them, every arm on the same grid with 2-seed trials and the reference's long runs; the stacked rule on hand-made
readings and on a hand-made stage-1 folder; stage 2 built from the rule's levers."""

import math

import pytest

from diffcurr_fast._files import write_json
from diffcurr_fast.study import presets as P
from diffcurr_fast.study.runner import prepare_study, status_path
from diffcurr_fast.study.spec import spec_from_dict


@pytest.mark.parametrize(
    "name, base, grid, steps, folder",
    [
        ("speedrun_optim", "speedrun_edge", P.EDGE_LR_GRID, 4000, "../long_reference_digits"),
        ("speedrun_optim_mnist5k", "speedrun_tuned_mnist5k", P.SR_TM_LR_GRID, 2400, "../long_reference_mnist5k"),
    ],
)
def test_stage_one_is_the_tuned_study_with_the_optimizer_arms_two_trial_seeds_and_a_long_reference(
    name, base, grid, steps, folder
):
    """Read from the preset's mapping: its configs resolve once the optimizer choice exists
    (``test_stage_one_arms_resolve_with_the_optimizer_choice``)."""
    data, before = P.PRESETS[name](), P.PRESETS[base]()
    arms = {a["name"]: a for a in data["arms"]}
    assert list(arms) == ["official_tuned_decay", "minsnr", "minsnr_muon", "minsnr_schedule_free", "minsnr_qk_norm"]
    assert data["set"] == before["set"] and data["eval"] == before["eval"] and data["seeds"] == [0, 1, 2]
    assert f"engine.max_steps={steps}" in data["set"]
    old = {a["name"]: a for a in before["arms"]}
    assert arms["official_tuned_decay"]["set"] == old["official_tuned_decay"]["set"]
    assert arms["minsnr"]["set"] == old["minsnr"]["set"]
    for lever, sets in P.OPTIM_LEVERS.items():
        assert arms[lever]["set"] == [*old["minsnr"]["set"], *sets]
    assert arms["minsnr_muon"]["set"][-1] == "optim.name=muon"
    assert arms["minsnr_schedule_free"]["set"][-2:] == ["optim.name=schedule_free", "optim.schedule=constant"]
    assert arms["minsnr_qk_norm"]["set"][-1] == "model.qk_norm=true"
    for a in arms.values():  # the same protocol for every arm, the reference included
        assert a["tune"] == {"optim.lr": grid} and a["reference"] == "official_tuned_decay"
    assert before["tuning"]["seed"] == 10  # the one trial seed of the study before: the first of the two
    assert data["tuning"] == {"budget": before["tuning"]["budget"], "pick": "final", "seeds": [10, 11]}
    assert data["speedrun"]["official_arm"] == "official_tuned_decay"
    assert data["long_reference"] == {
        "folder": folder,
        "factor": 8,
        "set": [f"optim.ema_decay={P.ema_decay_for(8 * steps)}"],
    }
    spec = spec_from_dict(data)  # the spec itself is well formed (its arms' configs need optim.name)
    assert len(spec.trials()) == 5 * len(grid) * 2


def test_stage_one_arms_resolve_with_the_optimizer_choice():
    """Needs the config key ``optim.name`` (adamw, muon, schedule_free): until it exists this fails with
    ``unknown config key 'optim.name'``."""
    from diffcurr_fast.study.spec import arm_config

    for name in ("speedrun_optim", "speedrun_optim_mnist5k"):
        spec = P.preset_spec(name)
        cfg = {a.name: arm_config(spec, a, 0, "check") for a in spec.arms}
        assert cfg["minsnr"].optim.name == "adamw" and cfg["minsnr_muon"].optim.name == "muon"
        assert cfg["minsnr_schedule_free"].optim.name == "schedule_free"
        assert cfg["minsnr_schedule_free"].optim.schedule == "constant" and cfg["minsnr_qk_norm"].model.qk_norm


def _reading(lo, lowers=False):
    return {"wall": (lo + 0.5, lo, lo + 1.0), "lowers_accuracy": lowers}


def test_the_stacked_rule_on_hand_made_readings():
    """A lever joins when its interval's lower end is above 1 on both datasets and it lowers the conditional
    accuracy on neither; of the optimizers that join, the one with the larger lower end on its weaker dataset."""
    both = {
        "digits": {
            "minsnr_muon": _reading(1.4),
            "minsnr_schedule_free": _reading(1.9),
            "minsnr_qk_norm": _reading(1.1),
        },
        "mnist5k": {
            "minsnr_muon": _reading(1.3),
            "minsnr_schedule_free": _reading(1.2),
            "minsnr_qk_norm": _reading(1.05),
        },
    }
    assert P.stacked_levers(both) == ["minsnr_muon", "minsnr_qk_norm"]  # muon's weaker end 1.3 > schedule-free's 1.2
    both["mnist5k"]["minsnr_qk_norm"] = _reading(1.05, lowers=True)
    both["digits"]["minsnr_muon"] = _reading(0.9)
    assert P.stacked_levers(both) == ["minsnr_schedule_free"]
    both["digits"]["minsnr_schedule_free"] = {"wall": None, "lowers_accuracy": False}  # a seed never got there
    assert P.stacked_levers(both) == []
    tie = {d: {"minsnr_muon": _reading(1.2), "minsnr_schedule_free": _reading(1.2)} for d in ("a", "b")}
    assert P.stacked_levers(tie) == ["minsnr_muon"]  # a tie: the first listed


def _stage_one(folder, mnsr_steps, lever_steps):
    """A finished stage 1 of status files alone: minsnr and each lever on seeds 0 and 1, FD 10 at the first
    evaluation and 1 at the end; each arm reaches minsnr's final FD (1) at the evaluation given for it."""
    data = {
        "name": "s1",
        "seeds": [0, 1],
        "eval_every": 100,
        "reference": "minsnr",
        "arms": [{"name": "minsnr"}, *({"name": a} for a in P.OPTIM_LEVERS)],
        "speedrun": {"official_arm": "minsnr", "smooth": 1},
    }
    prepare_study(spec_from_dict(data), folder)
    for arm, at in {"minsnr": mnsr_steps, **lever_steps}.items():
        for seed in (0, 1):
            n = at[seed]  # evaluations until FD 1
            evals = [{"step": 100 * (i + 1), "fd": 10.0 if i + 1 < n else 1.0} for i in range(8)]
            acc = 0.5 if arm == "minsnr_qk_norm" else 0.99 - 0.01 * seed
            final = {**evals[-1], "cond_acc": acc}
            st = {"arm": arm, "seed": seed, "kind": "train", "steps": 800, "train_flops": 800.0, "wall_s": 1.0}
            write_json({**st, "final": final, "evals": evals}, status_path(folder, arm, seed))


def test_lever_readings_of_a_hand_made_stage_one(tmp_path):
    levers = {"minsnr_muon": (2, 3), "minsnr_schedule_free": (4, 8), "minsnr_qk_norm": (2, 2)}
    _stage_one(tmp_path / "s1", (6, 8), levers)
    write_json(
        {
            "arms": {"minsnr": 0.5, "minsnr_muon": 1.0, "minsnr_schedule_free": 0.5, "minsnr_qk_norm": 0.5},
            "steps_each": 60,
            "threads": 1,
        },
        tmp_path / "s1" / "step_time.json",
    )
    got = P.lever_readings(str(tmp_path / "s1"))
    # minsnr reaches its final FD 1 at steps 600 and 800; muon at 200 and 300, at twice minsnr's step time
    assert got["minsnr_muon"]["wall"][0] == pytest.approx(math.sqrt(600 * 800) * 0.5 / (math.sqrt(200 * 300) * 1.0))
    assert got["minsnr_schedule_free"]["wall"][0] == pytest.approx(math.sqrt(600 * 800) / math.sqrt(400 * 800))
    assert got["minsnr_qk_norm"]["lowers_accuracy"] and not got["minsnr_muon"]["lowers_accuracy"]


def test_stage_two_is_the_reference_and_the_stacked_levers(monkeypatch):
    with pytest.raises(ValueError, match="pass --screen DIGITS_DIR,MNIST5K_DIR"):
        P.speedrun_optim_stacked_preset(None)
    picks = {"a": {"minsnr_muon": _reading(1.4), "minsnr_qk_norm": _reading(1.2)}}
    monkeypatch.setattr(P, "lever_readings", lambda d: picks[d[0]])
    data = P.speedrun_optim_stacked_mnist5k_preset("a1,a2")
    stage1 = P.speedrun_optim_mnist5k_preset()
    assert data["name"] == "speedrun_optim_stacked_mnist5k" and data["long_reference"] == stage1["long_reference"]
    assert [a["name"] for a in data["arms"]] == ["official_tuned_decay", "stacked"]
    assert data["arms"][0] == stage1["arms"][0] and data["tuning"] == stage1["tuning"]
    stacked = data["arms"][1]
    assert stacked["set"] == [*stage1["arms"][1]["set"], "optim.name=muon", "model.qk_norm=true"]
    assert stacked["tune"] == stage1["arms"][0]["tune"] and stacked["reference"] == "official_tuned_decay"
    picks["a"] = {"minsnr_muon": _reading(1.4)}
    with pytest.raises(ValueError, match=r"chose \['minsnr_muon'\] .*stacked is arm 'minsnr_muon' of stage 1"):
        P.speedrun_optim_stacked_preset("a1,a2")
