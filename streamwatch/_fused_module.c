/* Makes the fused kernel's shared library a valid CPython extension module, so that setuptools'
 * build_ext builds, names and installs it like any other (see setup.py). The kernel's functions live in
 * _fused.c and are called through ctypes from _kernel.py. The module itself has functions for the
 * calls per step where a ctypes call costs too much: the value of the float32 at an address (a step's
 * CPU loss, _boundary.py), the correct predictions of a CPU batch of class scores (train accuracy on a
 * sampled step, _accuracy.py), and the worker's summary table of a step
 * (assemble, _record.py; numpy's _summary.finalize is the reference and the fallback). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <string.h>

#include <_schema.h> /* generated from _schema.py by setup.py: the columns and the kernel values */

/* The address a Python int holds; NULL (no exception set) for 0, NULL with one for anything else. */
static void *address_of(PyObject *arg) {
    if (!PyLong_Check(arg)) {
        PyErr_Format(PyExc_TypeError, "expected an address (an int), got %.100s", Py_TYPE(arg)->tp_name);
        return NULL;
    }
    return PyLong_AsVoidPtr(arg);
}

/* The float32 at an address as a Python float (a sampled step's CPU loss, _observe.py). NaN for
 * address 0. */
static PyObject *scalar_f32(PyObject *self, PyObject *arg) {
    (void)self;
    void *p = address_of(arg);
    if (p == NULL) return PyErr_Occurred() ? NULL : PyFloat_FromDouble(NAN);
    float v;
    memcpy(&v, p, sizeof v);
    return PyFloat_FromDouble((double)v);
}

/* How many rows of a contiguous [n, c] score matrix have their argmax at the contiguous int64 target:
 * torch's (outputs.argmax(-1) == targets).sum() for a CPU batch, with argmax's rules: the first
 * maximum wins, and a NaN is the maximum (the first NaN wins). */
#define CORRECT(T, NAME)                                                                           \
    static PyObject *NAME(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {              \
        (void)self;                                                                                \
        if (nargs != 4) {                                                                          \
            PyErr_Format(PyExc_TypeError, #NAME "() takes 4 arguments (%zd given)", nargs);        \
            return NULL;                                                                           \
        }                                                                                          \
        const T *scores = address_of(args[0]);                                                     \
        if (scores == NULL && PyErr_Occurred()) return NULL;                                       \
        const int64_t *targets = address_of(args[1]);                                              \
        if (targets == NULL && PyErr_Occurred()) return NULL;                                      \
        const Py_ssize_t n = PyLong_AsSsize_t(args[2]), c = PyLong_AsSsize_t(args[3]);             \
        if (PyErr_Occurred()) return NULL;                                                         \
        if (n < 0 || c < 1 || ((scores == NULL || targets == NULL) && n > 0)) {                    \
            PyErr_Format(PyExc_ValueError, #NAME "(): %zd rows of %zd classes at NULL", n, c);     \
            return NULL;                                                                           \
        }                                                                                          \
        double correct = 0;                                                                        \
        for (Py_ssize_t i = 0; i < n; i++) {                                                       \
            const T *row = scores + i * c;                                                         \
            Py_ssize_t best = 0;                                                                   \
            T top = row[0];                                                                        \
            if (top == top) {                                                                      \
                for (Py_ssize_t j = 1; j < c; j++) {                                               \
                    const T v = row[j];                                                            \
                    if (v != v) { best = j; break; }                                               \
                    if (v > top) { top = v; best = j; }                                            \
                }                                                                                  \
            }                                                                                      \
            correct += targets[i] == (int64_t)best;                                                \
        }                                                                                          \
        return PyFloat_FromDouble(correct);                                                        \
    }
CORRECT(float, correct_f32)
CORRECT(double, correct_f64)

/* The summary table's columns and the kernel's values per row, from the schema (_schema.h). */
#define NCOLUMNS SW_NCOLUMNS
#define NSTATS SW_NSTATS

/* A list's item i as a double (an int or a float); -1.0 with an exception set on anything else. */
static double list_double(PyObject *list, Py_ssize_t i) {
    return PyFloat_AsDouble(PyList_GET_ITEM(list, i));
}

static int check_list(PyObject *obj, const char *name, Py_ssize_t n) {
    if (!PyList_Check(obj) || PyList_GET_SIZE(obj) < n) {
        PyErr_Format(PyExc_TypeError, "expected `%s` to be a list of at least %zd numbers", name, n);
        return -1;
    }
    return 0;
}

/* One row of the table from a row's stats v (sum, sumsq, min, max, nonzero[, nonfinite]). */
static void fill_row(double *row, const double *v, double count, double unit, double batch, int counted) {
    row[SW_COL_COUNT] = count;
#define COPY(value, column) row[column] = v[value];
    SW_COPIED(COPY)
#undef COPY
    /* aminmax propagates NaN: zeros, dead unknown */
    const int has_nan = isnan(v[SW_STAT_MIN]) || isnan(v[SW_STAT_MAX]);
    row[SW_COL_ZEROS] = has_nan ? NAN : count - v[SW_STAT_NONZERO];
    row[SW_COL_NONFINITE] = counted ? v[SW_STAT_NONFINITE]
                                    : (double)!(isfinite(v[SW_STAT_SUM]) && isfinite(v[SW_STAT_MIN]) &&
                                                isfinite(v[SW_STAT_MAX]));
    row[SW_COL_UNITS] = unit > 0 ? unit : NAN;
    row[SW_COL_DEAD] = NAN;
    row[SW_COL_SAMPLES] = unit > 0 ? batch : NAN;
    row[SW_COL_ACTIVE] = NAN;
}

/* A unit-row's dead units and active (sample, unit) pairs from its vector of per-unit counts (unknown,
 * NaN, when the row's min or max is NaN). The counts are whole numbers far below 2^53, so every partial
 * sum is exact and the order of the additions cannot change the result (numpy's reduceat, the
 * reference, adds in order): with GCC or Clang, two lanes of two sums each run side by side (a scalar
 * loop converts and adds one count at a time, about four times slower on a wide layer). */
#if defined(__GNUC__)
typedef double pair_d __attribute__((vector_size(16)));
typedef long long pair_l __attribute__((vector_size(16)));
#endif
static void fill_units(double *row, const double *vector, Py_ssize_t length) {
    long long dead = 0;
    double active = 0;
    Py_ssize_t j = 0;
#if defined(__GNUC__)
    pair_l dead0 = {0, 0}, dead1 = {0, 0};
    pair_d active0 = {0, 0}, active1 = {0, 0};
    const pair_d zero = {0, 0};
    for (; j + 4 <= length; j += 4) {
        pair_d x0, x1;
        memcpy(&x0, vector + j, sizeof x0);
        memcpy(&x1, vector + j + 2, sizeof x1);
        dead0 -= (pair_l)(x0 == zero); /* a true comparison is -1 in every bit */
        dead1 -= (pair_l)(x1 == zero);
        active0 += x0;
        active1 += x1;
    }
    dead = dead0[0] + dead0[1] + dead1[0] + dead1[1];
    active = (active0[0] + active1[0]) + (active0[1] + active1[1]);
#endif
    for (; j < length; j++) {
        dead += vector[j] == 0;
        active += vector[j];
    }
    const int has_nan = isnan(row[SW_COL_MIN]) || isnan(row[SW_COL_MAX]);
    row[SW_COL_DEAD] = has_nan ? NAN : (double)dead;
    row[SW_COL_ACTIVE] = has_nan ? NAN : active;
}

/* The number of per-unit counts of unit-row r (units[r]), checked to lie within the n rows and, from
 * offset, within the limit values of where they are read; -1 with an exception set if not. */
static Py_ssize_t unit_length(PyObject *units, Py_ssize_t r, Py_ssize_t n, Py_ssize_t offset,
                              Py_ssize_t limit, const char *where) {
    if (r < 0 || r >= n) {
        PyErr_Format(PyExc_ValueError, "assemble(): unit row %zd is outside the table's %zd rows", r, n);
        return -1;
    }
    const double length = list_double(units, r);
    if (PyErr_Occurred()) return -1;
    if (offset < 0 || !(length >= 0) || (double)offset + length > (double)limit) {
        PyErr_Format(PyExc_ValueError, "assemble(): unit row %zd's counts lie outside %s", r, where);
        return -1;
    }
    return (Py_ssize_t)length;
}

/* assemble(table, host, counts, units, samples, host_units, arena, counted, flat, device_rows, unit_rows,
 * start): the unmerged summary table of a step, what _summary.finalize computes before merging equal keys
 * (_record.PendingRecord.resolve; the numpy code is the reference and the fallback). Rows come from the
 * host table (the fused kernel's), or for device_rows from flat (nstats values each, in order: 6 when
 * counted, else 5); per-unit counts from the arena at each host unit-row's offset, or for unit_rows from
 * flat, one vector after another from index start. */
static PyObject *assemble(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 12) {
        PyErr_Format(PyExc_TypeError, "assemble() takes 12 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *counts = args[2], *units = args[3], *samples = args[4], *host_units = args[5];
    PyObject *device_rows = args[9], *unit_rows = args[10];
    const int counted = PyObject_IsTrue(args[7]);
    if (counted < 0) return NULL;
    const Py_ssize_t start = PyLong_AsSsize_t(args[11]);
    if (start == -1 && PyErr_Occurred()) return NULL;
    const Py_ssize_t nstats = counted ? NSTATS : NSTATS - 1;
    Py_buffer table, host, arena, flat;
    if (PyObject_GetBuffer(args[0], &table, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (PyObject_GetBuffer(args[1], &host, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&table);
        return NULL;
    }
    if (PyObject_GetBuffer(args[6], &arena, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&table);
        PyBuffer_Release(&host);
        return NULL;
    }
    if (PyObject_GetBuffer(args[8], &flat, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&table);
        PyBuffer_Release(&host);
        PyBuffer_Release(&arena);
        return NULL;
    }
    PyObject *result = NULL;
    const Py_ssize_t n = table.len / (Py_ssize_t)(NCOLUMNS * sizeof(double));
    const Py_ssize_t narena = arena.len / (Py_ssize_t)sizeof(double);
    const Py_ssize_t nflat = flat.len / (Py_ssize_t)sizeof(double);
    double *out = table.buf;
    const double *values = host.buf, *vectors = arena.buf, *copied = flat.buf;
    if (table.len != n * (Py_ssize_t)(NCOLUMNS * sizeof(double)) ||
        host.len < n * (Py_ssize_t)(NSTATS * sizeof(double))) {
        PyErr_Format(PyExc_ValueError, "assemble(): the table must be (rows, %d) and the host (>= rows, %d) float64",
                     NCOLUMNS, NSTATS);
        goto done;
    }
    if (check_list(counts, "counts", n) || check_list(units, "units", n) || check_list(samples, "samples", n) ||
        check_list(host_units, "host_units", 0) || check_list(device_rows, "device_rows", 0) ||
        check_list(unit_rows, "unit_rows", 0))
        goto done;
    const Py_ssize_t nd = PyList_GET_SIZE(device_rows);
    if (nd * nstats > nflat) {
        PyErr_Format(PyExc_ValueError, "assemble(): %zd device rows need more than the %zd values copied", nd, nflat);
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) { /* every row as if from the host; device rows are redone below */
        const double count = list_double(counts, i), unit = list_double(units, i), batch = list_double(samples, i);
        if (PyErr_Occurred()) goto done;
        fill_row(out + i * NCOLUMNS, values + i * NSTATS, count, unit, batch, counted);
    }
    for (Py_ssize_t k = 0; k < nd; k++) {
        const Py_ssize_t r = PyLong_AsSsize_t(PyList_GET_ITEM(device_rows, k));
        if (PyErr_Occurred()) goto done;
        if (r < 0 || r >= n) {
            PyErr_Format(PyExc_ValueError, "assemble(): device row %zd is outside the table's %zd rows", r, n);
            goto done;
        }
        double v[NSTATS] = {0};
        memcpy(v, copied + k * nstats, (size_t)nstats * sizeof(double));
        fill_row(out + r * NCOLUMNS, v, list_double(counts, r), list_double(units, r), list_double(samples, r),
                 counted);
    }
    for (Py_ssize_t k = 0; k < PyList_GET_SIZE(host_units); k++) {
        PyObject *pair = PyList_GET_ITEM(host_units, k);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            PyErr_SetString(PyExc_TypeError, "assemble(): `host_units` holds (row, offset) pairs");
            goto done;
        }
        const Py_ssize_t r = PyLong_AsSsize_t(PyTuple_GET_ITEM(pair, 0));
        const Py_ssize_t offset = PyLong_AsSsize_t(PyTuple_GET_ITEM(pair, 1));
        if (PyErr_Occurred()) goto done;
        const Py_ssize_t length = unit_length(units, r, n, offset, narena, "the arena");
        if (length < 0) goto done;
        fill_units(out + r * NCOLUMNS, vectors + offset, length);
    }
    Py_ssize_t at = start;
    for (Py_ssize_t k = 0; k < PyList_GET_SIZE(unit_rows); k++) {
        const Py_ssize_t r = PyLong_AsSsize_t(PyList_GET_ITEM(unit_rows, k));
        if (PyErr_Occurred()) goto done;
        const Py_ssize_t length = unit_length(units, r, n, at, nflat, "the values copied");
        if (length < 0) goto done;
        fill_units(out + r * NCOLUMNS, copied + at, length);
        at += length;
    }
    result = PyLong_FromSsize_t(at);
done:
    PyBuffer_Release(&table);
    PyBuffer_Release(&host);
    PyBuffer_Release(&arena);
    PyBuffer_Release(&flat);
    return result;
}

/* ewm_fold(xs, n, mean, dev, spikes, last, threshold, alpha, warmup, kind, mad_to_sigma, scale_floor)
 * -> (n, mean, dev, score, fresh, spikes, last): a smoothed detector's fold of one record's values over
 * its series (streamwatch._detectors._Smoothed.fold is the reference and the fallback; every operation
 * here is the reference's, in its order, so the results are the same bits). kind 0 scores a loss
 * (LossSpike._score: a robust z-score), kind 1 a gradient norm (GradientSpike._score: a ratio). */
static void ewm_score(int kind, double m, double d, double x, double threshold, double mad_to_sigma,
                     double scale_floor, double *score, double *low, double *high) {
    if (kind == 0) {
        const double a = mad_to_sigma * d;
        double floor = fabs(m);
        if (1.0 > floor) floor = 1.0;
        floor = scale_floor * floor;
        const double scale = floor > a ? floor : a; /* Python's max(a, floor) */
        const double margin = threshold * scale;
        *score = (x - m) / scale;
        *low = m - margin;
        *high = m + margin;
    } else if (m > 0) {
        *score = x / m;
        *low = -INFINITY;
        *high = threshold * m;
    } else {
        *score = NAN;
        *low = -INFINITY;
        *high = INFINITY;
    }
}

static PyObject *ewm_fold(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 12) {
        PyErr_Format(PyExc_TypeError, "ewm_fold() takes 12 arguments (%zd given)", nargs);
        return NULL;
    }
    for (int i = 0; i < 6; i++) {
        if (!PyTuple_Check(args[i])) {
            PyErr_SetString(PyExc_TypeError, "ewm_fold(): the values and the state are tuples");
            return NULL;
        }
    }
    const Py_ssize_t k = PyTuple_GET_SIZE(args[0]);
    for (int i = 1; i < 6; i++) {
        if (PyTuple_GET_SIZE(args[i]) != k) {
            PyErr_SetString(PyExc_ValueError, "ewm_fold(): the values and the state differ in length");
            return NULL;
        }
    }
    const double threshold = PyFloat_AsDouble(args[6]), alpha = PyFloat_AsDouble(args[7]);
    const long long warmup = PyLong_AsLongLong(args[8]);
    const long kind = PyLong_AsLong(args[9]);
    const double mad_to_sigma = PyFloat_AsDouble(args[10]), scale_floor = PyFloat_AsDouble(args[11]);
    if (PyErr_Occurred()) return NULL;
    PyObject *out[7] = {NULL};
    for (int i = 0; i < 7; i++) {
        if ((out[i] = PyTuple_New(k)) == NULL) goto fail;
    }
    for (Py_ssize_t j = 0; j < k; j++) {
        const double x = PyFloat_AsDouble(PyTuple_GET_ITEM(args[0], j));
        long long n = PyLong_AsLongLong(PyTuple_GET_ITEM(args[1], j));
        double m = PyFloat_AsDouble(PyTuple_GET_ITEM(args[2], j));
        double d = PyFloat_AsDouble(PyTuple_GET_ITEM(args[3], j));
        long long spikes = PyLong_AsLongLong(PyTuple_GET_ITEM(args[4], j));
        double last = PyFloat_AsDouble(PyTuple_GET_ITEM(args[5], j));
        if (PyErr_Occurred()) goto fail;
        double score = NAN;
        int fresh = 0;
        if (isfinite(x)) {
            fresh = 1;
            double entering = x;
            if (n >= warmup) {
                double low, high;
                ewm_score((int)kind, m, d, x, threshold, mad_to_sigma, scale_floor, &score, &low, &high);
                if (score > threshold) spikes += 1;
                if (score == score) last = score;
                entering = low > x ? low : x;
                entering = high < entering ? high : entering;
            }
            if (n) {
                const double a = 1.0 / (double)n;
                d += (a > alpha ? a : alpha) * (fabs(entering - m) - d);
            }
            const double a = 1.0 / (double)(n + 1);
            m += (a > alpha ? a : alpha) * (entering - m);
            n += 1;
        }
        PyObject *items[7] = {
            PyLong_FromLongLong(n),         PyFloat_FromDouble(m),  PyFloat_FromDouble(d),
            PyFloat_FromDouble(score),      PyBool_FromLong(fresh), PyLong_FromLongLong(spikes),
            PyFloat_FromDouble(last),
        };
        for (int i = 0; i < 7; i++) {
            if (items[i] == NULL) {
                for (int r = 0; r < 7; r++) Py_XDECREF(items[r]);
                goto fail;
            }
            PyTuple_SET_ITEM(out[i], j, items[i]);
        }
    }
    return Py_BuildValue("(NNNNNNN)", out[0], out[1], out[2], out[3], out[4], out[5], out[6]);
fail:
    for (int i = 0; i < 7; i++) Py_XDECREF(out[i]);
    return NULL;
}

static PyMethodDef fused_methods[] = {
    {"scalar_f32", scalar_f32, METH_O,
     "scalar_f32(address) -> float: the float32 at ``address`` (a live CPU tensor's data_ptr()); NaN for "
     "address 0."},
    {"correct_f32", (PyCFunction)(void (*)(void))correct_f32, METH_FASTCALL,
     "correct_f32(scores, targets, n, c) -> float: rows of the contiguous float32 [n, c] scores at address "
     "``scores`` whose argmax (first maximum; a NaN is the maximum) equals the int64 at ``targets``."},
    {"correct_f64", (PyCFunction)(void (*)(void))correct_f64, METH_FASTCALL,
     "correct_f64(scores, targets, n, c) -> float: the same for float64 scores."},
    {"assemble", (PyCFunction)(void (*)(void))assemble, METH_FASTCALL,
     "assemble(table, host, counts, units, samples, host_units, arena, counted, flat, device_rows, "
     "unit_rows, start) -> int: fill ``table`` ((rows, len(COLUMNS)) float64) with a step's unmerged summary table "
     "(see streamwatch._summary.finalize, the reference); returns where the values after the device "
     "unit-rows' counts start in ``flat``."},
    {"ewm_fold", (PyCFunction)(void (*)(void))ewm_fold, METH_FASTCALL,
     "ewm_fold(xs, n, mean, dev, spikes, last, threshold, alpha, warmup, kind, mad_to_sigma, scale_floor) "
     "-> (n, mean, dev, score, fresh, spikes, last): a smoothed detector's fold of one record's values "
     "(see streamwatch._detectors._Smoothed.fold, the reference); kind 0: a loss z-score, 1: a ratio."},
    {NULL, NULL, 0, NULL},
};

/* The module's SCHEMA: the schema it was built from (_kernel.py uses none of its functions unless it is
 * the package's own). */
static int fused_exec(PyObject *module) { return PyModule_AddStringConstant(module, "SCHEMA", SW_SCHEMA); }

static PyModuleDef_Slot fused_slots[] = {
    {Py_mod_exec, fused_exec},
    {0, NULL},
};

static struct PyModuleDef fused_module = {
    PyModuleDef_HEAD_INIT,
    "_fused",
    "streamwatch's fused CPU summary kernel (its functions are called through ctypes, _kernel.py), and "
    "the per-step calls where a ctypes call costs too much (a scalar's value, train accuracy, assembly).",
    0,
    fused_methods,
    fused_slots,
};

PyMODINIT_FUNC PyInit__fused(void) { return PyModuleDef_Init(&fused_module); }
