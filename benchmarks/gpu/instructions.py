"""The Triton summaries' main loops in machine code, without a GPU: instructions per element read.

    python3 benchmarks/gpu/instructions.py [--old FILE] [--arch 90]

Compiles ``tile_partials`` and ``flat_partials`` as a sampled step launches them on the tensors that cost
the most (a bfloat16 activation, units contiguous or positions contiguous; a contiguous bfloat16
gradient), specialised as Triton specialises them at a launch (a stride of 1 a constant, pointers and
sizes divisible by 16), for ``sm_<arch>`` with the ``ptxas`` and ``nvdisasm`` Triton's wheel carries (no
GPU, no CUDA install). From the SASS it takes the first loop (the main loop: the code between the first
backward branch and its target) and prints its instructions per element each thread reads, by kind.
``--old FILE``: the same for another copy of ``_triton_kernels.py`` (``git show
REV:streamwatch/_triton_kernels.py > FILE``), side by side.

A count, not a timing: where the kernels are bound by instruction issue rather than by memory (an H200
reads bfloat16 faster than ten statistics per element can be issued), fewer instructions per element is
the change a GPU run then times (``tiles.py --old``). Run without ``TRITON_INTERPRET`` (the interpreter
replaces the compiler). Prints a Markdown table; ``--json FILE`` writes the counts.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "scripts"))

from compile_triton import SIGNATURES  # noqa: E402
from harness import load_kernels_file  # noqa: E402

_NO_BOUNDS = {"BOUNDED": False, "HAS_LO": False, "HAS_HI": False}
CASES: list[tuple[str, str, dict[str, Any], int]] = [
    # (label, kernel, constexprs incl. the stride Triton makes constant, warps)
    (
        "tile, units contiguous (64×16), bf16",
        "tile_partials",
        {"WIDE": False, "UNITS": True, **_NO_BOUNDS, "BU": 64, "BP": 16, "FOLD": 1, "EVEN_U": True, "su": 1},
        4,
    ),
    (
        "tile, positions contiguous (8×128), bf16",
        "tile_partials",
        {"WIDE": False, "UNITS": True, **_NO_BOUNDS, "BU": 8, "BP": 128, "FOLD": 2, "EVEN_U": True, "sp": 1},
        4,
    ),
    (
        "flat, 1024 per block, bf16",
        "flat_partials",
        {"WIDE": False, "PACKED": False, "DIFF": False, "BLOCK": 1024},
        4,
    ),
    (
        "flat, pack of updates (after − before), fp32",
        "flat_partials",
        {"WIDE": False, "PACKED": True, "DIFF": True, "BLOCK": 1024},
        4,
    ),
]
_DTYPE = {"tile_partials": "bf16", "flat_partials": "bf16"}
_DIVISIBLE = {
    "x",
    "minus",
    "partials",
    "counts",
    "flags",
    "valid",
    "sb",
    "su",
    "sp",
    "U",
    "P",
    "per_split",
    "per_program",
    "n",
}
_INSTRUCTION = re.compile(r"^\S*\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(\.[A-Z0-9_.]+)?\s")


def load_kernels(path: Path | None) -> Any:
    if path is None:
        from streamwatch import _triton_kernels

        return _triton_kernels
    return load_kernels_file(path)


def compiled(kernels: Any, kernel: str, constexprs: dict[str, Any], warps: int, arch: int) -> Any:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(kernels, kernel)
    constexprs = {k: v for k, v in constexprs.items() if k in fn.arg_names}  # (an older copy has fewer)
    dtype = "fp32" if constexprs.get("PACKED") else _DTYPE[kernel]
    signature = {k: v.replace("X", dtype) for k, v in SIGNATURES[kernel].items()}
    signature |= dict.fromkeys(constexprs, "constexpr")
    attrs = {
        (fn.arg_names.index(name),): [["tt.divisibility", 16]]
        for name in signature
        if name in _DIVISIBLE and name not in constexprs
    }
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})


def registers(cubin: bytes) -> int:
    """Registers per thread of a cubin's kernel (``cuobjdump --dump-resource-usage``, from Triton's wheel)."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True)
    found = re.search(r"REG:(\d+)", out.stdout)
    if found is None:
        raise ValueError(f"no register count in cuobjdump's output: {out.stdout[-500:]} {out.stderr[-500:]}")
    return int(found.group(1))


def warps_per_sm(regs: int, warps: int) -> int:
    """Warps an SM of compute capability 9.0 holds at once for a kernel of ``regs`` registers per thread
    and ``warps`` warps per program (64 K registers, allocated 8 per thread at a time; 64 warps at most):
    what bounds the loads in flight."""
    per_program = -(-regs // 8) * 8 * 32 * warps
    return min(64, (65536 // per_program) * warps)


def main_loop(sass: str) -> list[str]:
    """The instructions of the first loop: from the label the first backward branch jumps to, to it."""
    lines = [line.strip() for line in sass.splitlines()]
    labels: dict[str, int] = {}
    for i, line in enumerate(lines):
        if re.fullmatch(r"\.?L\w+:", line):
            labels[line.rstrip(":")] = i
        match = re.search(r"\bBRA\s+(\.?L\w+)", line)
        if match and match.group(1) in labels:
            return [x for x in lines[labels[match.group(1)] + 1 : i + 1] if _INSTRUCTION.match(x)]
    raise ValueError("no backward branch in the SASS")


def kind(line: str) -> str:
    match = _INSTRUCTION.match(line)
    assert match is not None
    op = match.group(2)
    if op.startswith("LD"):
        return "loads"
    if op in ("FADD", "FMUL", "FFMA", "FMNMX", "HADD2", "HMUL2", "HFMA2") or op.startswith("F2F"):
        return "float math"
    if op in ("FSETP", "ISETP", "PLOP3", "P2R", "R2P") or op.startswith("SEL") or op == "FSEL":
        return "compare/select"
    if op in ("IADD3", "IMAD", "LEA", "SHF", "LOP3", "IMNMX", "VIMNMX", "MOV", "PRMT") or op.startswith(
        "IMAD"
    ):
        return "integer/address"
    return "other"


def count(kernels: Any, arch: int) -> dict[str, dict[str, Any]]:
    out = {}
    for label, kernel, constexprs, warps in CASES:
        done = compiled(kernels, kernel, constexprs, warps, arch)
        loop = main_loop(str(done.asm["sass"]))
        regs = registers(done.asm["cubin"])
        block = constexprs.get("BLOCK") or constexprs["BU"] * constexprs["BP"]
        per_thread = block / (32 * warps)
        kinds = collections.Counter(kind(line) for line in loop)
        out[label] = {
            "instructions": len(loop),
            "elements_per_thread": per_thread,
            "per_element": len(loop) / per_thread,
            "by_kind_per_element": {k: n / per_thread for k, n in sorted(kinds.items())},
            "registers": regs,
            "warps_per_sm": warps_per_sm(regs, warps),
        }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", type=Path, help="another _triton_kernels.py, counted beside this one")
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--json", type=Path, help="write the counts here")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("instructions.py: run without TRITON_INTERPRET=1 (it compiles the kernels)")
    if not (os.environ.get("TRITON_CACHE_DIR") or os.environ.get("TRITON_HOME")):
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="streamwatch-instructions-")  # (not ~)
    result = {"this": count(load_kernels(None), args.arch)}
    if args.old is not None:
        result["old"] = count(load_kernels(args.old), args.arch)
    print(
        f"Main loop of each kernel, SASS for sm_{args.arch}: instructions per element a thread reads; "
        "registers per thread and the warps an SM holds at once (of 64)\n"
    )
    head = "| kernel | " + ("old | " if "old" in result else "") + "this | this, by kind |"
    print(head)
    print("| --- | " + ("--- | " if "old" in result else "") + "--- | --- |")

    def cell(found: dict[str, Any]) -> str:
        return f"{found['per_element']:.1f}; {found['registers']} reg, {found['warps_per_sm']} warps"

    for label in result["this"]:
        this = result["this"][label]
        old = f" {cell(result['old'][label])} |" if "old" in result else ""
        kinds = ", ".join(f"{k} {n:.1f}" for k, n in this["by_kind_per_element"].items())
        print(f"| {label} |{old} {cell(this)} | {kinds} |")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
