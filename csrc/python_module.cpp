// Python entry point of diffcurr_fast._C. Importing the module loads this shared library, whose static
// initialisers register the `diffcurr_fast_C` torch ops (csrc/ops.cpp); it exports no Python functions.
#include <Python.h>

namespace {

PyModuleDef kModule = {
    PyModuleDef_HEAD_INIT,
    "_C",
    "Fused diffusion kernels; the ops are under torch.ops.diffcurr_fast_C.",
    -1,
    nullptr,
    nullptr,
    nullptr,
    nullptr,
    nullptr,
};

}  // namespace

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&kModule); }
