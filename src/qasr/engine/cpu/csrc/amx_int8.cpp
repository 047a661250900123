// int8 W8A8 linear layer on AMX-INT8 tiles (tdpbssd), exact to the spec in int8_common.h.
//
// C: 32 x 32 int32 in tmm0-3; A: two 16-row tiles of 64 int8 of K (tmm4-5); B: two tiles read in place from
// the packed weight with a 256-byte stride (tmm6-7). Rows are padded to 32 and K to 64 with zeros, so one tile
// configuration serves every call. Items are (64-column block, 32-row pair), block-major; calls of <= 4 rows
// run on AVX512-VNNI registers instead (vnni512_run). The sums are exact, so no blocking changes a result.
#include "amx_tiles.h"
#include "int8_common.h"

#if QASR_INT8_AVX512 && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#include <cpuid.h>
#define QASR_AMX_INT8 1
#else
#define QASR_AMX_INT8 0
#endif

#if QASR_AMX_INT8
static bool cpu_has_amx_int8() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool amx_tile = (d >> 24) & 1u, amx_int8 = (d >> 25) & 1u;  // CPUID.(7,0):EDX bits 24 and 25
  return amx_tile && amx_int8 && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
}

bool supported() {
  static const bool ok = cpu_has_amx_int8() && amx::request_tile_permission();  // asked once per process
  return ok;
}

constexpr int64_t TR = 16;   // rows per A / C tile
constexpr int64_t TK = 64;   // int8 values of K per tile (one 64-byte tile row)
constexpr int64_t PR = 32;   // rows per item: two A tiles
constexpr int64_t HC = 32;   // columns per pass: two B tiles (a block is two passes)

// GCC's tile intrinsics are asm statements that do not say they read memory: a compiler barrier before them
// makes the configuration (and the panel, written before the parallel region) reach memory first.
#define TILE_MEMORY_BARRIER() __asm__ volatile("" ::: "memory")

// C (32 or 16 rows x 32 columns, int32, into cbuf: 32 x 32) = panel rows from `a` x block columns
// [c0, c0 + 32), over all of K.
template <bool TWO>
static inline void tiles(const uint8_t* a, int64_t Kp, const int8_t* blk, int64_t c0, int32_t* cbuf) {
  constexpr int64_t B_STRIDE = int8::NB * 4;  // bytes from one 4-value group of a block to the next
  const int64_t ktiles = Kp / TK;
  TILE_MEMORY_BARRIER();
  _tile_zero(0);
  _tile_zero(1);
  if (TWO) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t kt = 0; kt < ktiles; ++kt) {
    const int8_t* w = blk + kt * (TK / 4) * B_STRIDE + c0 * 4;
    _tile_loadd(4, a + kt * TK, Kp);
    _tile_loadd(6, w, B_STRIDE);       // columns c0 .. c0+15
    _tile_loadd(7, w + 64, B_STRIDE);  // columns c0+16 .. c0+31
    _tile_dpbssd(0, 4, 6);
    _tile_dpbssd(1, 4, 7);
    if (TWO) {
      _tile_loadd(5, a + TR * Kp + kt * TK, Kp);
      _tile_dpbssd(2, 5, 6);
      _tile_dpbssd(3, 5, 7);
    }
  }
  constexpr int64_t C_STRIDE = HC * 4;
  _tile_stored(0, cbuf, C_STRIDE);
  _tile_stored(1, cbuf + 16, C_STRIDE);
  if (TWO) {
    _tile_stored(2, cbuf + TR * HC, C_STRIDE);
    _tile_stored(3, cbuf + TR * HC + 16, C_STRIDE);
  }
}

static void run(const int8::Args& a) {
  const int64_t blocks = (a.N + int8::NB - 1) / int8::NB, pairs = (a.M + PR - 1) / PR;
  const int64_t groups = a.Kp / 4, es = a.bf16 ? 2 : 4;
  at::parallel_for(0, blocks * pairs, 1, [&](int64_t i0, int64_t i1) {
    const amx::TileConfig cfg = amx::full_tiles();
    TILE_MEMORY_BARRIER();
    _tile_loadconfig(&cfg);  // per thread: the tile configuration is thread state
    alignas(64) int32_t cbuf[PR * HC];
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t b = item / pairs, p = item % pairs;
      const int64_t m0 = p * PR, nrows = std::min<int64_t>(PR, a.M - m0);
      const int8_t* blk = a.blocks + b * groups * int8::NB * 4;
      const uint8_t* rows = a.panel + m0 * a.Kp;
      for (int64_t c0 = 0; c0 < int8::NB; c0 += HC) {
        const int64_t n0 = b * int8::NB + c0;
        if (n0 >= a.N) break;
        if (nrows > TR) tiles<true>(rows, a.Kp, blk, c0, cbuf);
        else tiles<false>(rows, a.Kp, blk, c0, cbuf);
        for (int64_t h = 0; h < HC && n0 + h < a.N; h += 16) {
          const int8::Cols16 cols = int8::cols16(a.w_scale + n0 + h, a.bias ? a.bias + n0 + h : nullptr,
                                                 int8::tail_mask(a.N - n0 - h));
          for (int64_t r = 0; r < nrows; ++r) {
            const int64_t m = m0 + r;
            int8::epilogue16(_mm512_load_si512(cbuf + r * HC + h), a.a_scale[m], cols,
                             static_cast<char*>(a.out) + (m * a.N + n0 + h) * es, a.bf16);
          }
        }
      }
    }
    _tile_release();  // back to the init state: the OS saves less on context switches
  });
}
#else
bool supported() { return false; }  // built without AMX-INT8 (e.g. -march=native on a CPU that lacks it)
static constexpr int8::RunFn run = nullptr;
#endif

#if QASR_AMX_INT8 && defined(__AVX512VNNI__)
// Up to 4 rows, AVX512-VNNI registers beat 16-row tiles that mostly multiply padding
// (docs/log/*-cpu-amx-int8-few-rows.md).
static const int8::Gemm GEMM{"qasr AMX-INT8", "this build or CPU lacks AMX-INT8, or the OS refused tile data",
                             supported, run, 0, 4, int8::vnni512_run, 0x80};
#else
static const int8::Gemm GEMM{"qasr AMX-INT8", "this build or CPU lacks AMX-INT8, or the OS refused tile data",
                             supported, run, 0};
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("KIND") = "AMX-INT8";
  m.def("supported", &supported, "whether this build, CPU and OS can run the AMX-INT8 kernel");
  int8::def_int8(m, GEMM, "exact W8A8 x @ W^T * scales + b: per-row int8 activations, int32 products on AMX tiles");
}
