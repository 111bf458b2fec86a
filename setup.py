"""Builds streamwatch's fused CPU summary kernel when the package is built (wheel, sdist install, ``-e``).

Everything else about the package is declared in ``pyproject.toml``; this file only adds the C code.

Why a CPython extension module (``streamwatch/_fused<EXT_SUFFIX>``) called through ``ctypes``, rather than
a plain shared library or Python-API bindings:

- ``build_ext`` is the one build path every installer already knows: it finds the compiler the
  interpreter was built with, names the file with the interpreter's ABI tag, makes the wheel
  platform-specific, builds in place for ``pip install -e .`` and ships the sources in the sdist. A
  plain ``.so`` would need a custom command for each of those.
- The kernel itself is plain C over raw pointers (``_fused.c``, no ``Python.h``), called with
  ``ctypes.PyDLL`` (``_kernel.py``): the signatures live in one Python file and the C code knows nothing
  of Python. ``_fused_module.c`` adds what an extension module must have, an init function, so the
  file is also a valid module, and three module functions for the one call per step where a ctypes
  call costs too much (a CPU loss's finiteness on a quiet step, ``_observe.py``; the worker's summary
  table of a CPU step, ``_record.py``).

The column schema (``streamwatch/_schema.py``: the per-tensor values, their order, how they merge) is
declared once, in Python. Before compiling, :class:`BuildFused` loads that file by path (it imports
nothing but the standard library, so it runs in an isolated build without torch or numpy) and writes
its C header, ``_schema.h``, into the build's temporary directory, which the C sources include. The
header is generated, never committed: nothing can drift, and an sdist carries ``_schema.py`` (a package
module) from which any build regenerates it. ``python streamwatch/_schema.py`` prints it.

The extension is ``optional``: without a C compiler the install still succeeds, and streamwatch runs
its eager-torch summaries with one warning that says how to get the fused kernel.
"""

from __future__ import annotations

import runpy
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# -fno-math-errno lets the compiler vectorise; -ffast-math is never used (it breaks NaN/inf handling);
# -ffp-contract=off keeps a*b+c two roundings, as in Python (the detectors' fold must give its bits).
_GCC_FLAGS = ["-O3", "-funroll-loops", "-std=gnu11", "-fno-math-errno", "-ffp-contract=off"]


_SCHEMA = Path(__file__).resolve().parent / "streamwatch" / "_schema.py"


def write_schema_header(directory: Path) -> Path:
    """Write ``_schema.h`` (generated from ``streamwatch/_schema.py``) into ``directory``; rewritten only
    when its text changes, so an unchanged schema recompiles nothing."""
    header = runpy.run_path(str(_SCHEMA))["c_header"]()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "_schema.h"
    if not path.is_file() or path.read_text(encoding="utf-8") != header:
        path.write_text(header, encoding="utf-8")
    return path


class BuildFused(build_ext):
    """``build_ext`` that generates the schema header first, with the kernel's optimisation flags for
    GCC-compatible compilers."""

    def build_extensions(self) -> None:
        generated = write_schema_header(Path(self.build_temp) / "streamwatch-schema").parent
        for ext in self.extensions:
            ext.include_dirs = [str(generated), *ext.include_dirs]
        if self.compiler.compiler_type == "unix":
            for ext in self.extensions:
                ext.extra_compile_args = [*_GCC_FLAGS, *ext.extra_compile_args]
        super().build_extensions()


setup(
    ext_modules=[
        Extension(
            "streamwatch._fused",
            sources=["streamwatch/_fused.c", "streamwatch/_fused_module.c"],
            depends=["streamwatch/_fused_body.h", "streamwatch/_schema.py"],
            optional=True,
        )
    ],
    cmdclass={"build_ext": BuildFused},
)
