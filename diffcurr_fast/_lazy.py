"""What is imported on first use: matplotlib, whose import costs a third of torch's and which only plotting needs."""

from __future__ import annotations


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (files, no display), for the modules that write plots."""
    import matplotlib  # here, not at the top: the one place matplotlib is imported, on first use

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): the backend is set before pyplot loads

    return plt
