"""Multi-expert denoiser of TDC training (arXiv 2312.13307, Sec. 3): timestep t goes to its group's expert.

``MultiExpertDenoiser`` is a plain model callable ``(x, t, y) -> out`` so every sampler and ``forward_with_cfg``
work unchanged. Groups are ranges of cells of the formulation's difficulty axis (DDPM: its timesteps, routed by
t itself, fractional t of the ODE samplers included); for a continuous formulation ``input_edges`` holds the
network input time at the cell edges (flow: t; EDM: c_noise = ln(sigma) / 4), which the routing compares the input
time with. Routing: when the whole batch falls in one group (the usual sampling case, where all samples share
t) the batch goes to that expert in one call; a mixed batch is split by group with index masks and reassembled in
order. Experts can be ``torch.compile``d (``compile_experts``). A bundle is one directory: ``weights.safetensors``
(keys ``experts.<i>.<param>``) and ``bundle.json`` (each expert's ``config()``, the group ranges and optional group
metadata); ``load_bundle`` rebuilds the heterogeneous experts from their configs.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from diffcurr_fast._files import read_safetensors, write_json
from diffcurr_fast.curriculum.clustering import check_clusters
from diffcurr_fast.diffusion.samplers import guided_forward
from diffcurr_fast.models import DiT
from diffcurr_fast.runs.checkpoint import export_safetensors
from diffcurr_fast.tdc.flops import dit_flops

__all__ = ["BUNDLE_FORMAT", "COMPILE_MODES", "MultiExpertDenoiser", "load_bundle", "save_bundle"]

BUNDLE_FORMAT = "diffcurr_fast.tdc.bundle/1"
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
_SHARED_ATTRS = ("in_channels", "out_channels", "learn_sigma", "num_classes", "input_size", "num_timesteps")


class MultiExpertDenoiser(nn.Module):
    """Route each timestep to the expert of its group.

    Args:
        experts: one model per group, in ascending t (same input / output geometry and classes).
        ranges: ``[(lo, hi), ...]`` half-open ranges partitioning [0, T) in ascending t, one per expert.
        groups: optional per-group metadata dicts (e.g. ``TimestepGroup.to_dict()``), saved in bundles.
        input_edges: the (G + 1,) ascending network input times at the cell edges of a continuous formulation
            (``Formulation.cell_input_edges``); None: the input time is the cell index (DDPM).
    """

    def __init__(
        self,
        experts: Sequence[nn.Module],
        ranges: Sequence[tuple[int, int]],
        groups: Sequence[dict[str, Any]] | None = None,
        input_edges: Sequence[float] | torch.Tensor | None = None,
    ):
        super().__init__()
        experts = list(experts)
        if not experts:
            raise ValueError("experts must hold at least one model, got none")
        ranges = [tuple(r) for r in ranges]
        if len(ranges) != len(experts):
            raise ValueError(f"need one (lo, hi) range per expert: {len(experts)} experts, {len(ranges)} ranges")
        self.ranges = check_clusters(ranges, int(ranges[-1][1]) if ranges else 0)
        self.num_timesteps = self.ranges[-1][1]
        for name in _SHARED_ATTRS:
            values = {getattr(e, name, None) for e in experts}
            if len(values) > 1:
                raise ValueError(f"experts disagree on {name}: {sorted(map(str, values))}")
        e0 = experts[0]
        self.in_channels = e0.in_channels
        self.out_channels = getattr(e0, "out_channels", None)
        self.learn_sigma = getattr(e0, "learn_sigma", False)
        self.num_classes = getattr(e0, "num_classes", None)
        self.experts = nn.ModuleList(experts)
        self.groups = [dict(g) for g in groups] if groups is not None else None
        if self.groups is not None and len(self.groups) != len(experts):
            raise ValueError(f"need one group dict per expert: {len(experts)} experts, {len(self.groups)} groups")
        upper = torch.tensor([hi for _, hi in self.ranges[:-1]], dtype=torch.long)
        self.input_edges: torch.Tensor | None = None  # float64 on the CPU (not a buffer: no dtype casts)
        if input_edges is not None:
            edges = torch.as_tensor(input_edges, dtype=torch.float64).flatten()
            if edges.numel() != self.num_timesteps + 1 or not bool((edges[1:] > edges[:-1]).all()):
                raise ValueError(
                    f"input_edges must be {self.num_timesteps + 1} ascending values (one per cell "
                    f"edge), got {edges.numel()}"
                )
            self.input_edges, self._input_upper = edges, edges[upper]  # (N - 1,) input times of the groups' ends
        self.register_buffer("boundaries", upper, persistent=False)  # (N - 1,) upper ends of groups 0..N-2
        self._callables: list[Any] = list(experts)
        self.compile_mode: str | None = None

    @classmethod
    def from_base(cls, base: nn.Module, ranges: Sequence[tuple[int, int]], **kwargs: Any) -> MultiExpertDenoiser:
        """Every group's expert is an independent copy of ``base`` (k = 1, or the start of stage 2)."""
        return cls([copy.deepcopy(base) for _ in ranges], ranges, **kwargs)

    def group_index(self, t: torch.Tensor) -> torch.Tensor:
        """(N,) int64 group of each timestep (float t is routed by the same boundaries)."""
        b = self.boundaries.to(t.device)
        t = t.contiguous()
        if self.input_edges is not None:  # continuous input time, compared in float64 with the groups' upper edges
            return torch.bucketize(t.to(torch.float64), self._input_upper.to(t.device), right=True)
        return torch.bucketize(t, b.to(t.dtype) if t.is_floating_point() else b, right=True)

    def compile_experts(self, mode: str = "default", **kwargs: Any) -> MultiExpertDenoiser:
        """``torch.compile`` every expert with ``mode`` (one of ``COMPILE_MODES``); kwargs go to torch.compile."""
        if mode not in COMPILE_MODES:
            raise ValueError(f"unknown compile mode {mode!r}; valid choices: {', '.join(COMPILE_MODES)}")
        # Every expert is the same DiT.forward with other parameter shapes: dynamo counts each as a recompile of
        # that code object and silently runs the experts past its limit (8) uncompiled; leave room for all.
        import torch._dynamo

        need = 2 * len(self.experts) + 8  # plus the base model and guidance variants a caller may compile beside
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, need)
        self._callables = [torch.compile(e, mode=mode, **kwargs) for e in self.experts]
        self.compile_mode = mode
        return self

    def expert_flops(self) -> list[int]:
        """Per-sample forward FLOPs of every expert (``dit_flops``)."""
        return [dit_flops(e) for e in self.experts]

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        """Route (x, t, y) to the experts; extra keyword arguments are passed on (sliced when per-sample)."""
        if t.dim() == 0:
            t = t.expand(x.shape[0])  # (N,)
        if t.dim() != 1 or t.shape[0] != x.shape[0]:
            raise ValueError(f"t must have shape ({x.shape[0]},) or be a scalar, got {tuple(t.shape)}")
        gid = self.group_index(t)  # (N,)
        lo, hi = torch.aminmax(gid)
        lo, hi = int(lo), int(hi)
        if lo == hi:  # one group: whole batch to one expert (per-step routing in sampling)
            return self._callables[lo](x, t, y, **kwargs)
        out = None
        for g in range(lo, hi + 1):
            idx = (gid == g).nonzero().squeeze(1)  # (n_g,)
            if idx.numel() == 0:
                continue
            sub = {k: v.index_select(0, idx) if torch.is_tensor(v) and v.dim() else v for k, v in kwargs.items()}
            yg = None if y is None else y.index_select(0, idx)
            o = self._callables[g](x.index_select(0, idx), t.index_select(0, idx), yg, **sub)  # (n_g, C', H, W)
            if out is None:
                out = o.new_zeros((x.shape[0],) + tuple(o.shape[1:]))  # (N, C', H, W)
            out = out.index_copy(0, idx, o)
        return out

    def forward_with_cfg(
        self,
        x: torch.Tensor,
        t: torch.Tensor,
        y: torch.Tensor,
        cfg_scale: float,
        *,
        guide_all_channels: bool = False,
    ) -> torch.Tensor:
        """Classifier-free guidance over the routed model, batched as DiT's ``forward_with_cfg`` (Ho & Salimans
        2022, Eq. 6): x's first half is used for both halves; the first 3 (or all in_channels) channels are guided."""
        return guided_forward(self.forward, x, t, y, cfg_scale, self.in_channels if guide_all_channels else 3)


def save_bundle(model: MultiExpertDenoiser, path: str | Path) -> Path:
    """Write ``weights.safetensors`` and ``bundle.json`` into directory ``path`` (created if needed); experts with
    NaN or inf weights are refused (``export_safetensors``)."""
    if not isinstance(model, MultiExpertDenoiser):
        raise ValueError(f"save_bundle expects a MultiExpertDenoiser, got {type(model).__name__}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    configs = []
    for i, expert in enumerate(model.experts):
        if not hasattr(expert, "config"):
            raise ValueError(f"expert {i} ({type(expert).__name__}) has no config(); bundles hold DiT experts")
        configs.append(expert.config())
        for name, value in expert.state_dict().items():
            tensors[f"experts.{i}.{name}"] = value.detach().cpu().contiguous().clone()
    export_safetensors(tensors, path / "weights.safetensors", {})  # atomic, finite, mode 0644
    meta = {
        "format": BUNDLE_FORMAT,
        "num_timesteps": model.num_timesteps,
        "ranges": [list(r) for r in model.ranges],
        "experts": configs,
        "groups": model.groups,
        "input_edges": None if model.input_edges is None else model.input_edges.tolist(),
    }
    write_json(meta, path / "bundle.json")
    return path


def load_bundle(path: str | Path, device: str | torch.device = "cpu", **overrides: Any) -> MultiExpertDenoiser:
    """Rebuild a ``MultiExpertDenoiser`` saved by ``save_bundle``; ``overrides`` go to every ``DiT.from_config``
    (e.g. ``attn_backend="sdpa"``)."""
    path = Path(path)
    meta_path, weights_path = path / "bundle.json", path / "weights.safetensors"
    if not meta_path.is_file() or not weights_path.is_file():
        raise ValueError(f"{path} is not a bundle directory (needs bundle.json and weights.safetensors)")
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != BUNDLE_FORMAT:
        raise ValueError(f"unsupported bundle format {meta.get('format')!r}; expected {BUNDLE_FORMAT!r}")
    tensors = read_safetensors(weights_path, device=str(device))
    experts = []
    for i, cfg in enumerate(meta["experts"]):
        expert = DiT.from_config(cfg, **overrides)
        prefix = f"experts.{i}."
        state = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
        expert.load_state_dict(state, strict=True)
        experts.append(expert.to(device).eval())
    return MultiExpertDenoiser(
        experts, [tuple(r) for r in meta["ranges"]], groups=meta.get("groups"), input_edges=meta.get("input_edges")
    )
