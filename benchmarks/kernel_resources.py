"""Per-kernel GPU resources of every Triton and CUDA kernel, compiled ahead of time (no GPU needed).

Triton: every launch of ``diffcurr_fast.kernels.aot`` (dtypes, autotune configs, tiles) for sm_80 and sm_90.
CUDA: ``csrc/cuda/kernels.cu`` with ``nvcc --resource-usage`` (the flags setup.py uses) for sm_80 and sm_90.
Reports registers, shared memory, spill / stack bytes and, from the PTX, vector (``ld.global.v2/.v4``) against
scalar global loads, then rewrites the table in docs/ops.md between its markers. Exits non-zero when a kernel
spills or a streaming Triton kernel does not vectorise.

    python benchmarks/kernel_resources.py [--no-write] [--fast]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "ops.md"
BEGIN, END = "<!-- kernel-resources:begin -->", "<!-- kernel-resources:end -->"
ARCHS = (80, 90)


def triton_rows(fast: bool) -> tuple[list[str], list[str]]:
    """Markdown rows (one per kernel and arch, summarising its launches) and the problems found."""
    os.environ.pop("TRITON_INTERPRET", None)
    from diffcurr_fast.kernels import aot

    results = aot.compile_all(ARCHS, fast=fast)
    problems = aot.problems(results)
    groups = defaultdict(list)
    for r in results:
        if "error" not in r:
            groups[(r["kernel"], r["arch"])].append(r)
    rows = []
    for (kernel, arch), rs in sorted(groups.items()):
        regs = sorted(r["regs"] for r in rs)
        ld = [r for r in rs if r["streaming"]] or rs  # loads: the size-1 specialisations cannot vectorise
        share = min(r["ld_vec_bytes"] / max(1, r["ld_vec_bytes"] + r["ld_scalar_bytes"]) for r in ld)
        rows.append(
            f"| `{kernel}` | sm_{arch} | {len(rs)} | {regs[0]}-{regs[-1]} | {max(r['shared'] for r in rs)} | "
            f"{sum(r['spill_stores'] + r['spill_loads'] for r in rs)} | {max(r['stack'] for r in rs)} | "
            f"{min(r['ld_vec'] for r in ld)}-{max(r['ld_vec'] for r in ld)} | "
            f"{min(r['ld_scalar'] for r in ld)}-{max(r['ld_scalar'] for r in ld)} | {share:.0%} |"
        )
    return rows, problems


def _nvcc_flags() -> list[str]:
    import torch.utils.cpp_extension as cpp_ext

    return ["-std=c++20", "-O3", f"-I{ROOT / 'csrc'}"] + [f"-I{p}" for p in cpp_ext.include_paths()]


_ENTRY = re.compile(r"Compiling entry function '(\w+)' for 'sm_(\d+)'")
_PROPS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def _short(mangled: str) -> str:
    """``loss_kernel<CBF16, CF32, true, false>`` from the mangled name."""
    name = subprocess.run(["c++filt", mangled], capture_output=True, text=True).stdout.strip() or mangled
    name = name.replace("(anonymous namespace)::", "").replace("dcf::cuda::", "").replace("void ", "")
    return name[: name.index("(")] if "(" in name else name


def _ptx_loads(ptx: str) -> dict[str, tuple[int, int]]:
    out = {}
    for m in re.finditer(r"\.entry\s+(\w+)\s*\((.*?)^\}", ptx, re.S | re.M):
        body = m.group(2)
        vec = len(re.findall(r"ld\.global(?:\.[a-z0-9:]+)*\.v[24]\.", body))
        allld = len(re.findall(r"ld\.global[.\s]", body))
        out[m.group(1)] = (vec, allld - vec)
    return out


def cuda_rows() -> tuple[list[str], list[str]]:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return ["| (nvcc not found: CUDA kernels not compiled) | | | | | | | | |"], []
    rows, problems = [], []
    src = ROOT / "csrc" / "cuda" / "kernels.cu"
    for arch in ARCHS:
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [
                nvcc,
                "-c",
                *_nvcc_flags(),
                f"-arch=sm_{arch}",
                "--resource-usage",
                "--keep",
                "--keep-dir",
                tmp,
                str(src),
                "-o",
                os.path.join(tmp, "k.o"),
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                problems.append(f"nvcc sm_{arch} failed:\n{proc.stderr[-3000:]}")
                continue
            ptx = "".join(p.read_text() for p in Path(tmp).glob("*.ptx"))
        loads = _ptx_loads(ptx)
        log = proc.stdout + proc.stderr
        groups = defaultdict(list)
        for block in log.split("Compiling entry function")[1:]:
            block = "Compiling entry function" + block
            name = _ENTRY.search(block).group(1)
            stack, st, ld = map(int, _PROPS.search(block).groups())
            used = _USED.search(block)
            vec, scalar = loads.get(name, (0, 0))
            short = _short(name)
            groups[short.split("<")[0]].append(
                (int(used.group(1)), int(used.group(2) or 0), st + ld, stack, vec, scalar)
            )
            if st or ld or stack:
                problems.append(f"CUDA {short} sm_{arch}: {st} B spill stores, {ld} B loads, {stack} B stack")
        for kernel, rs in sorted(groups.items()):
            col = list(zip(*rs))
            rows.append(
                f"| `{kernel}` | sm_{arch} | {len(rs)} | {min(col[0])}-{max(col[0])} | {max(col[1])} | {sum(col[2])} | "
                f"{max(col[3])} | {min(col[4])}-{max(col[4])} | {min(col[5])}-{max(col[5])} |"
            )
    return rows, problems


def table(fast: bool) -> tuple[str, list[str]]:
    trows, tprob = triton_rows(fast)
    crows, cprob = cuda_rows()
    text = "\n".join(
        [
            BEGIN,
            "Generated by `python benchmarks/kernel_resources.py` (ahead-of-time compiles, no GPU needed). Loads",
            "are static counts per thread in the PTX; `vector share` is the smallest share of loaded bytes that",
            "moves in `ld.global.v2/.v4` over a kernel's launches (the rest are per-sample or per-row values;",
            "the launches with every int argument equal to 1, which the runtime compiles for size-1 dimensions,",
            "count for registers and spills only).",
            "",
            "Triton (every dtype, autotune config and tile of the launch tables in `diffcurr_fast/kernels/*.py`):",
            "",
            "| kernel | arch | launches | registers | shared B | spill B | stack B | vector loads | scalar loads "
            "| vector share |",
            "|---|---|---|---|---|---|---|---|---|---|",
            *trows,
            "",
            "CUDA (`csrc/cuda/kernels.cu`, `nvcc -O3 --resource-usage`, every template instance):",
            "",
            "| kernel | arch | instances | registers | shared B | spill B | stack B | vector loads | scalar loads |",
            "|---|---|---|---|---|---|---|---|---|",
            *crows,
            END,
        ]
    )
    return text, tprob + cprob


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-write", action="store_true", help="print the table instead of updating docs/ops.md")
    ap.add_argument("--fast", action="store_true", help="Triton: fp32/bf16 and one config per kernel")
    args = ap.parse_args(argv)
    text, problems = table(args.fast)
    if args.no_write:
        print(text)
    else:
        doc = DOC.read_text()
        if BEGIN in doc:
            doc = doc[: doc.index(BEGIN)] + text + doc[doc.index(END) + len(END) :]
        else:
            doc = doc.rstrip("\n") + "\n\n## Kernel resources (sm_80, sm_90)\n\n" + text + "\n"
        DOC.write_text(doc)
        print(f"wrote the kernel resource table into {DOC.relative_to(ROOT)}")
    for p in problems:
        print("PROBLEM " + p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
