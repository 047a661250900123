// int8 W8A8 linear layer on AVX512-VNNI (vpdpbusd), exact to the spec in int8_common.h.
//
// vpdpbusd multiplies unsigned bytes by signed bytes (4 per int32 lane, summed into the lane). Activations
// x_q are signed, so the panel holds x_q + 128 (1..255, as uint8) and the column sums fix it afterwards:
//   sum_k (x_q + 128) * w = sum_k x_q * w + 128 * sum_k w,   acc = that - comp[n],  comp[n] = 128 * sum_k w[n,k]
// comp is computed once at pack time. vpdpbusd (not the saturating vpdpbusds) wraps modulo 2^32, and the final
// subtraction does too, so the result is the exact acc whenever acc itself fits int32 (|acc| <= 127 * 127 * K),
// even when the shifted sum overflows on the way. Padded K holds zero weights: whatever the shifted panel has
// there adds nothing.
//
// Work items are (64-column block, chunk of up to 96 rows), block-major, so a thread keeps one block's weights
// in cache while its rows pass; a call of <= 96 rows (decode) is one chunk, and the items are the column blocks:
// the weights stream once, split over the threads. Inside an item, passes of up to 6 rows x 64 columns keep
// 24 int32 accumulators in registers, each pass over all of K.
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

constexpr int64_t MR = 6;          // rows per register pass
constexpr int64_t ROW_CHUNK = 96;  // rows per work item

// Rows [m0, m0 + R) x block b's 64 columns over all of K, then the epilogue.
template <int R>
static inline void pass(const int8::Args& a, int64_t m0, int64_t b) {
  const int64_t groups = a.Kp / 4;
  const int8_t* blk = a.blocks + b * groups * int8::NB * 4;
  const uint8_t* rows = a.panel + m0 * a.Kp;
  __m512i acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_si512();
  for (int64_t g = 0; g < groups; ++g) {
    const int8_t* w = blk + g * int8::NB * 4;
    const __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + 64), w2 = _mm512_loadu_si512(w + 128),
                  w3 = _mm512_loadu_si512(w + 192);
    for (int r = 0; r < R; ++r) {
      int32_t four;
      std::memcpy(&four, rows + r * a.Kp + 4 * g, 4);
      const __m512i x = _mm512_set1_epi32(four);
      acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], x, w0);
      acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], x, w1);
      acc[r][2] = _mm512_dpbusd_epi32(acc[r][2], x, w2);
      acc[r][3] = _mm512_dpbusd_epi32(acc[r][3], x, w3);
    }
  }
  const int64_t es = a.bf16 ? 2 : 4;
  for (int j = 0; j < 4; ++j) {
    const int64_t n0 = b * int8::NB + 16 * j;
    if (n0 >= a.N) break;
    const int8::Cols16 cols =
        int8::cols16(a.w_scale + n0, a.bias ? a.bias + n0 : nullptr, int8::tail_mask(a.N - n0));
    const __m512i comp = _mm512_loadu_si512(a.comp + n0);  // comp is padded to whole blocks
    for (int r = 0; r < R; ++r) {
      const int64_t m = m0 + r;
      int8::epilogue16(_mm512_sub_epi32(acc[r][j], comp), a.a_scale[m], cols,
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
      int64_t m = c * ROW_CHUNK;
      for (; m + MR <= end; m += MR) pass<MR>(a, m, b);
      switch (end - m) {
        case 5: pass<5>(a, m, b); break;
        case 4: pass<4>(a, m, b); break;
        case 3: pass<3>(a, m, b); break;
        case 2: pass<2>(a, m, b); break;
        case 1: pass<1>(a, m, b); break;
        default: break;
      }
    }
  });
}
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
