"""The GPU check in one script: environment, CUDA tests, launch counts, overhead ratios, a compiled model.

    python3 setup.py build_ext --inplace -q
    PYTHONPATH=. python3 benchmarks/gpu/run.py --out OUT        (make bench-gpu GPU_OUT=OUT)
    PYTHONPATH=. python3 benchmarks/gpu/run.py --out OUT --dry-run   (make bench-gpu DRY_RUN=1: CPU, tiny)

Sections, in order, each with its own time budget in seconds (``SECTIONS``: 355 in all, aimed at 330 with
``--budget``: a section keeps at least its own budget and gets what the earlier ones left unused) and each
isolated: an exception is recorded with its traceback and the next section runs; work that would overrun
is left out and recorded as ``"skipped: time budget"``:

1. ``environment`` (15): versions, the GPU, ``streamwatch._kernel.status()`` and, where the module
   exists, ``streamwatch._triton.status()`` under each kernel route;
2. ``cuda_tests`` (120: three of its tests compile with Inductor): ``pytest -q --maxfail=5
   tests/test_cuda.py tests/test_triton.py`` (the files that exist) in a child process killed at its
   budget; counts and outcomes from its JUnit XML, the output's tail;
3. ``launches`` (40): ``launches.py``, kernel launches a sampled and an unsampled step add, both routes;
4. ``overhead`` (130): ``overhead.py``, interleaved ratios of every variant to the unmonitored step;
5. ``compiled`` (50): ``compiled.py``, graph breaks and compile time of an observed compiled model.

Models (``workloads.py``): bench_cuda.py's MLP, CNN and transformer, and a GPT-2-small-sized decoder
(12 layers, d 768, 12 heads, batch 8 × 1024 tokens, vocabulary 50257, bf16 autocast, fused AdamW).

Writes to ``--out``: ``results.json`` (rewritten after every section and every model, so a killed run
leaves what it measured), ``results.md`` (the same as Markdown tables) and ``log.txt`` (the progress
lines). ``--dry-run`` runs every section's code on the CPU at toy sizes with one step per variant and
``pytest --co``: CI's proof that the script runs (exit 1 when any part failed or was skipped).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_cuda, bench_observe
sys.path.insert(0, str(Path(__file__).resolve().parent))

import compiled
import launches
import overhead
import tables
import tiles
import torch
from harness import SKIPPED, Budget, Recorder, run_child, tail
from workloads import KERNEL_ENV, kernel_route, workloads

import streamwatch as sw

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SECTIONS = {"environment": 15, "cuda_tests": 120, "launches": 40, "overhead": 130, "compiled": 50}
"""Each section's budget in seconds; the whole run's is ``--budget`` (330 on a GPU)."""
LEAST = {"compiled": 20.0}  # a section with less time than this left is skipped (others: 3 s)
TEST_FILES = ("tests/test_cuda.py", "tests/test_triton.py")
PACKAGES = (
    "numpy",
    "pytest",
    "pytest-timeout",
    "pytest-benchmark",
    "hypothesis",
    "prometheus_client",
    "anyio",
)


class Results:
    """The results dictionary and its files: rewritten whole (through a temporary name) on every save."""

    def __init__(self, out: Path, meta: dict[str, Any]) -> None:
        self.out = out
        self.data: dict[str, Any] = {"meta": meta, "sections": {}}
        self.started = time.monotonic()
        out.mkdir(parents=True, exist_ok=True)
        (out / "log.txt").write_text("")

    def log(self, line: str) -> None:
        stamped = f"[{time.monotonic() - self.started:6.1f}s] {line}"
        print(stamped, flush=True)
        with (self.out / "log.txt").open("a") as f:
            f.write(stamped + "\n")

    def save(self) -> None:
        self.data["meta"]["wall_s"] = round(time.monotonic() - self.started, 1)
        self.data["meta"]["problems"] = problems(self.data["sections"])
        self._write("results.json", json.dumps(clean(self.data), indent=1, default=str) + "\n")
        try:
            self._write("results.md", tables.render(clean(self.data)))
        except Exception:
            self._write(
                "results.md", f"# GPU check\n\nrendering failed:\n\n```\n{traceback.format_exc()}```\n"
            )

    def _write(self, name: str, text: str) -> None:
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=self.out)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, self.out / name)


def clean(value: Any) -> Any:
    """JSON without NaN or infinities (None instead)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [clean(v) for v in value]
    return value


def problems(value: Any, path: str = "") -> list[str]:
    """Where the results hold an error or a skip, as dotted paths."""
    if isinstance(value, str):
        return [path] if value.startswith(SKIPPED) else []  # (a test's outcome "skipped" is not one)
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in problems(v, f"{path}[{i}]")]
    if not isinstance(value, dict):
        return []
    found = [path] if value.get("error") or str(value.get("status", "ok")) not in ("ok", "running") else []
    for key, item in value.items():
        if key not in ("error", "status", "output_tail"):
            found += problems(item, f"{path}.{key}" if path else str(key))
    return found


def run_section(
    results: Results,
    name: str,
    deadline: float,
    work: Callable[[Budget, dict[str, Any], Recorder], None],
) -> None:
    """``work(budget, result, results)`` with its own entry in the results; never raises an Exception."""
    entry: dict[str, Any] = {"status": "running", "result": {}}
    results.data["sections"][name] = entry
    budget = Budget(deadline)
    entry["budget_s"] = round(budget.left(), 1)
    if budget.left() < LEAST.get(name, 3.0):
        entry["status"] = SKIPPED
        results.log(f"{name}: {SKIPPED}")
        results.save()
        return
    results.log(f"{name}: start ({budget.left():.0f} s)")
    start = time.monotonic()
    try:
        work(budget, entry["result"], results)
        entry["status"] = str(entry["result"].pop("status", "ok"))
    except Exception:
        entry["status"] = "error"
        entry["error"] = traceback.format_exc()
        results.log(f"{name}: error: {entry['error'].strip().splitlines()[-1]}")
    entry["seconds"] = round(time.monotonic() - start, 1)
    results.log(f"{name}: {entry['status']} in {entry['seconds']} s")
    results.save()


# -- 1. environment ----------------------------------------------------------------------------------------


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _guarded(call: Callable[[], Any]) -> Any:
    try:
        return call()
    except Exception as err:
        return f"error: {err!r}"


def triton_status() -> dict[str, Any]:
    """``streamwatch._triton.status()`` on each route, when the module exists."""
    try:
        module = importlib.import_module("streamwatch._triton")
    except ImportError as err:
        return {"module": f"absent ({err})"}
    status = getattr(module, "status", None)
    if status is None:
        return {"module": "present, no status()"}
    found: dict[str, Any] = {"module": "present"}
    with kernel_route(None):
        found["load()"] = _guarded(lambda: type(module.load()).__name__)  # compiles the kernels
    for route in (None, "torch"):
        with kernel_route(route):
            found[f"status ({route or 'default'} route)"] = _guarded(status)
    return found


def gpu(device: torch.device) -> dict[str, Any]:
    props = torch.cuda.get_device_properties(device)
    return {
        "name": props.name,
        "capability": f"{props.major}.{props.minor}",
        "memory_gib": round(props.total_memory / 2**30, 1),
        "count": torch.cuda.device_count(),
    }


def environment(device: torch.device, result: dict[str, Any]) -> None:
    from streamwatch import _kernel

    result.update(
        python=sys.version.split()[0],
        platform=platform.platform(),
        cpus=os.cpu_count(),
        torch=torch.__version__,
        cuda_runtime=torch.version.cuda,
        cuda_available=torch.cuda.is_available(),
        triton=_version("triton"),
        streamwatch=getattr(sw, "__version__", None),
        float32_matmul_precision=torch.get_float32_matmul_precision(),
        env={k: v for k, v in os.environ.items() if k.startswith(("STREAMWATCH", "CUDA_VISIBLE", "TORCH"))},
        packages={p: _version(p) for p in PACKAGES},
    )
    result["git_commit"] = _guarded(
        lambda: subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=5, check=True
        ).stdout.strip()
    )
    if device.type == "cuda":
        result["gpu"] = _guarded(lambda: gpu(device))
        result["driver"] = _guarded(
            lambda: subprocess.run(
                [
                    "nvidia-smi",
                    "--query-gpu=driver_version,clocks.max.sm,power.limit",
                    "--format=csv,noheader",
                ],
                capture_output=True,
                text=True,
                timeout=15,
                check=True,
            ).stdout.strip()
        )
    with kernel_route(None):
        _guarded(_kernel.load)
        result["kernel_status"] = _guarded(_kernel.status)
    result["triton_status"] = triton_status()


# -- 2. CUDA tests -----------------------------------------------------------------------------------------


def junit(path: Path) -> dict[str, Any]:
    """Counts and every test case's outcome from pytest's JUnit XML."""
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return {}
    counts = {k: suite.get(k) for k in ("tests", "failures", "errors", "skipped", "time")}
    cases = []
    for case in suite.iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome, message = tag, (found.get("message") or found.text or "")[:500]
                break
        cases.append(
            {
                "test": f"{case.get('classname')}::{case.get('name')}",
                "outcome": outcome,
                "time": case.get("time"),
            }
            | ({"message": message} if message else {})
        )
    return {"counts": counts, "cases": cases}


def cuda_tests(budget: Budget, result: dict[str, Any], dry: bool) -> None:
    files = [f for f in TEST_FILES if (REPO / f).exists()]
    result["files"] = files
    args = ["-q", "--maxfail=5", *files, "-p", "no:cacheprovider"]  # (one failure hides no other)
    if importlib.util.find_spec("pytest_timeout") is not None:
        args += ["--timeout", "120"]
    else:  # pyproject's `timeout = 120` is an unknown option without the plugin, and --strict-config fails
        args += ["-o", "addopts=-ra --strict-markers", "-W", "ignore::pytest.PytestConfigWarning"]
        result["note"] = "pytest-timeout absent: run without --timeout and --strict-config"
    if dry:
        args.append("--co")
    result["command"] = "python -m pytest " + " ".join(args)
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        done = run_child([sys.executable, "-m", "pytest", *args, f"--junitxml={xml}"], budget.left(), REPO)
        if xml.exists():
            result["junit"] = _guarded(lambda: junit(xml))
    result.update(returncode=done.returncode, seconds=round(done.seconds, 1), output_tail=tail(done.output))
    lines = [line for line in done.output.splitlines() if line.strip()]
    result["summary"] = lines[-1] if lines else ""
    if done.returncode is None:
        result["status"] = f"{SKIPPED} (killed after {done.seconds:.0f} s)"
    elif done.returncode not in (0, 5):
        result["status"] = f"failed (pytest exit {done.returncode})"


# -- the run -----------------------------------------------------------------------------------------------


def apply_tiles(path: Path) -> dict[str, Any]:
    """``tiles.py``'s best block shapes (``best`` in its JSON) set in ``streamwatch._triton`` for the
    sections that run in this process (the CUDA tests, a child process, keep the defaults)."""
    for layout, config in json.loads(path.read_text())["best"].items():
        tiles.apply(layout, tuple(config))
    return {"from": str(path)} | tiles.settings()


def _terminated(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, required=True, help="folder for results.json, results.md, log.txt"
    )
    parser.add_argument("--dry-run", action="store_true", help="every section on the CPU at toy sizes")
    parser.add_argument("--budget", type=float, default=None, help="seconds the run aims at (330; dry 240)")
    parser.add_argument("--only", nargs="*", choices=list(SECTIONS), help="run only these sections")
    parser.add_argument(
        "--tiles", type=Path, help="tiles.py's tiles.json: its best block shapes, applied before measuring"
    )
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    dry = args.dry_run or not cuda
    device = torch.device("cuda" if cuda and not dry else "cpu")
    if dry:
        torch.set_num_threads(1)  # toy sizes: a second thread only waits at barriers on a busy CI machine
    total = args.budget or (240.0 if dry else 330.0)
    meta = {
        "mode": "dry-run" if args.dry_run else ("gpu" if cuda else "cpu (no CUDA device: dry-run sizes)"),
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv,
        "budget_s": total,
        "device": str(device),
        "env_at_start": {KERNEL_ENV: os.environ.get(KERNEL_ENV)},
    }
    if args.tiles is not None:
        meta["tiles"] = apply_tiles(args.tiles)
    results = Results(args.out, meta)
    signal.signal(signal.SIGTERM, _terminated)
    end = time.monotonic() + total  # where the slack of the sections before goes
    found = workloads(dry)
    work: dict[str, Callable[[Budget, dict[str, Any], Recorder], None]] = {
        "environment": lambda budget, result, rec: environment(device, result),
        "cuda_tests": lambda budget, result, rec: cuda_tests(budget, result, dry),
        "launches": lambda budget, result, rec: launches.run(found, device, budget, result, rec, dry),
        "overhead": lambda budget, result, rec: overhead.run(found, device, budget, result, rec, dry),
        "compiled": lambda budget, result, rec: result.update(compiled.run(REPO, budget, dry)),
    }
    names = [name for name in SECTIONS if not args.only or name in args.only]
    results.log(f"bench-gpu: {meta['mode']}, {device}, {total:.0f} s, out {args.out}")
    try:
        for i, name in enumerate(names):
            later = sum(SECTIONS[n] for n in names[i + 1 :])  # each section keeps at least its own budget
            deadline = max(time.monotonic() + SECTIONS[name], end - later)
            with kernel_route(None):
                run_section(results, name, deadline, work[name])
    finally:
        for entry in results.data["sections"].values():
            if entry["status"] == "running":  # (a SIGTERM or Ctrl-C: what it had measured is kept)
                entry["status"] = "interrupted"
        results.data["meta"]["finished"] = datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"
        )
        results.save()
    found_problems = results.data["meta"]["problems"]
    results.log(f"done in {results.data['meta']['wall_s']} s; problems: {found_problems or 'none'}")
    return 1 if found_problems else 0


if __name__ == "__main__":
    sys.exit(main())
