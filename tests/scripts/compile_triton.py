"""Compile every Triton kernel variant streamwatch launches for a CUDA target, without a GPU.

Started by ``tests/test_triton_compile.py`` as ``python compile_triton.py --arch 90`` in a process without
``TRITON_INTERPRET`` (the interpreter replaces ``triton.jit``, and the compiler needs the real thing).
Triton's compiler and the ``ptxas`` its wheel carries need no GPU: each variant goes from Python through
Triton's IR and PTX to a cubin for ``sm_<arch>``. Prints one JSON object: variant -> cubin bytes, or the
PTX lines of any floating-point atomic (the kernels must have none: determinism), or the error.
"""

from __future__ import annotations

import argparse
import json
import os

# Arguments by kernel, as ``streamwatch/_triton.py`` passes them: a pointer's dtype is the tensor's (``X`` is
# the summarised tensor's), integers are int32 unless Triton specialises them, bounds are float32.
SIGNATURES = {
    "flat_partials": {
        "x": "*X",
        "minus": "*X",
        "valid": "*i64",
        "n": "i32",
        "per_program": "i32",
        "partials": "*fp64",
        "first": "i32",
    },
    "tile_partials": {
        "x": "*X",
        "U": "i32",
        "P": "i32",
        "sb": "i32",
        "su": "i32",
        "sp": "i32",
        "per_split": "i32",
        "partials": "*fp64",
        "first": "i32",
        "counts": "*i32",
        "flags": "*i32",
        "bound_lo": "fp32",
        "bound_hi": "fp32",
        "tol_lo": "fp32",
        "tol_hi": "fp32",
    },
    "finalize": {"partials": "*fp64", "starts": "*i64", "lengths": "*i64", "out": "*fp64"},
}


_STRIDES = {"one position": (1, 1, 1), "positions contiguous": (7, 1, 64), "units contiguous": (1, 7, 64)}
"""A ``(su, sp, positions)`` of each layout, for ``_triton._tile`` (any other is "strided")."""


def tiles() -> list[tuple[int, int, int]]:
    """``_triton.TILES``' block shapes ``(units, positions)`` with the ``FOLD`` each layout takes (as
    ``_triton._tile`` gives it)."""
    from streamwatch import _triton

    found = set()
    for layout in _triton.TILES:
        su, sp, positions = _STRIDES.get(layout, (7, 7, 64))
        units, block_positions, _, fold = _triton._tile(su, sp, 64, positions)
        found.add((units, block_positions, fold))
    return sorted(found)


_NO_BOUNDS = {"HAS_LO": False, "HAS_HI": False, "BU": 32, "BP": 32, "FOLD": 2, "EVEN_U": False}


def variants() -> list[tuple[str, str, dict[str, object]]]:
    """``(kernel, element dtype, constexprs)`` of every variant: each dtype of each kernel, and every
    combination of flags the taps use."""
    out: list[tuple[str, str, dict[str, object]]] = []
    for dtype in ("fp32", "bf16", "fp16", "fp64"):
        wide = dtype == "fp64"
        out.append(("flat_partials", dtype, {"WIDE": wide, "PACKED": False, "DIFF": False, "BLOCK": 1024}))
        for bu, bp, fold in tiles():
            for even in (True, False):
                out.append(
                    (
                        "tile_partials",
                        dtype,
                        {"WIDE": wide, "UNITS": True, "BOUNDED": False, "HAS_LO": False, "HAS_HI": False}
                        | {"BU": bu, "BP": bp, "FOLD": fold, "EVEN_U": even},
                    )
                )
    for dtype in ("fp32", "fp64"):  # packs: float32, or float64 for float64 tensors
        for diff in (False, True):
            wide = dtype == "fp64"
            out.append(("flat_partials", dtype, {"WIDE": wide, "PACKED": True, "DIFF": diff, "BLOCK": 1024}))
    for lo, hi in ((True, True), (True, False), (False, True)):  # saturation bounds
        flags = {
            "WIDE": False,
            "UNITS": True,
            "BOUNDED": True,
            "HAS_LO": lo,
            "HAS_HI": hi,
            "BU": 32,
            "BP": 32,
            "FOLD": 1,
            "EVEN_U": True,
        }
        out.append(("tile_partials", "fp32", flags))
    out.append(("tile_partials", "fp32", {"WIDE": False, "UNITS": False, "BOUNDED": False} | _NO_BOUNDS))
    for ncol in (8, 9):
        out.append(("finalize", "fp64", {"NCOL": ncol, "BLOCK": 64}))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="the CUDA compute capability, e.g. 80, 90")
    args = parser.parse_args()
    assert os.environ.get("TRITON_INTERPRET") != "1", "run without TRITON_INTERPRET"
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from streamwatch import _triton_kernels

    target = GPUTarget("cuda", args.arch, 32)
    results: dict[str, object] = {}
    for name, dtype, constexprs in variants():
        signature = {k: v.replace("X", dtype) for k, v in SIGNATURES[name].items()}
        signature |= dict.fromkeys(constexprs, "constexpr")
        label = f"{name}[{dtype}, {', '.join(f'{k}={v}' for k, v in constexprs.items())}]"
        try:
            source = ASTSource(fn=getattr(_triton_kernels, name), signature=signature, constexprs=constexprs)
            compiled = triton.compile(source, target=target)
            ptx = compiled.asm["ptx"]
            floats = [line.strip() for line in ptx.splitlines() if "atom" in line and ".f" in line]
            results[label] = floats or len(compiled.asm["cubin"])
        except Exception as exc:  # reported, not raised: the test shows every failure at once
            results[label] = f"{type(exc).__name__}: {exc}"[:2000]
    print(json.dumps(results))


if __name__ == "__main__":
    main()
