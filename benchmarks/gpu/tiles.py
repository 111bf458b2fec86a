"""The Triton summaries' block shapes on a GPU: time and GB/s per candidate, against one ``x.sum()``.

    PYTHONPATH=. python3 benchmarks/gpu/tiles.py --out OUT [--old FILE]

Each candidate of ``CANDIDATES`` (``(units, positions, warps)`` of ``tile_partials``' block, by layout;
``flat``: warps of ``flat_partials``; ``programs``: ``_triton._FLAT_PROGRAMS``, about how many programs
read one tensor, timed on every shape) summarises tensors the size of the GPT-2-sized model's and the
CNN's activations (``SHAPES``) through ``streamwatch._triton.Arena`` — one launch each, as on a sampled
step — timed with ``triton.testing.do_bench`` (L2 flushed between runs). ``--old FILE``: the same with
another copy of ``_triton_kernels.py`` (e.g. ``git show REV:streamwatch/_triton_kernels.py``), at
``_triton.TILES``' current values. The floor is ``x.sum()``, one read of the same bytes.

Writes ``tiles.json``: every timing, and ``best``: the fastest candidate per layout over its shapes — the
form ``run.py --tiles`` takes (which applies it to ``_triton.TILES`` before measuring). ``--dry-run``
(CI, under ``TRITON_INTERPRET=1 STREAMWATCH_KERNEL=triton``): CPU tensors 64 times smaller on each side,
two candidates per layout, timed once by the host clock — proof that the script runs, no timing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import types
from pathlib import Path
from typing import Any

import torch
from harness import load_kernels_file

from streamwatch import _triton

SHAPES: list[tuple[str, tuple[int, ...], torch.dtype, int | None]] = [
    ("gpt2 fc out [8,1024,3072] bf16, units last", (8, 1024, 3072), torch.bfloat16, 2),
    ("gpt2 ln out [8,1024,768] fp32, units last", (8, 1024, 768), torch.float32, 2),
    ("gpt2 fc out [8,1024,3072] bf16, units dim 1", (8, 1024, 3072), torch.bfloat16, 1),
    ("gpt2 logits [8,1024,50257] bf16, units dim 1", (8, 1024, 50257), torch.bfloat16, 1),
    ("cnn [64,64,32,32] bf16 NCHW, units dim 1", (64, 64, 32, 32), torch.bfloat16, 1),
    ("gpt2 fc grad [8,1024,3072] bf16, flat", (8, 1024, 3072), torch.bfloat16, None),
]
CANDIDATES: dict[str, list[tuple[int, int, int]]] = {  # (timed after the current setting, :func:`current`)
    "units contiguous": [(128, 8, 4), (64, 16, 8), (32, 32, 4), (128, 16, 8), (64, 32, 8)],
    "positions contiguous": [(8, 128, 8), (16, 128, 8), (4, 256, 4), (8, 256, 8), (2, 512, 4)],
    "flat": [(0, 0, 8), (0, 0, 16)],
    "programs": [(0, 0, 2048), (0, 0, 4096)],  # _FLAT_PROGRAMS, on every shape
}


def layout_of(shape: tuple[int, ...], unit_dim: int | None) -> str:
    if unit_dim is None:
        return "flat"
    return "units contiguous" if unit_dim == len(shape) - 1 else "positions contiguous"


class _Launcher:
    """Another copy's kernel, launched as ``kernel[grid](...)``: the keyword arguments it does not take
    (constexprs added since) are left out."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.names = set(fn.arg_names) | {"num_warps", "num_stages"}

    def __getitem__(self, grid: Any) -> Any:
        launch = self.fn[grid]
        return lambda *args, **kwargs: launch(*args, **{k: v for k, v in kwargs.items() if k in self.names})


class _Module:
    """A stand-in ``Kernels`` whose ``module`` is another copy of the kernels."""

    def __init__(self, module: Any) -> None:
        self.module = types.SimpleNamespace(
            **{
                name: _Launcher(getattr(module, name))
                for name in ("flat_partials", "tile_partials", "finalize")
            }
        )
        self.failed = None


def do_bench(fn: Any, warmup: int = 5, rep: int = 25) -> float:
    """``triton.testing.do_bench`` on a GPU (milliseconds, L2 flushed); on a CPU (``--dry-run``) one call
    timed by the host clock."""
    if torch.cuda.is_available():
        from triton.testing import do_bench as bench

        return float(bench(fn, warmup=warmup, rep=rep))
    start = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - start)


def time_one(kernels: Any, x: torch.Tensor, unit_dim: int | None) -> float:
    arena = _triton.Arena(kernels, x.device)

    def once() -> None:
        arena.reset()
        arena.summarize(x, unit_dim=unit_dim)

    return do_bench(once)


def current(layout: str) -> tuple[int, int, int]:
    """``layout``'s setting in ``streamwatch._triton`` now, as a candidate (see :data:`CANDIDATES`)."""
    if layout == "flat":
        return (0, 0, _triton._FLAT_WARPS)
    if layout == "programs":
        return (0, 0, _triton._FLAT_PROGRAMS)
    return _triton.TILES[layout]


def apply(layout: str, config: tuple[int, int, int]) -> None:
    """Set ``layout``'s candidate ``config`` in ``streamwatch._triton`` (``run.py --tiles`` too)."""
    if layout == "flat":
        _triton._FLAT_WARPS = config[2]
    elif layout == "programs":
        _triton._FLAT_PROGRAMS = config[2]
    else:
        _triton.TILES[layout] = config


def settings() -> dict[str, Any]:
    """Every setting :func:`apply` changes, as they are now."""
    return {
        "tiles": dict(_triton.TILES),
        "flat_warps": _triton._FLAT_WARPS,
        "programs": _triton._FLAT_PROGRAMS,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--old", type=Path, help="another _triton_kernels.py to time at the current TILES")
    parser.add_argument("--budget", type=float, default=120.0, help="seconds; later candidates skipped")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny tensors (TRITON_INTERPRET=1)")
    args = parser.parse_args()
    end = time.monotonic() + args.budget
    kernels = _triton.load()
    if kernels is None:
        raise SystemExit(f"tiles.py: the Triton kernels are not available: {_triton.status()}")
    dry = args.dry_run or not torch.cuda.is_available()
    device = torch.device("cpu" if dry else "cuda")
    shapes = [(n, _shrunk(shape) if dry else shape, dt, ud) for n, shape, dt, ud in SHAPES]
    candidates = {k: [current(k)] + [c for c in v if c != current(k)] for k, v in CANDIDATES.items()}
    if dry:
        candidates = {k: v[:2] for k, v in candidates.items()}
    saved = dict(_triton.TILES), _triton._FLAT_WARPS, _triton._FLAT_PROGRAMS
    result: dict[str, Any] = {"shapes": {}, "best": {}}
    tensors = {}
    for name, shape, dtype, _ in shapes:
        torch.manual_seed(0)
        x = torch.randn(shape, device=device).relu_().to(dtype)
        tensors[name] = x
        floor = do_bench(lambda x=x: x.sum())
        gb = x.numel() * x.element_size() / 1e9
        result["shapes"][name] = {
            "gb": gb,
            "floor_ms": floor,
            "floor_gbs": gb / max(floor, 1e-9) * 1e3,
            "runs": {},
        }
    if args.old is not None:
        old = _Module(load_kernels_file(args.old))
        for name, shape, _, unit_dim in shapes:
            ms = time_one(old, tensors[name], unit_dim)
            result["shapes"][name]["runs"]["old kernels, " + str(_tile_now(shape, unit_dim))] = ms
    totals: dict[str, dict[str, float]] = {}
    for layout, configs in candidates.items():
        for config in configs:
            if time.monotonic() > end:
                result.setdefault("skipped", []).append(f"{layout} {config}")
                continue
            apply(layout, config)
            total = 0.0
            for name, shape, _, unit_dim in shapes:
                if layout != "programs" and layout_of(shape, unit_dim) != layout:
                    continue
                ms = time_one(kernels, tensors[name], unit_dim)
                label = f"programs {config[2]}" if layout == "programs" else str(config)
                result["shapes"][name]["runs"][label] = ms
                total += ms
            totals.setdefault(layout, {})[str(config)] = total
            _triton.TILES.clear()
            _triton.TILES.update(saved[0])
            _triton._FLAT_WARPS, _triton._FLAT_PROGRAMS = saved[1], saved[2]
            print(f"[tiles] {layout} {config}: {total:.3f} ms", file=sys.stderr, flush=True)
    for layout, found in totals.items():
        best = min(found, key=found.__getitem__)
        result["best"][layout] = json.loads(best.replace("(", "[").replace(")", "]"))
    result["totals_ms"] = totals
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tiles.json").write_text(json.dumps(result, indent=1))
    for name, r in result["shapes"].items():
        runs = ", ".join(f"{c} {ms:.3f} ({r['gb'] / ms * 1e3:.0f} GB/s)" for c, ms in r["runs"].items())
        print(f"{name}: floor {r['floor_ms']:.3f} ms ({r['floor_gbs']:.0f} GB/s); {runs}")
    print("best:", result["best"])
    return 0


def _shrunk(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(max(1, side // 64) for side in shape)


def _tile_now(shape: tuple[int, ...], unit_dim: int | None) -> tuple[int, int, int] | str:
    layout = layout_of(shape, unit_dim)
    return f"flat warps {_triton._FLAT_WARPS}" if layout == "flat" else _triton.TILES[layout]


if __name__ == "__main__":
    sys.exit(main())
