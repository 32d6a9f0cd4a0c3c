// dynamicemb._C: importing it loads this library, whose static initializers
// register the TORCH_LIBRARY ops. It exposes no Python functions itself, so
// it needs only the CPython headers (not pybind11 or torch/extension.h).
#include <Python.h>

static struct PyModuleDef dynamicemb_module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&dynamicemb_module); }
