"""TDC training (arXiv 2312.13307): timestep grouping, FLOPs budgets, pruning, proxy search, multi-expert denoiser,
and the end-to-end pipeline (``run_tdc``)."""
