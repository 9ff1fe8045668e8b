"""The DiT MLP's activation, the tanh-GELU, with a vectorised CPU kernel.

``gelu_tanh(x)`` = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (Hendrycks & Gimpel 2016, Sec. 2), the same
function as ``F.gelu(x, approximate="tanh")``. torch's CPU kernel for it is slow (its vectorised ``tanh`` costs
about 2 ns per element on a recent x86 core): the C++ kernel computes x sigmoid(2u), the same value, with its own
``exp``, forward and backward each one pass (docs/ops.md). It runs where it is faster than torch's: CPU tensors,
AVX2 or AVX-512 kernels, eager mode. Elsewhere ``gelu_tanh`` is ``F.gelu``: on a GPU torch's kernel already makes
one pass over memory, and under ``torch.compile`` inductor fuses the activation into its neighbours.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from diffcurr_fast.ops import _backend, _common


def gelu_tanh_ref(x: torch.Tensor) -> torch.Tensor:
    """Reference: ``F.gelu(x, approximate="tanh")``."""
    return F.gelu(x, approximate="tanh")


class GeluTanhFunction(torch.autograd.Function):
    """The C++ forward and backward kernels; the input is saved for the backward, nothing else."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return _backend.ext_ops().gelu_tanh_fwd(x)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return _backend.ext_ops().gelu_tanh_bwd(grad_y, x)


def _cpu_kernel_is_faster() -> bool:
    """The C++ kernel is built and runs vectorised (AVX2 or AVX-512); its baseline build is slower than torch's."""
    return _backend.cpu_isa() in ("avx2", "avx512")


def gelu_tanh(x: torch.Tensor, backend: str | None = None) -> torch.Tensor:
    """tanh-GELU of ``x`` (any shape). ``backend``: None / ``auto`` (the C++ kernel where it is faster, module
    doc), ``cpu`` (the C++ kernel; raises where it cannot run) or ``reference`` (torch's); the GPU backends'
    names also mean torch's kernel; an unknown name is a ValueError. ``DIFFCURR_OPS_BACKEND`` is read when
    ``backend`` is None."""
    requested = _backend.requested(backend)
    if requested == "cpu":
        _backend.resolve("gelu_tanh_fwd", x.device, "cpu")  # raises with the reason when it cannot run
        if x.dtype not in _common.KERNEL_DTYPES:
            raise ValueError(f"gelu_tanh: the cpu backend takes {_common.KERNEL_DTYPES}, got {x.dtype}")
        return GeluTanhFunction.apply(x)
    fast = (
        requested == "auto"
        and x.device.type == "cpu"
        and x.dtype in _common.KERNEL_DTYPES
        and not torch.compiler.is_compiling()
        and _cpu_kernel_is_faster()
    )
    return GeluTanhFunction.apply(x) if fast else gelu_tanh_ref(x)


_backend.register_raw_fake("gelu_tanh_fwd", lambda x: torch.empty_like(x, memory_format=torch.contiguous_format))
_backend.register_raw_fake(
    "gelu_tanh_bwd", lambda grad_y, x: torch.empty_like(x, memory_format=torch.contiguous_format)
)

__all__ = ["GeluTanhFunction", "gelu_tanh", "gelu_tanh_ref"]
