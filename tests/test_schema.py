"""The column schema (``streamwatch/_schema.py``): its C header, the kernel built from it, its rules, and
the tables built from it by column name."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from streamwatch import _kernel, _schema, testing
from streamwatch._schema import COLUMN, COLUMN_NAMES, DEVICE_INDEX, DEVICE_NAMES
from streamwatch._summary import COLUMNS, DERIVED, derive

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = ROOT / "streamwatch" / "_schema.py"


def _run_schema(source: str, tmp_path: Path) -> dict[str, object]:
    """A variant of ``_schema.py`` (its text changed by a test), run by path as ``setup.py`` runs it."""
    import runpy

    path = tmp_path / "_schema.py"
    path.write_text(source)
    return runpy.run_path(str(path))


def test_setup_py_can_generate_the_header_without_torch_numpy_or_streamwatch() -> None:
    """The build runs the schema by path in an isolated environment: nothing but the standard library."""
    script = (
        "import runpy, sys\n"
        "for name in ('torch', 'numpy', 'streamwatch'):\n"
        "    sys.modules[name] = None  # importing any of them fails\n"
        f"print(runpy.run_path({str(SCHEMA)!r})['c_header'](), end='')\n"
    )
    done = subprocess.run([sys.executable, "-I", "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == _schema.c_header()


def test_the_header_declares_every_index_the_python_side_uses() -> None:
    header = _schema.c_header()
    defines = dict(re.findall(r"^#define (SW_\w+) (\d+)", header, flags=re.MULTILINE))
    assert int(defines["SW_NSTATS"]) == len(DEVICE_NAMES) == _kernel.NSTATS
    assert int(defines["SW_NCOLUMNS"]) == len(COLUMN_NAMES)
    for name, index in DEVICE_INDEX.items():
        assert int(defines[f"SW_STAT_{name.upper()}"]) == index, name
    for name, index in COLUMN.items():
        assert int(defines[f"SW_COL_{name.upper()}"]) == index, name
    assert f'#define SW_SCHEMA "{_schema.SIGNATURE}"' in header


def test_the_built_kernel_reports_the_schema_it_was_built_from() -> None:
    path = _kernel.library_path()
    assert path is not None
    lib = ctypes.PyDLL(str(path))
    lib.streamwatch_schema.restype = ctypes.c_char_p
    assert lib.streamwatch_schema().decode() == _schema.SIGNATURE
    from streamwatch import _fused  # type: ignore[attr-defined]

    assert _fused.SCHEMA == _schema.SIGNATURE


def test_a_lane_sum_added_to_the_schema_is_computed_by_the_rebuilt_kernel(tmp_path: Path) -> None:
    """The recipe's premise: a new sum over the elements is one declaration. Here Σ2x, declared before
    ``nonfinite``, compiled from the unchanged C sources with the regenerated header, comes out of the
    kernel in its place, for float32 and float64, plain and as a difference."""
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:  # pragma: no cover - the suite needs a compiler (CONTRIBUTING.md)
        pytest.skip("no C compiler")
    source = SCHEMA.read_text()
    marker = '    DeviceValue("nonfinite",'
    assert source.count(marker) == 1
    source = source.replace(
        marker, '    DeviceValue("twice", "sum", "Σ2x", term="2 * v", wide=True),\n' + marker
    )
    variant = _run_schema(source, tmp_path)
    (tmp_path / "_schema.h").write_text(variant["c_header"]())  # type: ignore[operator]
    library = tmp_path / "variant.so"
    flags = ["-O2", "-std=gnu11", "-fno-math-errno", "-ffp-contract=off", "-shared", "-fPIC"]
    done = subprocess.run(
        [compiler, *flags, "-I", str(tmp_path), str(ROOT / "streamwatch" / "_fused.c"), "-o", str(library)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    lib = ctypes.CDLL(str(library))
    lib.streamwatch_schema.restype = ctypes.c_char_p
    assert lib.streamwatch_schema().decode() == variant["SIGNATURE"] != _schema.SIGNATURE
    names = variant["DEVICE_NAMES"]
    assert isinstance(names, tuple)
    for dtype, suffix in ((torch.float32, "f32"), (torch.float64, "f64")):
        x = torch.linspace(-3, 5, 2053, dtype=dtype)
        out = np.zeros(len(names))
        summarize = getattr(lib, f"streamwatch_summarize_{suffix}")
        summarize.argtypes = [ctypes.c_void_p, *[ctypes.c_int64] * 4, ctypes.c_void_p, ctypes.c_void_p]
        summarize.argtypes += [ctypes.c_void_p, ctypes.c_void_p]
        summarize(x.data_ptr(), x.numel(), 1, 1, 1, None, out.ctypes.data, None, None)
        got = dict(zip(names, out.tolist(), strict=True))
        assert got["twice"] == pytest.approx(2 * float(x.double().sum()), abs=1e-9)
        assert got["sum"] == pytest.approx(float(x.double().sum()), abs=1e-3)
        assert got["nonzero"] == np.count_nonzero(x.numpy())
        assert got["nonfinite"] == 0
        diff = getattr(lib, f"streamwatch_summarize_diff_{suffix}")
        diff.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
        flipped = x.flip(0).contiguous()  # (held: the kernel reads it through its address)
        diff(x.data_ptr(), flipped.data_ptr(), x.numel(), out.ctypes.data)
        assert dict(zip(names, out.tolist(), strict=True))["twice"] == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (('±inf elements"),', '±inf elements"),\n    DeviceValue("late", "sum", "x", term="v"),'),
         "'nonfinite' must be the last"),
        (('DeviceValue("sumsq", "sum", "Σx²", term="v * v")', 'DeviceValue("sumsq", "sum", "Σx²")'),
         "a term goes with reduce='sum'"),
        (('Column("zeros", "add", "add"', 'Column("zeros", "sum", "add"'), "column 'zeros': merge one of"),
        (('Column("sum", "add", "add", "Σx",', 'Column("total", "add", "add", "Σx",'),
         "column 'total' copies a device value"),
        (('    ("mean", "sum / count"),', '    ("mean", "sum / count"),\n    ("min", "again"),'),
         r"derived statistics \['min'\] are also columns"),
    ],
    ids=["nonfinite-not-last", "sum-without-term", "unknown-merge", "no-such-value", "derived-is-column"],
)  # fmt: skip
def test_an_inconsistent_schema_is_refused_naming_the_rule(
    change: tuple[str, str], message: str, tmp_path: Path
) -> None:
    old, new = change
    source = SCHEMA.read_text()
    assert source.count(old) == 1, old
    with pytest.raises(ValueError, match=message):
        _run_schema(source.replace(old, new), tmp_path)


def test_every_statistic_has_its_family_in_the_prometheus_migration_table() -> None:
    """docs/prometheus.md's migration table names every statistic's family: each column and derived
    statistic of the schema, old ``streamwatch_tensor{stat=...}`` → the family /metrics serves it in."""
    from streamwatch._families import tensor_family

    text = (ROOT / "docs" / "prometheus.md").read_text()
    rows = dict(re.findall(r'^\| `streamwatch_tensor\{stat="(\w+)"\}` \| `(\w+)` \|', text, re.MULTILINE))
    for name in (*COLUMNS, *DERIVED):
        assert rows.get(name) == tensor_family(name).name, name
    assert len(set(rows.values())) == len(rows)  # one family per statistic


def test_every_statistic_has_a_row_in_the_metric_catalogue() -> None:
    """docs/metrics.md's table of per-tensor statistics: a row for every column and derived statistic."""
    text = (ROOT / "docs" / "metrics.md").read_text()
    start = text.index("| stat | what |")
    rows = text[start : text.index("\n\n", start)].splitlines()[2:]
    named = {name for row in rows for name in re.findall(r"`(\w+)`", row.split("|")[1])}
    assert named == {*COLUMNS, *DERIVED}


def test_derive_computes_exactly_the_declared_statistics() -> None:
    assert tuple(derive(testing.table(1, fill=1.0))) == DERIVED


def test_tables_are_built_by_column_name() -> None:
    t = testing.table(count=[4, 2], sumsq=9.0)
    assert t.shape == (2, len(COLUMNS))
    assert t[:, COLUMN["count"]].tolist() == [4.0, 2.0]
    assert t[:, COLUMN["sumsq"]].tolist() == [9.0, 9.0]
    assert np.isnan(t[:, COLUMN["sum"]]).all()  # not given: unknown
    assert testing.table(3, fill=0.0).tolist() == np.zeros((3, len(COLUMNS))).tolist()
    assert testing.table(0).shape == (0, len(COLUMNS))
    assert testing.table().shape == (1, len(COLUMNS))
    with pytest.raises(ValueError, match=r"^Expected column names .* got \['l2'\]$"):
        testing.table(l2=1.0)  # a derived statistic is not a column
    with pytest.raises(ValueError, match="could not broadcast"):
        testing.table(count=[1, 2, 3], sum=[1.0, 2.0])
