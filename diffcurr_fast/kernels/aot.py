"""Ahead-of-time compilation of every Triton kernel for NVIDIA GPUs, on any machine (no GPU needed).

Each kernel module lists the launches its launcher can make in ``aot_launches()``, next to the launcher and
built from the same block-size tables. This module compiles them with the real Triton pipeline (TTIR, TTGIR,
LLVM IR, PTX and a cubin through the ``ptxas`` the wheel ships) and reads the resources from ptxas' report.
It must run without ``TRITON_INTERPRET=1`` (the interpreter replaces ``@triton.jit``):

    python -m diffcurr_fast.kernels.aot [--arch 80 90] [--json out.json] [--fast]

Results are cached per compiled source (``~/.cache/diffcurr_fast/aot``), so a second run is quick.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import io
import json
import multiprocessing as mp
import os
import re
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace

ARCHS = (80, 90)
DTYPES = ("fp32", "bf16", "fp16")  # the kernel dtypes the ops accept (diffcurr_fast.ops._common.KERNEL_DTYPES)
CACHE_DIR = os.environ.get("DIFFCURR_AOT_CACHE") or os.path.join(
    os.path.expanduser("~"), ".cache", "diffcurr_fast", "aot"
)
MODULES = (
    "philox",
    "q_sample",
    "diffusion_loss",
    "sample_timesteps",
    "adaln",
    "rmsnorm_modulate",
    "qk_norm_rope",
    "swiglu",
    "token_route",
)


@dataclass(frozen=True)
class Launch:
    """One specialisation a launcher can make: argument types, constexprs and launch options.

    ``args`` maps each runtime argument to its Triton type (``*fp32``, ``i32``, ``i64``, ``fp32``); pointers
    are 16-byte aligned (torch allocations are) and the ints named in ``multiple_of_16`` are, as the runtime
    specialises them for the sizes of a typical launch. ``streaming`` marks a memory-bound kernel whose global
    loads must be vectorised.
    """

    kernel: object
    args: dict[str, str]
    constexprs: dict[str, object]
    num_warps: int = 4
    num_stages: int = 3
    multiple_of_16: tuple[str, ...] = ()
    streaming: bool = False
    label: str = field(default="")

    @property
    def name(self) -> str:
        return _jit_fn(self.kernel).__name__

    def describe(self) -> str:
        types = sorted({t.lstrip("*") for n, t in self.args.items() if t.startswith("*") and not _aux(n)})
        cx = ",".join(f"{k}={v}" for k, v in self.constexprs.items())
        return f"{self.name}[{'/'.join(types)}; {cx}; warps={self.num_warps}{'; ' + self.label if self.label else ''}]"


def _aux(name: str) -> bool:  # per-sample / statistics pointers, float32 whatever the data dtype
    return name in ("a_ptr", "c_ptr", "p_ptr", "q_ptr", "w_ptr", "partial_ptr", "mean_ptr", "rstd_ptr")


def _jit_fn(kernel):
    # optional dependency (triton), imported when compiling
    from triton.runtime.jit import JITFunction

    while not isinstance(kernel, JITFunction):  # Autotuner / Heuristics -> JITFunction
        kernel = kernel.fn
    return kernel


def autotune_configs(kernel) -> list:
    """The configs of an ``@triton.autotune`` kernel (one plain config for a bare ``@triton.jit``)."""
    return list(getattr(kernel, "configs", None) or [None])


def launches(fast: bool = False) -> list[Launch]:
    """Every launch of every kernel module (``fast``: fp32 and bf16, one config per kernel and flags)."""
    out = []
    for name in MODULES:
        mod = importlib.import_module(f"diffcurr_fast.kernels.{name}")
        table = mod.aot_launches(("fp32", "bf16") if fast else DTYPES, fast=fast)
        out.extend(table)
        if not fast:  # the runtime turns an int argument equal to 1 into a constant (e.g. M = 1, N = 1)
            out.extend(_ones(la) for la in {la.name: la for la in reversed(table)}.values())
    return out


def _ones(launch: Launch) -> Launch:
    """``launch`` with every specialisable int argument equal to 1, as the runtime compiles it then."""
    fn = _jit_fn(launch.kernel)
    keep = {fn.arg_names[i] if isinstance(i, int) else i for i in getattr(fn, "do_not_specialize", ())}
    ones = [a for a, t in launch.args.items() if t in ("i32", "i64") and a not in keep]
    return replace(
        launch,
        args={a: t for a, t in launch.args.items() if a not in ones},
        constexprs={**launch.constexprs, **dict.fromkeys(ones, 1)},
        multiple_of_16=tuple(a for a in launch.multiple_of_16 if a not in ones),
        streaming=False,  # rows of one element cannot vectorise
        label="int args = 1",
    )


def untested_configs(table: list[Launch]) -> list[str]:
    """Autotune configs of the kernels in ``table`` that no launch compiles (the table must cover them all)."""
    out = []
    for kernel in {id(la.kernel): la.kernel for la in table}.values():
        mine = [la for la in table if la.kernel is kernel]
        for cfg in autotune_configs(kernel):
            if cfg is None:
                continue
            if not any(la.num_warps == cfg.num_warps and cfg.kwargs.items() <= la.constexprs.items() for la in mine):
                out.append(f"{mine[0].name}: autotune config {cfg.kwargs} num_warps={cfg.num_warps} is not compiled")
    return out


def _source(launch: Launch):
    # optional dependency (triton), imported when compiling
    import triton

    fn = _jit_fn(launch.kernel)
    sig = dict(launch.args)
    for k in launch.constexprs:
        sig[k] = "constexpr"
    missing = [a for a in fn.arg_names if a not in sig]
    if missing:
        raise ValueError(f"{launch.name}: launch table lacks arguments {missing}")
    sig = {a: sig[a] for a in fn.arg_names}
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, a in enumerate(fn.arg_names)
        if sig[a] != "constexpr" and (sig[a].startswith("*") or a in launch.multiple_of_16)
    }
    return triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=dict(launch.constexprs), attrs=attrs)


_RESULTS_VERSION = 3  # bump when what is measured changes (invalidates the cache)
_PTXAS = {
    "regs": re.compile(r"Used (\d+) registers"),
    "stack": re.compile(r"(\d+) bytes stack frame"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
}
# Data loads; ``ld.global.nc`` are libdevice's constant tables (the trig argument reduction), not data.
_LD = re.compile(r"^\s*(?:@%p\d+\s+)?ld\.global(?!\.nc)((?:\.[A-Za-z0-9_:]+)*)\s", re.M)


def _load_stats(ptx: str) -> tuple[int, int, int, int]:
    """(vector loads, scalar loads, vector bytes, scalar bytes) of the global data loads in ``ptx``."""
    nv = ns = bv = bs = 0
    for (mods,) in (m.groups() for m in _LD.finditer(ptx)):
        parts = mods.split(".")
        lanes = next((int(p[1:]) for p in parts if re.fullmatch(r"v\d", p)), 1)
        bits = next((int(p[1:]) for p in parts if re.fullmatch(r"[bfsu]\d+", p)), 32)
        if lanes > 1:
            nv, bv = nv + 1, bv + lanes * bits // 8
        else:
            ns, bs = ns + 1, bs + bits // 8
    return nv, ns, bv, bs


def compile_launch(launch: Launch, arch: int) -> dict:
    """Compile ``launch`` for sm_``arch``; returns its resources (registers, spills, shared memory, loads)."""
    # optional dependency (triton), imported when compiling
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget

    src = _source(launch)
    key = hashlib.sha256(
        f"{src.hash()}-{arch}-{launch.num_warps}-{launch.num_stages}-{triton.__version__}-{_RESULTS_VERSION}".encode()
    ).hexdigest()[:32]
    path = os.path.join(CACHE_DIR, f"{key}.json")
    if os.path.exists(path):
        with open(path) as f:
            res = json.load(f)
        res.update(kernel=launch.name, launch=launch.describe(), streaming=launch.streaming)
        return res
    log = io.StringIO()
    with tempfile.TemporaryDirectory() as tmp:
        old_dir, old_dump = knobs.cache.dir, knobs.nvidia.dump_ptxas_log
        knobs.cache.dir, knobs.nvidia.dump_ptxas_log = tmp, True  # fresh compile, so ptxas reports
        try:
            with contextlib.redirect_stdout(log):
                ck = triton.compile(
                    src,
                    target=GPUTarget("cuda", arch, 32),
                    options={"num_warps": launch.num_warps, "num_stages": launch.num_stages},
                )
        finally:
            knobs.cache.dir, knobs.nvidia.dump_ptxas_log = old_dir, old_dump
    text = log.getvalue()
    res = {}
    for k, rx in _PTXAS.items():
        m = rx.search(text)
        if m is None:
            raise RuntimeError(f"{launch.describe()} sm_{arch}: no '{k}' in the ptxas report:\n{text}")
        res[k] = int(m.group(1))
    ptx = ck.asm["ptx"]
    res["shared"] = int(ck.metadata.shared)
    res["ld_vec"], res["ld_scalar"], res["ld_vec_bytes"], res["ld_scalar_bytes"] = _load_stats(ptx)
    res["cubin_bytes"] = len(ck.asm["cubin"])
    res["arch"], res["streaming"] = arch, launch.streaming
    try:  # the cache is an optimisation: an unwritable home only costs the recompile
        os.makedirs(CACHE_DIR, exist_ok=True)
        tmp_path = f"{path}.{os.getpid()}.tmp"
        with open(tmp_path, "w") as f:
            json.dump(res, f)
        os.replace(tmp_path, path)
    except OSError:
        pass
    res.update(kernel=launch.name, launch=launch.describe())
    return res


def _work(item: tuple[int, int, bool]) -> dict:
    index, arch, fast = item
    launch = launches(fast)[index]
    try:
        return compile_launch(launch, arch)
    except Exception as exc:  # reported per launch; the caller fails on any
        return {
            "kernel": launch.name,
            "launch": launch.describe(),
            "arch": arch,
            "error": f"{type(exc).__name__}: {exc}",
        }


def compile_all(archs=ARCHS, fast: bool = False, jobs: int | None = None) -> list[dict]:
    """Compile every launch for every arch (in ``jobs`` processes); one result dict per (launch, arch)."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise RuntimeError("AOT compilation needs the real Triton compiler: unset TRITON_INTERPRET")
    # optional dependency (triton), imported when compiling
    import triton

    if not hasattr(triton, "knobs"):  # the kernels themselves run on Triton >= 3.0; this tool reads ptxas via knobs
        raise RuntimeError(f"AOT compilation needs Triton >= 3.4 (triton.knobs), found {triton.__version__}")
    items = [(i, arch, fast) for i in range(len(launches(fast))) for arch in archs]
    jobs = jobs or min(len(items), os.cpu_count() or 1)
    if jobs <= 1:
        return [_work(it) for it in items]
    with ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) as pool:
        return list(pool.map(_work, items, chunksize=4))


def problems(results: list[dict]) -> list[str]:
    """Failures: a compile error, spilled registers or a stack frame, a streaming kernel whose global loads (per
    thread, in the PTX) are under two thirds vector loads by bytes (the rest: per-sample and per-row values)."""
    out = []
    for r in results:
        where = f"{r['launch']} sm_{r['arch']}"
        if "error" in r:
            out.append(f"{where}: {r['error']}")
            continue
        if r["spill_stores"] or r["spill_loads"] or r["stack"]:
            out.append(
                f"{where}: spills ({r['spill_stores']} B stores, {r['spill_loads']} B loads, {r['stack']} B stack)"
            )
        if r["streaming"] and r["ld_vec_bytes"] < 2 * r["ld_scalar_bytes"]:
            out.append(
                f"{where}: {r['ld_scalar']} scalar loads ({r['ld_scalar_bytes']} B) against {r['ld_vec']} vector "
                f"loads ({r['ld_vec_bytes']} B): under two thirds of the loaded bytes are vectorised"
            )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, nargs="+", default=list(ARCHS))
    ap.add_argument("--fast", action="store_true", help="fp32/bf16 and one config per kernel")
    ap.add_argument("--jobs", type=int, default=None)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    results = compile_all(tuple(args.arch), args.fast, args.jobs)
    if args.json:  # written whole, then renamed into place (layer 0: _files.write_json is beside it, not below)
        with open(f"{args.json}.tmp", "w") as f:
            json.dump(results, f, indent=1)
        os.replace(f"{args.json}.tmp", args.json)
    bad = problems(results) + ([] if args.fast else untested_configs(launches()))
    print(f"{len(results)} compiles, {len(bad)} problems")
    for p in bad:
        print("  " + p)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
