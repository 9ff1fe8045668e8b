"""The ``model`` section: the DiT's own fields (``DiTOptions``) and the model options by name (name ->
``module:OptionsClass``, imported on first use).

A model option changes the DiT's blocks or the tokens they process. Its ``Options`` (``options.Options``) declare
its fields in the ``model`` section, its rules, what it refuses, and ``dit_kwargs(cfg)``: the keywords of
``DiT.__init__`` it sets (``runs.sampling.build_model`` passes them on). Adding one is its file in this package, its
keyword in ``DiT``, and one line here.
"""

from __future__ import annotations

from dataclasses import dataclass

from diffcurr_fast.options import filled, load, option, positive, source_of, sources, unit

OPTIONS: dict[str, str] = {
    "dtr": "diffcurr_fast.models.dtr:DTROptions",
    "routing": "diffcurr_fast.models.routing:RoutingOptions",
    "modern": "diffcurr_fast.models.modern:ModernOptions",
}


def _owned(name: str) -> tuple:
    """``custom`` and the presets of ``models.dit`` (read when a value is checked)."""
    return lambda: ("custom", *load(f"diffcurr_fast.models.dit:{name}"))


@dataclass
class DiTOptions:
    """The network (a DiT)."""

    preset: str = option("custom", "DiT preset name, or 'custom' to use the dimensions below", _owned("DIT_PRESETS"))
    input_size: int = positive(8, "spatial size of the (latent) images the model sees")
    in_channels: int = positive(1, "channels of the (latent) images")
    num_classes: int = positive(10, "number of class labels (the null label for guidance is num_classes)")
    patch_size: int | None = option(None, "patch size (a preset fills it; custom default 2)", lo=1)
    hidden_size: int | None = option(None, "transformer width (a preset fills it; custom default 128)", lo=1)
    depth: int | None = option(None, "number of DiT blocks (a preset fills it; custom default 6)", lo=1)
    num_heads: int | None = option(None, "attention heads (a preset fills it; custom default 4)", lo=1)
    mlp_ratio: float = option(4.0, "MLP width / hidden_size", lo=0.0, lo_open=True)
    class_dropout_prob: float = unit(0.1, "label dropout probability (enables classifier-free guidance)", hi_open=True)
    attn_backend: str = option(
        "auto", "attention backend", lambda: load("diffcurr_fast.models.attention:ATTENTION_BACKENDS")
    )
    fused_adaln: bool = option(
        False, "run the blocks' elementwise ops fused (adaLN modulate, gated residual, tanh-GELU)"
    )
    init_from: str = option(
        "",
        "fine-tune: initial weights (.pt state dict such as DiT-XL-2-256x256.pt, one of our "
        "checkpoints, a .safetensors export, or a diffusers DiTTransformer2DModel / DiTPipeline directory); "
        "ignored when resuming",
    )

    def validate(self) -> None:
        """A preset fills the dimensions left unset, and replaces those set by an earlier source (the recipe when
        the preset is an override); a dimension set in the preset's own source or a later one that contradicts it
        is an error, and so are dimensions the DiT cannot take (``models.dit.check_dims``)."""
        # imported here, not at the top: keeps --help free of torch
        from diffcurr_fast.models.dit import DIT_PRESETS, check_dims

        dims = DIT_PRESETS.get(self.preset, CUSTOM_DIMS)
        done = filled(self)
        rank, where = source_of(self, "preset")
        by = f"model.preset {self.preset!r} ({where})" if self.preset != "custom" else "custom default"
        for name, value in dims.items():
            have = getattr(self, name)
            earlier = self.preset != "custom" and source_of(self, name)[0] < rank
            if have is None or name in done or earlier:  # a later preset takes every dimension, equal ones too
                setattr(self, name, value)
                done.add(name)
                sources(self)[name] = (rank, by)
            elif self.preset != "custom" and have != value:
                raise ValueError(
                    f"model.{name}={have!r} contradicts model.preset {self.preset!r} ({name} {value}) in the same "
                    f"or a later source ({source_of(self, name)[1]}); unset it (model.{name}=null) to take the "
                    "preset's value, or use model.preset=custom"
                )
        try:
            check_dims(self.input_size, self.patch_size, self.hidden_size, self.num_heads)
        except ValueError as exc:
            raise ValueError(f"model: {exc}") from None
        if int(self.hidden_size * self.mlp_ratio) < 1:
            raise ValueError(
                f"model.mlp_ratio {self.mlp_ratio!r} gives the MLP int({self.hidden_size} x {self.mlp_ratio!r}) = "
                f"{int(self.hidden_size * self.mlp_ratio)} hidden units; it needs at least 1 (DiT: 4.0)"
            )


CUSTOM_DIMS = {"patch_size": 2, "hidden_size": 128, "depth": 6, "num_heads": 4}
