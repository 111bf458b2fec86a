"""The compile section: a 2-layer bench_cuda transformer observed with ``every=1`` under ``torch.compile``.

Run by ``run.py`` in a child process, killed whole at the section's time budget (a compile cannot be
interrupted from inside). The child prints one line, ``COMPILED-RESULT {json}``:

* ``explain_plain`` / ``explain_observed``: ``torch._dynamo.explain``'s graph breaks in one forward of the
  model unobserved and observed (a sampled step), with the first reasons, and ``partials_ops``: the
  activations summarised in the graph by the registered Triton op ``streamwatch::partials`` (0 where
  the torch path's ops are traced: no Triton, or the dry run's CPU);
* ``graph_breaks``: ``torch._dynamo.utils.counters["graph_break"]`` summed over the compiled training
  steps (forward, backward, optimizer step, ``watch.step()``), with the first reasons, and dynamo's
  ``stats`` counters (``unique_graphs``, ...);
* ``recompile_reasons``: the guards that failed, by code name (``torch._dynamo.utils.guard_failures``);
* ``kernels_in_a_step``: one more compiled training step under ``torch.profiler``: its device kernels
  in all and streamwatch's by name (``tile_partials``/``flat_partials`` launched by Inductor's code
  for the registered op, ``finalize``);
* ``first_step_s`` (compiling the forward and the backward), ``step_ms`` of the later steps, and the
  watch's statistics (``hook_errors``, ``skipped``: gradient taps a compiled forward cannot take,
  counted there; output gradients go through ``streamwatch._gradprobe``).

``--dry-run``: a 1-layer, 32-wide transformer on the CPU with the ``aot_eager`` backend (no code
generation), the same path in seconds.
"""

from __future__ import annotations

import collections
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_cuda, bench_observe
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from harness import SKIPPED, Budget, run_child, tail
from workloads import Workload, compiled_workload, step

import streamwatch as sw

MARK = "COMPILED-RESULT "
STEPS = 5


def _line(text: Any, most: int = 400) -> str:
    """A reason on one line (a table cell, a list item)."""
    return " ".join(str(text).split())[:most]


def _forward(w: Workload, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.autocast(x.device.type, dtype=w.autocast or torch.bfloat16, enabled=w.autocast is not None):
        return model(x)


OURS = ("tile_partials", "flat_partials", "finalize")
"""streamwatch's Triton kernels by name (Inductor may add a suffix to a user kernel's name)."""


def kernels_in_a_step(run: Any, device: torch.device) -> dict[str, Any]:
    """The device kernels one call of ``run`` (a compiled training step) launches under
    ``torch.profiler``: how many in all, and streamwatch's by name (the Triton kernels Inductor launches
    for the registered op ``streamwatch::partials``, and the step's finalize). Empty counts on the CPU."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities) as prof:
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
    names = collections.Counter(
        e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
    )
    ours = {name: n for name, n in sorted(names.items()) if name.startswith(OURS)}
    return {"kernels": sum(names.values()), "streamwatch": ours}


def explain(w: Workload, model: torch.nn.Module, x: torch.Tensor) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    explained = torch._dynamo.explain(lambda x: _forward(w, model, x))(x)
    op = getattr(getattr(torch.ops, "streamwatch", None), "partials", None)
    return {
        "graph_breaks": explained.graph_break_count,
        "reasons": [_line(reason.reason) for reason in explained.break_reasons][:10],
        # activations summarised by the registered Triton op (0: the torch path's ops are traced)
        "partials_ops": sum(
            1
            for gm in explained.graphs
            for node in gm.graph.nodes
            if op is not None and node.target is op.default
        ),
    }


def _recompiles() -> dict[str, Any]:
    """Why dynamo compiled a frame again (its failed guards), by code name; private, so guarded."""
    try:
        from torch._dynamo.utils import guard_failures

        return {code.co_name: [_line(r) for r in reasons][:5] for code, reasons in guard_failures.items()}
    except Exception as err:
        return {"error reading them": repr(err)}


def child(dry: bool) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    device = torch.device("cuda" if torch.cuda.is_available() and not dry else "cpu")
    if dry:
        torch.set_num_threads(1)
    backend = "aot_eager" if dry else "inductor"
    w = compiled_workload(dry)
    x, y = w.batch(device)
    out: dict[str, Any] = {"model": w.name, "device": str(device), "backend": backend, "steps": STEPS}
    try:
        out["explain_plain"] = explain(w, w.model(device), x)
    except Exception as err:
        out["explain_plain"] = {"error": repr(err)}
    model = w.model(device)
    opt = w.optimizer(model.parameters())
    watch = sw.observe(model, opt, every=1)
    try:
        try:
            out["explain_observed"] = explain(w, model, x)
        except Exception as err:
            out["explain_observed"] = {"error": repr(err)}
        watch.step()  # ends the explained forward's step
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(model, backend=backend)
        times = []
        for i in range(STEPS):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            step(w, compiled, opt, x, y, watch)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            print(f"compiled step {i}: {times[-1]:.2f} s", file=sys.stderr, flush=True)
        breaks = counters["graph_break"]
        out["graph_breaks"] = sum(breaks.values())
        out["graph_break_reasons"] = [_line(r) for r in breaks][:10]
        out["dynamo_stats"] = {k: v for k, v in counters["stats"].items() if isinstance(v, int)}
        out["recompile_reasons"] = _recompiles()
        out["first_step_s"] = times[0]
        out["step_ms"] = [1e3 * t for t in times[1:]]
        out["kernels_in_a_step"] = kernels_in_a_step(lambda: step(w, compiled, opt, x, y, watch), device)
    finally:
        watch.close()
    stats = watch.statistics()
    out["watch"] = {
        "hook_errors": stats.hook_errors,
        "records_received": stats.records_received,
        "skipped": dict(getattr(stats, "skipped", {}) or {}),
    }
    return out


def run(repo: Path, budget: Budget, dry: bool) -> dict[str, Any]:
    """The child, within ``budget``; its result, or why there is none."""
    cmd = [sys.executable, str(Path(__file__).resolve()), *(["--dry-run"] if dry else [])]
    done = run_child(cmd, budget.left(), repo)
    for line in done.output.splitlines():
        if line.startswith(MARK):
            found: dict[str, Any] = json.loads(line[len(MARK) :])
            found["child_seconds"] = done.seconds
            return found
    if done.returncode is None:
        return {"status": SKIPPED, "killed_after_s": done.seconds, "output_tail": tail(done.output)}
    raise RuntimeError(f"the compile child exited {done.returncode} without a result:\n{tail(done.output)}")


if __name__ == "__main__":
    result = child("--dry-run" in sys.argv[1:])
    print(MARK + json.dumps(result, default=str), flush=True)
