// Batch-invariant bfloat16 linear layer for CPUs with AVX512-BF16.
//
// Why our own: oneDNN picks different blockings (and K splits) for different row counts, so a row's
// result depends on how many other rows share the call -- a request's tokens would then depend on its
// neighbours in the batch. Here every output element is one float32 accumulation over K in a fixed
// order (k pairs, ascending, one vdpbf16ps lane), whatever M is and whichever tile the row falls in.
// It is also the fast path for decode: with few rows the product streams the weight once at close to
// memory bandwidth, parallel over column blocks.
//
// Packed weight layout (shared with amx_linear.cpp, as pack() and the front of linear() / conv() are:
// gemm_common.h): (N_pad / 64, K / 2, 64, 2) bf16, so one k pair of a block is four contiguous 64-byte
// vectors.
#include "gemm_common.h"
#include <cmath>
#include <limits>
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

bool supported() { return QASR_HAS_BF16 == 1; }

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
  // Item order is for the caches only (every tile is the same computation in any order): block-major
  // keeps a weight block in L2 while all row groups pass over it; once the rows no longer fit in the
  // last-level cache that re-reads them from memory for every block (measured: an encoder conv GEMM,
  // 6400 x 4320 x 480, ran at 200 GFLOP/s instead of 440), so large inputs go group-major: a row group
  // stays in L2 while the blocks pass.
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

#if QASR_HAS_BF16
// e^x for x <= 0 (softmax): 2^(x log2 e) split into an integer power (scalef) and 2^f, |f| <= 1/2, by a
// degree-7 polynomial (relative error ~1e-7, below float32 resolution of the sums it feeds).
static inline __m512 exp_nonpositive(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-100.f)), _mm512_set1_ps(1.4426950408889634f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.525273380405984e-05f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530393381606e-04f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618129107628477e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550410866482158e-02f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402265069591007e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931471805599453e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// Causal attention of one prompt chunk (flash style, on the same bf16 tiles as the linears).
// Per kv head the sequence's keys are gathered through its block table and packed once as "weights" with the 64 keys of a block as columns
// (scores = queries x K^T), and its values transposed the same way (output = P x V). Each task runs 6
// query rows (query, head-in-group pairs) through the key blocks with an online softmax in float32;
// P is rounded to bf16 for the value product. A row's result depends only on its own query and keys.
template <int ROWS>
static void attend_rows(const uint16_t* const* qrows, const int64_t* qpos, const uint16_t* kpacked,
                        const uint16_t* vpacked, int64_t kpairs_total, float scale, float* o_out) {
  // qpos[r]: the last key index row r may see (causal). o_out: ROWS x 128 float32, normalised.
  constexpr int64_t D = 128;
  int64_t last = 0;
  for (int r = 0; r < ROWS; ++r) last = std::max(last, qpos[r]);
  float m[ROWS], l[ROWS];
  __m512 o[ROWS][8];
  for (int r = 0; r < ROWS; ++r) {
    m[r] = -std::numeric_limits<float>::max();
    l[r] = 0.f;
    for (int j = 0; j < 8; ++j) o[r][j] = _mm512_setzero_ps();
  }
  alignas(64) uint16_t p16[ROWS][NB];
  for (int64_t kb = 0; kb * NB <= last; ++kb) {
    __m512 s[ROWS][4];
    for (int r = 0; r < ROWS; ++r)
      for (int j = 0; j < 4; ++j) s[r][j] = _mm512_setzero_ps();
    dot_tile<ROWS>(s, qrows, 1, 0, D / 2, kpacked + kb * (D / 2) * NB * 2);
    for (int r = 0; r < ROWS; ++r) {
      const int64_t visible = qpos[r] - kb * NB + 1;  // keys of this block row r may see
      float mx = m[r];
      __mmask16 keep[4];
      for (int j = 0; j < 4; ++j) {
        s[r][j] = _mm512_mul_ps(s[r][j], _mm512_set1_ps(scale));
        const int64_t left = visible - j * 16;
        keep[j] = left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
        s[r][j] = _mm512_mask_blend_ps(keep[j], _mm512_set1_ps(-std::numeric_limits<float>::max()), s[r][j]);
        mx = std::max(mx, _mm512_reduce_max_ps(s[r][j]));
      }
      const float correction = std::exp(m[r] - mx);
      m[r] = mx;
      float sum = 0.f;
      for (int j = 0; j < 4; ++j) {
        // masked keys contribute exactly zero
        const __m512 ev = _mm512_maskz_mov_ps(keep[j], exp_nonpositive(_mm512_sub_ps(s[r][j], _mm512_set1_ps(mx))));
        sum += _mm512_reduce_add_ps(ev);
        _mm256_store_si256(reinterpret_cast<__m256i*>(&p16[r][j * 16]), (__m256i)_mm512_cvtneps_pbh(ev));
      }
      l[r] = l[r] * correction + sum;
      for (int j = 0; j < 8; ++j) o[r][j] = _mm512_mul_ps(o[r][j], _mm512_set1_ps(correction));
    }
    const uint16_t* prow[ROWS];
    for (int r = 0; r < ROWS; ++r) prow[r] = p16[r];
    for (int db = 0; db < 2; ++db) {  // output dims [0, 64) and [64, 128)
      __m512 acc[ROWS][4];
      for (int r = 0; r < ROWS; ++r)
        for (int j = 0; j < 4; ++j) acc[r][j] = o[r][db * 4 + j];
      dot_tile<ROWS>(acc, prow, 1, 0, NB / 2, vpacked + (db * (kpairs_total) + kb * (NB / 2)) * NB * 2);
      for (int r = 0; r < ROWS; ++r)
        for (int j = 0; j < 4; ++j) o[r][db * 4 + j] = acc[r][j];
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    const __m512 inv = _mm512_set1_ps(1.f / l[r]);
    for (int j = 0; j < 8; ++j) _mm512_storeu_ps(o_out + r * D + j * 16, _mm512_mul_ps(o[r][j], inv));
  }
}
#endif

// q: (n, H, 128) bf16, the chunk's queries at positions ctx .. ctx + n - 1 of a sequence whose keys and
// values (already written, ctx + n of them) lie in kpool / vpool: (KVH, P, 128), P a multiple of
// block_size, position t at row table[t / block_size] * block_size + t % block_size (table: int64 block ids).
// The packing below is the only place that reads the pool, so the rest is the same computation wherever
// the blocks lie.
torch::Tensor prefill_attention(torch::Tensor q, torch::Tensor kpool, torch::Tensor vpool, torch::Tensor table,
                                int64_t block_size, int64_t ctx, double scale) {
  TORCH_CHECK(supported(), "qasr prefill attention: built without AVX512-BF16");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && q.dim() == 3 && q.size(2) == 128, "prefill_attention: (n, H, 128) bf16");
  TORCH_CHECK(kpool.is_contiguous() && vpool.is_contiguous() && kpool.scalar_type() == at::kBFloat16, "contiguous bf16 pools");
  auto qc = q.contiguous();
  const int64_t n = qc.size(0), H = qc.size(1), D = 128, KVH = kpool.size(0), P = kpool.size(1);
  const int64_t bs = block_size, L = ctx + n;
  auto tb = table.contiguous();
  TORCH_CHECK(H % KVH == 0 && ctx >= 0 && bs > 0 && P % bs == 0, "prefill_attention: bad shapes");
  TORCH_CHECK(tb.scalar_type() == at::kLong && tb.dim() == 1 && tb.numel() * bs >= L,
              "prefill_attention: the block table (int64) must hold all ctx + n positions");
  const int64_t* tp = tb.data_ptr<int64_t>();
  for (int64_t i = 0; i < (L + bs - 1) / bs; ++i)
    TORCH_CHECK(tp[i] >= 0 && tp[i] < P / bs, "prefill_attention: a block id outside the pool");
  const int64_t rep = H / KVH, blocks = (L + NB - 1) / NB, Lp = blocks * NB, kpairs = Lp / 2;
  auto out = torch::empty_like(qc);
#if QASR_HAS_BF16
  // packed keys: (KVH, blocks, 64 d-pairs, 64 keys, 2); packed values: (KVH, 2 d-blocks, Lp/2 key pairs, 64 dims, 2)
  auto kp = torch::zeros({KVH, blocks, D / 2, NB, 2}, qc.options());
  auto vp = torch::zeros({KVH, 2, kpairs, NB, 2}, qc.options());
  const uint32_t* kpool32 = reinterpret_cast<const uint32_t*>(kpool.data_ptr<at::BFloat16>());
  const uint16_t* vpool16 = reinterpret_cast<const uint16_t*>(vpool.data_ptr<at::BFloat16>());
  uint32_t* kp32 = reinterpret_cast<uint32_t*>(kp.data_ptr<at::BFloat16>());
  uint16_t* vp16 = reinterpret_cast<uint16_t*>(vp.data_ptr<at::BFloat16>());
  at::parallel_for(0, KVH * blocks, 1, [&](int64_t a, int64_t b) {
    for (int64_t item = a; item < b; ++item) {
      const int64_t g = item / blocks, kb = item % blocks;
      const int64_t keys = std::min<int64_t>(NB, L - kb * NB);
      uint32_t* kdst = kp32 + (g * blocks + kb) * (D / 2) * NB;
      for (int64_t c = 0; c < keys; ++c) {
        const int64_t t = kb * NB + c;
        const uint32_t* src = kpool32 + ((g * P + tp[t / bs] * bs + t % bs) * D) / 2;
        for (int64_t dp = 0; dp < D / 2; ++dp) kdst[dp * NB + c] = src[dp];
      }
      for (int64_t c = 0; c < keys; ++c) {
        const int64_t t = kb * NB + c;
        const uint16_t* src = vpool16 + (g * P + tp[t / bs] * bs + t % bs) * D;
        for (int64_t d = 0; d < D; ++d)
          vp16[((((g * 2 + d / NB) * kpairs) + t / 2) * NB + d % NB) * 2 + t % 2] = src[d];
      }
    }
  });
  const uint16_t* q16 = reinterpret_cast<const uint16_t*>(qc.data_ptr<at::BFloat16>());
  uint16_t* o16 = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t rows = n * rep, tiles = (rows + MR - 1) / MR;
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, KVH * tiles, 1, [&](int64_t a, int64_t b) {
    alignas(64) float ob[MR * 128];
    for (int64_t item = a; item < b; ++item) {
      const int64_t g = item / tiles, t0 = (item % tiles) * MR;
      const int64_t nr = std::min<int64_t>(MR, rows - t0);
      const uint16_t* qr[MR];
      int64_t qpos[MR];
      for (int64_t r = 0; r < nr; ++r) {
        const int64_t i = (t0 + r) / rep, h = g * rep + (t0 + r) % rep;
        qr[r] = q16 + (i * H + h) * D;
        qpos[r] = ctx + i;
      }
      const uint16_t* kpg = reinterpret_cast<const uint16_t*>(kp32 + g * blocks * (D / 2) * NB);
      const uint16_t* vpg = vp16 + g * 2 * kpairs * NB * 2;
      with_rows(nr, [&](auto r) { attend_rows<decltype(r)::value>(qr, qpos, kpg, vpg, kpairs, sc, ob); });
      for (int64_t r = 0; r < nr; ++r) {
        const int64_t i = (t0 + r) / rep, h = g * rep + (t0 + r) % rep;
        uint16_t* dst = o16 + (i * H + h) * D;
        for (int j = 0; j < 8; ++j)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j * 16), (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(ob + r * 128 + j * 16)));
      }
    }
  });
#endif
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("supported", &supported, "whether this build has the AVX512-BF16 kernel");
  def_gemm(m, GEMM, "batch-invariant bf16 x @ W^T + b with float32 accumulation");
  m.def("prefill_attention", &prefill_attention, "causal attention of a prompt chunk over its sequence", NO_GIL);
}
