// Attention inside the audio encoder's windows: every row of a window attends to every row of the same
// window (no causality), the windows given as (start, length) runs of the packed rows. One task per
// (window, head); each query row is computed alone over its window's keys in order, in float32, so a row's
// result depends on its window only, never on how many windows or rows share the call, with no padding of
// every window to 104 rows (docs/log/*-cpu-encoder-attention.md).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

template <typename T>
static inline float as_float(T x) { return static_cast<float>(x); }

#if defined(__AVX512F__)
#include <immintrin.h>

// head_dim 64 (the released encoders' 896 / 14) with explicit AVX-512: R query rows at a time share each load
// of a key or value vector. A lane's arithmetic (an FMA chain over d in order, then over keys in order) is the
// same whichever rows share the block, so a row's result still depends on its window alone.
template <typename T, int R>
static void rows64(const float* qf, const float* kt, const float* vf, float* sc, int64_t L, int64_t Lp, T* const* dst) {
  constexpr int64_t D = 64, C = D / 16;
  for (int64_t j0 = 0; j0 < Lp; j0 += 16) {  // scores: 16 keys x R queries per pass over d
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; ++d) {
      const __m512 kv = _mm512_loadu_ps(kt + d * Lp + j0);
      for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(qf[r * D + d]), kv, acc[r]);
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(sc + r * Lp + j0, acc[r]);
  }
  float inv[R];
  for (int r = 0; r < R; ++r) {
    float* s = sc + r * Lp;
    for (int64_t j = L; j < Lp; ++j) s[j] = -std::numeric_limits<float>::max();  // padding keys: weight 0
    float mx = -std::numeric_limits<float>::max();
    for (int64_t j = 0; j < L; ++j) mx = std::max(mx, s[j]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < Lp; ++j) {  // whole vectors only: no scalar tail with other rounding
      s[j] = std::exp(s[j] - mx);
      sum += s[j];
    }
    inv[r] = 1.f / sum;
  }
  __m512 o[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) o[r][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < L; ++j) {
    __m512 v[C];
    for (int c = 0; c < C; ++c) v[c] = _mm512_loadu_ps(vf + j * D + c * 16);
    for (int r = 0; r < R; ++r) {
      const __m512 p = _mm512_set1_ps(sc[r * Lp + j]);
      for (int c = 0; c < C; ++c) o[r][c] = _mm512_fmadd_ps(p, v[c], o[r][c]);
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(64) float buf[D];
    for (int c = 0; c < C; ++c) _mm512_store_ps(buf + c * 16, _mm512_mul_ps(o[r][c], _mm512_set1_ps(inv[r])));
    for (int64_t d = 0; d < D; ++d) dst[r][d] = static_cast<T>(buf[d]);
  }
}

template <typename T>
static void run64(const T* q, const T* k, const T* v, T* out, const int64_t* windows, int64_t W, int64_t H,
                  float scale) {
  constexpr int64_t D = 64, R = 4;
  at::parallel_for(0, W * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf, kt, vf, sc;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t w = task / H, h = task % H;
      const int64_t start = windows[2 * w], L = windows[2 * w + 1], Lp = (L + 15) / 16 * 16;
      qf.assign(L * D, 0.f);
      kt.assign(D * Lp, 0.f);
      vf.assign(L * D, 0.f);
      sc.assign(R * Lp, 0.f);
      for (int64_t i = 0; i < L; ++i) {
        const int64_t at = ((start + i) * H + h) * D;
        for (int64_t d = 0; d < D; ++d) {
          qf[i * D + d] = as_float(q[at + d]) * scale;
          kt[d * Lp + i] = as_float(k[at + d]);
          vf[i * D + d] = as_float(v[at + d]);
        }
      }
      for (int64_t i0 = 0; i0 < L; i0 += R) {
        T* dst[R];
        const int64_t n = std::min<int64_t>(R, L - i0);
        for (int64_t r = 0; r < n; ++r) dst[r] = out + ((start + i0 + r) * H + h) * D;
        const float* qi = qf.data() + i0 * D;
        if (n == 4) rows64<T, 4>(qi, kt.data(), vf.data(), sc.data(), L, Lp, dst);
        if (n == 3) rows64<T, 3>(qi, kt.data(), vf.data(), sc.data(), L, Lp, dst);
        if (n == 2) rows64<T, 2>(qi, kt.data(), vf.data(), sc.data(), L, Lp, dst);
        if (n == 1) rows64<T, 1>(qi, kt.data(), vf.data(), sc.data(), L, Lp, dst);
      }
    }
  });
}
#endif

// q, k, v, out: (rows, heads, dim) contiguous; windows: (W, 2) int64 (start, length) over the rows. The portable
// loop (any head_dim, or no AVX-512).
template <typename T>
static void run(const T* q, const T* k, const T* v, T* out, const int64_t* windows, int64_t W, int64_t H,
                int64_t D, float scale) {
  at::parallel_for(0, W * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf, kf, vf, scores, acc(D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t w = task / H, h = task % H;
      const int64_t start = windows[2 * w], L = windows[2 * w + 1];
      qf.resize(L * D);
      kf.resize(L * D);
      vf.resize(L * D);
      scores.resize(L);
      for (int64_t i = 0; i < L; ++i) {  // this head's rows of the window, as float32 (q scaled once)
        const int64_t at = ((start + i) * H + h) * D;
        for (int64_t d = 0; d < D; ++d) {
          qf[i * D + d] = as_float(q[at + d]) * scale;
          kf[d * L + i] = as_float(k[at + d]);  // keys transposed: a query's scores are then L-wide vector FMAs
          vf[i * D + d] = as_float(v[at + d]);
        }
      }
      for (int64_t i = 0; i < L; ++i) {
        const float* qi = qf.data() + i * D;
        std::fill(scores.begin(), scores.end(), 0.f);
        for (int64_t d = 0; d < D; ++d) {  // each score summed over d in order, whatever the vector width
          const float qd = qi[d];
          const float* kd = kf.data() + d * L;
#pragma omp simd
          for (int64_t j = 0; j < L; ++j) scores[j] += qd * kd[j];
        }
        float mx = -std::numeric_limits<float>::max();  // not -INFINITY: built with -ffast-math
        for (int64_t j = 0; j < L; ++j) mx = std::max(mx, scores[j]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < L; ++j) {
          scores[j] = std::exp(scores[j] - mx);
          sum += scores[j];
        }
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t j = 0; j < L; ++j) {
          const float p = scores[j];
          const float* vj = vf.data() + j * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) acc[d] += p * vj[d];
        }
        const float inv = 1.f / sum;
        T* dst = out + ((start + i) * H + h) * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(acc[d] * inv);
      }
    }
  });
}

torch::Tensor encoder_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor windows,
                                double scale) {
  TORCH_CHECK(q.dim() == 3 && q.sizes() == k.sizes() && q.sizes() == v.sizes(), "q, k, v: (rows, heads, dim)");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), "one dtype");
  auto qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  auto win = windows.contiguous();
  TORCH_CHECK(win.scalar_type() == at::kLong && win.dim() == 2 && win.size(1) == 2, "windows: (W, 2) int64");
  const int64_t rows = qc.size(0), H = qc.size(1), D = qc.size(2), W = win.size(0);
  const int64_t* wp = win.data_ptr<int64_t>();
  for (int64_t w = 0; w < W; ++w)  // every window lies inside the rows: no stray reads
    TORCH_CHECK(wp[2 * w] >= 0 && wp[2 * w + 1] >= 1 && wp[2 * w] + wp[2 * w + 1] <= rows,
                "encoder_attention: a window outside the rows");
  auto out = torch::zeros_like(qc);  // rows in no window stay zero
  const float sc = static_cast<float>(scale);
#if defined(__AVX512F__)
  if (D == 64 && qc.scalar_type() == at::kBFloat16) {
    run64<at::BFloat16>(qc.data_ptr<at::BFloat16>(), kc.data_ptr<at::BFloat16>(), vc.data_ptr<at::BFloat16>(),
                        out.data_ptr<at::BFloat16>(), wp, W, H, sc);
    return out;
  }
  if (D == 64 && qc.scalar_type() == at::kFloat) {
    run64<float>(qc.data_ptr<float>(), kc.data_ptr<float>(), vc.data_ptr<float>(), out.data_ptr<float>(), wp, W, H,
                 sc);
    return out;
  }
#endif
  if (qc.scalar_type() == at::kBFloat16) {
    run<at::BFloat16>(qc.data_ptr<at::BFloat16>(), kc.data_ptr<at::BFloat16>(), vc.data_ptr<at::BFloat16>(),
                      out.data_ptr<at::BFloat16>(), wp, W, H, D, sc);
  } else if (qc.scalar_type() == at::kFloat) {
    run<float>(qc.data_ptr<float>(), kc.data_ptr<float>(), vc.data_ptr<float>(), out.data_ptr<float>(), wp, W, H, D,
               sc);
  } else {
    TORCH_CHECK(false, "encoder_attention supports float32 and bfloat16");
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("encoder_attention", &encoder_attention, "attention within each (start, length) window of packed rows",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("windows"), py::arg("scale"),
        py::call_guard<py::gil_scoped_release>());
}
