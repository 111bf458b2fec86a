/* Makes the fused kernel's shared library a valid (empty) CPython extension module, so that setuptools'
 * build_ext builds, names and installs it like any other (see setup.py). The kernel's functions live in
 * _fused.c and are called through ctypes from _kernel.py; nothing here is used at run time. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static struct PyModuleDef fused_module = {
    PyModuleDef_HEAD_INIT,
    "_fused",
    "streamwatch's fused CPU summary kernel; its functions are called through ctypes (_kernel.py).",
    0,
    NULL,
};

PyMODINIT_FUNC PyInit__fused(void) { return PyModuleDef_Init(&fused_module); }
