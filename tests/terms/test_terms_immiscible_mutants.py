"""Immiscible diffusion (terms/immiscible.py): the switch refuses CUDA graphs and nothing else, with a message that
names the fix; a batch of two is assigned (one sample needs no assignment, nor scipy); a missing scipy is named; the
assignment comes back as int64 on x0's device."""

import sys

import pytest
import torch

from diffcurr_fast.runs.recipes import load_config
from diffcurr_fast.terms import immiscible
from diffcurr_fast.terms.immiscible import SCIPY_MISSING, assign_noise


def test_cuda_graphs_are_refused_with_the_fix_and_other_uses_are_not():
    """``engine.cuda_graphs=true`` with ``terms.immiscible=true`` is refused, naming why and the setting to change;
    without CUDA graphs the config loads, and another use (TDC's) is not refused."""
    with pytest.raises(ValueError) as e:
        load_config(None, ["optim.name=adamw", "terms.immiscible=true", "engine.cuda_graphs=true"])
    msg = str(e.value)
    assert msg.startswith("engine.cuda_graphs does not work with terms.immiscible (its assignment runs on the host)")
    assert msg.endswith("; set engine.cuda_graphs=false")
    cfg = load_config(None, ["optim.name=adamw", "terms.immiscible=true"])
    cfg.check_refusals("tdc")


def test_a_batch_of_two_is_assigned_by_least_distance():
    """Each image sits next to the other stream's noise: the assignment swaps them."""
    noise = torch.randn(2, 3, 2, 2, generator=torch.Generator().manual_seed(0))
    x0 = noise[[1, 0]] + 0.01
    assert assign_noise(x0, noise).tolist() == [1, 0]


def test_one_sample_needs_no_scipy_and_a_missing_scipy_is_named(monkeypatch):
    """B = 1 is the identity without importing scipy; B = 2 without scipy raises an ImportError naming the fix."""
    monkeypatch.setitem(sys.modules, "scipy.optimize", None)  # ``from scipy.optimize import ...`` fails
    pi = assign_noise(torch.randn(1, 3), torch.randn(1, 3))
    assert pi.tolist() == [0] and pi.dtype == torch.int64
    with pytest.raises(ImportError) as e:
        assign_noise(torch.randn(2, 3), torch.randn(2, 3))
    assert str(e.value) == SCIPY_MISSING


def test_the_assignment_is_on_x0s_device(monkeypatch):
    """x0 on another device than the host (the meta device stands in for an accelerator here; its costs are
    replaced by host ones, as the assignment copies them to the host): pi comes back on x0's device, for one sample
    and for a batch."""
    x1 = torch.empty(1, 3, device="meta")
    pi = assign_noise(x1, torch.empty(1, 3, device="meta"))
    assert pi.device == x1.device and pi.dtype == torch.int64
    monkeypatch.setattr(immiscible, "pair_costs", lambda x0, noise: torch.tensor([[5.0, 1.0], [1.0, 5.0]]))
    x2 = torch.empty(2, 3, device="meta")
    pi = assign_noise(x2, torch.empty(2, 3, device="meta"))
    assert pi.device == x2.device and pi.dtype == torch.int64 and pi.shape == (2,)
