"""Offline difficulty analysis of the denoising tasks (Kim et al., ICLR 2025): consecutive KL, convergence per
interval, cluster layouts. Above training: it trains small models and evaluates them; nothing at run time imports it."""
