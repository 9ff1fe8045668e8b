"""``diffcurr-fast recipes``: the recipes shipped with the package (``diffcurr-fast train NAME`` runs one)."""

from __future__ import annotations

import argparse
import re
import shutil
import textwrap

from diffcurr_fast.runs.recipes import list_recipes, recipes_dir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``recipes`` (none besides --paths)."""
    parser.add_argument("--paths", action="store_true", help="print the full path of each recipe")


def _summary(path) -> str:
    """The first sentence of a recipe's leading comment (which may span lines), whole."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    text = " ".join(v for v in lines if v)
    for end in re.finditer(r"[.!?](?=\s|$)", text):
        head = text[: end.end()]
        if head.count("(") <= head.count(")") and not head.endswith(_ABBREVIATIONS):
            return head
    return text


_ABBREVIATIONS = (" al.", "e.g.", "i.e.", " cf.", " vs.")  # a period that ends no sentence


def run(args: argparse.Namespace) -> int:
    """Print one recipe per line: name and summary (wrapped, never cut) or path. Returns the exit status."""
    recipes = list_recipes()
    if not recipes:
        raise FileNotFoundError(f"no shipped recipes found under {recipes_dir()}")
    width = max(len(p.stem) for p in recipes)
    cols = max(60, shutil.get_terminal_size((120, 24)).columns)
    for p in recipes:
        if args.paths:
            print(f"{p.stem:<{width}}  {p}")
            continue
        print(
            textwrap.fill(
                _summary(p),
                cols,
                initial_indent=f"{p.stem:<{width}}  ",
                subsequent_indent=" " * (width + 2),
                break_on_hyphens=False,
            )
        )
    print(f"(diffcurr-fast train NAME [--set ...] runs one; copy one from {recipes_dir()} to edit it)")
    return 0
