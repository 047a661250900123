// What qasr's int8 W8A8 GEMM kernels share (amx_int8.cpp on AMX-INT8 tiles, int8_linear.cpp on AVX512-VNNI
// registers, int8_avx_vnni.cpp on 256-bit AVX-VNNI for AVX2-only CPUs): the packed weight layout and pack(),
// the per-row activation quantization, the float32 epilogue and the front of linear(), which quantizes x into
// a panel and hands it to the kernel's own run().
//
// The arithmetic is fixed bit for bit (int8.py's reference holds it in torch ops):
//   a_amax = max_k |x[m,k]|; a_scale = a_amax / 127, inv = 127 / a_amax (float32 divisions; 0 for a zero row)
//   x_q = clamp(round_half_even(x * inv), -127, 127); acc = sum_k x_q * w_q (exact int32)
//   out = dtype((float32(acc) * (a_scale[m] * w_scale[n])) + bias[n]), each step one IEEE rounding.
// The integer product is exact whatever order or blocking a kernel uses, and every other step is per element,
// so any correct kernel gives the same bits as the reference, and a row never depends on the other rows.
// Build with -ffp-contract=off: GCC may otherwise fuse the epilogue's multiply and add into one FMA.
//
// Packed weight (one int8 tensor, every kernel reads the same layout):
//   bytes [0, 64): header, int64 magic, N, K, Kp (K rounded up to 64)
//   then (N_pad / 64) blocks of (Kp / 4, 64, 4) int8: for each group of 4 input features, 64 columns x 4
//   weights = 256 contiguous bytes (the VNNI dot-product operand: 4 bytes per int32 lane; an AMX B tile is
//   16 groups x 16 columns = 16 rows of 64 bytes of it, read in place with a 256-byte stride);
//   then N_pad int32: 128 * sum_k w_q[n, k] (for the VNNI kernels' u8 x s8 trick, see vnni512_run).
// Padded columns and padded K are zero weights: they add nothing to any product.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "parallel_grain.h"

#if defined(__AVX2__)
#include <immintrin.h>
#define QASR_INT8_AVX2 1
#else
#define QASR_INT8_AVX2 0
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define QASR_INT8_AVX512 1
#else
#define QASR_INT8_AVX512 0
#endif

namespace int8 {

constexpr int64_t NB = 64;     // output columns per packed block
constexpr int64_t KALIGN = 64;  // K padding: one AMX tile row of int8
constexpr int64_t HEADER = 64;  // bytes before the blocks (keeps them 64-byte aligned)
constexpr int64_t MAGIC = 0x3150384951534151LL;  // "QASQI8P1"
constexpr int64_t ROW_ALIGN = 32;  // panel rows are padded to this (the AMX kernel's row pair)
// The largest K whose column sums x 128 (|128 * 127 K|) and products (|127 * 127 K|) fit int32.
constexpr int64_t MAX_K = 132104;

inline int64_t round_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

struct Layout {
  int64_t N, K, Kp, blocks;
  int64_t weight_bytes() const { return blocks * (Kp / 4) * NB * 4; }
  int64_t total_bytes() const { return HEADER + weight_bytes() + blocks * NB * 4; }
};

inline Layout layout(int64_t N, int64_t K) {
  return Layout{N, K, round_up(K, KALIGN), (N + NB - 1) / NB};
}

// w_q: (N, K) int8 -> the packed tensor described above.
inline torch::Tensor pack(torch::Tensor w_q) {
  TORCH_CHECK(w_q.dim() == 2 && w_q.scalar_type() == at::kChar, "pack: (N, K) int8 weight");
  const int64_t N = w_q.size(0), K = w_q.size(1);
  TORCH_CHECK(N >= 1 && K >= 1, "pack: N and K must be at least 1");
  TORCH_CHECK(K <= MAX_K, "pack: K must be at most ", MAX_K, " (int32 sums), got ", K);
  const Layout L = layout(N, K);
  auto w = w_q.contiguous();
  auto out = torch::zeros({L.total_bytes()}, w_q.options());
  int8_t* base = out.data_ptr<int8_t>();
  const int64_t head[4] = {MAGIC, N, K, L.Kp};
  std::memcpy(base, head, sizeof(head));
  const int8_t* src = w.data_ptr<int8_t>();
  int8_t* blocks = base + HEADER;
  int32_t* comp = reinterpret_cast<int32_t*>(blocks + L.weight_bytes());
  const int64_t groups = L.Kp / 4;
  at::parallel_for(0, L.blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t cols = std::min<int64_t>(NB, N - b * NB);
      int8_t* blk = blocks + b * groups * NB * 4;
      for (int64_t c = 0; c < cols; ++c) {
        const int8_t* row = src + (b * NB + c) * K;
        int32_t sum = 0;
        for (int64_t k = 0; k < K; ++k) {
          blk[((k / 4) * NB + c) * 4 + k % 4] = row[k];
          sum += row[k];
        }
        comp[b * NB + c] = 128 * sum;  // |sum| <= 127 K: exact in int32 for K <= MAX_K
      }
    }
  });
  return out;
}

// The layout of a tensor from pack(), checked against the caller's N and K.
inline Layout packed_layout(const torch::Tensor& packed, int64_t N, int64_t K, const char* who) {
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 1 && packed.is_contiguous() &&
                  packed.numel() >= HEADER, who, ": packed weight from pack()");
  int64_t head[4];
  std::memcpy(head, packed.data_ptr<int8_t>(), sizeof(head));
  TORCH_CHECK(head[0] == MAGIC, who, ": packed weight from pack()");
  TORCH_CHECK(head[1] == N && head[2] == K, who, ": the packed weight is (", head[1], ", ", head[2],
              "), the call wants (", N, ", ", K, ")");
  const Layout L = layout(N, K);
  TORCH_CHECK(packed.numel() == L.total_bytes(), who, ": packed weight has the wrong size");
  return L;
}

inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) { return static_cast<float>(v); }  // exact (bf16 is float32's top half)

#if QASR_INT8_AVX512
inline __mmask16 tail_mask(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1); }
inline __m512 load16(const float* x, __mmask16 m) { return _mm512_maskz_loadu_ps(m, x); }
inline __m512 load16(const at::BFloat16* x, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, reinterpret_cast<const uint16_t*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif
#if QASR_INT8_AVX2
inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 load8(const at::BFloat16* x) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

// The absolute maximum of K values, with `nan` set when one is NaN (max is exact in any order, so segments
// may be taken one after the other).
template <typename T>
inline float abs_max(const T* x, int64_t K, bool& nan) {
  float amax = 0.f;
  int64_t k = 0;
#if QASR_INT8_AVX512
  __m512 vmax = _mm512_setzero_ps();
  __mmask16 vnan = 0;
  for (; k < K; k += 16) {
    const __m512 v = load16(x + k, tail_mask(K - k));
    vmax = _mm512_max_ps(vmax, _mm512_abs_ps(v));
    vnan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  }
  amax = _mm512_reduce_max_ps(vmax);
  nan = nan || vnan != 0;
#elif QASR_INT8_AVX2
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 vmax = _mm256_setzero_ps(), vnan = _mm256_setzero_ps();
  for (; k + 8 <= K; k += 8) {
    const __m256 v = load8(x + k);
    vmax = _mm256_max_ps(vmax, _mm256_and_ps(v, absmask));
    vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  for (const float v : lanes) amax = std::max(amax, v);
  nan = nan || _mm256_movemask_ps(vnan) != 0;
#endif
  for (; k < K; ++k) {
    const float v = to_float(x[k]);
    amax = std::max(amax, std::fabs(v));
    nan = nan || std::isnan(v);
  }
  return amax;
}

// q[k] = clamp(round_half_even(x[k] * inv), -127, 127) (NaN products to 0), XORed with `flip`, for k < K.
template <typename T>
inline void quantize_values(const T* x, int64_t K, float inv, uint8_t flip, uint8_t* q) {
  int64_t k = 0;
#if QASR_INT8_AVX512
  const __m512 vinv = _mm512_set1_ps(inv), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  const __m128i vflip = _mm_set1_epi8(static_cast<char>(flip));
  for (; k < K; k += 16) {
    const __mmask16 m = tail_mask(K - k);
    // one multiply, then round half to even (explicit, whatever MXCSR says), clamp, NaN to 0
    const __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(load16(x + k, m), vinv),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 c = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(r, r, _CMP_ORD_Q),
                                         _mm512_min_ps(_mm512_max_ps(r, lo), hi));
    const __m512i i = _mm512_cvtt_roundps_epi32(c, _MM_FROUND_NO_EXC);  // exact: c is an integer
    _mm_mask_storeu_epi8(q + k, m, _mm_xor_si128(_mm512_cvtepi32_epi8(i), vflip));
  }
#elif QASR_INT8_AVX2
  const __m256 vinv = _mm256_set1_ps(inv), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  for (; k + 8 <= K; k += 8) {
    const __m256 r = _mm256_round_ps(_mm256_mul_ps(load8(x + k), vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 c = _mm256_and_ps(_mm256_cmp_ps(r, r, _CMP_ORD_Q), _mm256_min_ps(_mm256_max_ps(r, lo), hi));
    alignas(32) int32_t t[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(t), _mm256_cvttps_epi32(c));
    for (int j = 0; j < 8; ++j) q[k + j] = static_cast<uint8_t>(static_cast<int8_t>(t[j])) ^ flip;
  }
#endif
  for (; k < K; ++k) {
    const float r = std::nearbyint(to_float(x[k]) * inv);  // the default rounding mode: half to even
    const float c = std::isnan(r) ? 0.f : std::min(std::max(r, -127.f), 127.f);
    q[k] = static_cast<uint8_t>(static_cast<int8_t>(c)) ^ flip;
  }
}

#if QASR_INT8_AVX512
// bf16 rows, the engine's usual input, in integer steps: about a third of the float loops' instructions
// (docs/log/*-cpu-int8-vnni-pass.md).
// |x| of a bf16 is its bits & 0x7FFF, and for non-negative values the integer order of those bits is the float
// order, so a_amax is one vpmaxuw per 32 values; a NaN is any |bits| above +inf's (0x7F80). Returns the bits of
// a_amax, 0x7FC0 for NaN.
inline uint16_t abs_max_bits(const at::BFloat16* x, int64_t K) {
  const uint16_t* u = reinterpret_cast<const uint16_t*>(x);
  const __m512i mag = _mm512_set1_epi16(0x7FFF);
  __m512i vmax = _mm512_setzero_si512();
  for (int64_t k = 0; k < K; k += 32) {
    const __mmask32 m = K - k >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << (K - k)) - 1);
    vmax = _mm512_max_epu16(vmax, _mm512_and_si512(_mm512_maskz_loadu_epi16(m, u + k), mag));
  }
  const __m512i lo = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(vmax));
  const __m512i hi = _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(vmax, 1));
  const uint32_t bits = _mm512_reduce_max_epu32(_mm512_max_epu32(lo, hi));
  return bits > 0x7F80u ? uint16_t(0x7FC0) : static_cast<uint16_t>(bits);
}

// quantize_values for bf16 when every product x * inv is finite and |x * inv| <= 127 (a row of finite values
// with a_amax > 0 and inv finite): round half to even is then the whole rule (no clamp, no NaN), 64 values a
// step. bf16 -> float is a 16-bit shift, done by interleaving zeros (per 128-bit lane, as the packs below
// undo); vcvtps2dq rounds half to even (explicit here); vpackssdw / vpacksswb cannot saturate (|q| <= 127).
inline void quantize_values_finite(const at::BFloat16* x, int64_t K, float inv, uint8_t flip, uint8_t* q) {
  const uint16_t* u = reinterpret_cast<const uint16_t*>(x);
  const __m512 vinv = _mm512_set1_ps(inv);
  const __m512i zero = _mm512_setzero_si512(), vflip = _mm512_set1_epi8(static_cast<char>(flip));
  const __m512i order = _mm512_set_epi64(7, 5, 3, 1, 6, 4, 2, 0);  // (a0 b0 a1 b1 ..) qwords -> a0..a3 b0..b3
  auto q32 = [&](__m512i v) {  // 32 bf16 -> 32 int16, in order
    const __m512 lo = _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, v));
    const __m512 hi = _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, v));
    constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    return _mm512_packs_epi32(_mm512_cvt_roundps_epi32(_mm512_mul_ps(lo, vinv), kRound),
                              _mm512_cvt_roundps_epi32(_mm512_mul_ps(hi, vinv), kRound));
  };
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    const __m512i a = q32(_mm512_loadu_si512(u + k)), b = q32(_mm512_loadu_si512(u + k + 32));
    const __m512i bytes = _mm512_permutexvar_epi64(order, _mm512_packs_epi16(a, b));
    _mm512_storeu_si512(q + k, _mm512_xor_si512(bytes, vflip));
  }
  if (k < K) quantize_values(x + k, K - k, inv, flip, q + k);
}
#endif

// Quantizes one row given as `segs` segments of `seg` contiguous values, segment i at x + i * stride (a plain
// row: one segment; a convolution's patch: one segment per kernel row, read in place from the padded NHWC
// input), into q[0, segs * seg), and returns its a_scale. `flip` is XORed into every byte: 0 gives the int8
// x_q, 0x80 gives x_q + 128 as uint8 (the VNNI kernels' unsigned operand).
//
// Outside finite rows of ordinary size the reference's torch ops decide, and this follows them: a NaN makes
// a_amax NaN (torch's amax propagates it; a plain max would drop it), and a product x * inv that is NaN (a NaN
// or infinite input, or 0 * inf where 127 / a_amax overflows, a_amax < 2^-121) quantizes to 0, as torch's
// float -> int8 conversion gives on x86; +-inf products clamp to +-127 like any other.
template <typename T>
inline float quantize_segments(const T* x, int64_t segs, int64_t seg, int64_t stride, uint8_t flip, uint8_t* q) {
#if QASR_INT8_AVX512
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    uint16_t bits = 0;
    for (int64_t i = 0; i < segs; ++i) bits = std::max(bits, abs_max_bits(x + i * stride, seg));
    if (bits == 0) {
      std::memset(q, flip, segs * seg);  // x_q = 0 everywhere
      return 0.f;
    }
    const float amax = static_cast<float>(c10::BFloat16(bits, c10::BFloat16::from_bits()));
    const float inv = 127.f / amax, scale = amax / 127.f;
    const bool finite = bits < 0x7F80 && std::isfinite(inv);
    for (int64_t i = 0; i < segs; ++i) {
      if (finite) quantize_values_finite(x + i * stride, seg, inv, flip, q + i * seg);
      else quantize_values(x + i * stride, seg, inv, flip, q + i * seg);
    }
    return scale;
  }
#endif
  float amax = 0.f;
  bool nan = false;
  for (int64_t i = 0; i < segs; ++i) amax = std::max(amax, abs_max(x + i * stride, seg, nan));
  if (nan) amax = std::numeric_limits<float>::quiet_NaN();
  if (amax == 0.f) {
    std::memset(q, flip, segs * seg);  // x_q = 0 everywhere
    return 0.f;
  }
  const float inv = 127.f / amax, scale = amax / 127.f;
  for (int64_t i = 0; i < segs; ++i) quantize_values(x + i * stride, seg, inv, flip, q + i * seg);
  return scale;
}

template <typename T>
inline float quantize_row(const T* x, int64_t K, uint8_t flip, uint8_t* q) {
  return quantize_segments(x, 1, K, K, flip, q);
}

// Where a call's rows come from: row r is `segs` segments of `seg` values, segment i at row(r) + i * stride.
// A linear's x: row(r) = x + r * K, one segment of K. A convolution's padded NHWC input (n, hp, wp, cin):
// row (b, oy, ox) starts at its patch's top-left value, one segment of kw * cin per kernel row, a padded
// input row (wp * cin) apart -- the patch's features in (kh, kw, cin) order, read in place (implicit im2col).
template <typename T>
struct Rows {
  const T* x;
  int64_t segs, seg, stride;
  int64_t ho = 1, wo = 1, hp = 1, wp = 1, cin = 1, sh = 1, sw = 1;  // a convolution's geometry (segs > 1 or conv)
  bool conv = false;
  const T* row(int64_t r) const {
    if (!conv) return x + r * seg;
    const int64_t b = r / (ho * wo), oy = r / wo % ho, ox = r % wo;
    return x + ((b * hp + oy * sh) * wp + ox * sw) * cin;
  }
  int64_t K() const { return segs * seg; }
};

// Rows [0, M) quantized into a panel of `rows_pad` rows x Kp bytes (K values, then x_q = 0 up to Kp; rows
// past M all x_q = 0) and their a_scale (0 for the padding rows).
template <typename T>
inline void quantize_panel(const Rows<T>& src, int64_t M, int64_t Kp, int64_t rows_pad, uint8_t flip,
                           uint8_t* panel, float* a_scale) {
  const int64_t K = src.K();
  // a decode step's few rows are quantized by the calling thread (a fork and join per product costs more)
  at::parallel_for(0, rows_pad, grain_for(rows_pad, M * K, 16), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      uint8_t* dst = panel + r * Kp;
      if (r < M) {
        a_scale[r] = quantize_segments(src.row(r), src.segs, src.seg, src.stride, flip, dst);
        std::memset(dst + K, flip, Kp - K);
      } else {
        a_scale[r] = 0.f;
        std::memset(dst, flip, Kp);
      }
    }
  });
}

#if QASR_INT8_AVX512
// The epilogue of 16 columns (mask: fewer) of a C block: their w_scale and bias, loaded once for all rows.
struct Cols16 {
  __m512 w_scale, bias;
  bool has_bias;
  __mmask16 mask;
};
inline Cols16 cols16(const float* w_scale, const float* bias, __mmask16 mask) {
  return Cols16{_mm512_maskz_loadu_ps(mask, w_scale), bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps(),
                bias != nullptr, mask};
}

// 16 float32 values (mask: fewer) stored as float32 or bf16 (round to nearest even, NaN to the quiet NaN 0x7FC0,
// as torch's .to(bfloat16)).
inline void store16(__m512 y, __mmask16 mask, void* out, bool bf16) {
  if (!bf16) {
    _mm512_mask_storeu_ps(static_cast<float*>(out), mask, y);
    return;
  }
  const __m512i u = _mm512_castps_si512(y);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7FC0));
  _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out), mask, _mm512_cvtepi32_epi16(r));
}

// One row's 16 values: acc -> float32 * (a_scale * w_scale) (+ bias), stored by store16. Without a bias nothing
// is added (adding +0.0 would turn -0.0 into +0.0).
inline void epilogue16(__m512i acc, float a_scale, const Cols16& c, void* out, bool bf16) {
  const __m512 s = _mm512_mul_ps(_mm512_set1_ps(a_scale), c.w_scale);
  __m512 y = _mm512_mul_ps(_mm512_cvt_roundepi32_ps(acc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), s);
  if (c.has_bias) y = _mm512_add_ps(y, c.bias);
  store16(y, c.mask, out, bf16);
}
#endif

#if QASR_INT8_AVX2
// The same epilogue, 8 columns at a time (`n` of them valid, 1..8), for the AVX2 kernel.
struct Cols8 {
  __m256 w_scale, bias;
  bool has_bias;
  int64_t n;
  __m256i mask;
};
inline Cols8 cols8(const float* w_scale, const float* bias, int64_t n) {
  const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(n, 8))),
                                          _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  return Cols8{_mm256_maskload_ps(w_scale, mask), bias ? _mm256_maskload_ps(bias, mask) : _mm256_setzero_ps(),
               bias != nullptr, std::min<int64_t>(n, 8), mask};
}

inline void epilogue8(__m256i acc, float a_scale, const Cols8& c, void* out, bool bf16) {
  const __m256 s = _mm256_mul_ps(_mm256_set1_ps(a_scale), c.w_scale);
  // int32 -> float32 in the current rounding mode: to nearest even, as the process starts and torch keeps it
  __m256 y = _mm256_mul_ps(_mm256_cvtepi32_ps(acc), s);
  if (c.has_bias) y = _mm256_add_ps(y, c.bias);
  if (!bf16) {
    _mm256_maskstore_ps(static_cast<float*>(out), c.mask, y);
    return;
  }
  const __m256i u = _mm256_castps_si256(y);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(y, y, _CMP_UNORD_Q)));
  // 8 x 16 bits: packus works per 128-bit lane, the permute brings lane 1's four values after lane 0's
  const __m128i h = _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0b1000));
  if (c.n == 8) {
    _mm_storeu_si128(static_cast<__m128i*>(out), h);
  } else {
    alignas(16) uint16_t t[8];
    _mm_store_si128(reinterpret_cast<__m128i*>(t), h);
    std::memcpy(out, t, c.n * sizeof(uint16_t));
  }
}
#endif

// A kernel's product: panel (rows_pad x Kp bytes, from quantize_panel with the kernel's flip), rows [0, M)
// -> out (M, N) row-major, float32 or bf16.
struct Args {
  const uint8_t* panel;
  const float* a_scale;
  int64_t M, N, Kp;
  const int8_t* blocks;  // the packed weight's blocks
  const int32_t* comp;   // 128 * column sums
  const float* w_scale;
  const float* bias;  // or null
  void* out;
  bool bf16;
};
using RunFn = void (*)(const Args& a);

struct Gemm {
  const char* name;     // the messages' prefix, e.g. "qasr AMX-INT8"
  const char* missing;  // why supported() may be false
  bool (*supported)();
  RunFn run;      // null in a build without the kernel's instructions (supported() is false there)
  uint8_t flip;   // 0: the kernel reads x_q as int8; 0x80: as x_q + 128 (uint8)
  // calls of at most small_rows rows go to small_run instead, with its own panel flip (the integer product
  // is exact, so which path computes a row never changes its bits)
  int64_t small_rows = 0;
  RunFn small_run = nullptr;
  uint8_t small_flip = 0;
};

#if QASR_INT8_AVX512 && defined(__AVX512VNNI__)
// The AVX512-VNNI product (int8_linear.cpp's kernel; the AMX-INT8 kernel runs it for calls of very few rows,
// where 16-row tiles would mostly multiply padding). vpdpbusd multiplies unsigned by signed bytes, so the panel
// holds x_q + 128 (flip 0x80) and the packed column sums fix it afterwards:
//   sum_k (x_q + 128) * w = sum_k x_q * w + 128 * sum_k w,   acc = that - comp[n]
// vpdpbusd (not the saturating vpdpbusds) wraps modulo 2^32, and the subtraction does too, so the result is the
// exact acc whenever acc itself fits int32, even when the shifted sum overflows on the way. Padded K holds zero
// weights: whatever the panel has there adds nothing.
// Work items are (64-column block, chunk of up to 96 rows); each thread takes a contiguous run of them in
// block-major order (vnni512_run: split by cost) and runs its run chunk by chunk. A call of <= 96 rows (decode)
// is one chunk, and the items are the column blocks: the weights stream once, split over the threads. Inside
// an item, passes of up to 6 rows x 64 columns keep 24 int32 accumulators in registers, each pass over all of K.
constexpr int64_t VNNI_MR = 6;          // rows per register pass

// acc += u8 a x s8 b, four bytes per int32 lane (vpdpbusd), in inline assembly: the tied "+v" operand keeps each
// of a pass's 24 accumulators in one register (GCC's intrinsic let them live on the stack;
// docs/log/*-cpu-int8-inline-asm.md).
inline __m512i dpbusd(__m512i acc, __m512i a, __m512i b) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "vm"(b));
  return acc;
}
constexpr int64_t VNNI_ROW_CHUNK = 96;  // rows per work item

// Rows [m0, m0 + R) x the first V of block b's four 16-column vectors over all of K, then the epilogue.
template <int R, int V = 4>
inline void vnni512_pass(const Args& a, int64_t m0, int64_t b) {
  const int64_t groups = a.Kp / 4;
  const int8_t* blk = a.blocks + b * groups * NB * 4;
  const uint8_t* rows = a.panel + m0 * a.Kp;
  // Every loop over r and j is unrolled, so the accumulators live in registers from start to end (a rolled
  // epilogue loop made GCC keep a stack copy of them).
  __m512i acc[R][V];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < V; ++j) acc[r][j] = _mm512_setzero_si512();
  for (int64_t g = 0; g < groups; ++g) {
    const int8_t* w = blk + g * NB * 4;
    __m512i wv[V];
#pragma GCC unroll 4
    for (int j = 0; j < V; ++j) wv[j] = _mm512_loadu_si512(w + 64 * j);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      int32_t four;
      std::memcpy(&four, rows + r * a.Kp + 4 * g, 4);
      const __m512i x = _mm512_set1_epi32(four);
#pragma GCC unroll 4
      for (int j = 0; j < V; ++j) acc[r][j] = dpbusd(acc[r][j], x, wv[j]);
    }
  }
  const int64_t es = a.bf16 ? 2 : 4;
#pragma GCC unroll 4
  for (int j = 0; j < V; ++j) {
    const int64_t n0 = b * NB + 16 * j;
    if (n0 < a.N) {
      const Cols16 cols = cols16(a.w_scale + n0, a.bias ? a.bias + n0 : nullptr, tail_mask(a.N - n0));
      const __m512i comp = _mm512_loadu_si512(a.comp + n0);  // comp is padded to whole blocks
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int64_t m = m0 + r;
        epilogue16(_mm512_sub_epi32(acc[r][j], comp), a.a_scale[m], cols,
                   static_cast<char*>(a.out) + (m * a.N + n0) * es, a.bf16);
      }
    }
  }
}

// Rows [m, end) x block b in passes of up to VNNI_MR rows, V vectors wide.
template <int V>
inline void vnni512_rows(const Args& a, int64_t m, int64_t end, int64_t b) {
  for (; m + VNNI_MR <= end; m += VNNI_MR) vnni512_pass<VNNI_MR, V>(a, m, b);
  switch (end - m) {
    case 5: vnni512_pass<5, V>(a, m, b); break;
    case 4: vnni512_pass<4, V>(a, m, b); break;
    case 3: vnni512_pass<3, V>(a, m, b); break;
    case 2: vnni512_pass<2, V>(a, m, b); break;
    case 1: vnni512_pass<1, V>(a, m, b); break;
    default: break;
  }
}

inline void vnni512_run(const Args& a) {
  const int64_t blocks = (a.N + NB - 1) / NB, chunks = (a.M + VNNI_ROW_CHUNK - 1) / VNNI_ROW_CHUNK;
  // A last block of at most 32 columns (the encoder convolutions' 480 = 7.5 blocks) runs on two vectors, at
  // about half a block's cost; the threads split the (block, chunk) items, block-major, by cost, not count.
  const auto narrow = [&](int64_t b) { return a.N - b * NB <= 32; };  // only ever the last block
  const bool half_last = narrow(blocks - 1);
  const int64_t whole = (half_last ? blocks - 1 : blocks) * chunks;  // items before the half block's
  const int64_t cost = 2 * whole + (blocks * chunks - whole);          // in half blocks
  const auto item_at = [&](int64_t c) { return c <= 2 * whole ? (c + 1) / 2 : whole + (c - 2 * whole); };
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), blocks * chunks));
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    const int64_t first = item_at(cost * p0 / parts), last = item_at(cost * p1 / parts);
    // A thread's items run chunk by chunk, its blocks inside: a chunk's panel rows stay in L2 while the blocks
    // pass, instead of the whole panel streaming from memory once per block. A decode call is one chunk.
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t m = c * VNNI_ROW_CHUNK, end = std::min(a.M, m + VNNI_ROW_CHUNK);
      for (int64_t b = first / chunks; b * chunks < last; ++b) {
        const int64_t item = b * chunks + c;
        if (item < first || item >= last) continue;
        if (narrow(b)) vnni512_rows<2>(a, m, end, b);
        else vnni512_rows<4>(a, m, end, b);
      }
    }
  });
}
#endif

// Per-call panel and scales of the calling thread, kept between calls (no allocation once grown).
struct Panel {
  std::vector<uint8_t> q;
  std::vector<float> scale;
};
inline Panel& panel_scratch() {
  static thread_local Panel p;
  return p;
}

// The calling thread's panel, grown to hold `rows` rows of Kp bytes and their scales.
inline Panel& panel_for(int64_t rows, int64_t Kp) {
  Panel& p = panel_scratch();
  if (static_cast<int64_t>(p.q.size()) < rows * Kp) p.q.resize(rows * Kp);
  if (static_cast<int64_t>(p.scale.size()) < rows) p.scale.resize(rows);
  return p;
}

// A call's bias as N contiguous float32 values, or an undefined tensor when it has none.
inline torch::Tensor float_bias(const c10::optional<torch::Tensor>& bias, int64_t N, const char* who) {
  if (!bias.has_value() || !bias->defined()) return torch::Tensor();
  TORCH_CHECK(bias->numel() == N, who, ": bias must have N values");
  return bias->to(at::kFloat).contiguous();
}

inline void check_x(const torch::Tensor& x, const char* who) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat), who,
              ": x must be (M, K) bfloat16 or float32");
  TORCH_CHECK(x.size(1) >= 1, who, ": K must be at least 1");
  TORCH_CHECK(x.device().is_cpu(), who, ": x must be on the CPU");
}

template <typename F>
inline void dispatch_x(const torch::Tensor& x, F&& f) {
  if (x.scalar_type() == at::kFloat) f(x.data_ptr<float>());
  else f(x.data_ptr<at::BFloat16>());
}

// quantize_rows(x) -> (x_q int8 (M, K), a_scale float32 (M,)), the activations' quantization alone.
inline std::tuple<torch::Tensor, torch::Tensor> quantize_rows(torch::Tensor x) {
  check_x(x, "quantize_rows");
  auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1);
  auto q = torch::empty({M, K}, xc.options().dtype(at::kChar));
  auto s = torch::empty({M}, xc.options().dtype(at::kFloat));
  uint8_t* qp = reinterpret_cast<uint8_t*>(q.data_ptr<int8_t>());
  float* sp = s.data_ptr<float>();
  dispatch_x(xc, [&](auto* xp) {
    at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) sp[r] = quantize_row(xp + r * K, K, 0, qp + r * K);
    });
  });
  return {q, s};
}

// The product of M rows (from `rows_of(data pointer)`, a Rows<T>) with the packed weight -> (M, N) in x's dtype:
// quantize the rows into a panel, the kernel's product, the epilogue. linear() and conv() differ only in rows.
template <typename RowsOf>
inline torch::Tensor product(const Gemm& g, const char* who, const torch::Tensor& xc, int64_t M, int64_t K,
                             torch::Tensor packed, int64_t N, torch::Tensor w_scale,
                             c10::optional<torch::Tensor> bias, RowsOf&& rows_of) {
  const Layout L = packed_layout(packed, N, K, who);
  TORCH_CHECK(w_scale.numel() == N, who, ": w_scale must have N values");
  auto ws = w_scale.to(at::kFloat).contiguous();
  const torch::Tensor bf = float_bias(bias, N, who);
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  auto out = torch::empty({M, N}, xc.options());
  if (M == 0 || g.run == nullptr) return out;
  const int64_t rows_pad = round_up(M, ROW_ALIGN);
  Panel& p = panel_for(rows_pad, L.Kp);
  const bool small = g.small_run != nullptr && M <= g.small_rows;
  const uint8_t flip = small ? g.small_flip : g.flip;
  dispatch_x(xc, [&](auto* xp) { quantize_panel(rows_of(xp), M, L.Kp, rows_pad, flip, p.q.data(), p.scale.data()); });
  const int8_t* blocks = packed.data_ptr<int8_t>() + HEADER;
  const Args a{p.q.data(), p.scale.data(), M, N, L.Kp, blocks,
               reinterpret_cast<const int32_t*>(blocks + L.weight_bytes()), ws.data_ptr<float>(), bp,
               out.data_ptr(), xc.scalar_type() == at::kBFloat16};
  (small ? g.small_run : g.run)(a);
  return out;
}

// linear(x, packed, N, w_scale, bias) -> (M, N) in x's dtype.
inline torch::Tensor linear(const Gemm& g, torch::Tensor x, torch::Tensor packed, int64_t N, torch::Tensor w_scale,
                            c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(g.supported(), g.name, " linear: ", g.missing);
  check_x(x, "linear");
  auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1);
  return product(g, "linear", xc, M, K, packed, N, w_scale, bias, [K](auto* xp) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(xp)>>;
    return Rows<T>{xp, 1, K, K};
  });
}

// conv(xp, packed, N, w_scale, bias, kh, kw, sh, sw) -> (n * ho * wo, N) in xp's dtype: the product whose row
// (b, oy, ox) is the kh x kw x cin patch of the padded NHWC input xp (n, hp, wp, cin) at (oy * sh, ox * sw),
// features in (kh, kw, cin) order (the packed weight's K order). The same bits as linear() on the explicit
// im2col rows (each row is quantized on its own scale either way), without materialising them.
inline torch::Tensor conv(const Gemm& g, torch::Tensor xp, torch::Tensor packed, int64_t N, torch::Tensor w_scale,
                          c10::optional<torch::Tensor> bias, int64_t kh, int64_t kw, int64_t sh, int64_t sw) {
  TORCH_CHECK(g.supported(), g.name, " conv: ", g.missing);
  TORCH_CHECK(xp.dim() == 4 && (xp.scalar_type() == at::kBFloat16 || xp.scalar_type() == at::kFloat) &&
                  xp.device().is_cpu(), "conv: xp must be a (n, hp, wp, cin) bfloat16 or float32 CPU tensor");
  TORCH_CHECK(kh >= 1 && kw >= 1 && sh >= 1 && sw >= 1, "conv: kernel and stride must be positive");
  auto xc = xp.contiguous();
  const int64_t n = xc.size(0), hp = xc.size(1), wp = xc.size(2), cin = xc.size(3);
  TORCH_CHECK(cin >= 1 && hp >= kh && wp >= kw, "conv: kernel larger than the padded input");
  const int64_t ho = (hp - kh) / sh + 1, wo = (wp - kw) / sw + 1;
  return product(g, "conv", xc, n * ho * wo, kh * kw * cin, packed, N, w_scale, bias, [&](auto* x) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(x)>>;
    return Rows<T>{x, kh, kw * cin, wp * cin, ho, wo, hp, wp, cin, sh, sw, true};
  });
}

// The interface every int8 module shares: pack(), quantize_rows(), linear() and conv() on kernel `g` (a static
// object). Each releases the GIL while it runs; the bodies touch no Python object.
inline void def_int8(pybind11::module& m, const Gemm& g, const char* linear_doc) {
  const auto no_gil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("pack", &pack, "pack an (N, K) int8 weight for linear() (the layout every int8 kernel shares)", no_gil);
  m.def("quantize_rows", &quantize_rows,
        "per-row symmetric int8 quantization of (M, K) bf16/float32: (x_q, a_scale)", no_gil);
  m.def("linear", [&g](torch::Tensor x, torch::Tensor packed, int64_t N, torch::Tensor w_scale,
                       c10::optional<torch::Tensor> bias) { return linear(g, x, packed, N, w_scale, bias); },
        linear_doc, pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("n"), pybind11::arg("w_scale"),
        pybind11::arg("bias") = pybind11::none(), no_gil);
  m.def("conv", [&g](torch::Tensor xp, torch::Tensor packed, int64_t N, torch::Tensor w_scale,
                     c10::optional<torch::Tensor> bias, int64_t kh, int64_t kw, int64_t sh, int64_t sw) {
          return conv(g, xp, packed, N, w_scale, bias, kh, kw, sh, sw);
        },
        "linear()'s product on the kh x kw patches of a padded NHWC input (n, hp, wp, cin), read in place",
        pybind11::arg("xp"), pybind11::arg("packed"), pybind11::arg("n"), pybind11::arg("w_scale"),
        pybind11::arg("bias"), pybind11::arg("kh"), pybind11::arg("kw"), pybind11::arg("sh"), pybind11::arg("sw"),
        no_gil);
}

}  // namespace int8
