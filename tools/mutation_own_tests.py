"""Check every mutant of one module against that module's own test files, one pytest process per mutant.

For modules whose functions every training run calls, ``mutmut run`` reruns every test that trains for each survivor
(docs/mutation.md, "Fifth run"). This runs each mutant of ``MODULE`` (``mutants/<MODULE>.meta`` of an earlier
``make mutation``, which generated them) with mutmut's ``MUTANT_UNDER_TEST`` switching it on in the mutated tree,
against only the given test files, stopping at the first failure. Prints the counts and writes every mutant's pytest
exit code (0: survived, 1: killed, "timeout") to ``--out``.

    python tools/mutation_own_tests.py diffcurr_fast/train/state.py tests/train/test_train_state.py --out state.json

``--fork`` (run from inside the mutated tree, with PYTHONPATH set to it) imports torch and the package once and forks
each mutant's pytest run; ``--covering`` then runs only the tests of the given files that call the mutated function.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm


def check(tree: Path, name: str, tests: list[str], timeout: float) -> int | str:
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1", MUTANT_UNDER_TEST=name)
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "no:xdist", *tests]
    try:
        return subprocess.run(cmd, cwd=tree, env=env, capture_output=True, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        return "timeout"


def covering(tree: Path, names: list[str], tests: list[str]) -> dict[str, list[str]]:
    """{mutant: the test ids of ``tests`` (files; other pytest arguments are kept) that call its function}, from
    the per-function test lists of mutmut's stats pass (``mutmut-stats.json``); [] for a function none of them calls."""
    data = json.loads((tree / "mutmut-stats.json").read_text())
    stats, durations = data["tests_by_mangled_function_name"], data.get("duration_by_test", {})
    files = [t for t in tests if not t.startswith("-") and Path(t).suffix == ".py"]
    rest = [t for t in tests if t not in files]
    out = {}
    for name in names:
        ids = [i for i in stats.get(name.rpartition("__mutmut_")[0], []) if i.split("::")[0] in files]
        ids.sort(key=lambda i: (durations.get(i, math.inf), i))  # the quickest first: a killed mutant stops early
        out[name] = [*ids, *rest] if ids else []
    return out


def check_forked(names: list[str], tests: list[str] | dict[str, list[str]], jobs: int, timeout: float):
    """``check`` of each name, from one process that imported torch and the package once: each mutant's pytest runs
    in a fork of it (mutmut's trampolines read ``MUTANT_UNDER_TEST`` at each call); ``tests`` may be per mutant
    (``covering``; a mutant with none gets "no tests"). Yields (name, code) as they end."""
    import signal

    import pytest
    import torch  # noqa: F401  (imported once, before the forks)

    import diffcurr_fast  # noqa: F401

    running: dict[int, str] = {}
    todo = list(names)
    while todo or running:
        while todo and len(running) < jobs:
            name = todo.pop(0)
            its = tests[name] if isinstance(tests, dict) else tests
            if not its:
                yield name, "no tests"
                continue
            pid = os.fork()
            if pid == 0:  # the child: one pytest run with the mutant on, killed by its own alarm
                os.environ["MUTANT_UNDER_TEST"] = name
                signal.alarm(int(timeout))
                fd = os.open(os.devnull, os.O_WRONLY)
                os.dup2(fd, 1), os.dup2(fd, 2)
                args = ["-q", "-x", "-p", "no:cacheprovider", "-p", "no:xdist", *its]
                os._exit(int(pytest.main(args)))
            running[pid] = name
        pid, status = os.wait()
        name = running.pop(pid)
        if os.WIFSIGNALED(status):
            yield name, "timeout" if os.WTERMSIG(status) == signal.SIGALRM else f"signal {os.WTERMSIG(status)}"
        else:
            yield name, os.WEXITSTATUS(status)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("module", help="the module's path, e.g. diffcurr_fast/train/state.py")
    p.add_argument("tests", nargs="+", help="test files (paths inside the mutated tree)")
    p.add_argument("--tree", default="mutants", help="the mutated tree of `make mutation` (default: mutants)")
    p.add_argument("--out", required=True, help="JSON file of mutant name -> exit code; a rerun skips those in it")
    p.add_argument("--jobs", type=int, default=2, help="processes at once (default 2)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a mutant may take (default 300)")
    p.add_argument(
        "--fork",
        action="store_true",
        help="import torch and the package once and fork a pytest run per mutant (no start-up per mutant); run it "
        "with PYTHONPATH set to the mutated tree, from inside it",
    )
    p.add_argument(
        "--covering",
        action="store_true",
        help="with --fork: each mutant against only the tests of the given files that call its function (mutmut's "
        "stats pass, mutmut-stats.json); a function none of them calls gets 'no tests'",
    )
    args = p.parse_args(argv)
    tree = Path(args.tree).resolve()
    meta = tree / f"{args.module}.meta"
    if not meta.is_file():
        p.error(f"{meta} not found: run `make mutation MUTANTS=...` for this module first")
    out = Path(args.out)
    done = json.loads(out.read_text()) if out.is_file() else {}
    if check(tree, "none", args.tests, args.timeout) != 0:  # a name of no mutant: the unmutated code
        p.error(f"the tests fail without any mutant: {' '.join(args.tests)}")
    names = [n for n in json.loads(meta.read_text())["exit_code_by_key"] if n not in done]
    if args.fork:
        if Path.cwd().resolve() != tree or os.environ.get("PYTHONPATH") != str(tree):
            p.error(f"--fork runs from inside the mutated tree: cd {tree} && PYTHONPATH={tree} python ...")
        tests = covering(tree, names, args.tests) if args.covering else args.tests
        results = check_forked(names, tests, args.jobs, args.timeout)
    else:
        ex = ThreadPoolExecutor(args.jobs)
        results = zip(names, ex.map(lambda n: check(tree, n, args.tests, args.timeout), names))
    for i, (name, rc) in enumerate(tqdm(results, total=len(names), desc=args.module, unit="mutant")):
        done[name] = rc
        if i % 10 == 9 or i == len(names) - 1:
            out.write_text(json.dumps(done, indent=1))
    c = Counter("survived" if v == 0 else "killed" if v == 1 else str(v) for v in done.values())
    print(f"{args.module}: {len(done)} mutants, " + ", ".join(f"{k} {v}" for k, v in sorted(c.items())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
