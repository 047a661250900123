// Batch-invariant bfloat16 linear layer for CPUs with AVX512-BF16.
//
// Why our own: oneDNN picks different blockings (and K splits) for different row counts, so a row's
// result depends on how many other rows share the call -- a request's tokens would then depend on its
// neighbours in the batch. Here every output element is one float32 accumulation over K in a fixed
// order (k pairs, ascending, one vdpbf16ps lane), whatever M is and whichever tile the row falls in.
// It is also the fast path for decode: with few rows the product streams the weight once at close to
// memory bandwidth, parallel over column blocks.
//
// Packed weight layout: (N_pad / 64, K / 2, 64, 2) bf16 -- for each block of 64 output columns and
// each pair of input features, the 64 columns' two weights sit next to each other, so one k pair of
// a block is four contiguous 64-byte vectors.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstring>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define QASR_HAS_BF16 1
#else
#define QASR_HAS_BF16 0
#endif

constexpr int64_t NB = 64;  // output columns per block (4 vectors of 16 floats)
constexpr int64_t MR = 6;   // rows per register tile: 6 x 4 accumulators + 4 weight vectors + 1 broadcast

bool supported() { return QASR_HAS_BF16 == 1; }

// weight: (N, K) bf16 -> packed (N_pad/64, K/2, 64, 2); padded columns are zero.
torch::Tensor pack(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "pack: (N, K) bfloat16 weight");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(K % 2 == 0, "pack: K must be even");
  const int64_t blocks = (N + NB - 1) / NB;
  auto w = weight.contiguous();
  auto out = torch::zeros({blocks, K / 2, NB, 2}, weight.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t c = 0; c < NB; ++c) {
        const int64_t n = b * NB + c;
        if (n >= N) break;
        const uint16_t* row = src + n * K;
        uint16_t* base = dst + b * (K / 2) * NB * 2 + c * 2;
        for (int64_t kp = 0; kp < K / 2; ++kp) {
          base[kp * NB * 2] = row[2 * kp];
          base[kp * NB * 2 + 1] = row[2 * kp + 1];
        }
      }
  });
  return out;
}

#if QASR_HAS_BF16
// Where the K features of row m live: `segs` runs of 2 * seg_pairs contiguous values, the run s of row
// m starting at row(m) + s * seg_stride. A plain matrix is one run per row; a convolution reads its
// input in place (implicit im2col): one run per kernel row, each covering (kernel width x channels).
struct Rows {
  const uint16_t* base;
  int64_t segs, seg_stride, seg_pairs;
  int64_t ho, wo, s_n, s_i, s_j;  // row m = (n, i, j) -> base + n*s_n + i*s_i + j*s_j
  const uint16_t* row(int64_t m) const {
    const int64_t j = m % wo, i = (m / wo) % ho, n = m / (wo * ho);
    return base + n * s_n + i * s_i + j * s_j;
  }
};

// One register tile: `ROWS` (<= MR) rows times one 64-column block, full K.
template <int ROWS>
static inline void tile(const uint16_t* const* xr, const Rows& rows, const uint16_t* wblock, const float* bias,
                        uint16_t* out, int64_t ldo, int64_t ncols) {
  __m512 acc[ROWS][4];
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  const uint16_t* w = wblock;
  for (int64_t sg = 0; sg < rows.segs; ++sg) {
    const uint16_t* x[ROWS];
    for (int r = 0; r < ROWS; ++r) x[r] = xr[r] + sg * rows.seg_stride;
    for (int64_t kp = 0; kp < rows.seg_pairs; ++kp, w += NB * 2) {
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
  at::parallel_for(0, blocks * groups, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t b = item / groups, g = item % groups;
      const uint16_t* wblock = packed + b * kpairs * NB * 2;
      const int64_t ncols = std::min<int64_t>(NB, N - b * NB);
      const float* bb = bias ? bias + b * NB : nullptr;
      const int64_t m_end = std::min<int64_t>(M, (g + 1) * rows_per_group);
      for (int64_t m = g * rows_per_group; m < m_end; m += MR) {
        const uint16_t* xr[MR];
        const int64_t n_rows = std::min<int64_t>(MR, m_end - m);
        for (int64_t r = 0; r < n_rows; ++r) xr[r] = rows.row(m + r);
        uint16_t* o = out + m * N + b * NB;
        switch (n_rows) {
          case 6: tile<6>(xr, rows, wblock, bb, o, N, ncols); break;
          case 5: tile<5>(xr, rows, wblock, bb, o, N, ncols); break;
          case 4: tile<4>(xr, rows, wblock, bb, o, N, ncols); break;
          case 3: tile<3>(xr, rows, wblock, bb, o, N, ncols); break;
          case 2: tile<2>(xr, rows, wblock, bb, o, N, ncols); break;
          default: tile<1>(xr, rows, wblock, bb, o, N, ncols); break;
        }
      }
    }
  });
}
#endif

// x: (M, K) bf16; packed from pack(); bias: optional (N,) float32 -> (M, N) bf16
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t N, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(supported(), "qasr bf16 linear: built without AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "linear: (M, K) bfloat16 input");
  auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1);
  TORCH_CHECK(packed.size(1) * 2 == K && packed.size(0) * NB >= N, "linear: packed weight does not match");
  auto out = torch::empty({M, N}, x.options());
  const float* bp = nullptr;
  torch::Tensor bf;
  if (bias.has_value() && bias->defined()) {
    bf = bias->to(at::kFloat).contiguous();
    bp = bf.data_ptr<float>();
  }
#if QASR_HAS_BF16
  if (M > 0) {
    const Rows rows{reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()), 1, 0, K / 2, 1, 1, K, 0, 0};
    // row m = (n=m, i=0, j=0): base + m * K
    run(rows, M, reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), N, bp,
        reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()));
  }
#endif
  return out;
}

// Convolution with a (kh, kw) kernel over a zero-padded channels-last input xp: (n, hp, wp, cin) bf16,
// weight packed from (cout, kh * kw * cin) in (kh, kw, cin) order -> (n * ho * wo, cout) bf16.
torch::Tensor conv(torch::Tensor xp, torch::Tensor packed, int64_t cout, c10::optional<torch::Tensor> bias,
                   int64_t kh, int64_t kw, int64_t sh, int64_t sw) {
  TORCH_CHECK(supported(), "qasr bf16 conv: built without AVX512-BF16");
  TORCH_CHECK(xp.dim() == 4 && xp.scalar_type() == at::kBFloat16 && xp.is_contiguous(), "conv: contiguous NHWC bf16");
  const int64_t n = xp.size(0), hp = xp.size(1), wp = xp.size(2), cin = xp.size(3);
  TORCH_CHECK((kw * cin) % 2 == 0, "conv: kernel width x channels must be even");
  TORCH_CHECK(packed.size(1) * 2 == kh * kw * cin && packed.size(0) * NB >= cout, "conv: packed weight mismatch");
  const int64_t ho = (hp - kh) / sh + 1, wo = (wp - kw) / sw + 1, M = n * ho * wo;
  auto out = torch::empty({M, cout}, xp.options());
  const float* bp = nullptr;
  torch::Tensor bf;
  if (bias.has_value() && bias->defined()) {
    bf = bias->to(at::kFloat).contiguous();
    bp = bf.data_ptr<float>();
  }
#if QASR_HAS_BF16
  if (M > 0) {
    const Rows rows{reinterpret_cast<const uint16_t*>(xp.data_ptr<at::BFloat16>()), kh, wp * cin, kw * cin / 2,
                    ho, wo, hp * wp * cin, sh * wp * cin, sw * cin};
    run(rows, M, reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), cout, bp,
        reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()));
  }
#endif
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("supported", &supported, "whether this build has the AVX512-BF16 kernel");
  m.def("pack", &pack, "pack an (N, K) bf16 weight for linear()");
  m.def("linear", &linear, "batch-invariant bf16 x @ W^T + b with float32 accumulation");
  m.def("conv", &conv, "the same product as a convolution over a padded NHWC input (implicit im2col)");
}
