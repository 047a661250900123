// Fused bf16 elementwise steps of a decoder layer: RMSNorm, q/k RMSNorm + rotary, and the MLP's SiLU(gate) * up,
// each one pass instead of several torch ops (each a dispatch), with torch's roundings (float math, bf16 where
// torch rounds). Rows eight at a time and 16 values a step with AVX-512 give the bits of the scalar loops, which
// stay for other widths and CPUs (docs/log/*-cpu-fused-norms*.md).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>

#include "parallel_grain.h"

using bf16 = at::BFloat16;

static inline float rms_scale(const bf16* x, int64_t n, float eps) {
  float ss = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    ss += v * v;
  }
  return 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
}

// The scales of G rows (x + j * stride, j < G), each one's sum of squares added in index order exactly as
// rms_scale adds it (so the same bits): G independent sums in flight instead of one chain of dependent adds,
// which is what a row's norm waited on.
template <int G>
static inline void rms_scales(const bf16* x, int64_t stride, int64_t n, float eps, float* r) {
  float ss[G];
  for (int j = 0; j < G; ++j) ss[j] = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    for (int j = 0; j < G; ++j) {
      const float v = static_cast<float>(x[j * stride + i]);
      ss[j] += v * v;
    }
  }
  for (int j = 0; j < G; ++j) r[j] = 1.f / std::sqrt(ss[j] / static_cast<float>(n) + eps);
}

// torch: weight * (x.float() * rsqrt(mean(x^2) + eps)).to(bf16), with the row's scale r
static inline void rms_apply_scalar(const bf16* x, const bf16* w, float r, bf16* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const bf16 h = static_cast<bf16>(static_cast<float>(x[i]) * r);
    out[i] = static_cast<bf16>(static_cast<float>(w[i]) * static_cast<float>(h));
  }
}

// y = norm(x) (bf16 values), then y * cos + rotate_half(y) * sin, every op rounded to bf16 as torch does
static inline void rope_scalar(const bf16* y, const bf16* c, const bf16* s, bf16* o, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < D; ++d) {
    const float rot = d < half ? -static_cast<float>(y[d + half]) : static_cast<float>(y[d - half]);
    const bf16 p1 = static_cast<bf16>(static_cast<float>(y[d]) * static_cast<float>(c[d]));
    const bf16 p2 = static_cast<bf16>(static_cast<bf16>(rot) * static_cast<float>(s[d]));
    o[d] = static_cast<bf16>(static_cast<float>(p1) + static_cast<float>(p2));
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
// The same element-wise steps 16 at a time: the same IEEE products and sums (this file is built without
// contraction into fused multiply-adds, as the scalar loops are) and c10::BFloat16's rounding.
static inline __m512 load16(const bf16* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// f rounded to bf16 as c10::BFloat16(float) rounds (nearest even, any NaN to 0x7FC0), kept as a float
static inline __m512 round_bf16(__m512 f) {
  const __m512i x = _mm512_castps_si512(f);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_and_si512(_mm512_add_epi32(x, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))),
                               _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc00000));
  return _mm512_castsi512_ps(r);
}

static inline void store16(bf16* p, __m512 rounded) {  // a float that is already a bf16 value: its top half
  const __m256i v = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(rounded), 16));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v);
}

static inline void rms_apply(const bf16* x, const bf16* w, float r, bf16* out, int64_t n) {
  if (n % 16) return rms_apply_scalar(x, w, r, out, n);
  const __m512 rv = _mm512_set1_ps(r);
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 h = round_bf16(_mm512_mul_ps(load16(x + i), rv));
    store16(out + i, round_bf16(_mm512_mul_ps(load16(w + i), h)));
  }
}

static inline void rope(const bf16* y, const bf16* c, const bf16* s, bf16* o, int64_t D) {
  const int64_t half = D / 2;
  if (half % 16) return rope_scalar(y, c, s, o, D);
  const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(0x80000000u)));
  for (int64_t d = 0; d < half; d += 16) {
    const __m512 lo = load16(y + d), hi = load16(y + half + d);
    // d < half: rot = -y[d + half]; d >= half: rot = y[d - half] (negation and bf16 values: exact)
    const __m512 p1 = round_bf16(_mm512_mul_ps(lo, load16(c + d)));
    const __m512 p2 = round_bf16(_mm512_mul_ps(_mm512_xor_ps(hi, sign), load16(s + d)));
    store16(o + d, round_bf16(_mm512_add_ps(p1, p2)));
    const __m512 q1 = round_bf16(_mm512_mul_ps(hi, load16(c + half + d)));
    const __m512 q2 = round_bf16(_mm512_mul_ps(lo, load16(s + half + d)));
    store16(o + half + d, round_bf16(_mm512_add_ps(q1, q2)));
  }
}
#else
static inline void rms_apply(const bf16* x, const bf16* w, float r, bf16* out, int64_t n) {
  rms_apply_scalar(x, w, r, out, n);
}
static inline void rope(const bf16* y, const bf16* c, const bf16* s, bf16* o, int64_t D) { rope_scalar(y, c, s, o, D); }
#endif

constexpr int ROW_GROUP = 8;  // rows whose sums of squares are added side by side

// emit(i, scale) for rows [a, b) of x (rows of n values, `stride` apart), ROW_GROUP scales at a time
template <typename Emit>
static inline void rms_rows(const bf16* x, int64_t stride, int64_t a, int64_t b, int64_t n, float eps,
                            const Emit& emit) {
  float r[ROW_GROUP];
  int64_t i = a;
  for (; i + ROW_GROUP <= b; i += ROW_GROUP) {
    rms_scales<ROW_GROUP>(x + i * stride, stride, n, eps, r);
    for (int j = 0; j < ROW_GROUP; ++j) emit(i + j, r[j]);
  }
  for (; i < b; ++i) emit(i, rms_scale(x + i * stride, n, eps));
}

// x: (N, C) bf16, weight: (C,) bf16
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16, "rms_norm: bfloat16");
  auto xc = x.contiguous();
  const int64_t C = xc.size(-1), N = xc.numel() / C;
  TORCH_CHECK(weight.numel() == C, "rms_norm: weight size");
  auto out = torch::empty_like(xc);
  const bf16* xp = xc.data_ptr<bf16>();
  const bf16* wp = weight.contiguous().data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, N, grain_for(N, N * C, ROW_GROUP), [&](int64_t a, int64_t b) {
    rms_rows(xp, C, a, b, C, e, [&](int64_t i, float r) { rms_apply(xp + i * C, wp, r, op + i * C, C); });
  });
  return out;
}

// x: (N, H, D) bf16 -> per head RMSNorm(weight), then rotary with cos/sin: (N, D) bf16.
// torch: y = norm(x); out = y * cos + cat(-y2, y1) * sin, every op rounded to bf16.
torch::Tensor norm_rope(torch::Tensor x, torch::Tensor weight, torch::Tensor cos, torch::Tensor sin, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 3, "norm_rope: (N, H, D) bfloat16");
  auto xc = x.contiguous();
  const int64_t N = xc.size(0), H = xc.size(1), D = xc.size(2);
  auto cc = cos.reshape({N, D}).contiguous(), sc = sin.reshape({N, D}).contiguous();
  TORCH_CHECK(cc.scalar_type() == at::kBFloat16 && sc.scalar_type() == at::kBFloat16, "norm_rope: bf16 cos/sin");
  auto out = torch::empty_like(xc);
  const bf16* xp = xc.data_ptr<bf16>();
  const bf16* wp = weight.contiguous().data_ptr<bf16>();
  const bf16* cp = cc.data_ptr<bf16>();
  const bf16* sp = sc.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, N * H, grain_for(N * H, N * H * D, ROW_GROUP), [&](int64_t a, int64_t b) {
    std::vector<bf16> y(D);
    rms_rows(xp, D, a, b, D, e, [&](int64_t i, float r) {
      const int64_t n = i / H;
      rms_apply(xp + i * D, wp, r, y.data(), D);
      rope(y.data(), cp + n * D, sp + n * D, op + i * D, D);
    });
  });
  return out;
}

// silu(gate) * up for bf16 rows, torch's F.silu(gate) * up in one pass: gate and up (N, F) with contiguous rows at
// any row stride (the column halves of one gate/up product are read in place); table: 65,536 float32, table[bits] =
// torch's F.silu of the bf16 value with those bits, a bf16 value held as float32 (activation_tables.py makes it
// with torch itself, so no exp is written here; float32 so that AVX-512 gathers 16 entries at a time from it)
// -> (N, F) contiguous bf16. The product is float32 (exact: two 8-bit significands) rounded once to bf16 as
// torch's bf16 multiply rounds: one pass instead of torch's two (docs/log/*-cpu-silu-mul.md).
torch::Tensor silu_mul(torch::Tensor gate, torch::Tensor up, torch::Tensor table) {
  TORCH_CHECK(gate.dim() == 2 && gate.scalar_type() == at::kBFloat16 && up.scalar_type() == at::kBFloat16 &&
                  gate.sizes() == up.sizes(), "silu_mul: gate and up (N, F) bfloat16 of one shape");
  TORCH_CHECK(table.scalar_type() == at::kFloat && table.dim() == 1 && table.numel() == 65536 && table.is_contiguous(),
              "silu_mul: a contiguous table of 65,536 float32");
  const int64_t N = gate.size(0), F = gate.size(1);
  auto g = gate.stride(1) == 1 ? gate : gate.contiguous();
  auto u = up.stride(1) == 1 ? up : up.contiguous();
  auto out = torch::empty({N, F}, gate.options());
  if (out.numel() == 0) return out;
  const int64_t gs = g.stride(0), us = u.stride(0);
  const uint16_t* gp = reinterpret_cast<const uint16_t*>(g.data_ptr<bf16>());
  const bf16* upp = u.data_ptr<bf16>();
  const float* lut = table.data_ptr<float>();
  bf16* op = out.data_ptr<bf16>();
  at::parallel_for(0, N, grain_for(N, N * F, 1), [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) {
      const uint16_t* gr = gp + i * gs;
      const bf16* ur = upp + i * us;
      bf16* orow = op + i * F;
      int64_t j = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
      for (; j + 16 <= F; j += 16) {
        const __m512i idx = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(gr + j)));
        const __m512 s = _mm512_i32gather_ps(idx, lut, 4);
        store16(orow + j, round_bf16(_mm512_mul_ps(s, load16(ur + j))));
      }
#endif
      for (; j < F; ++j) orow[j] = static_cast<bf16>(lut[gr[j]] * static_cast<float>(ur[j]));
    }
  });
  return out;
}

// The float32 (and float16) forms: the same torch ops as model/decoder.py, in the same order, so the same
// bits; composed here so that a layer's two norms and two norm + rotary steps are four Python calls instead
// of about forty, each of which hands the GIL back and forth (under a busy server, a wait for the GIL each).
torch::Tensor rms_norm_ops(torch::Tensor x, torch::Tensor weight, double eps) {
  auto h = x.to(at::kFloat);
  h = h * at::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return weight * h.to(x.scalar_type());
}

torch::Tensor norm_rope_ops(torch::Tensor x, torch::Tensor weight, torch::Tensor cos, torch::Tensor sin, double eps) {
  auto y = rms_norm_ops(x, weight, eps);
  auto halves = y.chunk(2, -1);
  return y * cos + at::cat({-halves[1], halves[0]}, -1) * sin;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // without the GIL while they run, like every qasr kernel (other Python threads go on meanwhile)
  m.def("rms_norm", &rms_norm, "bf16 RMSNorm over the last dim", py::call_guard<py::gil_scoped_release>());
  m.def("norm_rope", &norm_rope, "bf16 per-head RMSNorm followed by rotary embedding",
        py::call_guard<py::gil_scoped_release>());
  m.def("silu_mul", &silu_mul, "bf16 silu(gate) * up, silu by a table of torch's own values, in one pass",
        py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm_ops", &rms_norm_ops, "RMSNorm as model/decoder.py computes it (any float dtype), one call",
        py::call_guard<py::gil_scoped_release>());
  m.def("norm_rope_ops", &norm_rope_ops, "per-head RMSNorm + rotary as model/decoder.py computes them, one call",
        py::call_guard<py::gil_scoped_release>());
}
