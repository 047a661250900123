// Two steps of the encoder's conv front (bf16): the first convolution (one input channel), and GELU of a
// convolution's output zero-padded channels-last as the next one reads it, in one pass instead of torch's three.
// GELU is a lookup in a table of torch's own F.gelu at all 65,536 bf16 values (activation_tables.py): torch's
// contiguous GELU bits by construction. Figures: docs/log/*-cpu-encoder-ops.md.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

// x: an (n, h, w, c) bf16 view, any strides (the GEMM convolutions leave channels-last memory, oneDNN's first
// convolution channels-first: both are read in place, no transposing copy first); table: 65,536 int16, table[bits]
// = the bits of gelu(bf16 with those bits) -> (n, h + 2 ph, w + 2 pw, c) contiguous bf16: zeros around gelu(x).
torch::Tensor pad_gelu(torch::Tensor x, torch::Tensor table, int64_t ph, int64_t pw) {
  TORCH_CHECK(x.dim() == 4 && x.scalar_type() == at::kBFloat16, "pad_gelu: (n, h, w, c) bfloat16 input");
  TORCH_CHECK(table.scalar_type() == at::kShort && table.dim() == 1 && table.numel() == 65536 && table.is_contiguous(),
              "pad_gelu: a contiguous table of 65,536 int16");
  TORCH_CHECK(ph >= 0 && pw >= 0, "pad_gelu: negative padding");
  const int64_t n = x.size(0), h = x.size(1), w = x.size(2), c = x.size(3);
  const int64_t sn = x.stride(0), sh = x.stride(1), sw = x.stride(2), sc = x.stride(3);
  const int64_t hp = h + 2 * ph, wp = w + 2 * pw, prow = wp * c;
  auto out = torch::empty({n, hp, wp, c}, x.options());
  if (out.numel() == 0) return out;
  const uint16_t* src = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const uint16_t* lut = reinterpret_cast<const uint16_t*>(table.data_ptr<int16_t>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  // one item per output row (image b, padded row i): border rows are zeros, the others zeros | gelu(x) | zeros
  at::parallel_for(0, n * hp, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / hp, i = r % hp;
      uint16_t* o = dst + r * prow;
      if (i < ph || i >= ph + h) {
        std::memset(o, 0, prow * sizeof(uint16_t));
        continue;
      }
      std::memset(o, 0, pw * c * sizeof(uint16_t));
      std::memset(o + (pw + w) * c, 0, pw * c * sizeof(uint16_t));
      const uint16_t* s = src + b * sn + (i - ph) * sh;
      uint16_t* oi = o + pw * c;
      if (sc == 1) {  // channels-last: each position's channels are contiguous
        for (int64_t j = 0; j < w; ++j)
          for (int64_t k = 0; k < c; ++k) oi[j * c + k] = lut[s[j * sw + k]];
      } else {  // e.g. channels-first: read each channel's run along the row, write it strided by c
        for (int64_t k = 0; k < c; ++k)
          for (int64_t j = 0; j < w; ++j) oi[j * c + k] = lut[s[k * sc + j * sw]];
      }
    }
  });
  return out;
}

// The encoder's first convolution (one input channel, the log-mel image): x (n, 1, h, w) bf16, weight (kh * kw,
// cout) float32 (tap-major: (ky, kx) order), bias (cout) float32 or none -> (n, ho, wo, cout) bf16, channels-last
// as the GEMM convolutions after it read it. Each output is float32: bias, then + x * w for the taps in (ky, kx)
// order (zero padding adds nothing), rounded once to bf16 -- a position's result depends on nothing else.
// Why: oneDNN's speed here moved with the strides, and it wrote channels-first, which the next step transposed.
torch::Tensor conv_one_channel(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias, int64_t kh,
                               int64_t kw, int64_t sh, int64_t sw, int64_t ph, int64_t pw) {
  TORCH_CHECK(x.dim() == 4 && x.size(1) == 1 && x.scalar_type() == at::kBFloat16, "conv_one_channel: (n, 1, h, w) bfloat16");
  TORCH_CHECK(kh > 0 && kw > 0 && sh > 0 && sw > 0 && ph >= 0 && pw >= 0, "conv_one_channel: bad geometry");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 2 && weight.size(0) == kh * kw &&
                  weight.is_contiguous(), "conv_one_channel: weight (kh * kw, cout) float32");
  const int64_t cout = weight.size(1);
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == cout, "conv_one_channel: bias must have cout values");
  } else {
    b = torch::zeros({cout}, weight.options());
  }
  auto xc = x.contiguous();
  const int64_t n = xc.size(0), h = xc.size(2), w = xc.size(3);
  TORCH_CHECK(h + 2 * ph >= kh && w + 2 * pw >= kw, "conv_one_channel: kernel larger than the padded input");
  const int64_t ho = (h + 2 * ph - kh) / sh + 1, wo = (w + 2 * pw - kw) / sw + 1;
  auto out = torch::empty({n, ho, wo, cout}, xc.options());
  const at::BFloat16* src = xc.data_ptr<at::BFloat16>();
  const float* wt = weight.data_ptr<float>();
  const float* bp = b.data_ptr<float>();
  at::BFloat16* dst = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, n * ho, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> acc(cout);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t bi = r / ho, oy = r % ho;
      for (int64_t ox = 0; ox < wo; ++ox) {
        std::copy(bp, bp + cout, acc.begin());
        for (int64_t ky = 0; ky < kh; ++ky) {
          const int64_t iy = oy * sh - ph + ky;
          if (iy < 0 || iy >= h) continue;
          for (int64_t kx = 0; kx < kw; ++kx) {
            const int64_t ix = ox * sw - pw + kx;
            if (ix < 0 || ix >= w) continue;
            const float v = static_cast<float>(src[(bi * h + iy) * w + ix]);
            const float* wr = wt + (ky * kw + kx) * cout;
            for (int64_t c = 0; c < cout; ++c) acc[c] += v * wr[c];
          }
        }
        at::BFloat16* o = dst + (r * wo + ox) * cout;
        for (int64_t c = 0; c < cout; ++c) o[c] = static_cast<at::BFloat16>(acc[c]);
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pad_gelu", &pad_gelu, "gelu (by table) of an (n, h, w, c) bf16 activation, zero-padded, in one pass",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("conv_one_channel", &conv_one_channel, "a one-input-channel convolution, float32 sums, channels-last bf16 out",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
