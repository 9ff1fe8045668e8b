"""Fused diffusion ops: forward process, training loss, timestep sampling, Philox noise, DiT block math.

Each op has a pure-torch ``*_ref`` (its definition, see docs/ops.md) and one dispatch table (backend name -> function,
``_backend.table``); ``_backend`` picks the backend per device (``cuda`` -> ``triton`` -> ``cpu`` -> ``reference``;
force one with the ``backend=`` argument or ``DIFFCURR_OPS_BACKEND``), all registered with ``torch.library`` with fake
implementations, so they compose with ``torch.compile``. ``q_sample`` and ``diffusion_loss`` are
``torch.autograd.Function``s that call the raw C++/CUDA kernels (``diffcurr_fast_C::*``) directly, the reference and
Triton forwards through the opaque custom ops ``diffcurr_fast::q_sample`` / ``diffusion_loss`` (under
``torch.compile`` with the noise given they trace their plain-torch definition, which inductor fuses:
``_common.traced_under_compile``); the DiT block ops are custom ops with autograd registrations; ``gelu_tanh`` (the
MLP's activation) is a CPU kernel where it beats torch's, torch's own elsewhere; the modern block's ops
``rmsnorm_modulate``, ``qk_norm_rope`` and ``swiglu`` are custom ops with autograd registrations like the DiT block
ops; ``token_gather`` and ``token_scatter`` route the kept tokens of token routing past a span of blocks and back.
"""

from diffcurr_fast.ops._backend import BACKENDS, available_backends, resolve
from diffcurr_fast.ops.adaln import (
    adaln_modulate,
    adaln_modulate_bwd_ref,
    adaln_modulate_ref,
    gated_residual,
    gated_residual_bwd_ref,
    gated_residual_ref,
)
from diffcurr_fast.ops.diffusion_loss import diffusion_loss, diffusion_loss_coef, diffusion_loss_ref
from diffcurr_fast.ops.gelu import gelu_tanh, gelu_tanh_ref
from diffcurr_fast.ops.philox import normalize_seed, philox_randn, philox_randn_ref
from diffcurr_fast.ops.q_sample import q_sample, q_sample_coef, q_sample_ref
from diffcurr_fast.ops.qk_norm_rope import qk_norm_rope, qk_norm_rope_bwd_ref, qk_norm_rope_ref
from diffcurr_fast.ops.rmsnorm_modulate import rmsnorm_modulate, rmsnorm_modulate_bwd_ref, rmsnorm_modulate_ref
from diffcurr_fast.ops.sample_timesteps import check_weights, sample_timesteps, sample_timesteps_ref
from diffcurr_fast.ops.swiglu import swiglu, swiglu_bwd_ref, swiglu_ref
from diffcurr_fast.ops.token_gather import token_gather, token_gather_ref
from diffcurr_fast.ops.token_scatter import token_scatter, token_scatter_ref

__all__ = [
    "BACKENDS",
    "adaln_modulate",
    "adaln_modulate_bwd_ref",
    "adaln_modulate_ref",
    "available_backends",
    "check_weights",
    "diffusion_loss",
    "diffusion_loss_coef",
    "diffusion_loss_ref",
    "gated_residual",
    "gated_residual_bwd_ref",
    "gated_residual_ref",
    "gelu_tanh",
    "gelu_tanh_ref",
    "normalize_seed",
    "philox_randn",
    "philox_randn_ref",
    "q_sample",
    "q_sample_coef",
    "q_sample_ref",
    "qk_norm_rope",
    "qk_norm_rope_bwd_ref",
    "qk_norm_rope_ref",
    "resolve",
    "rmsnorm_modulate",
    "rmsnorm_modulate_bwd_ref",
    "rmsnorm_modulate_ref",
    "sample_timesteps",
    "sample_timesteps_ref",
    "swiglu",
    "swiglu_bwd_ref",
    "swiglu_ref",
    "token_gather",
    "token_gather_ref",
    "token_scatter",
    "token_scatter_ref",
]
