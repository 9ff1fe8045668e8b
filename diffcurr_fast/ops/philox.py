"""Counter-based normal noise: Philox4x32-10 (Salmon et al. 2011, Random123) with the Box-Muller transform.

``philox_randn(seed, shape, device)`` is a pure function of the 64-bit seed and the flat element index (see
``docs/ops.md``), so a loss can regenerate the noise ``q_sample`` drew without storing it. The reference is
written in int64 torch arithmetic and is bit-exact with ``triton.language.randint4x``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from diffcurr_fast.ops import _backend

_M32 = 0xFFFFFFFF
PHILOX_M0, PHILOX_M1 = 0xD2511F53, 0xCD9E8D57  # round multipliers
PHILOX_W0, PHILOX_W1 = 0x9E3779B9, 0xBB67AE85  # Weyl key increments
UNIFORM_SCALE = 4.6566127342e-10  # ~2^-31: int31 -> [0, 1)
TWO_PI = 6.283185307179586


def normalize_seed(seed: int) -> int:
    """Return ``seed`` (an int in [-2**63, 2**64)) as the signed int64 with the same 64 bits; ValueError else."""
    if isinstance(seed, torch.Tensor) and seed.numel() == 1 and not seed.dtype.is_floating_point:
        seed = int(seed)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int in [-2**63, 2**64), got {seed!r}")
    if not -(2**63) <= seed < 2**64:
        raise ValueError(f"seed must be an int in [-2**63, 2**64), got {seed}")
    return seed - 2**64 if seed >= 2**63 else seed


def draw_seed(generator: torch.Generator | None = None) -> int:
    """One int64 seed drawn from ``generator`` (the default CPU generator when None)."""
    device = generator.device if generator is not None else "cpu"
    return int(torch.randint(-(2**63), 2**63 - 1, (1,), generator=generator, device=device, dtype=torch.int64))


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # 32x32 -> 64-bit product of the constant a and uint32 values b held in int64, without overflow:
    # split b into 16-bit halves so every partial product stays below 2**49.
    bl, bh = b & 0xFFFF, b >> 16
    t_lo, t_hi = a * bl, a * bh
    mid = ((t_hi & 0xFFFF) << 16) + t_lo
    return (t_hi >> 16) + (mid >> 32), mid & _M32


def philox4x32_10(
    c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor, c3: torch.Tensor, k0: int, k1: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox4x32-10 on uint32 counters held in int64 tensors, key (k0, k1); returns four int64 uint32 words."""
    for _ in range(10):
        hi0, lo0 = _mulhilo(PHILOX_M0, c0)
        hi1, lo1 = _mulhilo(PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + PHILOX_W0) & _M32, (k1 + PHILOX_W1) & _M32
    return c0, c1, c2, c3


def uniform_from_uint32(r: torch.Tensor) -> torch.Tensor:
    """u(r) of docs/ops.md: the uint32 word read as int32, folded to [0, 2**31), times 2**-31, in float32."""
    s = torch.where(r >= 2**31, r - 2**32, r)  # as int32
    s = torch.where(s < 0, -s - 1, s)
    return s.to(torch.float32) * torch.tensor(UNIFORM_SCALE, dtype=torch.float32)


def philox_words(seed: int, counters: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The four Philox words at 64-bit ``counters`` (int64 tensor) for ``seed``: counter (c_lo, c_hi, 0, 0)."""
    seed = normalize_seed(seed)
    zero = torch.zeros_like(counters)
    return philox4x32_10(counters & _M32, (counters >> 32) & _M32, zero, zero, seed & _M32, (seed >> 32) & _M32)


def philox_randn_ref(seed: int, shape: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """Reference normal noise (float32): noise[i] = n_{i % 4} of the Box-Muller pairs at counter i // 4."""
    shape = tuple(int(s) for s in shape)
    n = 1
    for s in shape:
        n *= s
    n_ctr = (n + 3) // 4
    r0, r1, r2, r3 = philox_words(seed, torch.arange(n_ctr, dtype=torch.int64, device=device))
    one_m7 = torch.tensor(1.0e-7, dtype=torch.float32, device=device)
    rad_a = torch.sqrt(-2.0 * torch.log(torch.maximum(uniform_from_uint32(r0), one_m7)))  # Box-Muller radius
    rad_b = torch.sqrt(-2.0 * torch.log(torch.maximum(uniform_from_uint32(r2), one_m7)))
    th_a = TWO_PI * uniform_from_uint32(r1)
    th_b = TWO_PI * uniform_from_uint32(r3)
    out = torch.stack(
        [rad_a * torch.cos(th_a), rad_a * torch.sin(th_a), rad_b * torch.cos(th_b), rad_b * torch.sin(th_b)], 1
    )
    return out.reshape(-1)[:n].reshape(shape)


_KERNELS = _backend.table(
    reference=philox_randn_ref,
    triton=lambda seed, shape, device: _backend.kernels("philox").philox_randn_fwd(seed, tuple(shape), device),
    ext=lambda seed, shape, device: _backend.ext_ops().randn_like(
        torch.empty(shape, dtype=torch.float32, device=device), seed
    ),
)


@torch.library.custom_op("diffcurr_fast::randn", mutates_args=())
def _randn_op(seed: int, shape: Sequence[int], device: torch.device, backend: str) -> torch.Tensor:
    return _KERNELS[backend](seed, [int(s) for s in shape], device)


@_randn_op.register_fake
def _(seed, shape, device, backend):
    return torch.empty([int(s) for s in shape], dtype=torch.float32, device=device)


def philox_randn(
    seed: int,
    shape: Sequence[int],
    device: torch.device | str | None = None,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """Standard normal float32 noise of ``shape`` on ``device``, a pure function of ``seed`` (docs/ops.md)."""
    seed = normalize_seed(seed)
    if isinstance(shape, int):
        shape = (shape,)
    shape = tuple(shape)
    if any((not isinstance(s, int)) or isinstance(s, bool) or s < 0 for s in shape):
        raise ValueError(f"shape must be a sequence of non-negative ints, got {shape!r}")
    device = torch.device(device) if device is not None else torch.device("cpu")
    name = _backend.resolve("randn_like", device, backend)
    return _randn_op(seed, list(shape), device, name)
