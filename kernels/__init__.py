"""Triton kernels for the fused diffusion ops (installed as ``diffcurr_fast.kernels``).

Import only through ``diffcurr_fast.ops``, which checks that Triton is available. To run them on CPU tensors
set ``TRITON_INTERPRET=1`` before anything imports this package.
"""
