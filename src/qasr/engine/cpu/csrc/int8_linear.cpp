// int8 W8A8 linear layer on AVX512-VNNI (vpdpbusd), exact to the spec in int8_common.h.
//
// The product (int8_common.h: vnni512_run) is shared with the AMX-INT8 kernel, which runs it for calls of very
// few rows; this module is it alone, for CPUs with AVX512-VNNI and no AMX-INT8.
#include "int8_common.h"

#if QASR_INT8_AVX512 && defined(__AVX512VNNI__)
#define QASR_VNNI 1
#else
#define QASR_VNNI 0
#endif

#if QASR_VNNI
bool supported() {
  static const bool ok = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl");
  return ok;
}

static constexpr int8::RunFn run = int8::vnni512_run;
#else
bool supported() { return false; }  // built without AVX512-VNNI (-march=native on a CPU that lacks it)
static constexpr int8::RunFn run = nullptr;
#endif

static const int8::Gemm GEMM{"qasr int8 VNNI", "this build or CPU lacks AVX512-VNNI", supported, run, 0x80};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("KIND") = "AVX512-VNNI";
  m.def("supported", &supported, "whether this build and CPU can run the AVX512-VNNI int8 kernel");
  int8::def_int8(m, GEMM, "exact W8A8 x @ W^T * scales + b: per-row int8 activations, int32 vpdpbusd products");
}
