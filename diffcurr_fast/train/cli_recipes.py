"""``diffcurr-fast recipes``: the recipes shipped with the package (``diffcurr-fast train NAME`` runs one)."""

from __future__ import annotations

import argparse

from diffcurr_fast.runs.config import list_recipes, recipes_dir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``recipes`` (none besides --paths)."""
    parser.add_argument("--paths", action="store_true", help="print the full path of each recipe")


def _summary(path) -> str:
    """The first comment line of a recipe."""
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            return line.lstrip("# ").strip()
        if line.strip():
            break
    return ""


def run(args: argparse.Namespace) -> int:
    """Print one recipe per line: name and summary (or path). Returns the exit status."""
    recipes = list_recipes()
    if not recipes:
        raise FileNotFoundError(f"no shipped recipes found under {recipes_dir()}")
    width = max(len(p.stem) for p in recipes)
    for p in recipes:
        print(f"{p.stem:<{width}}  {p if args.paths else _summary(p)}")
    print(f"(diffcurr-fast train NAME [--set ...] runs one; copy one from {recipes_dir()} to edit it)")
    return 0
