// The AVX512-BF16 register tile that bf16_linear.cpp (the GEMM) and prefill_attention.cpp share.
#pragma once
#include "gemm_common.h"
#include <type_traits>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define QASR_HAS_BF16 1
#else
#define QASR_HAS_BF16 0
#endif

constexpr int64_t MR = 6;   // rows per register tile: 6 x 4 accumulators + 4 weight vectors + 1 broadcast

// f(std::integral_constant<int, n>{}) for a row count n in 1..MR: register tiles are sized at compile time,
// and both the GEMM and the attention pick theirs here.
template <class F>
static inline void with_rows(int64_t n, F&& f) {
  switch (n) {
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    default: f(std::integral_constant<int, 1>{}); break;
  }
}

inline bool supported() { return QASR_HAS_BF16 == 1; }

#if QASR_HAS_BF16
// acc[r][0..3] += rows r (bf16, read as `segs` runs of 2 * seg_pairs values, run s at xr[r] + s * seg_stride)
// times one packed 64-column block w: float32 accumulation, k pairs in ascending order.
template <int ROWS>
static inline void dot_tile(__m512 (&acc)[ROWS][4], const uint16_t* const* xr, int64_t segs, int64_t seg_stride,
                            int64_t seg_pairs, const uint16_t* w) {
  for (int64_t sg = 0; sg < segs; ++sg) {
    const uint16_t* x[ROWS];
    for (int r = 0; r < ROWS; ++r) x[r] = xr[r] + sg * seg_stride;
    for (int64_t kp = 0; kp < seg_pairs; ++kp, w += NB * 2) {
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w);
      const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + 32);
      const __m512bh w2 = (__m512bh)_mm512_loadu_si512(w + 64);
      const __m512bh w3 = (__m512bh)_mm512_loadu_si512(w + 96);
      for (int r = 0; r < ROWS; ++r) {
        int32_t pair;
        std::memcpy(&pair, x[r] + 2 * kp, 4);
        const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, w0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, w1);
        acc[r][2] = _mm512_dpbf16_ps(acc[r][2], a, w2);
        acc[r][3] = _mm512_dpbf16_ps(acc[r][3], a, w3);
      }
    }
  }
}
#endif
