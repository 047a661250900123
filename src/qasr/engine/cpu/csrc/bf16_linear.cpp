// Batch-invariant bfloat16 linear layer on AVX512-BF16: every output is one float32 accumulation over K in a
// fixed order (k pairs ascending, one vdpbf16ps lane), whatever M, so a row never depends on its batch (oneDNN
// picks its blocking by row count). Few rows stream the weight once, parallel over column blocks.
// Packed layout and interface: gemm_common.h (shared with amx_linear.cpp).
#include "bf16_dot_tile.h"

#if QASR_HAS_BF16
// One register tile: `ROWS` (<= MR) rows times one 64-column block, full K, stored as bf16 (+ bias).
template <int ROWS>
static inline void tile(const uint16_t* const* xr, const Rows& rows, const uint16_t* wblock, const float* bias,
                        uint16_t* out, int64_t ldo, int64_t ncols) {
  __m512 acc[ROWS][4];
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  dot_tile<ROWS>(acc, xr, rows.segs, rows.seg_stride, rows.seg_pairs, wblock);
  for (int j = 0; j < 4; ++j) {
    const int64_t c0 = j * 16;
    if (c0 >= ncols) break;
    const __mmask16 mask = ncols - c0 >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (ncols - c0)) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + c0) : _mm512_setzero_ps();
    for (int r = 0; r < ROWS; ++r) {
      const __m256bh v = _mm512_cvtneps_pbh(_mm512_add_ps(acc[r][j], b));
      _mm256_mask_storeu_epi16(out + r * ldo + c0, mask, (__m256i)v);
    }
  }
}

static void run(const Rows& rows, int64_t M, const uint16_t* packed, int64_t N, const float* bias, uint16_t* out) {
  const int64_t blocks = (N + NB - 1) / NB, kpairs = rows.segs * rows.seg_pairs;
  // Work items are (column block, group of row tiles); row groups keep a block's weights hot in L2
  // while many rows pass over them, column blocks spread the weight stream over the threads.
  const int64_t rows_per_group = 6 * MR;
  const int64_t groups = (M + rows_per_group - 1) / rows_per_group;
  // Item order is for the caches only: block-major keeps a weight block in L2 while the row groups pass;
  // inputs larger than the last-level cache go group-major, so rows are not re-read from memory per block
  // (docs/log/*-cpu-bf16-gemm-group-major.md).
  const bool group_major = M * kpairs * 4 > (int64_t(16) << 20);
  at::parallel_for(0, blocks * groups, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t b = group_major ? item % blocks : item / groups;
      const int64_t g = group_major ? item / blocks : item % groups;
      const uint16_t* wblock = packed + b * kpairs * NB * 2;
      const int64_t ncols = std::min<int64_t>(NB, N - b * NB);
      const float* bb = bias ? bias + b * NB : nullptr;
      const int64_t m_end = std::min<int64_t>(M, (g + 1) * rows_per_group);
      for (int64_t m = g * rows_per_group; m < m_end; m += MR) {
        const uint16_t* xr[MR];
        const int64_t n_rows = std::min<int64_t>(MR, m_end - m);
        for (int64_t r = 0; r < n_rows; ++r) xr[r] = rows.row(m + r);
        uint16_t* o = out + m * N + b * NB;
        with_rows(n_rows, [&](auto r) { tile<decltype(r)::value>(xr, rows, wblock, bb, o, N, ncols); });
      }
    }
  });
}
#else
static constexpr RunFn run = nullptr;  // never called: supported() is false in this build
#endif

static const Gemm GEMM{"qasr bf16", "built without AVX512-BF16", supported, run};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("supported", &supported, "whether this build has the AVX512-BF16 kernel");
  def_gemm(m, GEMM, "batch-invariant bf16 x @ W^T + b with float32 accumulation");
}
