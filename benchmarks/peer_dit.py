"""The official DiT step as a benchmark provider: see ``diffcurr_fast.study.peer_dit`` (the study's reference arm
measures its time axis with the same code)."""

from diffcurr_fast.study.peer_dit import import_peer, official_dims, official_step, update_ema  # noqa: F401
