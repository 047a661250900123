// int8 W8A8 linear layer on 256-bit AVX-VNNI (VEX vpdpbusd), for CPUs with AVX2 and AVX-VNNI but no AVX-512;
// exact to the spec in int8_common.h.
//
// The same arithmetic as int8_linear.cpp, 8 columns per register instead of 16: the panel holds x_q + 128 as
// uint8, the packed column sums (128 * sum_k w) are subtracted afterwards, and both wrap modulo 2^32 together,
// so the result is the exact int32 sum. With 16 registers, a pass is up to 3 rows x 32 columns (12
// accumulators); a 64-column block is two passes. Work items are (column block, chunk of up to 96 rows) as
// in the AVX-512 kernel, so a decode call streams the weights once over the threads.
//
// Always built without AVX-512 (-mno-avx512f): on CPUs that have it the AVX512-VNNI kernel is used instead,
// and there this build still runs (and is tested) as it would on an AVX2-only CPU.
#include "int8_common.h"

#if QASR_INT8_AVX2 && defined(__AVXVNNI__)
#include <cpuid.h>
#define QASR_AVX_VNNI 1
#else
#define QASR_AVX_VNNI 0
#endif

#if QASR_AVX_VNNI
bool supported() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 1, &a, &b, &c, &d)) return false;
  static const bool ok = ((a >> 4) & 1u) && __builtin_cpu_supports("avx2");  // CPUID.(7,1):EAX bit 4: AVX-VNNI
  return ok;
}

constexpr int64_t MR = 3;          // rows per register pass
constexpr int64_t ROW_CHUNK = 96;  // rows per work item

// acc += u8 a x s8 b (VEX vpdpbusd) in inline assembly, as int8_common.h's dpbusd and for the same reason: GCC's
// intrinsic lets the register allocator keep the accumulators in memory.
static inline __m256i dpbusd(__m256i acc, __m256i a, __m256i b) {
  asm("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(a), "xm"(b));
  return acc;
}

// Rows [m0, m0 + R) x columns [32 h, 32 h + 32) of block b over all of K, then the epilogue.
template <int R>
static inline void pass(const int8::Args& a, int64_t m0, int64_t b, int64_t h) {
  const int64_t groups = a.Kp / 4;
  const int8_t* blk = a.blocks + b * groups * int8::NB * 4 + h * 32 * 4;
  const uint8_t* rows = a.panel + m0 * a.Kp;
  __m256i acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_setzero_si256();
  for (int64_t g = 0; g < groups; ++g) {
    const int8_t* w = blk + g * int8::NB * 4;
    __m256i x[R];
    for (int r = 0; r < R; ++r) {
      int32_t four;
      std::memcpy(&four, rows + r * a.Kp + 4 * g, 4);
      x[r] = _mm256_set1_epi32(four);
    }
    for (int j = 0; j < 4; ++j) {
      const __m256i wj = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * j));
      for (int r = 0; r < R; ++r) acc[r][j] = dpbusd(acc[r][j], x[r], wj);
    }
  }
  const int64_t es = a.bf16 ? 2 : 4;
  for (int j = 0; j < 4; ++j) {
    const int64_t n0 = b * int8::NB + h * 32 + 8 * j;
    if (n0 >= a.N) break;
    const int8::Cols8 cols = int8::cols8(a.w_scale + n0, a.bias ? a.bias + n0 : nullptr, a.N - n0);
    const __m256i comp = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.comp + n0));  // padded to blocks
    for (int r = 0; r < R; ++r) {
      const int64_t m = m0 + r;
      int8::epilogue8(_mm256_sub_epi32(acc[r][j], comp), a.a_scale[m], cols,
                      static_cast<char*>(a.out) + (m * a.N + n0) * es, a.bf16);
    }
  }
}

static void run(const int8::Args& a) {
  const int64_t blocks = (a.N + int8::NB - 1) / int8::NB, chunks = (a.M + ROW_CHUNK - 1) / ROW_CHUNK;
  at::parallel_for(0, blocks * chunks, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t b = item / chunks, c = item % chunks;
      const int64_t end = std::min(a.M, (c + 1) * ROW_CHUNK);
      for (int64_t h = 0; h < 2 && b * int8::NB + h * 32 < a.N; ++h) {
        int64_t m = c * ROW_CHUNK;
        for (; m + MR <= end; m += MR) pass<MR>(a, m, b, h);
        if (end - m == 2) pass<2>(a, m, b, h);
        else if (end - m == 1) pass<1>(a, m, b, h);
      }
    }
  });
}
#else
bool supported() { return false; }  // built without AVX2 and AVX-VNNI
static constexpr int8::RunFn run = nullptr;
#endif

static const int8::Gemm GEMM{"qasr int8 AVX-VNNI", "this build or CPU lacks AVX2 with AVX-VNNI", supported, run, 0x80};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("KIND") = "AVX-VNNI";
  m.def("supported", &supported, "whether this build and CPU can run the 256-bit AVX-VNNI int8 kernel");
  int8::def_int8(m, GEMM, "exact W8A8 x @ W^T * scales + b: per-row int8 activations, int32 AVX-VNNI products");
}
