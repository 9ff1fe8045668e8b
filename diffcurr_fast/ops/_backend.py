"""Backend selection for the fused ops.

Backends, in ``auto`` preference order for a tensor's device:

- ``cuda``: the raw CUDA kernels ``torch.ops.diffcurr_fast_C.*`` (extension built with CUDA), CUDA tensors;
- ``triton``: the Triton kernels in ``diffcurr_fast.kernels``; CUDA tensors, or CPU tensors when
  ``TRITON_INTERPRET=1`` (never chosen by ``auto`` on CPU: the interpreter is slow);
- ``cpu``: the raw C++ kernels ``torch.ops.diffcurr_fast_C.*`` on CPU tensors;
- ``reference``: the pure-torch definitions (any device).

``auto`` falls back with one warning per (op, device type) when a faster backend is missing. A backend asked
for explicitly (``backend=`` argument or ``DIFFCURR_OPS_BACKEND``) raises ``RuntimeError`` when unavailable.

Each op file holds one dispatch ``table`` (backend name -> the function that runs the op there). The choice is
made outside any traced code: ``resolve`` and ``available`` are constants to ``torch.compile`` (evaluated once
while tracing), so a compiled graph never breaks on an availability check (an import, a cache lookup).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import warnings
from collections.abc import Callable

import torch

BACKENDS = ("cuda", "triton", "cpu", "reference")
CHOICES = ("auto",) + BACKENDS
EXTENSION = ("cuda", "cpu")  # served by diffcurr_fast._C: one function per kernel, dispatched on the device
ENV_VAR = "DIFFCURR_OPS_BACKEND"

_warned: set[tuple[str, str]] = set()


@functools.cache
def _ext_error() -> str | None:
    """None when ``diffcurr_fast._C`` imports, else the reason it does not."""
    try:
        importlib.import_module("diffcurr_fast._C")
    except Exception as exc:  # ImportError, or an undefined symbol / ABI mismatch in the shared object
        return f"the C++ extension diffcurr_fast._C is not importable ({type(exc).__name__}: {exc})"
    return None


@functools.cache
def _ext_has(op: str, dispatch_key: str) -> bool:
    if _ext_error() is not None:
        return False
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"diffcurr_fast_C::{op}", dispatch_key)
    except RuntimeError:  # the op is not registered at all
        return False


@functools.cache
def _triton_error() -> str | None:
    try:
        importlib.import_module("diffcurr_fast.kernels.philox")
    except Exception as exc:
        return f"Triton kernels are not importable ({type(exc).__name__}: {exc})"
    return None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def unavailable_reason(backend: str, op: str, device: torch.device) -> str | None:
    """None when ``backend`` can run ``op`` on ``device``, else a sentence saying why not."""
    if backend == "reference":
        return None
    if backend == "cuda":
        if device.type != "cuda":
            return f"backend 'cuda' needs CUDA tensors, got device {device}"
        if _ext_error() is not None:
            return _ext_error()
        if not _ext_has(op, "CUDA"):
            return f"diffcurr_fast._C was built without a CUDA kernel for {op}"
        return None
    if backend == "cpu":
        if device.type != "cpu":
            return f"backend 'cpu' needs CPU tensors, got device {device}"
        if _ext_error() is not None:
            return _ext_error()
        if not _ext_has(op, "CPU"):
            return f"diffcurr_fast._C has no CPU kernel for {op}"
        return None
    if backend == "triton":
        if device.type == "cpu" and not _interpreting():
            return "backend 'triton' runs on CPU tensors only with TRITON_INTERPRET=1 set before import"
        if device.type not in ("cpu", "cuda"):
            return f"backend 'triton' does not support device {device}"
        return _triton_error()
    raise ValueError(f"unknown backend {backend!r}; choose one of {CHOICES}")


@torch.compiler.assume_constant_result
def available(backend: str, op: str, device: torch.device) -> bool:
    """Whether ``backend`` can run ``op`` on ``device`` (``unavailable_reason`` is None); a constant under
    ``torch.compile``, so traced code may ask it."""
    return unavailable_reason(backend, op, device) is None


def requested(backend: str | None) -> str:
    """The backend asked for: ``backend``, or ``DIFFCURR_OPS_BACKEND`` when it is None (default ``auto``); a
    ValueError for an unknown name."""
    name = backend if backend is not None else os.environ.get(ENV_VAR, "auto")
    if name not in CHOICES:
        raise ValueError(f"unknown ops backend {name!r}; choose one of {CHOICES}")
    return name


@torch.compiler.assume_constant_result
def resolve(op: str, device: torch.device, backend: str | None = None) -> str:
    """Name of the backend that runs ``op`` for tensors on ``device``.

    ``backend`` (or ``DIFFCURR_OPS_BACKEND`` when ``backend`` is None) is one of ``auto``, ``cuda``, ``triton``,
    ``cpu``, ``reference``.
    """
    name = requested(backend)
    device = torch.device(device)
    if name != "auto":
        reason = unavailable_reason(name, op, device)
        if reason is not None:
            raise RuntimeError(f"ops backend {name!r} requested for {op} but unavailable: {reason}")
        return name
    order = ("cuda", "triton", "reference") if device.type == "cuda" else ("cpu", "reference")
    if device.type not in ("cuda", "cpu"):
        order = ("reference",)
    reasons = []
    for name in order:
        reason = unavailable_reason(name, op, device)
        if reason is None:
            if reasons and (op, device.type) not in _warned and not torch.compiler.is_compiling():
                _warned.add((op, device.type))
                warnings.warn(
                    f"diffcurr_fast.ops.{op}: falling back to the {name!r} backend on {device.type} "
                    f"({'; '.join(reasons)})",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return name
        reasons.append(reason)
    return "reference"


def available_backends(op: str, device: torch.device | str = "cpu") -> list[str]:
    """Backends that can run ``op`` on ``device`` here (``triton`` on CPU only under the interpreter)."""
    device = torch.device(device)
    return [b for b in BACKENDS if unavailable_reason(b, op, device) is None]


def register_raw_fake(op: str, fake) -> None:
    """Give the raw kernel ``diffcurr_fast_C::<op>`` a fake implementation, so it traces under torch.compile.

    The public ops call the C++/CUDA kernels directly (no Python op layer in between); this is what lets a
    compiled graph hold them as single nodes. A no-op when the extension is missing or was built before the op
    existed (a stale build: the op then falls back with ``resolve``'s warning instead of failing the import).
    """
    if _ext_error() is None and hasattr(ext_ops(), op):
        torch.library.register_fake(f"diffcurr_fast_C::{op}")(fake)


def table(*, reference: Callable, triton: Callable, ext: Callable) -> dict[str, Callable]:
    """An op's dispatch table, backend name -> the function that runs it: the pure-torch ``reference``, the
    ``triton`` launcher, and ``ext`` (the C++/CUDA kernel of ``diffcurr_fast._C``, for both ``cpu`` and ``cuda``).
    All entries of one table take the same arguments."""
    return {"cuda": ext, "triton": triton, "cpu": ext, "reference": reference}


def contiguous_args(fn: Callable) -> Callable:
    """``fn`` called with its tensor arguments made contiguous (what the kernels take); other arguments as given."""
    return lambda *args: fn(*(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args))


def ext_ops():
    """The namespace of the raw C++/CUDA kernels, ``torch.ops.diffcurr_fast_C``."""
    return torch.ops.diffcurr_fast_C


@functools.cache
def cpu_isa() -> str | None:
    """The instruction set of the C++ CPU kernels in use (``generic``, ``avx2`` or ``avx512``), None without the
    extension. Chosen once at start (``DIFFCURR_CPU_ISA`` forces one); ``use_cpu_isa`` switches it."""
    return None if _ext_error() is not None else ext_ops().cpu_isa()


def cpu_isas() -> list[str]:
    """The instruction sets that this build of the extension and this CPU can run; [] without the extension."""
    return [] if _ext_error() is not None else list(ext_ops().cpu_isas())


@contextlib.contextmanager
def use_cpu_isa(isa: str):
    """Run the C++ CPU kernels of instruction set ``isa`` inside the block (tests and benchmarks run every set
    of a machine in one process); a RuntimeError naming the supported sets when ``isa`` is not one of them.
    Switch between ops only, not while another thread runs one."""
    previous = ext_ops().set_cpu_isa(isa)
    cpu_isa.cache_clear()
    try:
        yield
    finally:
        ext_ops().set_cpu_isa(previous)
        cpu_isa.cache_clear()


def kernels(module: str):
    """Import ``diffcurr_fast.kernels.<module>`` (the Triton launchers)."""
    return importlib.import_module(f"diffcurr_fast.kernels.{module}")
