"""The terms registry (terms/registry.py): the names ``terms.use`` takes, a term's class by name (an unknown one is a
ValueError listing the valid ones), each term of ``terms.use`` with its weight in order, the draw's pairing of a
switch that is on, and the section's refusals of a switch, an unknown and a repeated name in ``terms.use``."""

import pytest

from diffcurr_fast.runs.recipes import load_config
from diffcurr_fast.terms import registry
from diffcurr_fast.terms.contrastive import Contrastive
from diffcurr_fast.terms.dispersive import Dispersive
from diffcurr_fast.terms.immiscible import assign_noise
from diffcurr_fast.terms.registry import TermsOptions, build_terms, names, noise_pairing, term_class


def test_the_names_are_the_registry_now_in_its_order(monkeypatch):
    """``names()`` is the registry's keys in order, and follows a term registered after import."""
    assert names() == ("contrastive", "dispersive", "sra", "repa")
    monkeypatch.setitem(registry.TERMS, "toy", "diffcurr_fast.terms.contrastive:Contrastive")
    assert names() == ("contrastive", "dispersive", "sra", "repa", "toy")


def test_an_unknown_term_is_a_value_error_naming_it_and_the_valid_ones():
    """The message names the term and lists the valid names separated by ", "; a known name loads its class."""
    with pytest.raises(ValueError) as e:
        term_class("nope")
    assert (
        str(e.value) == "unknown training term 'nope' in terms.use; valid choices: contrastive, dispersive, sra, repa"
    )
    assert term_class("dispersive") is Dispersive and term_class("contrastive") is Contrastive


def test_the_terms_come_in_the_order_of_terms_use_with_their_weights():
    """Each entry is (the term's ``Options.weight`` read from the config, ``from_config(cfg)``), in the listed order."""
    cfg = load_config(
        None,
        [
            "terms.use=[dispersive, contrastive]",
            "terms.dispersive_weight=0.25",
            "terms.dispersive_tau=2",
            "terms.contrastive_weight=0.125",
        ],
    )
    (w1, t1), (w2, t2) = build_terms(cfg)
    assert (w1, w2) == (0.25, 0.125)
    assert isinstance(t1, Dispersive) and isinstance(t2, Contrastive)
    assert t1.tau == 2.0 and t1.features == (cfg.model.depth // 4,)
    assert build_terms(load_config(None, [])) == []


def test_the_pairing_is_the_switch_that_is_on_and_none_without_one():
    """No switch on: None. ``terms.immiscible=true``: the draw's pairing is the immiscible assignment."""
    assert noise_pairing(load_config(None, [])) is None
    assert noise_pairing(load_config(None, ["terms.immiscible=true"])) is assign_noise


def test_a_switch_in_terms_use_is_refused_naming_the_switch_to_set():
    """A switch listed as a term names itself and the ``terms.KEY=true`` to set instead."""
    with pytest.raises(ValueError) as e:
        TermsOptions(use=["contrastive", "immiscible"]).validate()
    assert str(e.value) == (
        "terms.use lists 'immiscible', which adds no loss and is not a term: it is the switch "
        "terms.immiscible=true; drop it from terms.use"
    )


@pytest.mark.parametrize(
    "use", [["nope"], ["dispersive", "nope"], ["sra", "sra"], ["contrastive", "dispersive", "contrastive"]]
)
def test_an_unknown_or_repeated_term_is_refused_listing_the_valid_ones(use):
    """Every name must be registered and appear once; the message lists the valid names."""
    with pytest.raises(ValueError) as e:
        TermsOptions(use=use).validate()
    assert str(e.value) == f"terms.use {use!r}: each term once, from contrastive, dispersive, sra, repa"


@pytest.mark.parametrize("use", [[], ["repa"], ["contrastive", "dispersive", "sra", "repa"]])
def test_distinct_registered_terms_pass(use):
    """Each registered term once, in any number, passes."""
    TermsOptions(use=use).validate()
