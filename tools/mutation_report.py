"""Per-module mutation scores from a mutmut run (``make mutation``; docs/mutation.md).

Reads ``mutants/**/*.py.meta`` under the given directory (default: the current one), optionally restricted to mutant
names matching the fnmatch patterns in ``--patterns FILE`` (one per line), and prints per module: mutants checked,
killed (timeouts count as killed, as in mutmut), survived, and the score killed / (killed + survived); then every
survivor's name (``mutmut show NAME`` prints its diff).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
from collections import Counter
from pathlib import Path

KILLED = {1, 3, 24, -24, 152, 255, 36}  # mutmut's "killed" and "timeout" exit codes
SURVIVED = {0}


def scores(root: Path, patterns: list[str]) -> tuple[dict[str, Counter], list[str]]:
    per_module: dict[str, Counter] = {}
    survivors = []
    for meta in sorted(root.glob("mutants/**/*.py.meta")):
        module = meta.relative_to(root / "mutants").as_posix().removesuffix(".meta")
        for name, code in json.loads(meta.read_text())["exit_code_by_key"].items():
            if patterns and not any(fnmatch.fnmatch(name, p) for p in patterns):
                continue
            c = per_module.setdefault(module, Counter())
            if code in KILLED:
                c["killed"] += 1
            elif code in SURVIVED:
                c["survived"] += 1
                survivors.append(name)
            else:
                c["other"] += 1  # not checked, no tests, skipped, suspicious
    return per_module, survivors


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("root", nargs="?", default=".", help="directory holding mutants/ (default: .)")
    p.add_argument("--patterns", help="file of fnmatch patterns of mutant names, one per line")
    args = p.parse_args(argv)
    pats = [] if not args.patterns else [s for s in Path(args.patterns).read_text().split() if s]
    per_module, survivors = scores(Path(args.root), pats)
    print(f"{'module':42s} {'checked':>7s} {'killed':>6s} {'survived':>8s} {'score':>6s}")
    for module, c in per_module.items():
        checked = c["killed"] + c["survived"]
        score = f"{100 * c['killed'] / checked:5.1f}%" if checked else "   n/a"
        print(f"{module:42s} {checked:7d} {c['killed']:6d} {c['survived']:8d} {score}")
    if survivors:
        print("\nsurvivors:")
        print("\n".join(f"  {s}" for s in survivors))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
