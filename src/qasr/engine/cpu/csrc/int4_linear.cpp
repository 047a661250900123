// int4 weight W4A8 linear layer on AVX512-VNNI for the decoder's linears and LM head (quantize="int4"):
// group-wise int4 weights, the int8 per-row activations of int8_common.h, exact to the spec below.
//
// Why: a decode step's time is the weights' bytes over the memory bandwidth, and int4 halves int8's bytes; the
// compute-bound encoder stays on the int8 kernels (docs/log/*-cpu-int4-decoder.md).
//
// The arithmetic (int4.py's reference holds it in torch ops), groups of G = 128 input features along K:
//   w_scale[n, g] = max_{k in g} |w[n, k]| / 7 (1 for an all-zero group), w_q = clamp(round_half_even(w / s), -7, 7)
//   x_q, a_scale: the int8 activation quantization of int8_common.h (per row, 127 levels)
//   acc_g = sum_{k in g} x_q[m, k] * w_q[n, k] (exact int32)
//   y = 0; for g in order: y = y + float32(acc_g) * w_scale[n, g]; y = y * a_scale[m]; y = y + bias[n];
//   out = y in x's dtype. Each step is one IEEE rounding (no fused multiply-add: built with -ffp-contract=off).
// A row's result depends only on that row, and the group order is fixed, so every kernel gives the same bits.
//
// Packed weight (one int8 tensor):
//   bytes [0, 64): header, int64 magic, N, K, Kp (K rounded up to G)
//   then (N_pad / 64) blocks, each Kp / 8 pairs of 256 bytes: pair p covers input features [8p, 8p + 8) of the
//   block's 64 columns, laid out as four 64-byte vectors (16 columns x 4 bytes, the vpdpbusd operand) whose
//   byte i of column c holds u = w_q + 8 (0..15) of feature 8p + i in its low nibble and of 8p + 4 + i in its
//   high nibble; then per block, per group, 64 float32 w_scale (padded columns and features: w_q = 0, scale 1).
// vpdpbusd multiplies unsigned by signed bytes: the weights are the unsigned operand (u = w_q + 8) and the
// activations the signed one, so sum_k u * x_q = acc + 8 * sum_k x_q, and each row's 8 * sum_{k in g} x_q is
// taken off per group (exact in int32).
#include "int8_common.h"

#if QASR_INT8_AVX512 && defined(__AVX512VNNI__)
#define QASR_VNNI 1
#else
#define QASR_VNNI 0
#endif

namespace int4 {

constexpr int64_t G = 128;  // features per scale group (a multiple of the 8 of a pair)
constexpr int64_t NB = 64;  // columns per block
constexpr int64_t HEADER = 64;
constexpr int64_t MAGIC = 0x3150344951534151LL;  // "QASQI4P1"
constexpr int64_t ROW_CHUNK = 96;               // rows per work item (a decode call is one chunk)
constexpr int64_t MR = 6;                       // rows per register pass (24 accumulators)

struct Layout {
  int64_t N, K, Kp, blocks, groups;
  int64_t weight_bytes() const { return blocks * Kp * NB / 2; }
  int64_t total_bytes() const { return HEADER + weight_bytes() + blocks * groups * NB * 4; }
};

inline Layout layout(int64_t N, int64_t K) {
  const int64_t Kp = int8::round_up(K, G);
  return Layout{N, K, Kp, (N + NB - 1) / NB, Kp / G};
}

// w_q (N, K) int8 in [-7, 7], w_scale (N, ceil(K / G)) float32 -> the packed tensor described above.
torch::Tensor pack(torch::Tensor w_q, torch::Tensor w_scale) {
  TORCH_CHECK(w_q.dim() == 2 && w_q.scalar_type() == at::kChar, "pack: (N, K) int8 weight");
  const int64_t N = w_q.size(0), K = w_q.size(1);
  TORCH_CHECK(N >= 1 && K >= 1, "pack: N and K must be at least 1");
  const Layout L = layout(N, K);
  TORCH_CHECK(w_scale.dim() == 2 && w_scale.size(0) == N && w_scale.size(1) == L.groups &&
                  w_scale.scalar_type() == at::kFloat, "pack: w_scale must be (N, ceil(K / 128)) float32");
  auto w = w_q.contiguous();
  auto s = w_scale.contiguous();
  TORCH_CHECK(!w.lt(-7).logical_or(w.gt(7)).any().item<bool>(), "pack: int4 weights must lie in [-7, 7]");
  auto out = torch::zeros({L.total_bytes()}, w_q.options());
  uint8_t* base = reinterpret_cast<uint8_t*>(out.data_ptr<int8_t>());
  const int64_t head[4] = {MAGIC, N, K, L.Kp};
  std::memcpy(base, head, sizeof(head));
  const int8_t* src = w.data_ptr<int8_t>();
  const float* sp = s.data_ptr<float>();
  uint8_t* blocks = base + HEADER;
  float* scales = reinterpret_cast<float*>(blocks + L.weight_bytes());
  const int64_t pairs = L.Kp / 8;
  at::parallel_for(0, L.blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      uint8_t* blk = blocks + b * pairs * 256;
      float* bs = scales + b * L.groups * NB;
      for (int64_t c = 0; c < NB; ++c) {
        const int64_t n = b * NB + c;
        const bool real = n < N;
        for (int64_t g = 0; g < L.groups; ++g) bs[g * NB + c] = real ? sp[n * L.groups + g] : 1.f;
        for (int64_t p = 0; p < pairs; ++p) {
          uint8_t* vec = blk + p * 256 + (c / 16) * 64 + (c % 16) * 4;
          for (int64_t i = 0; i < 4; ++i) {
            const int64_t k_lo = 8 * p + i, k_hi = 8 * p + 4 + i;
            const int lo = (real && k_lo < K) ? src[n * K + k_lo] : 0;
            const int hi = (real && k_hi < K) ? src[n * K + k_hi] : 0;
            vec[i] = static_cast<uint8_t>((lo + 8) | ((hi + 8) << 4));
          }
        }
      }
    }
  });
  return out;
}

inline Layout packed_layout(const torch::Tensor& packed, int64_t N, int64_t K) {
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 1 && packed.is_contiguous() &&
                  packed.numel() >= HEADER, "linear: packed weight from pack()");
  int64_t head[4];
  std::memcpy(head, packed.data_ptr<int8_t>(), sizeof(head));
  TORCH_CHECK(head[0] == MAGIC, "linear: packed weight from int4 pack()");
  TORCH_CHECK(head[1] == N && head[2] == K, "linear: the packed weight is (", head[1], ", ", head[2],
              "), the call wants (", N, ", ", K, ")");
  const Layout L = layout(N, K);
  TORCH_CHECK(packed.numel() == L.total_bytes(), "linear: packed weight has the wrong size");
  return L;
}

struct Args {
  const uint8_t* panel;  // rows x Kp signed x_q bytes
  const float* a_scale;
  const int32_t* corr;   // per row, per group: 8 * sum_{k in g} x_q
  int64_t M, N, Kp, groups;
  const uint8_t* blocks;
  const float* scales;
  const float* bias;
  void* out;
  bool bf16;
};

#if QASR_VNNI
bool supported() {
  static const bool ok = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl");
  return ok;
}

// acc += u8 u x s8 (the 4 bytes at x, broadcast to every lane by the instruction's embedded {1to16}): the rows'
// activations need no register of their own, so a pass can hold more rows' accumulators (see int8::dpbusd for
// why inline assembly).
inline __m512i dpbusd_bcast(__m512i acc, __m512i u, const uint8_t* x) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*reinterpret_cast<const int32_t*>(x)));
  return acc;
}

// Rows [m0, m0 + R) x block b's 64 columns over all of K, group by group, then the epilogue. The int32
// accumulators of a group live in registers; the float sums over groups in memory (touched once a group).
template <int R>
inline void pass(const Args& a, int64_t m0, int64_t b) {
  const int64_t pairs_per_group = G / 8;
  const uint8_t* blk = a.blocks + b * (a.Kp / 8) * 256;
  const float* bs = a.scales + b * a.groups * NB;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  alignas(64) float y[R][4][16];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) _mm512_store_ps(y[r][j], _mm512_setzero_ps());
  for (int64_t g = 0; g < a.groups; ++g) {
    __m512i acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_si512();
    const uint8_t* wg = blk + g * pairs_per_group * 256;
    const uint8_t* xg = a.panel + m0 * a.Kp + g * G;
    for (int64_t p = 0; p < pairs_per_group; ++p) {
      const uint8_t* w = wg + p * 256;
      const uint8_t* x = xg + 8 * p;
      for (int j = 0; j < 4; ++j) {
        const __m512i v = _mm512_loadu_si512(w + 64 * j);
        const __m512i ulo = _mm512_and_si512(v, nibble);
        const __m512i uhi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
        for (int r = 0; r < R; ++r) {
          acc[r][j] = dpbusd_bcast(acc[r][j], ulo, x + r * a.Kp);
          acc[r][j] = dpbusd_bcast(acc[r][j], uhi, x + r * a.Kp + 4);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512i corr = _mm512_set1_epi32(a.corr[(m0 + r) * a.groups + g]);
      for (int j = 0; j < 4; ++j) {
        const __m512 s = _mm512_loadu_ps(bs + g * NB + 16 * j);
        const __m512 t = _mm512_mul_ps(
            _mm512_cvt_roundepi32_ps(_mm512_sub_epi32(acc[r][j], corr), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), s);
        _mm512_store_ps(y[r][j], _mm512_add_ps(_mm512_load_ps(y[r][j]), t));
      }
    }
  }
  const int64_t es = a.bf16 ? 2 : 4;
  for (int j = 0; j < 4; ++j) {
    const int64_t n0 = b * NB + 16 * j;
    if (n0 >= a.N) break;
    const __mmask16 mask = int8::tail_mask(a.N - n0);
    const __m512 bias = a.bias ? _mm512_maskz_loadu_ps(mask, a.bias + n0) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const int64_t m = m0 + r;
      __m512 v = _mm512_mul_ps(_mm512_load_ps(y[r][j]), _mm512_set1_ps(a.a_scale[m]));
      if (a.bias) v = _mm512_add_ps(v, bias);  // no bias: nothing added (+0.0 would turn -0.0 into +0.0)
      int8::store16(v, mask, static_cast<char*>(a.out) + (m * a.N + n0) * es, a.bf16);
    }
  }
}

void run(const Args& a) {
  const int64_t chunks = (a.M + ROW_CHUNK - 1) / ROW_CHUNK;
  const int64_t blocks = (a.N + NB - 1) / NB;
  at::parallel_for(0, blocks * chunks, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t b = item / chunks, c = item % chunks;
      const int64_t end = std::min(a.M, (c + 1) * ROW_CHUNK);
      int64_t m = c * ROW_CHUNK;
      for (; m + MR <= end; m += MR) pass<MR>(a, m, b);
      switch (end - m) {
        case 5: pass<5>(a, m, b); break;
        case 4: pass<4>(a, m, b); break;
        case 3: pass<3>(a, m, b); break;
        case 2: pass<2>(a, m, b); break;
        case 1: pass<1>(a, m, b); break;
        default: break;
      }
    }
  });
}
#else
bool supported() { return false; }  // built without AVX512-VNNI
void run(const Args&) {}
#endif

// linear(x, packed, N, bias) -> (M, N) in x's dtype.
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t N, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(supported(), "qasr int4 linear: this build or CPU lacks AVX512-VNNI");
  int8::check_x(x, "linear");
  auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1);
  const Layout L = packed_layout(packed, N, K);
  const torch::Tensor bf = int8::float_bias(bias, N, "linear");
  const float* bp = bf.defined() ? bf.data_ptr<float>() : nullptr;
  auto out = torch::empty({M, N}, xc.options());
  if (M == 0) return out;
  int8::Panel& p = int8::panel_for(M, L.Kp);
  thread_local std::vector<int32_t> corr;
  if (static_cast<int64_t>(corr.size()) < M * L.groups) corr.resize(M * L.groups);
  int8::dispatch_x(xc, [&](auto* xp) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(xp)>>;
    int8::quantize_panel(int8::Rows<T>{xp, 1, K, K}, M, L.Kp, M, 0, p.q.data(), p.scale.data());
  });
  int32_t* cp = corr.data();  // thread_local: the worker threads below must not name it themselves
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t m = r0; m < r1; ++m) {
      const int8_t* row = reinterpret_cast<const int8_t*>(p.q.data() + m * L.Kp);
      for (int64_t g = 0; g < L.groups; ++g) {
        int32_t sum = 0;
        for (int64_t k = g * G; k < (g + 1) * G; ++k) sum += row[k];
        cp[m * L.groups + g] = 8 * sum;
      }
    }
  });
  const uint8_t* blocks = reinterpret_cast<const uint8_t*>(packed.data_ptr<int8_t>()) + HEADER;
  const Args a{p.q.data(), p.scale.data(), cp, M, N, L.Kp, L.groups, blocks,
               reinterpret_cast<const float*>(blocks + L.weight_bytes()), bp, out.data_ptr(),
               xc.scalar_type() == at::kBFloat16};
  run(a);
  return out;
}

}  // namespace int4

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto no_gil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.attr("KIND") = "AVX512-VNNI int4";
  m.attr("GROUP") = int4::G;
  m.def("supported", &int4::supported, "whether this build and CPU can run the AVX512-VNNI int4 kernel");
  m.def("pack", &int4::pack, "pack (N, K) int8 weights in [-7, 7] and their (N, groups) float32 scales", no_gil);
  m.def("linear", &int4::linear, "exact W4A8 x @ W^T: per-row int8 activations, group-wise int4 weights",
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("n"), pybind11::arg("bias") = pybind11::none(),
        no_gil);
}
