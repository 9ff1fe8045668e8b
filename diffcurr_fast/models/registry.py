"""The model options by name: name -> ``module:OptionsClass``, imported on first use.

A model option changes the DiT's blocks or the tokens they process. Its ``Options`` (``options.Options``) declare
its fields in the ``model`` section, its rules, what it refuses, and ``dit_kwargs(cfg)``: the keywords of
``DiT.__init__`` it sets (``runs.sampling.build_model`` passes them on). Adding one is its file in this package, its
keyword in ``DiT``, and one line here.
"""

from __future__ import annotations

OPTIONS: dict[str, str] = {
    "dtr": "diffcurr_fast.models.dtr:DTROptions",
    "routing": "diffcurr_fast.models.routing:RoutingOptions",
    "modern": "diffcurr_fast.models.modern:ModernOptions",
}
