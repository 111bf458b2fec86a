"""The Triton kernels of the CUDA summaries (imported only by ``_triton``, and only where Triton imports).

Three kernels, each writing *partials* — one row of :data:`NPART` float64 values per program, in the
schema's device order (``_schema.DEVICE``) plus a NaN count — into a step-wide arena; one finalize per
step reduces every summary's partials, in a fixed order, into the step's table:

* :func:`flat_partials`: a contiguous tensor, or a pack of parameters (``_torchpath.Packing``: one
  program per chunk, its valid elements read from ``valid``, the zero padding never read);
* :func:`tile_partials`: a tensor seen as ``[B, U, P]`` through strides (samples, units, positions): one
  program per sample and block of units, looping over the positions — with ``UNITS``, also per-unit
  activity (kept per element of the block and reduced over positions once, after the loop: a reduction
  across warps at every iteration cost up to 2.5× the kernel's time on an H200), each program adding 0/1
  per unit to an int32 count with an integer atomic (exact, so the result is the same whatever order
  the programs run in);
* :func:`finalize`: one program per summary, adding its partials in order (float64), taking min/max,
  NaN min/max where an element was NaN.

Their main loops do only what every element needs — five running sums, the nonzero count, min and max:
eight float operations, 13.5–16 SASS instructions per element for ``sm_90`` where testing each element
for NaN and ±inf took 26–40 (``benchmarks/gpu/instructions.py``). A program whose sum of |x| comes out
non-finite reads its elements a second time, counting NaN and ±inf and taking min, max and unit
activity without NaN. Whole blocks are read without a position mask, the last partial one with. Each
thread adds the elements of one 16-byte load together at once (``R`` of them along the contiguous
dimension: no exchange between threads), so it keeps one running value per statistic and load rather
than one per element: 64–96 registers per thread where it took 112–127, so an SM holds 20–32 warps
(and their loads in flight) instead of 16.

Elements are loaded in their own dtype and converted after the load (bf16/fp16 accumulate in float32,
float64 in float64): the Triton interpreter (``TRITON_INTERPRET=1``, CPU tensors) runs them as they are,
which is how the tests check them without a GPU. No float atomics anywhere.

Example (on CPU, through the interpreter)::

    TRITON_INTERPRET=1 STREAMWATCH_KERNEL=triton python -c \\
        "import torch, streamwatch._triton as t; print(t.summarize_values(torch.ones(5)))"
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # (only streamwatch._triton imports this module, and only where Triton is)
    raise ImportError(
        "streamwatch._triton_kernels needs triton (it comes with Linux CUDA wheels of torch); without it "
        "CUDA tensors take the torch path"
    ) from exc

from streamwatch._schema import DEVICE_INDEX

C_SUM = tl.constexpr(DEVICE_INDEX["sum"])
C_SUMSQ = tl.constexpr(DEVICE_INDEX["sumsq"])
C_MIN = tl.constexpr(DEVICE_INDEX["min"])
C_MAX = tl.constexpr(DEVICE_INDEX["max"])
C_NONZERO = tl.constexpr(DEVICE_INDEX["nonzero"])
C_SUMABS = tl.constexpr(DEVICE_INDEX["sumabs"])
C_SUMCUBE = tl.constexpr(DEVICE_INDEX["sumcube"])
C_SUMFOURTH = tl.constexpr(DEVICE_INDEX["sumfourth"])
C_NONFINITE = tl.constexpr(DEVICE_INDEX["nonfinite"])
C_NAN = tl.constexpr(len(DEVICE_INDEX))
NPART = tl.constexpr(len(DEVICE_INDEX) + 1)
"""Values per partials row: the device values in the schema's order, then the NaN count."""
_COLS = tl.constexpr(16)  # NPART rounded up to a power of two (a block's width in finalize)
_INF = tl.constexpr(float("inf"))


@triton.jit
def _sums(f, AX: tl.constexpr, s1, s2, s3, s4, sa):
    """Add a block of elements ``f`` (0 where a lane holds none), summed along ``AX`` — the elements of
    each thread's own 16-byte load, no exchange between threads — to a program's running sums, which it
    returns. The main loops test nothing else per element: no NaN or ±inf test (a non-finite element
    makes ``sa`` non-finite, and :func:`_nonfinite` then counts them in a second pass) and no mask on
    min/max but in the last, partial block: half the instructions per element the kernels had when every
    block counted everything (docs/performance.md, *The Triton kernels*)."""
    sq = f * f
    return (
        s1 + tl.sum(f, AX),
        s2 + tl.sum(sq, AX),
        s3 + tl.sum(sq * f, AX),
        s4 + tl.sum(sq * sq, AX),
        sa + tl.sum(tl.abs(f), AX),
    )


@triton.jit
def _nonfinite(v, nf, nan):
    """Add a block's non-finite and NaN counts (lanes without an element hold 0)."""
    return nf + ((v - v) != 0).to(tl.int32), nan + (v != v).to(tl.int32)  # (v − v: NaN at NaN and ±inf)


@triton.jit
def _store_partials(out, s1, s2, s3, s4, sa, nz, nf, nan, lo, hi):
    """Store one program's reduced values at ``out`` (a partials row)."""
    tl.store(out + C_SUM, s1.to(tl.float64))
    tl.store(out + C_SUMSQ, s2.to(tl.float64))
    tl.store(out + C_MIN, lo.to(tl.float64))
    tl.store(out + C_MAX, hi.to(tl.float64))
    tl.store(out + C_NONZERO, nz.to(tl.float64))
    tl.store(out + C_SUMABS, sa.to(tl.float64))
    tl.store(out + C_SUMCUBE, s3.to(tl.float64))
    tl.store(out + C_SUMFOURTH, s4.to(tl.float64))
    tl.store(out + C_NONFINITE, nf.to(tl.float64))
    tl.store(out + C_NAN, nan.to(tl.float64))


@triton.jit
def flat_partials(
    x,
    minus,
    valid,
    n,
    per_program,
    partials,
    first,
    WIDE: tl.constexpr,
    PACKED: tl.constexpr,
    DIFF: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Partials of ``x[pid·per_program : …]`` (at most ``n`` elements in all) into row ``first + pid``.
    ``PACKED``: program ``pid`` reads chunk ``pid`` (``per_program`` = the chunk size) up to its
    ``valid[pid]`` elements. ``DIFF``: of ``x − minus`` element by element (an update: the weights after
    the step and before it), the difference never stored. Whole blocks are read without a mask, the
    last, partial one with; each thread adds the ``R`` elements of its 16-byte load together (one
    running value per statistic and load); non-finite elements are counted in a second pass, only when
    ``x`` has one."""
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * per_program
    if PACKED:  # noqa: SIM108 (a static branch on a constexpr, as Triton compiles it)
        end = start + tl.load(valid + pid)
    else:
        end = tl.minimum(start + per_program, n)
    whole = start + (end - start) // BLOCK * BLOCK
    acc = tl.float64 if WIDE else tl.float32
    R: tl.constexpr = 128 // x.dtype.element_ty.primitive_bitwidth  # (one 16-byte load per thread)
    L: tl.constexpr = BLOCK // R
    s1 = tl.zeros([L], acc)
    s2 = tl.zeros([L], acc)
    s3 = tl.zeros([L], acc)
    s4 = tl.zeros([L], acc)
    sa = tl.zeros([L], acc)
    lo = tl.full([L], _INF, acc)
    hi = tl.full([L], -_INF, acc)
    nz = tl.zeros([L], tl.int32)
    for off in range(start, whole, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        v = tl.load(x + idx).to(acc)
        if DIFF:
            v = v - tl.load(minus + idx).to(acc)
        v2 = tl.reshape(v, [L, R])
        s1, s2, s3, s4, sa = _sums(v2, 1, s1, s2, s3, s4, sa)
        nz += tl.sum((v2 != 0).to(tl.int32), 1)
        lo = tl.minimum(lo, tl.min(v2, 1))
        hi = tl.maximum(hi, tl.max(v2, 1))
    idx = whole + tl.arange(0, BLOCK)  # the partial block (or none)
    m = idx < end
    v = tl.load(x + idx, mask=m, other=0.0).to(acc)
    if DIFF:
        v = v - tl.load(minus + idx, mask=m, other=0.0).to(acc)
    v2 = tl.reshape(v, [L, R])
    m2 = tl.reshape(m, [L, R])
    s1, s2, s3, s4, sa = _sums(v2, 1, s1, s2, s3, s4, sa)
    nz += tl.sum((v2 != 0).to(tl.int32), 1)
    lo = tl.minimum(lo, tl.min(tl.where(m2, v2, _INF), 1))
    hi = tl.maximum(hi, tl.max(tl.where(m2, v2, -_INF), 1))
    total_abs = tl.sum(sa, 0)
    nf_n = tl.sum(tl.zeros([BLOCK], tl.int32), 0)
    nan_n = tl.sum(tl.zeros([BLOCK], tl.int32), 0)
    if (total_abs != total_abs) | (total_abs == _INF):  # a NaN or ±inf (or a finite overflow): count them
        nf = tl.zeros([BLOCK], tl.int32)
        nan = tl.zeros([BLOCK], tl.int32)
        lo2 = tl.full([BLOCK], _INF, acc)  # (min and max again, without NaN: the interpreter's minimum
        hi2 = tl.full([BLOCK], -_INF, acc)  # keeps a NaN that a GPU's skips)
        for off in range(start, end, BLOCK):
            idx = off + tl.arange(0, BLOCK)
            m = idx < end
            v = tl.load(x + idx, mask=m, other=0.0).to(acc)
            if DIFF:
                v = v - tl.load(minus + idx, mask=m, other=0.0).to(acc)
            nf, nan = _nonfinite(v, nf, nan)
            lo2 = tl.minimum(lo2, tl.where(m & (v == v), v, _INF))
            hi2 = tl.maximum(hi2, tl.where(m & (v == v), v, -_INF))
        nf_n = tl.sum(nf, 0)
        nan_n = tl.sum(nan, 0)
        lo = tl.min(tl.reshape(lo2, [L, R]), 1)
        hi = tl.max(tl.reshape(hi2, [L, R]), 1)
    _store_partials(
        partials + (first + pid).to(tl.int64) * NPART,
        tl.sum(s1, 0),
        tl.sum(s2, 0),
        tl.sum(s3, 0),
        tl.sum(s4, 0),
        total_abs,
        tl.sum(nz, 0),
        nf_n,
        nan_n,
        tl.min(lo, 0),
        tl.max(hi, 0),
    )


@triton.jit
def _bounded(v, bound_lo, bound_hi, tol_lo, tol_hi, HAS_LO: tl.constexpr, HAS_HI: tl.constexpr):
    """Whether each element is active against finite bounds: not NaN and farther than ``tol`` from each
    bound there is (``HAS_LO``/``HAS_HI``), as the C kernel decides (NaN fails every comparison)."""
    on = v == v
    if HAS_LO:
        on = on & (tl.abs(v - bound_lo) > tol_lo)
    if HAS_HI:
        on = on & (tl.abs(v - bound_hi) > tol_hi)
    return on


@triton.jit
def _folded(v, FOLD: tl.constexpr, R: tl.constexpr):
    """A ``[BU, BP]`` block as three dimensions, the one :func:`tile_partials` reduces in its loop (each
    thread's own ``R`` elements, no exchange between threads) in the middle (``FOLD`` 1: ``R`` units) or
    last (2: ``R`` positions; 0: ``R`` is 1)."""
    if FOLD == 1:
        out = tl.reshape(v, [v.shape[0] // R, R, v.shape[1]])
    else:
        out = tl.reshape(v, [v.shape[0], v.shape[1] // R, R])
    return out


@triton.jit
def _per_unit(x, FOLD: tl.constexpr, R: tl.constexpr, ANY: tl.constexpr = False):
    """Integer counts (``ANY``: 0/1 flags) of a ``[BU, BP]`` block with each thread's own ``R``
    positions added (any one set) where they lie along positions (``FOLD`` 2): still one value per unit
    and lane, for activity. Units folded (1) would mix units: those stay per element."""
    if FOLD == 1:
        out = x
    elif ANY:
        out = tl.max(_folded(x, FOLD, R), 2)
    else:
        out = tl.sum(_folded(x, FOLD, R), 2)
    return out


@triton.jit
def tile_partials(
    x,
    U,
    P,
    sb,
    su,
    sp,
    per_split,
    partials,
    first,
    counts,
    flags,
    bound_lo,
    bound_hi,
    tol_lo,
    tol_hi,
    WIDE: tl.constexpr,
    UNITS: tl.constexpr,
    BOUNDED: tl.constexpr,
    HAS_LO: tl.constexpr,
    HAS_HI: tl.constexpr,
    BU: tl.constexpr,
    BP: tl.constexpr,
    FOLD: tl.constexpr,
    EVEN_U: tl.constexpr,
):
    """Partials of sample ``b`` (axis 0), units ``[t·BU, …)`` (axis 1) and positions
    ``[s·per_split, …)`` (axis 2) of ``x`` seen as ``[B, U, P]`` with strides ``(sb, su, sp)``, into row
    ``first + (b·T + t)·S + s``. With ``UNITS``, each of those units active at any of those positions —
    nonzero and not NaN, or with ``BOUNDED`` not NaN and farther than ``tol`` from each finite bound
    (``HAS_LO``/``HAS_HI``), as the C kernel decides — sets its (sample, unit) flag, and the program that
    set it first adds 1 to ``counts[u]`` (integer atomics: exact, in any order). As in
    :func:`flat_partials`, whole blocks of positions are read without a position mask, each thread adds
    its own elements along the contiguous dimension (``FOLD``, :func:`_folded`) into one running value
    per statistic, and non-finite elements are counted in a second pass only where there is one;
    unbounded activity is read off the per-unit nonzero counts (recounted without NaN in that pass).
    ``EVEN_U``: ``U`` is a multiple of ``BU`` (no unit mask)."""
    b = tl.program_id(0)
    t = tl.program_id(1)
    s = tl.program_id(2)
    acc = tl.float64 if WIDE else tl.float32
    R: tl.constexpr = 128 // x.dtype.element_ty.primitive_bitwidth if FOLD != 0 else 1
    AX: tl.constexpr = 1 if FOLD == 1 else 2
    u = t * BU + tl.arange(0, BU)
    um = u < U
    rows = x + b.to(tl.int64) * sb + u.to(tl.int64)[:, None] * su
    zero = tl.sum(_folded(tl.zeros([BU, BP], acc), FOLD, R), AX)  # (a running value's shape)
    s1 = zero
    s2 = zero
    s3 = zero
    s4 = zero
    sa = zero
    lo = zero + _INF
    hi = zero - _INF
    nz = _per_unit(tl.zeros([BU, BP], tl.int32), FOLD, R)  # (by unit: activity is read off it)
    active = nz  # (bounded activity; reduced over positions once, at the end)
    p_start = s * per_split
    p_end = tl.minimum(p_start + per_split, P)
    whole = p_start + (p_end - p_start) // BP * BP
    rm = um[:, None]  # (units past U: their lanes hold 0 and are left out of min, max and the counts)
    for p0 in range(p_start, whole, BP):
        p = p0 + tl.arange(0, BP)
        if EVEN_U:
            v = tl.load(rows + p.to(tl.int64)[None, :] * sp).to(acc)
            low = v
            high = v
        else:
            v = tl.load(rows + p.to(tl.int64)[None, :] * sp, mask=rm, other=0.0).to(acc)
            low = tl.where(rm, v, _INF)
            high = tl.where(rm, v, -_INF)
        s1, s2, s3, s4, sa = _sums(_folded(v, FOLD, R), AX, s1, s2, s3, s4, sa)
        lo = tl.minimum(lo, tl.min(_folded(low, FOLD, R), AX))
        hi = tl.maximum(hi, tl.max(_folded(high, FOLD, R), AX))
        nz += _per_unit((v != 0).to(tl.int32), FOLD, R)
        if UNITS and BOUNDED:
            on = _bounded(v, bound_lo, bound_hi, tol_lo, tol_hi, HAS_LO, HAS_HI)
            active = tl.maximum(active, _per_unit(on.to(tl.int32), FOLD, R, True))
    p = whole + tl.arange(0, BP)  # the partial block of positions (or none)
    m = rm & (p < p_end)[None, :]
    v = tl.load(rows + p.to(tl.int64)[None, :] * sp, mask=m, other=0.0).to(acc)
    s1, s2, s3, s4, sa = _sums(_folded(v, FOLD, R), AX, s1, s2, s3, s4, sa)
    lo = tl.minimum(lo, tl.min(_folded(tl.where(m, v, _INF), FOLD, R), AX))
    hi = tl.maximum(hi, tl.max(_folded(tl.where(m, v, -_INF), FOLD, R), AX))
    nz += _per_unit((v != 0).to(tl.int32), FOLD, R)
    if UNITS:
        if BOUNDED:
            on = m & _bounded(v, bound_lo, bound_hi, tol_lo, tol_hi, HAS_LO, HAS_HI)
            active = tl.maximum(active, _per_unit(on.to(tl.int32), FOLD, R, True))
        else:
            active = (nz > 0).to(tl.int32)  # (a NaN counts as nonzero: recounted below)
    total_abs = tl.sum(tl.sum(sa, 1), 0)
    low_n = tl.min(tl.min(lo, 1), 0)
    high_n = tl.max(tl.max(hi, 1), 0)
    nf_n = tl.sum(tl.zeros([BU], tl.int32), 0)
    nan_n = tl.sum(tl.zeros([BU], tl.int32), 0)
    if (total_abs != total_abs) | (total_abs == _INF):  # a NaN or ±inf (or a finite overflow): count them
        nf = tl.zeros([BU, BP], tl.int32)
        nan = tl.zeros([BU, BP], tl.int32)
        nonzero = tl.zeros([BU, BP], tl.int32)
        lo2 = tl.full([BU, BP], _INF, acc)  # (min and max again, without NaN, as in flat_partials)
        hi2 = tl.full([BU, BP], -_INF, acc)
        for p0 in range(p_start, p_end, BP):
            p = p0 + tl.arange(0, BP)
            m = rm & (p < p_end)[None, :]
            v = tl.load(rows + p.to(tl.int64)[None, :] * sp, mask=m, other=0.0).to(acc)
            nf, nan = _nonfinite(v, nf, nan)
            number = m & (v == v)
            nonzero = tl.maximum(nonzero, (number & (v != 0)).to(tl.int32))
            lo2 = tl.minimum(lo2, tl.where(number, v, _INF))
            hi2 = tl.maximum(hi2, tl.where(number, v, -_INF))
        nf_n = tl.sum(tl.sum(nf, 1), 0)
        nan_n = tl.sum(tl.sum(nan, 1), 0)
        low_n = tl.min(tl.min(lo2, 1), 0)
        high_n = tl.max(tl.max(hi2, 1), 0)
        if UNITS and not BOUNDED:
            active = _per_unit(nonzero, FOLD, R, True)
    _store_partials(
        partials + (first + (b * tl.num_programs(1) + t) * tl.num_programs(2) + s).to(tl.int64) * NPART,
        tl.sum(tl.sum(s1, 1), 0),
        tl.sum(tl.sum(s2, 1), 0),
        tl.sum(tl.sum(s3, 1), 0),
        tl.sum(tl.sum(s4, 1), 0),
        total_abs,
        tl.sum(tl.sum(nz, 1), 0),
        nf_n,
        nan_n,
        low_n,
        high_n,
    )
    if UNITS:  # the first program to find (b, u) active counts it
        unit_active = tl.max(active, 1)
        seen = tl.atomic_max(flags + b.to(tl.int64) * U + u, unit_active, mask=um)
        tl.atomic_add(counts + u, tl.where(seen == 0, unit_active, 0), mask=um)


@triton.jit
def finalize(partials, starts, lengths, out, NCOL: tl.constexpr, BLOCK: tl.constexpr):
    """Row ``r`` of ``out`` (``NCOL`` device values in the schema's order) from partials rows
    ``starts[r] …`` (``lengths[r]`` of them), added in order."""
    r = tl.program_id(0)
    start = tl.load(starts + r)
    length = tl.load(lengths + r)
    cols = tl.arange(0, _COLS)
    cm = cols < NPART
    total = tl.zeros([_COLS], tl.float64)
    lo = tl.full([_COLS], _INF, tl.float64)
    hi = tl.full([_COLS], -_INF, tl.float64)
    for i in range(0, length, BLOCK):
        k = i + tl.arange(0, BLOCK)
        rm = k < length
        m = rm[:, None] & cm[None, :]
        tile = tl.load(
            partials + (start + k).to(tl.int64)[:, None] * NPART + cols[None, :], mask=m, other=0.0
        )
        total += tl.sum(tile, 0)
        lo = tl.minimum(lo, tl.min(tl.where(m, tile, _INF), 0))
        hi = tl.maximum(hi, tl.max(tl.where(m, tile, -_INF), 0))
    nans = tl.sum(tl.where(cols == C_NAN, total, 0.0), 0)
    value = tl.where(cols == C_MIN, lo, tl.where(cols == C_MAX, hi, total))
    nan_here = ((cols == C_MIN) | (cols == C_MAX)) & (
        (tl.zeros([_COLS], tl.float64) + nans) > 0
    )  # (a vector: the
    value = tl.where(nan_here, float("nan"), value)  # interpreter cannot AND a vector with a scalar)
    tl.store(out + r.to(tl.int64) * NCOL + cols, value, mask=cols < NCOL)
