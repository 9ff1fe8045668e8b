"""Triton kernels for the fused diffusion ops (the top-level ``kernels/README.md`` indexes every kernel source).

Import only through ``diffcurr_fast.ops``, which checks that Triton is available. To run them on CPU tensors
set ``TRITON_INTERPRET=1`` before anything imports this package.
"""
