"""diffcurr_fast: a kernel-optimized trainer for diffusion models (DiT family).

Two research methods made practical: the difficulty curriculum (Kim et al., ICLR 2025) and TDC training
(arXiv 2312.13307), on fused diffusion kernels (Triton, CUDA, C++).
"""

__version__ = "0.1.0"
