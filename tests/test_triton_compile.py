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


@pytest.mark.parametrize("arch", [80, 90])
def test_every_kernel_variant_compiles_to_a_cubin(arch: int, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")  # (never under the home folder)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--arch", str(arch)],
        capture_output=True,
        text=True,
        env=env,
        timeout=110,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    failed = {name: result for name, result in results.items() if not isinstance(result, int)}
    assert failed == {}
    assert len(results) == 30
    assert all(size > 1000 for size in results.values())  # a real cubin each
