/* Makes the fused kernel's shared library a valid CPython extension module, so that setuptools'
 * build_ext builds, names and installs it like any other (see setup.py). The kernel's functions live in
 * _fused.c and are called through ctypes from _kernel.py. The module itself has two functions, for the
 * one call per step where a ctypes call costs too much: whether the float32/float64 at an address is
 * finite (the quiet step's look at a CPU loss, _observe.py). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <string.h>

/* The address a Python int holds; NULL (no exception set) for 0, NULL with one for anything else. */
static void *address_of(PyObject *arg) {
    if (!PyLong_Check(arg)) {
        PyErr_Format(PyExc_TypeError, "expected an address (an int), got %.100s", Py_TYPE(arg)->tp_name);
        return NULL;
    }
    return PyLong_AsVoidPtr(arg);
}

static PyObject *finite_f32(PyObject *self, PyObject *arg) {
    (void)self;
    void *p = address_of(arg);
    if (p == NULL) {
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_FALSE; /* no data: not a finite value */
    }
    float v;
    memcpy(&v, p, sizeof v);
    return PyBool_FromLong(isfinite(v));
}

static PyObject *finite_f64(PyObject *self, PyObject *arg) {
    (void)self;
    void *p = address_of(arg);
    if (p == NULL) {
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_FALSE;
    }
    double v;
    memcpy(&v, p, sizeof v);
    return PyBool_FromLong(isfinite(v));
}

static PyMethodDef fused_methods[] = {
    {"finite_f32", finite_f32, METH_O,
     "finite_f32(address) -> bool: whether the float32 at ``address`` (a live CPU tensor's data_ptr()) "
     "is finite; False for address 0."},
    {"finite_f64", finite_f64, METH_O,
     "finite_f64(address) -> bool: the same for a float64."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef fused_module = {
    PyModuleDef_HEAD_INIT,
    "_fused",
    "streamwatch's fused CPU summary kernel (its functions are called through ctypes, _kernel.py), and "
    "finite_f32/finite_f64 for a scalar's finiteness in one C call.",
    0,
    fused_methods,
};

PyMODINIT_FUNC PyInit__fused(void) { return PyModuleDef_Init(&fused_module); }
