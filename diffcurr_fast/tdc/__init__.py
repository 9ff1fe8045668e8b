"""TDC training (arXiv 2312.13307): timestep grouping, FLOPs budgets, pruning, proxy search, multi-expert denoiser,
and the end-to-end pipeline (``run_tdc``)."""

from diffcurr_fast.tdc.accounting import sampling_flops, training_flops, visited_input_times, write_json
from diffcurr_fast.tdc.experts import COMPILE_MODES, MultiExpertDenoiser, load_bundle, save_bundle
from diffcurr_fast.tdc.flops import block_flops, dit_flops, dit_flops_breakdown, widths_flops
from diffcurr_fast.tdc.grouping import (
    FULL_BUDGET_ENDS,
    GROUP_METHODS,
    TimestepGroup,
    budget_ratio,
    group_timesteps,
    make_groups,
    snr_db,
)
from diffcurr_fast.tdc.llm import LLMProposer, parse_reply
from diffcurr_fast.tdc.pipeline import TDCOptions, load_bundle_with_config, options_from_dict, run_tdc
from diffcurr_fast.tdc.proposers import PROPOSERS, LocalProposer, UniformProposer, make_proposer
from diffcurr_fast.tdc.proxy import proxy_loss, recover
from diffcurr_fast.tdc.prune import (
    IMPORTANCE_METHODS,
    Importance,
    importance_scores,
    keep_indices,
    prune_dit,
    prune_to_budget,
    prune_to_widths,
    select_widths,
    unit_costs,
)
from diffcurr_fast.tdc.search import (
    Candidate,
    MemoryBank,
    Proposer,
    SearchResult,
    SearchState,
    plot_history,
    proxy_search,
    validate_widths,
)
from diffcurr_fast.train.config import TDCConfig

__all__ = [
    "COMPILE_MODES",
    "FULL_BUDGET_ENDS",
    "GROUP_METHODS",
    "IMPORTANCE_METHODS",
    "PROPOSERS",
    "Candidate",
    "Importance",
    "LLMProposer",
    "LocalProposer",
    "MemoryBank",
    "MultiExpertDenoiser",
    "Proposer",
    "SearchResult",
    "SearchState",
    "TDCConfig",
    "TDCOptions",
    "TimestepGroup",
    "UniformProposer",
    "block_flops",
    "budget_ratio",
    "dit_flops",
    "dit_flops_breakdown",
    "group_timesteps",
    "importance_scores",
    "keep_indices",
    "load_bundle",
    "load_bundle_with_config",
    "make_groups",
    "make_proposer",
    "options_from_dict",
    "parse_reply",
    "plot_history",
    "proxy_loss",
    "proxy_search",
    "prune_dit",
    "prune_to_budget",
    "prune_to_widths",
    "recover",
    "run_tdc",
    "sampling_flops",
    "visited_input_times",
    "save_bundle",
    "select_widths",
    "snr_db",
    "training_flops",
    "unit_costs",
    "validate_widths",
    "widths_flops",
    "write_json",
]
