// Causal attention of a prompt chunk over its sequence's KV blocks, on the AVX512-BF16 tiles of bf16_dot_tile.h.
#include "bf16_dot_tile.h"
#include <cmath>
#include <limits>

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
  m.def("prefill_attention", &prefill_attention, "causal attention of a prompt chunk over its sequence", NO_GIL);
}
