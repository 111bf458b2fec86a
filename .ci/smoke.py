"""Smoke test of an installed streamwatch, run by .ci/install_check inside a fresh venv.

Run from outside the checkout (so ``import streamwatch`` finds the installed package), with no C
compiler on PATH and an empty HOME. It checks that

- the installed distribution is streamwatch-torch (the import name is streamwatch) and its version is
  what ``streamwatch.__version__`` and ``streamwatch --version`` say;
- every module imports with only the declared runtime dependencies, and optional features name the
  extra that provides them;
- the README quickstart (the first ``python`` block of README.md) runs;
- the fused CPU kernel is in use and was loaded from the installed package's own directory;
- nothing was written under HOME.

Usage: python smoke.py README.md
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path


def fail(message: str) -> None:
    print(f"smoke: FAIL: {message}", file=sys.stderr)
    raise SystemExit(1)


def quickstart(readme: Path) -> str:
    """The first ```python block of README.md."""
    text = readme.read_text(encoding="utf-8")
    start = text.find("```python\n")
    if start < 0:
        fail(f"{readme} has no ```python block")
    start += len("```python\n")
    return text[start : text.index("```", start)]


def main() -> None:
    readme = Path(sys.argv[1]).resolve()
    home = Path(os.environ["HOME"])
    before = sorted(home.rglob("*"))
    if before:
        fail(f"HOME={home} is not empty to begin with: {before[:5]}")
    warnings.simplefilter("error", RuntimeWarning)  # a missing kernel warns: make it fatal here

    import streamwatch

    package = Path(streamwatch.__file__).parent
    if "site-packages" not in package.parts:
        fail(f"streamwatch was imported from {package}, not from an installed package")
    print(f"smoke: streamwatch {streamwatch.__version__} from {package}")
    from importlib import metadata

    installed = metadata.version("streamwatch-torch")
    if streamwatch.__version__ != installed:
        fail(f"streamwatch.__version__ is {streamwatch.__version__!r}, streamwatch-torch {installed!r}")
    said = subprocess.run(
        [str(Path(sys.executable).with_name("streamwatch")), "--version"],
        capture_output=True,
        text=True,
        check=False,
    )
    if said.returncode != 0 or said.stdout.strip() != f"streamwatch {installed} (streamwatch-torch)":
        fail(f"streamwatch --version said {said.stdout!r} {said.stderr!r} (exit {said.returncode})")

    optional = {
        "streamwatch._live": "streamwatch-torch[demo]",
        "streamwatch.integrations.lightning": "streamwatch-torch[lightning]",
        "streamwatch.integrations.transformers": "streamwatch-torch[transformers]",
        "streamwatch._triton_kernels": "triton",  # (with CUDA torch wheels; imported only with CUDA)
    }
    for info in pkgutil.walk_packages(streamwatch.__path__, "streamwatch."):
        try:
            importlib.import_module(info.name)
        except ImportError as err:
            extra = optional.get(info.name)
            if extra is None:
                fail(f"import {info.name}: {err} (an undeclared runtime dependency?)")
            if extra not in str(err):
                fail(f"import {info.name} fails without naming {extra}: {err}")
            print(f"smoke: {info.name} needs {extra}, and says so")
    try:
        streamwatch.sinks.TensorBoard(tempfile.mkdtemp())
    except ImportError as err:
        if "streamwatch-torch[tensorboard]" not in str(err):
            fail(f"the TensorBoard sink fails without naming its extra: {err}")
    else:
        fail("tensorboard is importable in a plain install: is it a hard dependency now?")

    namespace: dict[str, object] = {}
    exec(compile(quickstart(readme), str(readme), "exec"), namespace)  # our own README
    watch = namespace.get("watch")
    if not isinstance(watch, streamwatch.Watch):
        fail("the README quickstart no longer defines `watch`")
    kernel = watch.statistics().kernel
    if not kernel.startswith(f"fused: {package}{os.sep}_fused"):
        fail(f"the fused kernel is not in use from the installed package: {kernel!r}")
    print(f"smoke: kernel {kernel}")

    after = sorted(home.rglob("*"))
    if after:
        fail(f"files were written under HOME: {[str(p) for p in after[:10]]}")
    print("smoke: ok")


if __name__ == "__main__":
    main()
