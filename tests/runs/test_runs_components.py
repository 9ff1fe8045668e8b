"""A component is one file and one registry line: a toy training term and a toy model option, registered from inside
this test, get ``--help-config``, validation, the preflight's refusals and checkpointing with no other file touched
(runs/config.py composes the sections from the registries; the preflights and the objective ask the components)."""

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from conftest import TINY_SETS

from diffcurr_fast.models import registry as model_registry
from diffcurr_fast.options import Options, option
from diffcurr_fast.runs import checkpoint as ck
from diffcurr_fast.runs.recipes import describe_config, load_config
from diffcurr_fast.tdc.preflight import check_tdc_run
from diffcurr_fast.terms import registry as term_registry
from diffcurr_fast.terms.base import TermInputs, TrainingTerm
from diffcurr_fast.train.loop import Trainer
from diffcurr_fast.train.preflight import check_run

pytestmark = pytest.mark.usefixtures("one_thread")


@dataclass
class ToyTermOptions(Options):
    """toy: a test's term."""

    PREFIX = "toy_"
    weight: float = option(0.25, "toy: its weight", lo=0.0, lo_open=True)
    scale: float = option(2.0, "toy: the gain's starting value", lo=0.0)

    def validate(self, cfg: Any) -> None:
        if self.scale > 10:
            raise ValueError(f"terms.toy_scale {self.scale} must be <= 10")

    def refusal(self, cfg: Any, use: str) -> str | None:
        return "terms.use 'toy': a toy term is no TDC expert's" if use == "tdc" else None

    def min_micro_batch(self, cfg: Any) -> int:
        return 3


class ToyTerm(TrainingTerm):
    """gain * mean of block 0's squared tokens: a loss of its own, with a parameter (a head the run trains)."""

    Options = ToyTermOptions
    features = (0,)

    def __init__(self, scale: float):
        super().__init__()
        self.gain = torch.nn.Parameter(torch.tensor(float(scale)))

    @classmethod
    def from_config(cls, cfg: Any) -> "ToyTerm":
        return cls(ToyTermOptions.of(cfg.terms).scale)

    def forward(self, inputs: TermInputs) -> torch.Tensor:
        return self.gain * inputs.features[0].float().square().mean(dim=(1, 2))  # (B,)


@dataclass
class ToyModelOptions(Options):
    """toy_gate: a test's model option."""

    SWITCH = "toy_gate"
    toy_gate: bool = option(False, "toy model option: on or off")
    toy_gain: float = option(0.5, "toy model option: a gain", lo=0.0)

    def active(self) -> bool:
        return self.toy_gate

    def validate(self, cfg: Any) -> None:
        if self.toy_gain > cfg.model.depth:
            raise ValueError(f"model.toy_gain {self.toy_gain} must be <= model.depth {cfg.model.depth}")

    def refusal(self, cfg: Any, use: str) -> str | None:
        return "model.toy_gate: TDC cannot prune a toy" if use == "tdc" else None

    def dit_kwargs(self, cfg: Any) -> dict[str, Any]:
        return {}


@pytest.fixture
def toys(monkeypatch):
    monkeypatch.setitem(term_registry.TERMS, "toy", f"{__name__}:ToyTerm")
    monkeypatch.setitem(model_registry.OPTIONS, "toy", f"{__name__}:ToyModelOptions")


def _cfg(run, *extra):
    return load_config(None, [f"checkpoint.run_dir={run}", *TINY_SETS, "engine.max_steps=2", *extra])


def test_a_registered_term_and_model_option_are_in_help_config(toys):
    text = describe_config()
    assert (
        "  # toy: toy: a test's term." in text and "  toy_scale: 2.0  # float; toy: the gain's starting value" in text
    )
    assert "  # toy: toy_gate: a test's model option." in text and "  toy_gain: 0.5  # float" in text


def test_their_options_are_checked_and_refused_when_unused(toys, tmp_path):
    cfg = _cfg(tmp_path, "terms.use=[toy]", "terms.toy_scale=3", "model.toy_gate=true", "model.toy_gain=1")
    assert (cfg.terms.toy_scale, cfg.model.toy_gain) == (3.0, 1.0)
    with pytest.raises(ValueError, match=r"^terms.toy_scale 11.0 must be <= 10$"):
        _cfg(tmp_path, "terms.use=[toy]", "terms.toy_scale=11")
    with pytest.raises(ValueError, match=r"^model.toy_gain 2.0 must be <= model.depth 1$"):
        _cfg(tmp_path, "model.toy_gate=true", "model.toy_gain=2")
    with pytest.raises(ValueError, match=r"terms.toy_scale \(--set\) is an option of 'toy', which this run does not"):
        _cfg(tmp_path, "terms.toy_scale=3")
    with pytest.raises(ValueError, match=r"model.toy_gain \(--set\) is an option of 'toy'.*when model.toy_gate"):
        _cfg(tmp_path, "model.toy_gain=0.25")
    with pytest.raises(ValueError, match=r"terms.toy_scale must be >= 0"):
        _cfg(tmp_path, "terms.use=[toy]", "terms.toy_scale=-1")


def test_the_preflights_ask_them(toys, tmp_path):
    cfg = _cfg(tmp_path / "a", "terms.use=[toy]", "data.batch_size=4", "optim.grad_accum_steps=2")
    with pytest.raises(ValueError, match=r"^terms.use toy needs at least 3 samples per micro-batch, got 2"):
        check_run(cfg, read_inputs=False)
    with pytest.raises(ValueError, match=r"^terms.use 'toy': a toy term is no TDC expert's$"):
        check_tdc_run(_cfg(tmp_path / "b", "terms.use=[toy]"), cfg.tdc, tmp_path / "b")
    with pytest.raises(ValueError, match=r"^model.toy_gate: TDC cannot prune a toy$"):
        check_tdc_run(_cfg(tmp_path / "c", "model.toy_gate=true"), cfg.tdc, tmp_path / "c")


def test_a_run_trains_and_checkpoints_them_and_a_resume_holds_their_options(toys, tmp_path):
    sets = ("terms.use=[toy]", "model.toy_gate=true", "model.toy_gain=0.75", "checkpoint.every=1")
    Trainer(_cfg(tmp_path, *sets)).fit()
    state = ck.load_checkpoint(ck.latest_checkpoint(tmp_path))
    gain = state["model"]["term_heads.toy.gain"]
    assert state["step"] == 2 and gain != 2.0  # the term's parameter, trained with the model
    assert state["config"]["model"]["toy_gain"] == 0.75 and state["config"]["terms"]["use"] == ["toy"]
    with pytest.raises(ValueError, match=r"model.toy_gain: checkpoint 0.75 vs now 0.5"):
        Trainer(_cfg(tmp_path, *sets[:2], "engine.max_steps=3"), resume=True)
    resumed = Trainer(_cfg(tmp_path, *sets, "engine.max_steps=3"), resume=True)
    assert resumed.step == 2 and torch.equal(resumed.model.term_heads["toy"].gain.detach(), gain)
