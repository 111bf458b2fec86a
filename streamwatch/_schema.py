"""The column schema: every per-tensor statistic, declared once.

A summary row is a few values the device computes per tensor (:data:`DEVICE`, in the order the kernels
write them) that the worker turns into the columns of a record's table (:data:`COLUMNS`); everything
else is derived from those columns (:data:`DERIVED`). Every reader and writer of a row follows this file:

* the fused C kernel: ``setup.py`` loads this file by path when the package is built and writes
  :func:`c_header` into the build (``_schema.h``: the value and column indices, the kernel's lane sums
  as X-macros, ``activity_t`` and the entry points' prototypes), which ``_fused.c``,
  ``_fused_body.h`` and ``_fused_module.c`` include;
* the kernel's load-time check: the library returns the :data:`SIGNATURE` it was built from and
  ``_kernel.py`` refuses one that differs from this file's (there is no version number to keep by hand);
* the torch path, the numpy assembly, merging and totals and :func:`streamwatch._summary.derive`, which
  index columns by name through :data:`COLUMN` and merge each as it declares;
* ``streamwatch.testing.table``, which builds tables by column name for tests, doctests and docs.

How columns combine. ``repeat`` says how two rows of one key in one step merge (a module called twice,
gradient accumulation); ``merge`` how rows of different tensors combine into a total (layers, shards,
ranks; also what PromQL's ``sum``/``min``/``max`` do across series). ``add``: sum; ``min``/``max``: the
extreme; ``first``: the first row's (per-unit activity, already merged per key on the training thread);
``pairs``: ``samples`` is combined so that ``samples × units`` adds up (activation rates stay exact).
The ``nonfinite`` column adds when it holds exact counts and is an any-of when it holds 0/1 flags.

Pure Python with no imports outside the standard library: ``setup.py`` runs it where neither torch,
numpy nor streamwatch is importable (build isolation). ``python streamwatch/_schema.py`` prints the
header.

Example:
    >>> COLUMN["sumsq"], DEVICE_INDEX["nonzero"], len(COLUMNS) == len(COLUMN)
    (2, 4, True)
    >>> [c.name for c in COLUMNS if c.merge == "add"][:4]
    ['count', 'sum', 'sumsq', 'zeros']
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = [
    "ACTIVITY",
    "COLUMN",
    "COLUMNS",
    "COLUMN_NAMES",
    "DERIVED",
    "DEVICE",
    "DEVICE_INDEX",
    "DEVICE_NAMES",
    "ENTRY_POINTS",
    "SIGNATURE",
    "Column",
    "DeviceValue",
    "c_header",
]


@dataclass(frozen=True, slots=True)
class DeviceValue:
    """One value the device computes per tensor.

    Attributes:
        name: its name (a column of the same name copies it, unless the column is assembled: ``zeros``
            from ``nonzero``, ``nonfinite``).
        reduce: ``sum`` (Σ ``term`` over the elements, in vector lanes), ``min``, ``max``, ``nonzero``
            (the count of nonzero elements) or ``nonfinite`` (the count of NaN and ±inf elements).
        meaning: one line for the docs.
        term: for ``sum``: the element's term, a C expression of ``v`` (the element, of the tensor's
            float type ``T``; ``FABS(v)`` is its magnitude); the torch path computes the same in
            ``_summary.summarize``.
        wide: for ``sum``: accumulate in float64 lanes even for float32 tensors (a term that would
            overflow float32 far below the data's range); otherwise lanes of the tensor's type are
            flushed into float64 totals every 1 024 elements.
    """

    name: str
    reduce: str
    meaning: str
    term: str = ""
    wide: bool = False


@dataclass(frozen=True, slots=True)
class Column:
    """One column of a record's table (see the module docstring for ``merge`` and ``repeat``).

    Attributes:
        name: the column, also the ``stat`` label it is served under.
        merge: how rows of different tensors combine: ``add``, ``min``, ``max`` or ``pairs``.
        repeat: how rows of one key in one step merge: ``add``, ``min``, ``max`` or ``first``.
        meaning: one line for the docs.
        device: the device value of the same name, copied as it is.
        nan_unknown: unknown (NaN) when the tensor holds a NaN (its source counts NaN as zero).
    """

    name: str
    merge: str
    repeat: str
    meaning: str
    device: bool = False
    nan_unknown: bool = False


DEVICE: tuple[DeviceValue, ...] = (
    DeviceValue("sum", "sum", "Σx", term="v"),
    DeviceValue("sumsq", "sum", "Σx²", term="v * v"),
    DeviceValue("min", "min", "the smallest element (NaN if any element is NaN)"),
    DeviceValue("max", "max", "the largest element (NaN if any element is NaN)"),
    DeviceValue("nonzero", "nonzero", "elements that are not zero (NaN counts as zero on the torch path)"),
    DeviceValue("sumabs", "sum", "Σ|x|", term="FABS(v)"),
    DeviceValue("sumcube", "sum", "Σx³", term="v * v * v"),
    DeviceValue("sumfourth", "sum", "Σx⁴", term="(v * v) * (v * v)"),
    # nonfinite stays last: the torch path computes it only when exact counts are asked for
    DeviceValue("nonfinite", "nonfinite", "NaN and ±inf elements"),
)
"""What the kernels write per tensor, in this order (``nonfinite`` last: the torch path leaves it out
unless exact non-finite counts are asked for)."""

COLUMNS: tuple[Column, ...] = (
    Column("count", "add", "add", "elements"),
    Column("sum", "add", "add", "Σx", device=True),
    Column(
        "sumsq", "add", "add", "Σx² (a norm is √ of a sum of squares, which adds across shards)", device=True
    ),
    Column("min", "min", "min", "the smallest element (NaN if any element is NaN)", device=True),
    Column("max", "max", "max", "the largest element (NaN if any element is NaN)", device=True),
    Column("zeros", "add", "add", "elements equal to zero", nan_unknown=True),
    Column("nonfinite", "add", "add", "NaN/±inf elements: an exact count, or a 0/1 flag unless counted"),
    Column("units", "add", "first", "units (neurons, channels) with per-unit activity taken"),
    Column("dead", "add", "first", "units inactive for every sample", nan_unknown=True),
    Column("samples", "pairs", "add", "samples behind the per-unit activity (the batch)"),
    Column("active", "add", "first", "(sample, unit) pairs in which the unit was active", nan_unknown=True),
    Column("sumabs", "add", "add", "Σ|x|", device=True),
    Column("sumcube", "add", "add", "Σx³ (with sumfourth: skewness and kurtosis, mergeable)", device=True),
    Column("sumfourth", "add", "add", "Σx⁴", device=True),
)
"""The columns of a record's table, in this order. All of them add up (or take min/max) across rows,
steps, shards and ranks: which is why sums of squares, not norms, are kept."""

DERIVED: tuple[tuple[str, str], ...] = (
    ("mean", "sum / count"),
    ("std", "√var"),
    ("var", "population variance sumsq/count − mean² (clipped at 0)"),
    ("l2", "√sumsq, the L2 norm"),
    ("rms", "√(sumsq/count)"),
    ("absmax", "max(|min|, |max|), the ∞-norm"),
    ("zero_fraction", "zeros / count"),
    ("dead_fraction", "dead / units"),
    ("activation_rate", "active / (samples × units)"),
    ("mean_abs", "sumabs / count, the mean magnitude"),
    ("skewness", "m3 / m2^1.5 from the central moments m_k (population; NaN where rounding could move it)"),
    ("kurtosis", "m4 / m2², Pearson's (population; NaN where rounding could move it by 1 %)"),
    ("excess_kurtosis", "kurtosis − 3 (0 for a normal distribution)"),
)
"""The statistics ``_summary.derive`` computes from the columns, with what each is."""

ACTIVITY: tuple[tuple[str, str], ...] = (
    ("bounded", "int32_t"),  # 0: active = nonzero; 1: active = away from the finite bounds below
    ("has_lo", "int32_t"),  # which bounds are finite
    ("has_hi", "int32_t"),
    ("reserved", "int32_t"),
    ("lo", "double"),
    ("hi", "double"),
    ("tol_lo", "double"),
    ("tol_hi", "double"),
)
"""``activity_t``: what "active" means for per-unit activity (``_kernel.Activity`` mirrors it)."""

ENTRY_POINTS: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    (
        "streamwatch_summarize",
        (
            ("x", "const T *"),
            ("n", "int64_t"),
            ("a", "int64_t"),
            ("u", "int64_t"),
            ("b", "int64_t"),
            ("act", "const activity_t *"),
            ("out", "double *"),
            ("units_out", "double *"),
            ("flags", "int32_t *"),
        ),
    ),
    (
        "streamwatch_summarize_diff",
        (("a", "const T *"), ("b", "const T *"), ("n", "int64_t"), ("out", "double *")),
    ),
    (
        "streamwatch_histogram",
        (
            ("x", "const T *"),
            ("n", "int64_t"),
            ("bounds", "const T *"),
            ("nb", "int64_t"),
            ("lo", "double"),
            ("pd", "double"),
            ("k", "int64_t"),
            ("counts", "double *"),
            ("zeros", "double *"),
        ),
    ),
)
"""The kernel's ctypes entry points (each returns ``int`` and exists as ``<name>_f32`` and ``<name>_f64``,
``T`` being ``float`` and ``double``): the header declares their prototypes, so the C definitions must
match them, and ``_kernel.py`` builds its ctypes signatures from the same declaration."""

DEVICE_NAMES = tuple(d.name for d in DEVICE)
COLUMN_NAMES = tuple(c.name for c in COLUMNS)
DEVICE_INDEX = {name: i for i, name in enumerate(DEVICE_NAMES)}
"""A device value's position in a kernel's output row, by name."""
COLUMN = {name: i for i, name in enumerate(COLUMN_NAMES)}
"""A column's position in a record's table, by name."""

_REDUCES = ("sum", "min", "max", "nonzero", "nonfinite")
_MERGES = ("add", "min", "max", "pairs")
_REPEATS = ("add", "min", "max", "first")
_REQUIRED_DEVICE = ["sum", "sumsq", "min", "max", "nonzero", "nonfinite"]
_REQUIRED_COLUMNS = [
    "count",
    "sum",
    "sumsq",
    "min",
    "max",
    "zeros",
    "nonfinite",
    "units",
    "dead",
    "samples",
    "active",
]


def _check() -> None:
    """The rules the code that reads the schema relies on; raises ``ValueError`` naming the broken one."""
    problems = []
    for value in DEVICE:
        if value.reduce not in _REDUCES:
            problems.append(f"device value {value.name!r}: reduce {value.reduce!r} is not one of {_REDUCES}")
        if (value.reduce == "sum") != bool(value.term):
            problems.append(f"device value {value.name!r}: a term goes with reduce='sum' and only with it")
        if value.reduce != "sum" and value.name != value.reduce:
            problems.append(f"device value {value.name!r} must be named {value.reduce!r}, as it is reduced")
    for column in COLUMNS:
        if column.merge not in _MERGES or column.repeat not in _REPEATS:
            problems.append(f"column {column.name!r}: merge one of {_MERGES}, repeat one of {_REPEATS}")
        if column.device and column.name not in DEVICE_NAMES:
            problems.append(f"column {column.name!r} copies a device value of that name, and there is none")
    for name in _REQUIRED_DEVICE:
        if name not in DEVICE_NAMES:
            problems.append(f"device value {name!r} is missing (the kernels and the assembly read it)")
    for name in _REQUIRED_COLUMNS:
        if name not in COLUMN_NAMES:
            problems.append(f"column {name!r} is missing (the assembly writes it)")
    if DEVICE_NAMES[-1:] != ("nonfinite",):
        problems.append("device value 'nonfinite' must be the last (the torch path may leave it out)")
    for names in (DEVICE_NAMES, COLUMN_NAMES, tuple(name for name, _ in DERIVED)):
        if len(set(names)) != len(names):
            problems.append(f"names repeat in {names}")
    derived = {name for name, _ in DERIVED}
    if derived & set(COLUMN_NAMES):
        problems.append(f"derived statistics {sorted(derived & set(COLUMN_NAMES))} are also columns")
    if problems:
        raise ValueError("streamwatch's column schema is inconsistent: " + "; ".join(problems))


_check()


def _signature() -> str:
    """Every declaration above that the compiled kernel depends on, as one line of text."""
    device = ",".join(f"{d.name}:{d.reduce}:{d.term}:{'wide' if d.wide else 'T'}" for d in DEVICE)
    columns = ",".join(f"{c.name}:{c.merge}:{c.repeat}:{int(c.device)}:{int(c.nan_unknown)}" for c in COLUMNS)
    activity = ",".join(f"{ctype} {name}" for name, ctype in ACTIVITY)
    entries = ";".join(f"{name}({','.join(t for _, t in params)})" for name, params in ENTRY_POINTS)
    return f"device[{device}] columns[{columns}] activity[{activity}] entries[{entries}]"


SIGNATURE = _signature()
"""The schema as one line: compiled into the kernel (``streamwatch_schema()``), compared at load time."""


def _macro(name: str) -> str:
    return re.sub(r"\W", "_", name).upper()


def c_header() -> str:
    """The C header the kernel is compiled with (``_schema.h``), generated from the declarations above.

    Example:
        >>> header = c_header()
        >>> f"#define SW_NCOLUMNS {len(COLUMNS)}" in header, f"#define SW_NSTATS {len(DEVICE)}" in header
        (True, True)
    """
    lines = [
        "/* Generated from streamwatch/_schema.py by setup.py when the package is built: do not edit. */",
        "#ifndef STREAMWATCH_SCHEMA_H",
        "#define STREAMWATCH_SCHEMA_H",
        "#include <stdint.h>",
        "",
        "/* _schema.SIGNATURE: streamwatch_schema() returns it, _kernel.py compares it with its own */",
        f'#define SW_SCHEMA "{SIGNATURE}"',
        "",
        "/* the values the kernel writes per tensor (_schema.DEVICE), in order */",
        f"#define SW_NSTATS {len(DEVICE)}",
        *(f"#define SW_STAT_{_macro(d.name)} {i} /* {d.meaning} */" for i, d in enumerate(DEVICE)),
        "",
        "/* the columns of a record's table (_schema.COLUMNS), in order */",
        f"#define SW_NCOLUMNS {len(COLUMNS)}",
        *(f"#define SW_COL_{_macro(c.name)} {i} /* {c.meaning} */" for i, c in enumerate(COLUMNS)),
        "",
        "/* every device value: X(name, index) */",
        "#define SW_DEVICE(X) " + " ".join(f"X({d.name}, {i})" for i, d in enumerate(DEVICE)),
        "",
        "/* the fused pass's lane sums: X(name, lane type, term of the element v); T is the element type,",
        " * LANE_WIDE the float64 lane type of wide sums */",
        "#define SW_LANE_SUMS(X) "
        + " ".join(
            f"X({d.name}, {'LANE_WIDE' if d.wide else 'T'}, {_lane_term(d)})"
            for d in DEVICE
            if d.reduce == "sum"
        ),
        "",
        "/* device values a column copies as they are: X(value index, column index) */",
        "#define SW_COPIED(X) "
        + " ".join(f"X(SW_STAT_{_macro(c.name)}, SW_COL_{_macro(c.name)})" for c in COLUMNS if c.device),
        "",
        "/* a tensor's device values, accumulated in float64 */",
        "typedef struct {",
        *(f"    double {d.name};" for d in DEVICE),
        "} stats_t;",
        "",
        '/* what "active" means for per-unit activity (_schema.ACTIVITY; _kernel.Activity mirrors it) */',
        "typedef struct {",
        *(f"    {ctype} {name};" for name, ctype in ACTIVITY),
        "} activity_t;",
        "",
        "/* the ctypes entry points (_schema.ENTRY_POINTS): their definitions must match */",
        *(_prototype(name, params, suffix, t) for name, params in ENTRY_POINTS for suffix, t in _SUFFIXES),
        "const char *streamwatch_schema(void);",
        "",
        "#endif",
        "",
    ]
    return "\n".join(lines)


_SUFFIXES = (("f32", "float"), ("f64", "double"))


def _prototype(name: str, params: tuple[tuple[str, str], ...], suffix: str, t: str) -> str:
    """The C prototype of one entry point for one element type ``t``."""
    declared = (re.sub(r"\bT\b", t, ctype) + ("" if ctype.endswith("*") else " ") + p for p, ctype in params)
    return f"int {name}_{suffix}({', '.join(declared)});"


def _lane_term(value: DeviceValue) -> str:
    """A lane sum's term with ``v`` read in the lane's type (a wide sum converts the element first)."""
    term = re.sub(r"\bv\b", "(LANE_WIDE)v", value.term) if value.wide else value.term
    return f"({term})"


if __name__ == "__main__":
    print(c_header(), end="")
