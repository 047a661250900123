// Decode attention over a block pool: one query token per sequence, keys/values of each sequence in
// fixed-size blocks of a (kv_heads, num_blocks * block_size, head_dim) pool, named by its block table
// (position t lives at row table[t / bs] * bs + t % bs). One call serves the whole batch, parallel over
// (sequence, kv head); each task streams its keys and values once, block by block (a block's keys are
// contiguous per head), accumulating in float32 in position order, so the result is the same bits
// wherever the blocks lie. No padding to the longest sequence, no gather, no per-sequence Python call.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "parallel_grain.h"

template <typename T>
static inline float as_float(T x) { return static_cast<float>(x); }

// Runs body(begin, end) over the (sequence, kv head) tasks [0, batch * kv_heads), each thread a contiguous run
// holding about an equal share of the keys (a split by count leaves a thread with the long contexts). Small
// calls stay on the calling thread. A task's result does not depend on which thread runs it.
template <typename Body>
static void for_tasks_by_keys(const int64_t* lens, int64_t batch, int64_t kv_heads, int64_t dim, const Body& body) {
  const int64_t n = batch * kv_heads;
  int64_t total = 0;
  for (int64_t b = 0; b < batch; ++b) total += lens[b];
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  if (total * kv_heads * dim < (int64_t(1) << 18) || threads <= 1) {
    body(0, n);
    return;
  }
  constexpr int64_t kTaskCost = 16;  // a task's fixed cost (its query, softmax and output), in keys
  std::vector<int64_t> cum(n + 1, 0);
  for (int64_t t = 0; t < n; ++t) cum[t + 1] = cum[t] + lens[t / kv_heads] + kTaskCost;
  auto first_task = [&](int64_t part) {  // the first task whose keys start at or past part / threads of them
    return static_cast<int64_t>(std::lower_bound(cum.begin(), cum.end(), cum[n] * part / threads) - cum.begin());
  };
  at::parallel_for(0, threads, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t part = p0; part < p1; ++part) {
      const int64_t begin = part == 0 ? 0 : first_task(part), end = part + 1 == threads ? n : first_task(part + 1);
      if (begin < end) body(begin, end);
    }
  });
}


#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define QASR_AVX512 1
#else
#define QASR_AVX512 0
#endif

#if QASR_AVX512
// 32 bf16 (64 bytes) -> two float vectors: the even-indexed and the odd-indexed elements. Exact (bf16 is
// the top half of a float) and only two ALU ops per 32 values; the dimension order inside the
// accumulators is then (even, odd), undone once per output row.
static inline void load32_bf16(const at::BFloat16* p, __m512& even, __m512& odd) {
  const __m512i raw = _mm512_loadu_si512(p);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(int32_t(0xFFFF0000u))));
}

// acc + a * b, fused (one rounding, as _mm512_fmadd_ps), in inline assembly: the tied "+v" operand keeps each
// of the values pass's 16 accumulators in a register (GCC's intrinsic let it spill the array to the stack).
static inline __m512 fma_acc(__m512 acc, __m512 a, __m512 b) {
  asm("vfmadd231ps %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}

// The pool row (of kv head g) where the block after the one holding position t0 starts, or -1 past the last.
static inline int64_t next_block_row(const int64_t* table, int64_t t0, int64_t len, int64_t bs, int64_t g,
                                     int64_t pool) {
  return t0 + bs < len ? g * pool + table[t0 / bs + 1] * bs : -1;
}

// The next block of a sequence lies anywhere in the pool, so each key (or pair) read prefetches the next block's
// row at the same offset. Into L2 (T1), not L1: L1 prefetches hold the few L1 miss buffers the current block's
// loads need (docs/log/*-cpu-decode-attention-prefetch.md).
static inline void prefetch_lines(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(c + off, _MM_HINT_T1);
}

// Where the d128 loop reads a row's dims (row is the pool row: kv head g's rows first, g * pool + token row).
struct Bf16Rows {
  const at::BFloat16* data;
  struct Row {
    const at::BFloat16* p;
    inline void load(int c, __m512& even, __m512& odd) const { load32_bf16(p + c * 32, even, odd); }
  };
  inline Row at(int64_t row) const { return Row{data + row * 128}; }
  inline void prefetch(int64_t row) const { prefetch_lines(data + row * 128, 128 * 2); }
};

// The common shape (head_dim 128, bf16) with explicit AVX-512 and float32 accumulation. The portable
// loop below leaves the bf16 conversions to the compiler and is compute-bound well below bandwidth.
template <int REP, typename Rows>
static void run_d128(const at::BFloat16* q, Rows kpool, Rows vpool, at::BFloat16* out, const int64_t* tables,
                     int64_t width, int64_t bs, const int64_t* lens, int64_t batch, int64_t heads, int64_t kv_heads,
                     int64_t pool, float scale) {
  constexpr int64_t D = 128, C = D / 32;  // C blocks of 32 dims, each held as (even, odd) vectors
  for_tasks_by_keys(lens, batch, kv_heads, D, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, g = task % kv_heads;
      const int64_t* table = tables + b * width;
      const int64_t len = lens[b];
      scores.resize(REP * len);
      __m512 qe[REP][C], qo[REP][C];
      const __m512 sc = _mm512_set1_ps(scale);
      for (int r = 0; r < REP; ++r)
        for (int c = 0; c < C; ++c) {
          load32_bf16(q + (b * heads + g * REP + r) * D + c * 32, qe[r][c], qo[r][c]);
          qe[r][c] = _mm512_mul_ps(qe[r][c], sc);
          qo[r][c] = _mm512_mul_ps(qo[r][c], sc);
        }
      float mx[REP];  // not -INFINITY: this file is built with -ffast-math, which assumes no infinities
      for (int r = 0; r < REP; ++r) mx[r] = -std::numeric_limits<float>::max();
      for (int64_t t0 = 0; t0 < len; t0 += bs) {  // block by block; within a block the keys are contiguous
        const int64_t first = g * pool + table[t0 / bs] * bs;
        const int64_t next = next_block_row(table, t0, len, bs, g, pool);
        for (int64_t t = t0, tend = std::min(len, t0 + bs); t < tend; ++t) {
          const auto k = kpool.at(first + (t - t0));
          if (next >= 0) kpool.prefetch(next + (t - t0));
          __m512 acc[REP];
          for (int r = 0; r < REP; ++r) acc[r] = _mm512_setzero_ps();
          for (int c = 0; c < C; ++c) {
            __m512 ke, ko;
            k.load(c, ke, ko);
            for (int r = 0; r < REP; ++r) acc[r] = _mm512_fmadd_ps(qo[r][c], ko, _mm512_fmadd_ps(qe[r][c], ke, acc[r]));
          }
          for (int r = 0; r < REP; ++r) {
            const float s = _mm512_reduce_add_ps(acc[r]);
            scores[r * len + t] = s;
            mx[r] = std::max(mx[r], s);
          }
        }
      }
      float inv[REP];
      for (int r = 0; r < REP; ++r) {
        float* sr = scores.data() + r * len;
        const float m = mx[r];
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; ++t) { sr[t] = std::exp(sr[t] - m); sum += sr[t]; }
        inv[r] = 1.f / sum;
      }
      // every loop over oe / oo is unrolled whole, so that their elements are registers (see fma_acc)
      __m512 oe[REP][C], oo[REP][C];
#pragma GCC unroll 16
      for (int r = 0; r < REP; ++r)
#pragma GCC unroll 16
        for (int c = 0; c < C; ++c) oe[r][c] = oo[r][c] = _mm512_setzero_ps();
      for (int64_t t0 = 0; t0 < len; t0 += bs) {
        const int64_t first = g * pool + table[t0 / bs] * bs;
        const int64_t next = next_block_row(table, t0, len, bs, g, pool);
        for (int64_t t = t0, tend = std::min(len, t0 + bs); t < tend; ++t) {
          const auto v = vpool.at(first + (t - t0));
          if (next >= 0) vpool.prefetch(next + (t - t0));
          __m512 p[REP];
          for (int r = 0; r < REP; ++r) p[r] = _mm512_set1_ps(scores[r * len + t]);
#pragma GCC unroll 16
          for (int c = 0; c < C; ++c) {
            __m512 ve, vo;
            v.load(c, ve, vo);
#pragma GCC unroll 16
            for (int r = 0; r < REP; ++r) {
              oe[r][c] = fma_acc(oe[r][c], p[r], ve);
              oo[r][c] = fma_acc(oo[r][c], p[r], vo);
            }
          }
        }
      }
      alignas(64) float ev[REP][D / 2], od[REP][D / 2];
#pragma GCC unroll 16
      for (int r = 0; r < REP; ++r) {
        const __m512 iv = _mm512_set1_ps(inv[r]);
#pragma GCC unroll 16
        for (int c = 0; c < C; ++c) {
          _mm512_store_ps(ev[r] + c * 16, _mm512_mul_ps(oe[r][c], iv));
          _mm512_store_ps(od[r] + c * 16, _mm512_mul_ps(oo[r][c], iv));
        }
      }
      for (int r = 0; r < REP; ++r) {
        at::BFloat16* dst = out + (b * heads + g * REP + r) * D;
        for (int c = 0; c < C; ++c)
          for (int i = 0; i < 16; ++i) {
            dst[c * 32 + 2 * i] = static_cast<at::BFloat16>(ev[r][c * 16 + i]);
            dst[c * 32 + 2 * i + 1] = static_cast<at::BFloat16>(od[r][c * 16 + i]);
          }
      }
    }
  });
}

// 16 int8 -> 16 floats in order (exact).
static inline __m512 load16_q8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// int32 dot-product accumulation of 32 int16 pairs: VNNI's one instruction where the CPU has it.
static inline __m512i dot16(__m512i acc, __m512i a, __m512i b) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, a, b);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}

// The sums of four int32 vectors' lanes, as one 4-lane vector (a, b, c, d): a dozen instructions for four
// horizontal sums instead of about eight each. Integer sums: exact in any order.
static inline __m128i reduce4(__m512i a, __m512i b, __m512i c, __m512i d) {
  const __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
  const __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
  // each 128-bit lane now holds (a, b, a, b) and (c, d, c, d) partial sums
  const __m512i abcd = _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
  const __m256i h = _mm256_add_epi32(_mm512_castsi512_si256(abcd), _mm512_extracti64x4_epi64(abcd, 1));
  return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

// The int8 pool at head_dim 128, bf16 queries. Scores: each query row (bf16, times the softmax scale) is
// quantized once to int16 with its own scale (amax / 32767: an error of 1.5e-5 of its largest value, far below
// bf16's own rounding), so a key row's dot product is exact int32 arithmetic on its int8 values (vpdpwssd: 32
// products an instruction), scaled once by the query's and the key row's scales; two keys at a time, their
// horizontal sums four at once. Values: a row's scale is folded into its softmax weight, each value widened to
// float once and accumulated in float32 in position order. A row's result does not depend on the other rows.
template <int REP>
static void run_int8_d128(const at::BFloat16* q, const int8_t* kq, const float* ks, const int8_t* vq,
                          const float* vs, at::BFloat16* out, const int64_t* tables, int64_t width, int64_t bs,
                          const int64_t* lens, int64_t batch, int64_t heads, int64_t kv_heads, int64_t pool,
                          float scale) {
  constexpr int64_t D = 128, C = D / 16, C16 = D / 32;
  for_tasks_by_keys(lens, batch, kv_heads, D, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, g = task % kv_heads;
      const int64_t* table = tables + b * width;
      const int64_t len = lens[b];
      scores.resize(REP * len);
      __m512i q16[REP][C16];
      float qscale[REP];
      for (int r = 0; r < REP; ++r) {
        alignas(64) float qf[D];
        const at::BFloat16* src = q + (b * heads + g * REP + r) * D;
        float amax = 0.f;
        for (int64_t d = 0; d < D; ++d) {
          qf[d] = static_cast<float>(src[d]) * scale;
          amax = std::max(amax, std::fabs(qf[d]));
        }
        const float inv = amax > 0.f ? 32767.f / amax : 0.f;
        alignas(64) int16_t qi[D];
        for (int64_t d = 0; d < D; ++d) qi[d] = static_cast<int16_t>(std::nearbyint(qf[d] * inv));
        constexpr float kInv32767 = 1.f / 32767.f;
        qscale[r] = amax * kInv32767;
        for (int c = 0; c < C16; ++c) q16[r][c] = _mm512_load_si512(qi + c * 32);
      }
      float mx[REP];  // not -INFINITY: this file is built with -ffast-math, which assumes no infinities
      for (int r = 0; r < REP; ++r) mx[r] = -std::numeric_limits<float>::max();
      auto keep = [&](int r, int64_t t, int64_t row, int32_t sum) {
        const float s = static_cast<float>(sum) * (qscale[r] * ks[row]);
        scores[r * len + t] = s;
        mx[r] = std::max(mx[r], s);
      };
      for (int64_t t0 = 0; t0 < len; t0 += bs) {
        const int64_t first = g * pool + table[t0 / bs] * bs, tend = std::min(len, t0 + bs);
        const int64_t next = next_block_row(table, t0, len, bs, g, pool);
        if (next >= 0) prefetch_lines(ks + next, bs * 4);
        int64_t t = t0;
        for (; t + 1 < tend; t += 2) {  // two keys of the block at a time
          const int64_t row = first + (t - t0);
          const int8_t* k0 = kq + row * D;
          const int8_t* k1 = k0 + D;
          if (next >= 0) prefetch_lines(kq + (next + (t - t0)) * D, 2 * D);  // the next block's same two rows
          __m512i acc0[REP], acc1[REP];
          for (int r = 0; r < REP; ++r) acc0[r] = acc1[r] = _mm512_setzero_si512();
          for (int c = 0; c < C16; ++c) {
            const __m512i a = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(k0 + c * 32)));
            const __m512i e = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(k1 + c * 32)));
            for (int r = 0; r < REP; ++r) {
              acc0[r] = dot16(acc0[r], q16[r][c], a);
              acc1[r] = dot16(acc1[r], q16[r][c], e);
            }
          }
          alignas(16) int32_t sums[4];
          if constexpr (REP == 1) {
            _mm_store_si128(reinterpret_cast<__m128i*>(sums), reduce4(acc0[0], acc1[0], acc0[0], acc1[0]));
            keep(0, t, row, sums[0]);
            keep(0, t + 1, row + 1, sums[1]);
          } else {
            for (int r = 0; r < REP; r += 2) {
              _mm_store_si128(reinterpret_cast<__m128i*>(sums), reduce4(acc0[r], acc0[r + 1], acc1[r], acc1[r + 1]));
              keep(r, t, row, sums[0]);
              keep(r + 1, t, row, sums[1]);
              keep(r, t + 1, row + 1, sums[2]);
              keep(r + 1, t + 1, row + 1, sums[3]);
            }
          }
        }
        for (; t < tend; ++t) {  // the block's last key when its count is odd
          const int64_t row = first + (t - t0);
          const int8_t* k0 = kq + row * D;
          __m512i acc0[REP];
          for (int r = 0; r < REP; ++r) acc0[r] = _mm512_setzero_si512();
          for (int c = 0; c < C16; ++c) {
            const __m512i a = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(k0 + c * 32)));
            for (int r = 0; r < REP; ++r) acc0[r] = dot16(acc0[r], q16[r][c], a);
          }
          for (int r = 0; r < REP; ++r) keep(r, t, row, _mm512_reduce_add_epi32(acc0[r]));
        }
      }
      float inv[REP];
      for (int r = 0; r < REP; ++r) {
        float* sr = scores.data() + r * len;
        const float m = mx[r];
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; ++t) { sr[t] = std::exp(sr[t] - m); sum += sr[t]; }
        inv[r] = 1.f / sum;
      }
      // every loop over o is unrolled whole, so that o's elements are registers (see fma_acc)
      __m512 o[REP][C];
#pragma GCC unroll 16
      for (int r = 0; r < REP; ++r)
#pragma GCC unroll 16
        for (int c = 0; c < C; ++c) o[r][c] = _mm512_setzero_ps();
      for (int64_t t0 = 0; t0 < len; t0 += bs) {
        const int64_t first = g * pool + table[t0 / bs] * bs;
        const int64_t next = next_block_row(table, t0, len, bs, g, pool);
        if (next >= 0) prefetch_lines(vs + next, bs * 4);
        for (int64_t t = t0, tend = std::min(len, t0 + bs); t < tend; ++t) {
          const int64_t row = first + (t - t0);
          const int8_t* v = vq + row * D;
          if (next >= 0) prefetch_lines(vq + (next + (t - t0)) * D, D);
          __m512 p[REP];
          for (int r = 0; r < REP; ++r) p[r] = _mm512_set1_ps(scores[r * len + t] * vs[row]);
#pragma GCC unroll 16
          for (int c = 0; c < C; ++c) {
            const __m512 vf = load16_q8(v + c * 16);
#pragma GCC unroll 16
            for (int r = 0; r < REP; ++r) o[r][c] = fma_acc(o[r][c], p[r], vf);
          }
        }
      }
      alignas(64) float res[REP][D];
#pragma GCC unroll 16
      for (int r = 0; r < REP; ++r) {
        const __m512 iv = _mm512_set1_ps(inv[r]);
#pragma GCC unroll 16
        for (int c = 0; c < C; ++c) _mm512_store_ps(res[r] + c * 16, _mm512_mul_ps(o[r][c], iv));
      }
      for (int r = 0; r < REP; ++r) {
        at::BFloat16* dst = out + (b * heads + g * REP + r) * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<at::BFloat16>(res[r][d]);
      }
    }
  });
}
#endif

// Where the portable loop reads a row's dims as float: a pool of T, or an int8 pool with its scales, each
// value as T(float(q) * scale) (the model's dtype, as torch's dequantization gives it).
template <typename T>
struct PlainRows {
  const T* data;
  int64_t dim;
  struct Row {
    const T* p;
    inline float operator[](int64_t d) const { return as_float(p[d]); }
  };
  inline Row at(int64_t row) const { return Row{data + row * dim}; }
};

template <typename T>
struct DequantRows {
  const int8_t* data;
  const float* scales;
  int64_t dim;
  struct Row {
    const int8_t* p;
    float s;
    inline float operator[](int64_t d) const { return as_float(static_cast<T>(static_cast<float>(p[d]) * s)); }
  };
  inline Row at(int64_t row) const { return Row{data + row * dim, scales[row]}; }
};

template <typename T, typename Rows>
static void run(const T* q, Rows kpool, Rows vpool, T* out, const int64_t* tables, int64_t width, int64_t bs,
                const int64_t* lens, int64_t batch, int64_t heads, int64_t kv_heads, int64_t pool, int64_t dim,
                float scale) {
  const int64_t rep = heads / kv_heads;
  for_tasks_by_keys(lens, batch, kv_heads, dim, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(rep * dim), acc(rep * dim), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, g = task % kv_heads;
      const int64_t* table = tables + b * width;
      const int64_t len = lens[b];
      scores.assign(rep * len, 0.f);
      for (int64_t r = 0; r < rep; ++r)
        for (int64_t d = 0; d < dim; ++d)
          qf[r * dim + d] = as_float(q[(b * heads + g * rep + r) * dim + d]) * scale;
      for (int64_t t = 0; t < len; ++t) {  // the portable loop: one row lookup per token is fine here
        const auto k = kpool.at(g * pool + table[t / bs] * bs + t % bs);
        for (int64_t r = 0; r < rep; ++r) {
          const float* qr = qf.data() + r * dim;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < dim; ++d) s += qr[d] * k[d];
          scores[r * len + t] = s;
        }
      }
      for (int64_t r = 0; r < rep; ++r) {
        float* sr = scores.data() + r * len;
        float mx = -std::numeric_limits<float>::max();  // see the note in run_d128
        for (int64_t t = 0; t < len; ++t) mx = std::max(mx, sr[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) { sr[t] = std::exp(sr[t] - mx); sum += sr[t]; }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; ++t) sr[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const auto v = vpool.at(g * pool + table[t / bs] * bs + t % bs);
        for (int64_t r = 0; r < rep; ++r) {
          const float p = scores[r * len + t];
          float* ar = acc.data() + r * dim;
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) ar[d] += p * v[d];
        }
      }
      for (int64_t r = 0; r < rep; ++r)
        for (int64_t d = 0; d < dim; ++d)
          out[(b * heads + g * rep + r) * dim + d] = static_cast<T>(acc[r * dim + d]);
    }
  });
}

// Every block a sequence reads must lie in the pool: no stray reads.
static void check_tables(const int64_t* tp, const int64_t* lp, int64_t B, int64_t W, int64_t bs, int64_t nblocks) {
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lp[b] >= 1 && (lp[b] + bs - 1) / bs <= W, "decode_attention: a length beyond its block table");
    for (int64_t i = 0; i < (lp[b] + bs - 1) / bs; ++i)
      TORCH_CHECK(tp[b * W + i] >= 0 && tp[b * W + i] < nblocks, "decode_attention: a block id outside the pool");
  }
}

// q: (B, H, D); kpool, vpool: (KVH, P, D) with P a multiple of block_size; tables: (B, W) int64 block ids;
// lens: (B,) int64 positions attended (the new token's included) -> out (B, H, D).
// Optionally first stores each sequence's new key/value (k_new, v_new: (B, KVH, D)) at its last
// position, len - 1: one call instead of two index_put dispatches per layer.
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor kpool, torch::Tensor vpool,
                               torch::Tensor tables, torch::Tensor lens, int64_t block_size, double scale,
                               c10::optional<torch::Tensor> k_new, c10::optional<torch::Tensor> v_new) {
  TORCH_CHECK(q.is_contiguous() && kpool.is_contiguous() && vpool.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(q.scalar_type() == kpool.scalar_type() && kpool.scalar_type() == vpool.scalar_type());
  auto out = torch::empty_like(q);
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = kpool.size(0), P = kpool.size(1);
  const int64_t bs = block_size;
  auto tb = tables.contiguous(), ln = lens.contiguous();
  TORCH_CHECK(tb.scalar_type() == at::kLong && ln.scalar_type() == at::kLong && tb.dim() == 2 && tb.size(0) == B &&
              ln.numel() == B, "decode_attention: tables (B, W) and lens (B,) int64");
  TORCH_CHECK(bs > 0 && P % bs == 0, "decode_attention: the pool must hold whole blocks");
  const int64_t W = tb.size(1), nblocks = P / bs;
  const auto* tp = tb.data_ptr<int64_t>();
  const auto* lp = ln.data_ptr<int64_t>();
  check_tables(tp, lp, B, W, bs, nblocks);
  if (k_new.has_value() && v_new.has_value()) {
    auto kn = k_new->contiguous(), vn = v_new->contiguous();
    TORCH_CHECK(kn.sizes() == vn.sizes() && kn.size(0) == B && kn.size(1) == KVH && kn.size(2) == D &&
                kn.scalar_type() == kpool.scalar_type(), "k_new/v_new: (B, kv_heads, head_dim)");
    const int64_t item = kpool.element_size() * D;
    auto* kb = static_cast<char*>(kpool.data_ptr());
    auto* vb = static_cast<char*>(vpool.data_ptr());
    const auto* knp = static_cast<const char*>(kn.data_ptr());
    const auto* vnp = static_cast<const char*>(vn.data_ptr());
    for (int64_t b = 0; b < B; ++b) {
      const int64_t t = lp[b] - 1, pos = tp[b * W + t / bs] * bs + t % bs;
      for (int64_t g = 0; g < KVH; ++g) {
        std::memcpy(kb + (g * P + pos) * item, knp + (b * KVH + g) * item, item);
        std::memcpy(vb + (g * P + pos) * item, vnp + (b * KVH + g) * item, item);
      }
    }
  }
  const int64_t rep = KVH > 0 ? H / KVH : 0;
#if QASR_AVX512
  if (q.scalar_type() == at::kBFloat16 && D == 128 && (rep == 1 || rep == 2 || rep == 4) && H == rep * KVH) {
    auto* qp = q.data_ptr<at::BFloat16>();
    const Bf16Rows kp{kpool.data_ptr<at::BFloat16>()}, vp{vpool.data_ptr<at::BFloat16>()};
    auto* op = out.data_ptr<at::BFloat16>();
    const float sc = static_cast<float>(scale);
    if (rep == 1) run_d128<1>(qp, kp, vp, op, tp, W, bs, lp, B, H, KVH, P, sc);
    if (rep == 2) run_d128<2>(qp, kp, vp, op, tp, W, bs, lp, B, H, KVH, P, sc);
    if (rep == 4) run_d128<4>(qp, kp, vp, op, tp, W, bs, lp, B, H, KVH, P, sc);
    return out;
  }
#endif
  const float sc = static_cast<float>(scale);
  if (q.scalar_type() == at::kBFloat16) {
    using T = at::BFloat16;
    run<T>(q.data_ptr<T>(), PlainRows<T>{kpool.data_ptr<T>(), D}, PlainRows<T>{vpool.data_ptr<T>(), D},
           out.data_ptr<T>(), tp, W, bs, lp, B, H, KVH, P, D, sc);
  } else if (q.scalar_type() == at::kFloat) {
    run<float>(q.data_ptr<float>(), PlainRows<float>{kpool.data_ptr<float>(), D},
               PlainRows<float>{vpool.data_ptr<float>(), D}, out.data_ptr<float>(), tp, W, bs, lp, B, H, KVH, P, D,
               sc);
  } else {
    TORCH_CHECK(false, "decode_attention supports float32 and bfloat16");
  }
  return out;
}

// ---------------------------------------------------------------------------------------- the int8 KV cache
// Each (token, kv head) row of keys or values is stored as int8 with one float32 scale: amax = max |x|,
// q = round-to-nearest-even(x * (127 / amax)) clamped to [-127, 127], scale = amax * (1 / 127) (a product, not
// a quotient: -ffast-math may turn a division by a constant into a product anyway, so the definition is the
// product; qasr.engine.kv_cache.quantize_kv_reference is the same arithmetic in torch). An all-zero row gets
// q = 0 and scale 0. A row's result depends on that row alone.
template <typename T>
static inline void quantize_row(const T* x, int64_t dim, int8_t* q, float* scale) {
  float amax = 0.f;
  for (int64_t d = 0; d < dim; ++d) amax = std::max(amax, std::fabs(as_float(x[d])));
  if (!(amax > 0.f)) {
    std::memset(q, 0, dim);
    *scale = 0.f;
    return;
  }
  const float inv = 127.f / amax;
  for (int64_t d = 0; d < dim; ++d) {
    const float r = std::nearbyint(as_float(x[d]) * inv);
    q[d] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, r)));
  }
  constexpr float kInv127 = 1.f / 127.f;
  *scale = amax * kInv127;
}

// x: (..., D) float32 or bf16 -> (q (..., D) int8, scale (...) float32).
std::vector<torch::Tensor> quantize_kv(torch::Tensor x) {
  TORCH_CHECK(x.dim() >= 1 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "quantize_kv: float32 or bfloat16 rows");
  auto xc = x.contiguous();
  const int64_t D = xc.size(-1), rows = D ? xc.numel() / D : 0;
  auto q = torch::empty(xc.sizes(), xc.options().dtype(at::kChar));
  auto s = torch::empty(xc.sizes().slice(0, xc.dim() - 1), xc.options().dtype(at::kFloat));
  auto* qp = q.data_ptr<int8_t>();
  auto* sp = s.data_ptr<float>();
  if (xc.scalar_type() == at::kBFloat16) {
    const auto* xp = xc.data_ptr<at::BFloat16>();
    for (int64_t r = 0; r < rows; ++r) quantize_row(xp + r * D, D, qp + r * D, sp + r);
  } else {
    const auto* xp = xc.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r) quantize_row(xp + r * D, D, qp + r * D, sp + r);
  }
  return {q, s};
}

// x (n, KVH, D) float32 or bf16 quantized as quantize_kv does and stored at pool rows index (n,): row index[i] of
// each kv head g gets x[i, g] (pool (KVH, P, D) int8, scales (KVH, P) float32). The same bits as quantize_kv
// followed by the two index stores, in one pass (a prefill chunk's keys and values).
void store_kv_int8(torch::Tensor x, torch::Tensor pool, torch::Tensor scales, torch::Tensor index) {
  TORCH_CHECK(pool.is_contiguous() && scales.is_contiguous() && pool.scalar_type() == at::kChar &&
              scales.scalar_type() == at::kFloat && pool.dim() == 3 && scales.dim() == 2 &&
              scales.size(0) == pool.size(0) && scales.size(1) == pool.size(1), "store_kv_int8: pool and scales");
  TORCH_CHECK(x.dim() == 3 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat) &&
              x.size(1) == pool.size(0) && x.size(2) == pool.size(2), "store_kv_int8: x (n, kv_heads, head_dim)");
  auto xc = x.contiguous();
  auto ic = index.contiguous();
  const int64_t n = xc.size(0), KVH = xc.size(1), D = xc.size(2), P = pool.size(1);
  TORCH_CHECK(ic.scalar_type() == at::kLong && ic.numel() == n, "store_kv_int8: index (n,) int64");
  const auto* ip = ic.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(ip[i] >= 0 && ip[i] < P, "store_kv_int8: a row outside the pool");
  auto* qp = pool.data_ptr<int8_t>();
  auto* sp = scales.data_ptr<float>();
  const auto* xb = xc.scalar_type() == at::kBFloat16 ? xc.data_ptr<at::BFloat16>() : nullptr;
  const auto* xf = xb == nullptr ? xc.data_ptr<float>() : nullptr;
  at::parallel_for(0, n * KVH, grain_for(n * KVH, n * KVH * D, 16), [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r) {
      const int64_t i = r / KVH, g = r % KVH, row = g * P + ip[i];
      if (xb != nullptr) {
        quantize_row(xb + r * D, D, qp + row * D, sp + row);
      } else {
        quantize_row(xf + r * D, D, qp + row * D, sp + row);
      }
    }
  });
}

// decode_attention over an int8 pool: q (B, H, D) in the model's dtype (bf16 or float32); kpool, vpool (KVH, P, D)
// int8; kscale, vscale (KVH, P) float32. Optionally first quantizes and stores each sequence's new key/value
// (k_new, v_new: (B, KVH, D) in q's dtype) at its last position. The bf16 head_dim-128 path reads each value as
// float(q) * scale (the scale applied to a row's sums); the portable loop as T(float(q) * scale), the value
// torch's dequantization gives in the model's dtype.
torch::Tensor decode_attention_int8(torch::Tensor q, torch::Tensor kpool, torch::Tensor vpool, torch::Tensor kscale,
                                    torch::Tensor vscale, torch::Tensor tables, torch::Tensor lens, int64_t block_size,
                                    double scale, c10::optional<torch::Tensor> k_new,
                                    c10::optional<torch::Tensor> v_new) {
  TORCH_CHECK(q.is_contiguous() && kpool.is_contiguous() && vpool.is_contiguous() && kscale.is_contiguous() &&
              vscale.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(kpool.scalar_type() == at::kChar && vpool.scalar_type() == at::kChar &&
              kscale.scalar_type() == at::kFloat && vscale.scalar_type() == at::kFloat,
              "decode_attention_int8: int8 pools with float32 scales");
  auto out = torch::empty_like(q);
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = kpool.size(0), P = kpool.size(1);
  TORCH_CHECK(kpool.sizes() == vpool.sizes() && kpool.size(2) == D && kscale.dim() == 2 && kscale.size(0) == KVH &&
              kscale.size(1) == P && vscale.sizes() == kscale.sizes(), "decode_attention_int8: pool shapes");
  const int64_t bs = block_size;
  auto tb = tables.contiguous(), ln = lens.contiguous();
  TORCH_CHECK(tb.scalar_type() == at::kLong && ln.scalar_type() == at::kLong && tb.dim() == 2 && tb.size(0) == B &&
              ln.numel() == B, "decode_attention: tables (B, W) and lens (B,) int64");
  TORCH_CHECK(bs > 0 && P % bs == 0, "decode_attention: the pool must hold whole blocks");
  const int64_t W = tb.size(1), nblocks = P / bs;
  const auto* tp = tb.data_ptr<int64_t>();
  const auto* lp = ln.data_ptr<int64_t>();
  check_tables(tp, lp, B, W, bs, nblocks);
  auto* kq = kpool.data_ptr<int8_t>();
  auto* vq = vpool.data_ptr<int8_t>();
  auto* ks = kscale.data_ptr<float>();
  auto* vs = vscale.data_ptr<float>();
  if (k_new.has_value() && v_new.has_value()) {
    auto kn = k_new->contiguous(), vn = v_new->contiguous();
    TORCH_CHECK(kn.sizes() == vn.sizes() && kn.size(0) == B && kn.size(1) == KVH && kn.size(2) == D &&
                kn.scalar_type() == q.scalar_type() && vn.scalar_type() == q.scalar_type(),
                "k_new/v_new: (B, kv_heads, head_dim) in q's dtype");
    for (int64_t b = 0; b < B; ++b) {
      const int64_t t = lp[b] - 1, pos = tp[b * W + t / bs] * bs + t % bs;
      for (int64_t g = 0; g < KVH; ++g) {
        const int64_t row = g * P + pos, src = (b * KVH + g) * D;
        if (q.scalar_type() == at::kBFloat16) {
          quantize_row(kn.data_ptr<at::BFloat16>() + src, D, kq + row * D, ks + row);
          quantize_row(vn.data_ptr<at::BFloat16>() + src, D, vq + row * D, vs + row);
        } else {
          quantize_row(kn.data_ptr<float>() + src, D, kq + row * D, ks + row);
          quantize_row(vn.data_ptr<float>() + src, D, vq + row * D, vs + row);
        }
      }
    }
  }
  const int64_t rep = KVH > 0 ? H / KVH : 0;
  const float sc = static_cast<float>(scale);
#if QASR_AVX512
  if (q.scalar_type() == at::kBFloat16 && D == 128 && (rep == 1 || rep == 2 || rep == 4) && H == rep * KVH) {
    auto* qp = q.data_ptr<at::BFloat16>();
    auto* op = out.data_ptr<at::BFloat16>();
    if (rep == 1) run_int8_d128<1>(qp, kq, ks, vq, vs, op, tp, W, bs, lp, B, H, KVH, P, sc);
    if (rep == 2) run_int8_d128<2>(qp, kq, ks, vq, vs, op, tp, W, bs, lp, B, H, KVH, P, sc);
    if (rep == 4) run_int8_d128<4>(qp, kq, ks, vq, vs, op, tp, W, bs, lp, B, H, KVH, P, sc);
    return out;
  }
#endif
  if (q.scalar_type() == at::kBFloat16) {
    using T = at::BFloat16;
    run<T>(q.data_ptr<T>(), DequantRows<T>{kq, ks, D}, DequantRows<T>{vq, vs, D}, out.data_ptr<T>(), tp, W, bs, lp,
           B, H, KVH, P, D, sc);
  } else if (q.scalar_type() == at::kFloat) {
    run<float>(q.data_ptr<float>(), DequantRows<float>{kq, ks, D}, DequantRows<float>{vq, vs, D},
               out.data_ptr<float>(), tp, W, bs, lp, B, H, KVH, P, D, sc);
  } else {
    TORCH_CHECK(false, "decode_attention_int8 supports float32 and bfloat16 queries");
  }
  return out;
}

// One pool's rows for dequantize_kv_rows: out[g, i, :] = T(float(q[g, rows[i], :]) * scale[g, rows[i]]).
template <typename T>
static void dequantize_rows(const int8_t* q, const float* scales, const int64_t* rows, int64_t pool, int64_t length,
                            int64_t dim, T* out, int64_t g, int64_t i0, int64_t i1) {
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t row = g * pool + rows[i];
    const int8_t* src = q + row * dim;
    const float s = scales[row];
    T* dst = out + (g * length + i) * dim;
    int64_t d = 0;
#if QASR_AVX512
    if constexpr (std::is_same_v<T, at::BFloat16>) {  // c10's round to nearest even, 16 values at a time
      const __m512 sv = _mm512_set1_ps(s);
      const __m512i one = _mm512_set1_epi32(1), bias = _mm512_set1_epi32(0x7FFF);
      for (; d + 16 <= dim; d += 16) {
        const __m512 f = _mm512_mul_ps(load16_q8(src + d), sv);
        const __m512i u = _mm512_castps_si512(f);
        const __m512i r = _mm512_srli_epi32(
            _mm512_add_epi32(_mm512_add_epi32(u, bias), _mm512_and_si512(_mm512_srli_epi32(u, 16), one)), 16);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d), _mm512_cvtepi32_epi16(r));
      }
    }
#endif
    for (; d < dim; ++d) dst[d] = static_cast<T>(static_cast<float>(src[d]) * s);  // as DequantRows reads it
  }
}

// A sequence's keys and values read out of the int8 pool for a prefill chunk's attention, in one pass each:
// k_out[g, i] and v_out[g, i] (kv_heads, length, D; bf16 or float32, preallocated by the caller) get pool row
// rows[i] of kv head g dequantized exactly as torch's dequantize_kv gives it (float(q) * scale rounded to the
// output's dtype); rows after rows.numel() (the padding to whole blocks) are zeros. The same bits as the torch
// gather + dequantize + pad, in one pass.
void dequantize_kv_rows(torch::Tensor kpool, torch::Tensor vpool, torch::Tensor kscale, torch::Tensor vscale,
                        torch::Tensor rows, torch::Tensor k_out, torch::Tensor v_out) {
  TORCH_CHECK(kpool.is_contiguous() && vpool.is_contiguous() && kscale.is_contiguous() && vscale.is_contiguous() &&
              k_out.is_contiguous() && v_out.is_contiguous(), "dequantize_kv_rows: contiguous inputs");
  TORCH_CHECK(kpool.scalar_type() == at::kChar && vpool.scalar_type() == at::kChar &&
              kscale.scalar_type() == at::kFloat && vscale.scalar_type() == at::kFloat,
              "dequantize_kv_rows: int8 pools with float32 scales");
  const int64_t KVH = kpool.size(0), P = kpool.size(1), D = kpool.size(2);
  TORCH_CHECK(kpool.sizes() == vpool.sizes() && kscale.dim() == 2 && kscale.size(0) == KVH && kscale.size(1) == P &&
              vscale.sizes() == kscale.sizes(), "dequantize_kv_rows: pool shapes");
  auto rc = rows.contiguous();
  TORCH_CHECK(rc.scalar_type() == at::kLong && rc.dim() == 1, "dequantize_kv_rows: rows (N,) int64");
  const int64_t N = rc.numel();
  TORCH_CHECK(k_out.dim() == 3 && k_out.size(0) == KVH && k_out.size(1) >= N && k_out.size(2) == D &&
              v_out.sizes() == k_out.sizes() && v_out.scalar_type() == k_out.scalar_type() &&
              (k_out.scalar_type() == at::kBFloat16 || k_out.scalar_type() == at::kFloat),
              "dequantize_kv_rows: outputs (kv_heads, length >= rows, head_dim), bf16 or float32");
  const auto* rp = rc.data_ptr<int64_t>();
  for (int64_t i = 0; i < N; ++i) TORCH_CHECK(rp[i] >= 0 && rp[i] < P, "dequantize_kv_rows: row outside the pool");
  const int64_t L = k_out.size(1);
  const auto* kq = kpool.data_ptr<int8_t>();
  const auto* vq = vpool.data_ptr<int8_t>();
  const auto* ks = kscale.data_ptr<float>();
  const auto* vs = vscale.data_ptr<float>();
  const bool bf16 = k_out.scalar_type() == at::kBFloat16;
  const int64_t width = bf16 ? 2 : 4;
  constexpr int64_t kRows = 64;  // rows per task
  const int64_t per_head = (N + kRows - 1) / kRows;
  // tasks: (pool, kv head, 64 rows); small sequences stay on the calling thread
  at::parallel_for(0, 2 * KVH * per_head, N * KVH < 4096 ? 2 * KVH * per_head : 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t which = task / (KVH * per_head), g = (task / per_head) % KVH, c = task % per_head;
      const int64_t i0 = c * kRows, i1 = std::min(N, i0 + kRows);
      const int8_t* q = which ? vq : kq;
      const float* sc = which ? vs : ks;
      torch::Tensor& out = which ? v_out : k_out;
      if (bf16) {
        dequantize_rows(q, sc, rp, P, L, D, out.data_ptr<at::BFloat16>(), g, i0, i1);
      } else {
        dequantize_rows(q, sc, rp, P, L, D, out.data_ptr<float>(), g, i0, i1);
      }
      if (c == per_head - 1 && L > N) {  // the padding rows of this head
        std::memset(static_cast<char*>(out.data_ptr()) + (g * L + N) * D * width, 0, (L - N) * D * width);
      }
    }
  });
  if (N == 0) {
    k_out.zero_();
    v_out.zero_();
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // the GIL is released while they run: other Python threads (the server's event loop) go on meanwhile
  m.def("decode_attention", &decode_attention, "batched single-token attention over a block pool",
        py::arg("q"), py::arg("kpool"), py::arg("vpool"), py::arg("tables"), py::arg("lens"), py::arg("block_size"),
        py::arg("scale"), py::arg("k_new") = py::none(), py::arg("v_new") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("decode_attention_int8", &decode_attention_int8, "decode_attention over an int8 block pool with scales",
        py::arg("q"), py::arg("kpool"), py::arg("vpool"), py::arg("kscale"), py::arg("vscale"), py::arg("tables"),
        py::arg("lens"), py::arg("block_size"), py::arg("scale"), py::arg("k_new") = py::none(),
        py::arg("v_new") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("dequantize_kv_rows", &dequantize_kv_rows, "a sequence's int8 keys and values, dequantized and padded",
        py::arg("kpool"), py::arg("vpool"), py::arg("kscale"), py::arg("vscale"), py::arg("rows"), py::arg("k_out"),
        py::arg("v_out"), py::call_guard<py::gil_scoped_release>());
  m.def("store_kv_int8", &store_kv_int8, "rows quantized as quantize_kv does, stored at pool rows index",
        py::arg("x"), py::arg("pool"), py::arg("scales"), py::arg("index"), py::call_guard<py::gil_scoped_release>());
  m.def("quantize_kv", &quantize_kv, "per-row symmetric int8 of keys or values: (q, scale)", py::arg("x"),
        py::call_guard<py::gil_scoped_release>());
}
