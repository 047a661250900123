// Fused bf16 elementwise steps of a decoder layer on CPU: RMSNorm, and q/k RMSNorm + rotary.
//
// A decode step runs 28 layers of small tensors; in plain torch each RMSNorm is eight ops and the
// rotary six more per projection, each paying a dispatch (and an OpenMP team wake-up) of several
// microseconds -- about 7 ms of a 50 ms step. These kernels do each in one pass, row by row, with the
// same roundings as the torch code (float math, bf16 results where torch rounds to bf16).
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

// torch: weight * (x.float() * rsqrt(mean(x^2) + eps)).to(bf16)
static inline void rms_row(const bf16* x, const bf16* w, bf16* out, int64_t n, float eps) {
  const float r = rms_scale(x, n, eps);
  for (int64_t i = 0; i < n; ++i) {
    const bf16 h = static_cast<bf16>(static_cast<float>(x[i]) * r);
    out[i] = static_cast<bf16>(static_cast<float>(w[i]) * static_cast<float>(h));
  }
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
  at::parallel_for(0, N, grain_for(N, N * C), [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) rms_row(xp + i * C, wp, op + i * C, C, e);
  });
  return out;
}

// x: (N, H, D) bf16 -> per head RMSNorm(weight), then rotary with cos/sin: (N, D) bf16.
// torch: y = norm(x); out = y * cos + cat(-y2, y1) * sin, every op rounded to bf16.
torch::Tensor norm_rope(torch::Tensor x, torch::Tensor weight, torch::Tensor cos, torch::Tensor sin, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 3, "norm_rope: (N, H, D) bfloat16");
  auto xc = x.contiguous();
  const int64_t N = xc.size(0), H = xc.size(1), D = xc.size(2), half = D / 2;
  auto cc = cos.reshape({N, D}).contiguous(), sc = sin.reshape({N, D}).contiguous();
  TORCH_CHECK(cc.scalar_type() == at::kBFloat16 && sc.scalar_type() == at::kBFloat16, "norm_rope: bf16 cos/sin");
  auto out = torch::empty_like(xc);
  const bf16* xp = xc.data_ptr<bf16>();
  const bf16* wp = weight.contiguous().data_ptr<bf16>();
  const bf16* cp = cc.data_ptr<bf16>();
  const bf16* sp = sc.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, N * H, grain_for(N * H, N * H * D), [&](int64_t a, int64_t b) {
    std::vector<bf16> y(D);
    for (int64_t i = a; i < b; ++i) {
      const int64_t n = i / H;
      rms_row(xp + i * D, wp, y.data(), D, e);
      const bf16* c = cp + n * D;
      const bf16* s = sp + n * D;
      bf16* o = op + i * D;
      for (int64_t d = 0; d < D; ++d) {
        const float rot = d < half ? -static_cast<float>(y[d + half]) : static_cast<float>(y[d - half]);
        const bf16 p1 = static_cast<bf16>(static_cast<float>(y[d]) * static_cast<float>(c[d]));
        const bf16 p2 = static_cast<bf16>(static_cast<bf16>(rot) * static_cast<float>(s[d]));
        o[d] = static_cast<bf16>(static_cast<float>(p1) + static_cast<float>(p2));
      }
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
  m.def("rms_norm_ops", &rms_norm_ops, "RMSNorm as model/decoder.py computes it (any float dtype), one call",
        py::call_guard<py::gil_scoped_release>());
  m.def("norm_rope_ops", &norm_rope_ops, "per-head RMSNorm + rotary as model/decoder.py computes them, one call",
        py::call_guard<py::gil_scoped_release>());
}
