// A kernel for tests/engine/cpu/test_kernel_build.py that compiles in about a second: plain CPython, no torch headers.
// torch.utils.cpp_extension.load passes -DTORCH_EXTENSION_NAME=<module name> and imports <module name>, so
// the init function's name is pasted from that macro. One function: add(a, b) -> a + b.
#include <Python.h>

#define QASR_CAT2(a, b) a##b
#define QASR_CAT(a, b) QASR_CAT2(a, b)
#define QASR_STR2(a) #a
#define QASR_STR(a) QASR_STR2(a)

static PyObject* add(PyObject*, PyObject* args) {
    long a = 0, b = 0;
    if (!PyArg_ParseTuple(args, "ll", &a, &b)) return nullptr;
    return PyLong_FromLong(a + b);
}

static PyMethodDef methods[] = {
    {"add", add, METH_VARARGS, "a + b"},
    {nullptr, nullptr, 0, nullptr},
};

static PyModuleDef module = {PyModuleDef_HEAD_INIT, QASR_STR(TORCH_EXTENSION_NAME), nullptr, -1, methods};

PyMODINIT_FUNC QASR_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&module); }
