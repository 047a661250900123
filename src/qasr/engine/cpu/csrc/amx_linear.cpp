// Batch-invariant bfloat16 linear layer on AMX-BF16 tiles (TDPBF16PS), with bf16_linear.cpp's rule: every
// output is one float32 accumulation over K in a fixed order, whatever M (oneDNN's AMX GEMM rounds a row by
// how many rows share the call).
//   - K tiles of 32 values at fixed offsets, accumulated in ascending order; K is never split across threads.
//   - AMX computes each C row from its own A row, so other rows (or zero padding) never touch it.
//   - a K tail is zero-padded on both sides (A panel, B copy of the block's last k pairs), for every M.
// Items are (row pair, column block), each all of K for 32 x 64 outputs; a decode call is one row pair.
// Interface and packed layout are gemm_common.h's; a B tile is 16 rows of 64 bytes of a block, read in place
// with a 256-byte stride. Tests run this path on a scalar model of the tiles (tests/amx_emulate.h).
#include "amx_tiles.h"
#include "gemm_common.h"
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__)
#include <immintrin.h>
#if defined(QASR_AMX_EMULATE)
#include "amx_emulate.h"  // defines the TILE_* macros on a scalar model (tests only)
#define QASR_AMX 1
#elif defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <cpuid.h>
// Tile numbers must be literal constants: the intrinsics paste them into the instruction.
#define TILE_CONFIG(cfg) _tile_loadconfig(cfg)
#define TILE_ZERO(t) _tile_zero(t)
#define TILE_LOAD(t, ptr, stride_bytes) _tile_loadd(t, ptr, stride_bytes)
#define TILE_DP(c, a, b) _tile_dpbf16ps(c, a, b)
#define TILE_STORE(t, ptr, stride_bytes) _tile_stored(t, ptr, stride_bytes)
#define TILE_RELEASE() _tile_release()
// GCC's tile intrinsics are asm statements that do not tell the compiler they read memory (ldtilecfg
// declares 8 of its 64 bytes, tileloadd none): a compiler barrier before them makes every store to the
// tile configuration, the A panel and the B tail reach memory first.
#define TILE_MEMORY_BARRIER() __asm__ volatile("" ::: "memory")
#define QASR_AMX 1
#endif
#endif
#ifndef QASR_AMX
#define QASR_AMX 0
#endif

constexpr int64_t TR = 16;  // rows per A / C tile
constexpr int64_t TK = 32;  // bf16 values of K per tile (16 k pairs = one 64-byte tile row)
constexpr int64_t PR = 2 * TR;  // rows per item: two A tiles
constexpr int64_t HC = 32;  // columns per micro-kernel pass: two B tiles (a block is two passes)

#if QASR_AMX && !defined(QASR_AMX_EMULATE)
static bool cpu_has_amx_bf16() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool amx_bf16 = (d >> 22) & 1u, amx_tile = (d >> 24) & 1u;  // CPUID.(7,0):EDX bits 22 and 24
  return amx_bf16 && amx_tile && __builtin_cpu_supports("avx512bf16");
}

bool supported() {
  static const bool ok = cpu_has_amx_bf16() && amx::request_tile_permission();  // asked once per process
  return ok;
}
bool emulated() { return false; }
#elif QASR_AMX
bool supported() { return true; }
bool emulated() { return true; }
#else
bool supported() { return false; }  // built without AMX (e.g. -march=native on a CPU that lacks it)
bool emulated() { return false; }
#endif

#if QASR_AMX
// The tiles (amx_tiles.h: one configuration, every tile 16 rows of 64 bytes):
//   C: tmm0..3, 16 rows x 16 float32 (tmm0 rows 0-15 / cols 0-15, tmm1 rows 0-15 / cols 16-31,
//                                      tmm2 rows 16-31 / cols 0-15, tmm3 rows 16-31 / cols 16-31)
//   A: tmm4 (rows 0-15), tmm5 (rows 16-31), 16 rows x 32 bf16 (16 k pairs)
//   B: tmm6 (cols 0-15), tmm7 (cols 16-31), 16 k-pair rows x 16 columns x 2 bf16
//
// C (32 rows x 32 columns, float32) = A (32 rows: `a` and a + 16 * lda, lda in bf16 values) x the block's
// columns [c0, c0 + 32) over every K tile in ascending order, stored to cbuf (32 x 32 floats).
// K tile kt reads A values [32 kt, 32 kt + 32) and B k-pair rows [16 kt, 16 kt + 16): those of `wblock`
// for the `kfull` full tiles, then (if K % 32 != 0) the zero-padded copy `btail` of the last rows.
static inline void micro_kernel(const uint16_t* a, int64_t lda, const uint16_t* wblock, const uint16_t* btail,
                                int64_t kfull, int64_t ktiles, int64_t c0, float* cbuf) {
  constexpr int64_t B_STRIDE = NB * 2 * 2;  // bytes from one k pair of a block to the next: 64 cols x 2 x bf16
  const int64_t a_stride = lda * 2;
  TILE_MEMORY_BARRIER();  // the panel and tail copies are in memory before the tile loads read them
  TILE_ZERO(0);
  TILE_ZERO(1);
  TILE_ZERO(2);
  TILE_ZERO(3);
  for (int64_t kt = 0; kt < ktiles; ++kt) {
    const uint16_t* w = kt < kfull ? wblock + kt * (TK / 2) * NB * 2 : btail;
    TILE_LOAD(4, a + kt * TK, a_stride);
    TILE_LOAD(5, a + TR * lda + kt * TK, a_stride);
    TILE_LOAD(6, w + c0 * 2, B_STRIDE);         // columns c0 .. c0+15: 16 x (2 bf16) = 64 bytes a row
    TILE_LOAD(7, w + (c0 + 16) * 2, B_STRIDE);  // columns c0+16 .. c0+31
    TILE_DP(0, 4, 6);
    TILE_DP(1, 4, 7);
    TILE_DP(2, 5, 6);
    TILE_DP(3, 5, 7);
  }
  constexpr int64_t C_STRIDE = HC * 4;  // cbuf rows: 32 floats
  TILE_STORE(0, cbuf, C_STRIDE);
  TILE_STORE(1, cbuf + 16, C_STRIDE);
  TILE_STORE(2, cbuf + TR * HC, C_STRIDE);
  TILE_STORE(3, cbuf + TR * HC + 16, C_STRIDE);
}

// out rows [0, nrows) x columns [0, ncols) = bf16(cbuf + bias), rounded once, to nearest even, exactly as
// bf16_linear.cpp rounds (vcvtneps2bf16 of the float32 sum, bias or +0 added first).
static inline void store_rows(const float* cbuf, int64_t nrows, int64_t ncols, const float* bias, uint16_t* out,
                              int64_t ldo) {
  for (int64_t c = 0; c < ncols; c += 16) {
    const __mmask16 mask = ncols - c >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (ncols - c)) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + c) : _mm512_setzero_ps();
    for (int64_t r = 0; r < nrows; ++r) {
      const __m256bh v = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_loadu_ps(cbuf + r * HC + c), b));
      _mm256_mask_storeu_epi16(out + r * ldo + c, mask, (__m256i)v);
    }
  }
}

// Per-thread scratch, kept between calls (no allocation per call once grown).
struct Scratch {
  std::vector<uint16_t> panel;  // PR rows x kpad: one row pair's K values, zero-padded
  std::vector<uint16_t> btail;  // 16 k-pair rows x 64 columns x 2: a block's last k pairs, zero-padded
};
static Scratch& scratch() {
  static thread_local Scratch s;
  return s;
}

// Copy rows [m0, m0 + 32) into the panel: row r's K values, then zeros up to kpad; rows >= M all zero.
// Zero rows only fill tile rows whose results are discarded; zero K values multiply zero weights.
static void fill_panel(const Rows& rows, int64_t M, int64_t m0, int64_t kpad, uint16_t* panel) {
  const int64_t run = 2 * rows.seg_pairs, K = rows.segs * run;
  for (int64_t r = 0; r < PR; ++r) {
    uint16_t* dst = panel + r * kpad;
    if (m0 + r < M) {
      const uint16_t* src = rows.row(m0 + r);
      for (int64_t s = 0; s < rows.segs; ++s)
        std::memcpy(dst + s * run, src + s * rows.seg_stride, run * sizeof(uint16_t));
      std::memset(dst + K, 0, (kpad - K) * sizeof(uint16_t));
    } else {
      std::memset(dst, 0, kpad * sizeof(uint16_t));
    }
  }
}

// Copy k-pair rows [16 * kfull, kpairs) of one packed block into btail (16 rows), zeros after them.
static void fill_btail(const uint16_t* wblock, int64_t kfull, int64_t kpairs, uint16_t* btail) {
  const int64_t row = NB * 2, have = kpairs - kfull * (TK / 2);
  std::memcpy(btail, wblock + kfull * (TK / 2) * row, have * row * sizeof(uint16_t));
  std::memset(btail + have * row, 0, ((TK / 2) - have) * row * sizeof(uint16_t));
}

static void run(const Rows& rows, int64_t M, const uint16_t* packed, int64_t N, const float* bias, uint16_t* out) {
  const int64_t K = rows.segs * rows.seg_pairs * 2, kpairs = K / 2;
  const int64_t ktiles = (K + TK - 1) / TK, kfull = K / TK, kpad = ktiles * TK;
  const int64_t blocks = (N + NB - 1) / NB, pairs = (M + PR - 1) / PR;
  // A plain matrix with whole K tiles is read in place by the tile loads (full row pairs only); anything
  // else (a convolution's rows, a K tail, the last partial row pair) is copied to the panel first. Both
  // put the same values in the same tile rows, so the choice never changes a result.
  const bool in_place = rows.plain && K % TK == 0;
  // Item order is for the caches only: in place, consecutive items share a column block (its weights stay
  // in L2 while the row pairs pass); with a panel, they share a row pair (the panel is filled once).
  at::parallel_for(0, blocks * pairs, 1, [&](int64_t i0, int64_t i1) {
    const amx::TileConfig cfg = amx::full_tiles();
    TILE_MEMORY_BARRIER();
    TILE_CONFIG(&cfg);  // per thread: the tile configuration is thread state
    Scratch& s = scratch();
    if (!in_place || M % PR != 0) s.panel.resize(PR * kpad);
    if (kfull < ktiles) s.btail.resize((TK / 2) * NB * 2);
    int64_t panel_pair = -1, tail_block = -1;  // what the scratch holds in this call (nothing yet)
    alignas(64) float cbuf[PR * HC];
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t p = in_place ? item % pairs : item / blocks;
      const int64_t b = in_place ? item / pairs : item % blocks;
      const int64_t m0 = p * PR, nrows = std::min<int64_t>(PR, M - m0);
      const uint16_t* a;
      int64_t lda;
      if (in_place && nrows == PR) {
        a = rows.row(m0);
        lda = K;
      } else {
        if (panel_pair != p) fill_panel(rows, M, m0, kpad, s.panel.data());
        panel_pair = p;
        a = s.panel.data();
        lda = kpad;
      }
      const uint16_t* wblock = packed + b * kpairs * NB * 2;
      if (kfull < ktiles && tail_block != b) fill_btail(wblock, kfull, kpairs, s.btail.data());
      tail_block = b;
      for (int64_t c0 = 0; c0 < NB; c0 += HC) {
        const int64_t ncols = std::min<int64_t>(HC, N - b * NB - c0);
        if (ncols <= 0) break;
        micro_kernel(a, lda, wblock, s.btail.data(), kfull, ktiles, c0, cbuf);
        store_rows(cbuf, nrows, ncols, bias ? bias + b * NB + c0 : nullptr, out + m0 * N + b * NB + c0, N);
      }
    }
    TILE_RELEASE();  // back to the init state: the OS saves less on context switches
  });
}
#else
static constexpr RunFn run = nullptr;  // never called: supported() is false in this build
#endif

static const Gemm GEMM{"qasr AMX", "this build or CPU lacks AMX-BF16, or the OS refused tile data", supported, run};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
#if defined(QASR_AMX_EMULATE)
  m.attr("KIND") = "AMX-BF16 (scalar emulation, tests only)";
#else
  m.attr("KIND") = "AMX-BF16";
#endif
  m.def("supported", &supported, "whether this build, CPU and OS can run the AMX-BF16 kernel");
  m.def("emulated", &emulated, "whether the tile instructions are a scalar model (a test build)");
  def_gemm(m, GEMM, "batch-invariant bf16 x @ W^T + b with float32 accumulation on AMX tiles");
}
