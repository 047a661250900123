// What the two batch-invariant bf16 GEMM kernels share (amx_linear.cpp, bf16_linear.cpp): the packed weight
// layout and pack(), the rows a product reads, and the front of linear() and conv(); no arithmetic.
//
// Packed weight: (N_pad / 64, K / 2, 64, 2) bf16 -- per block of 64 output columns and pair of input features,
// the 64 columns' two weights side by side (256 contiguous bytes). Weights packed once serve both kernels.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <cstring>

constexpr int64_t NB = 64;  // output columns per packed block

// weight: (N, K) bf16 -> packed (N_pad/64, K/2, 64, 2); padded columns are zero.
inline torch::Tensor pack(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "pack: (N, K) bfloat16 weight");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(K % 2 == 0, "pack: K must be even");
  const int64_t blocks = (N + NB - 1) / NB, kpairs = K / 2;
  auto w = weight.contiguous();
  auto out = torch::zeros({blocks, kpairs, NB, 2}, weight.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t cols = std::min<int64_t>(NB, N - b * NB);
      for (int64_t c = 0; c < cols; ++c) {
        const uint16_t* row = src + (b * NB + c) * K;
        uint16_t* col = dst + (b * kpairs * NB + c) * 2;
        // one k pair of one column: 4 bytes (memcpy: the weight may sit at any 2-byte offset)
        for (int64_t kp = 0; kp < kpairs; ++kp) std::memcpy(col + kp * NB * 2, row + 2 * kp, 4);
      }
    }
  });
  return out;
}

// Where the K values of row m live: `segs` runs of 2 * seg_pairs contiguous values, run s of row m at
// row(m) + s * seg_stride. A plain matrix is one run per row (`plain`: (M, K) row-major, row m at
// base + m * K); a convolution reads its padded NHWC input in place (implicit im2col): one run per kernel
// row, each covering (kernel width x channels).
struct Rows {
  const uint16_t* base;
  int64_t segs, seg_stride, seg_pairs;
  int64_t ho, wo, s_n, s_i, s_j;  // row m = (n, i, j) -> base + n*s_n + i*s_i + j*s_j
  bool plain;
  const uint16_t* row(int64_t m) const {
    const int64_t j = m % wo, i = (m / wo) % ho, n = m / (wo * ho);
    return base + n * s_n + i * s_i + j * s_j;
  }
};

// A kernel's product, M > 0 and N > 0: out (M, N) bf16, row-major = rows x the packed weight's first N
// columns (+ bias, N float32 values, or null), each element one float32 sum over K rounded once to bf16.
using RunFn = void (*)(const Rows& rows, int64_t M, const uint16_t* packed, int64_t N, const float* bias,
                       uint16_t* out);

// What linear() and conv() need of a kernel.
struct Gemm {
  const char* name;     // the messages' prefix, e.g. "qasr AMX"
  const char* missing;  // why supported() may be false
  bool (*supported)();
  RunFn run;  // null in a build without the kernel's instructions (supported() is false there)
};

// The shared tail of linear() and conv(): bias to float32, then the kernel's product into a new (M, N) tensor.
inline torch::Tensor product(const Gemm& g, const char* op, const torch::Tensor& x, const torch::Tensor& packed,
                             int64_t M, int64_t N, const c10::optional<torch::Tensor>& bias, Rows rows) {
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 && packed.is_contiguous() &&
                  packed.size(2) == NB && packed.size(3) == 2, g.name, " ", op, ": packed weight from pack()");
  auto out = torch::empty({M, N}, x.options());
  torch::Tensor bf;
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, g.name, " ", op, ": bias must have N values");
    bf = bias->to(at::kFloat).contiguous();
    bp = bf.data_ptr<float>();
  }
  if (M > 0 && N > 0 && g.run != nullptr) {
    rows.base = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    g.run(rows, M, reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()), N, bp,
          reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()));
  }
  return out;
}

// x: (M, K) bf16; packed from pack(); bias: optional (N,) float32 -> (M, N) bf16
inline torch::Tensor gemm_linear(const Gemm& g, torch::Tensor x, torch::Tensor packed, int64_t N,
                                 c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(g.supported(), g.name, " linear: ", g.missing);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "linear: (M, K) bfloat16 input");
  auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1);
  TORCH_CHECK(packed.size(1) * 2 == K && packed.size(0) * NB >= N, "linear: packed weight does not match");
  // one run of K values per row; row m at base + m * K
  return product(g, "linear", xc, packed, M, N, bias, Rows{nullptr, 1, 0, K / 2, 1, 1, K, 0, 0, true});
}

// Convolution with a (kh, kw) kernel over a zero-padded channels-last input xp: (n, hp, wp, cin) bf16,
// weight packed from (cout, kh * kw * cin) in (kh, kw, cin) order -> (n * ho * wo, cout) bf16.
inline torch::Tensor gemm_conv(const Gemm& g, torch::Tensor xp, torch::Tensor packed, int64_t cout,
                               c10::optional<torch::Tensor> bias, int64_t kh, int64_t kw, int64_t sh, int64_t sw) {
  TORCH_CHECK(g.supported(), g.name, " conv: ", g.missing);
  TORCH_CHECK(xp.dim() == 4 && xp.scalar_type() == at::kBFloat16 && xp.is_contiguous(), "conv: contiguous NHWC bf16");
  const int64_t n = xp.size(0), hp = xp.size(1), wp = xp.size(2), cin = xp.size(3);
  TORCH_CHECK((kw * cin) % 2 == 0, "conv: kernel width x channels must be even");
  TORCH_CHECK(packed.size(1) * 2 == kh * kw * cin && packed.size(0) * NB >= cout, "conv: packed weight mismatch");
  TORCH_CHECK(hp >= kh && wp >= kw && sh > 0 && sw > 0, "conv: kernel larger than the padded input");
  const int64_t ho = (hp - kh) / sh + 1, wo = (wp - kw) / sw + 1;
  // kh runs per output position (one per kernel row), each kw * cin contiguous values
  return product(g, "conv", xp, packed, n * ho * wo, cout, bias,
                 Rows{nullptr, kh, wp * cin, kw * cin / 2, ho, wo, hp * wp * cin, sh * wp * cin, sw * cin, false});
}

// The GEMM interface both modules share: pack(), linear() and conv() on kernel `g` (a static object).
// Every compute entry point releases the GIL while it runs (NO_GIL), so other Python threads (the server's
// event loop) go on; the bodies touch no Python object.
#define NO_GIL pybind11::call_guard<pybind11::gil_scoped_release>()

inline void def_gemm(pybind11::module& m, const Gemm& g, const char* linear_doc) {
  m.def("pack", &pack, "pack an (N, K) bf16 weight for linear() (the layout both GEMM kernels share)", NO_GIL);
  m.def("linear", [&g](torch::Tensor x, torch::Tensor packed, int64_t N, c10::optional<torch::Tensor> bias) {
    return gemm_linear(g, x, packed, N, bias);
  }, linear_doc, NO_GIL);
  m.def("conv", [&g](torch::Tensor xp, torch::Tensor packed, int64_t cout, c10::optional<torch::Tensor> bias,
                     int64_t kh, int64_t kw, int64_t sh, int64_t sw) {
    return gemm_conv(g, xp, packed, cout, bias, kh, kw, sh, sw);
  }, "the same product as a convolution over a padded NHWC input (implicit im2col)", NO_GIL);
}
