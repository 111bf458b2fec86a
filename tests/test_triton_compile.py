"""The Triton kernels compile, without a GPU: Triton's compiler and the ``ptxas`` its wheel carries turn
every variant streamwatch launches into a cubin for an A100 (``sm_80``) and an H100 (``sm_90``), and
their PTX holds no floating-point atomic (whose order would make sums differ from run to run).

The interpreter tests (``tests/test_triton.py``) check what the kernels compute; this checks that the
compiler accepts them — a construct the interpreter runs but the compiler refuses would otherwise show
only on a GPU (where streamwatch then falls back to the torch path with a warning). It runs
``tests/scripts/compile_triton.py`` in a child process without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = Path(__file__).parent / "scripts" / "compile_triton.py"


def compile_in_child(script: Path, args: list[str], tmp_path: Path) -> str:
    """Run ``script`` (it compiles kernels) in a child process without ``TRITON_INTERPRET``, its Triton
    cache in ``tmp_path`` (never under the home folder); its standard output."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=110,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.parametrize("arch", [80, 90])
def test_every_kernel_variant_compiles_to_a_cubin(arch: int, tmp_path: Path) -> None:
    stdout = compile_in_child(SCRIPT, ["--arch", str(arch)], tmp_path)
    results = json.loads(stdout.strip().splitlines()[-1])
    failed = {name: result for name, result in results.items() if not isinstance(result, int)}
    assert failed == {}
    assert len(results) == 46
    assert all(size > 1000 for size in results.values())  # a real cubin each


INSTRUCTIONS = Path(__file__).parents[1] / "benchmarks" / "gpu" / "instructions.py"


def test_the_main_loops_issue_few_instructions_per_element(tmp_path: Path) -> None:
    """A budget like the launch budgets, in machine code: the SASS of each kernel's main loop for an H100
    issues at most 20 instructions per element a thread reads (13.5–16 when written; 26–40 when every
    block tested each element for NaN and ±inf and masked min/max), and each kernel takes at most 100
    registers per thread, so that an SM holds at least 20 warps (it held 16 at 112–127 registers, when
    each thread kept every statistic per element). The eight float operations the statistics need are in
    the loop: the count is of the real loop."""
    out = tmp_path / "instructions.json"
    compile_in_child(INSTRUCTIONS, ["--arch", "90", "--json", str(out)], tmp_path)
    counts = json.loads(out.read_text())["this"]
    assert len(counts) == 4
    for label, found in counts.items():
        assert found["by_kind_per_element"]["float math"] >= 8.0, (label, found)
        assert found["per_element"] <= 20.0, (label, found)
        assert found["registers"] <= 100, (label, found)
        assert found["warps_per_sm"] >= 20, (label, found)


TRACED = Path(__file__).parent / "scripts" / "traced_triton.py"


def test_compiled_code_launches_the_kernels_itself_without_copying_the_tensor(tmp_path: Path) -> None:
    """Under ``torch.compile`` an observed model's activations are summarised by the registered op
    ``streamwatch::partials``: the graph holds the kernel itself (one ``triton_kernel_wrapper_functional``
    per activation, which Inductor launches from its own code), with no graph break, and torch's analysis
    of the kernel finds that it writes only its own outputs, so the activation is not copied for it."""
    result = json.loads(compile_in_child(TRACED, [], tmp_path).strip().splitlines()[-1])
    assert result["graphs"] == 1
    assert result["graph_breaks"] == 0
    assert result["kernels"] == [{"kernel": "tile_partials", "clones": ["counts", "flags", "partials"]}] * 3
