// A scalar model of the AMX tile instructions used by src/qasr/engine/cpu/csrc/amx_linear.cpp, so its
// indexing (packed layout, panels, K tails, row and column remainders, threading) can be run and checked
// on CPUs without AMX. Included only when the kernel is built with -DQASR_AMX_EMULATE (tests/engine/cpu/test_amx_linear.py);
// never used for inference.
//
// Semantics follow the Intel SDM pseudo-code: LDTILECFG zeroes every tile; TILELOADD fills rows x colsb
// bytes and zeroes the rest; TDPBF16PS adds, for each C row m and column n, the products of A row m and
// B column n pair by pair in ascending k (DAZ on inputs; the bf16 x bf16 product is exact in float32, so
// rounding happens only in the adds, as on the hardware up to its internal summation order). Shape rules
// the hardware enforces with a fault (#UD) throw here instead.
#pragma once
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

namespace qasr_amx_emu {

struct State {
  bool configured = false;
  uint8_t rows[8] = {};
  uint16_t colsb[8] = {};
  alignas(64) uint8_t data[8][16][64] = {};
};

inline State& state() {
  static thread_local State s;  // tile registers and configuration are per thread, as on the CPU
  return s;
}

inline void fault(const char* what) { throw std::logic_error(std::string("AMX emulation: ") + what); }

inline void check_tile(int t) {
  const State& s = state();
  if (!s.configured) fault("tile instruction without a loaded configuration");
  if (t < 0 || t > 7 || s.rows[t] == 0 || s.colsb[t] == 0) fault("tile used but not configured");
}

inline void loadconfig(const void* cfg) {
  const uint8_t* c = static_cast<const uint8_t*>(cfg);
  State& s = state();
  if (c[0] != 1) fault("palette must be 1");
  if (c[1] != 0) fault("start_row must be 0");
  for (int i = 2; i < 16; ++i)
    if (c[i] != 0) fault("reserved bytes must be 0");
  for (int t = 0; t < 8; ++t) {
    s.colsb[t] = static_cast<uint16_t>(c[16 + 2 * t] | (c[17 + 2 * t] << 8));
    s.rows[t] = c[48 + t];
    if (s.rows[t] > 16 || s.colsb[t] > 64 || (s.rows[t] == 0) != (s.colsb[t] == 0)) fault("bad tile shape");
  }
  std::memset(s.data, 0, sizeof(s.data));
  s.configured = true;
}

inline void load(int t, const void* base, long stride) {
  check_tile(t);
  State& s = state();
  std::memset(s.data[t], 0, sizeof(s.data[t]));
  for (int r = 0; r < s.rows[t]; ++r)
    std::memcpy(s.data[t][r], static_cast<const uint8_t*>(base) + r * stride, s.colsb[t]);
}

inline void store(int t, void* base, long stride) {
  check_tile(t);
  const State& s = state();
  for (int r = 0; r < s.rows[t]; ++r) std::memcpy(static_cast<uint8_t*>(base) + r * stride, s.data[t][r], s.colsb[t]);
}

inline void zero(int t) {
  check_tile(t);
  std::memset(state().data[t], 0, sizeof(state().data[t]));
}

inline float bf16_daz(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  if ((h & 0x7F80u) == 0) h &= 0x8000u;  // denormal in -> zero (DAZ)
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline void dpbf16ps(int c, int a, int b) {
  check_tile(c);
  check_tile(a);
  check_tile(b);
  State& s = state();
  if (c == a || c == b || a == b) fault("TDPBF16PS operands must be distinct tiles");
  if (s.rows[c] != s.rows[a] || s.colsb[c] != s.colsb[b] || s.colsb[a] / 4 != s.rows[b] || s.colsb[c] % 4 ||
      s.colsb[a] % 4)
    fault("TDPBF16PS shape mismatch");
  const int M = s.rows[c], N = s.colsb[c] / 4, K = s.colsb[a] / 4;
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      float acc;
      std::memcpy(&acc, s.data[c][m] + 4 * n, 4);
      for (int k = 0; k < K; ++k) {
        acc += bf16_daz(s.data[a][m] + 4 * k) * bf16_daz(s.data[b][k] + 4 * n);
        acc += bf16_daz(s.data[a][m] + 4 * k + 2) * bf16_daz(s.data[b][k] + 4 * n + 2);
      }
      std::memcpy(s.data[c][m] + 4 * n, &acc, 4);
    }
}

inline void release() { state().configured = false; }

}  // namespace qasr_amx_emu

#define TILE_CONFIG(cfg) qasr_amx_emu::loadconfig(cfg)
#define TILE_ZERO(t) qasr_amx_emu::zero(t)
#define TILE_LOAD(t, ptr, stride_bytes) qasr_amx_emu::load(t, ptr, stride_bytes)
#define TILE_DP(c, a, b) qasr_amx_emu::dpbf16ps(c, a, b)
#define TILE_STORE(t, ptr, stride_bytes) qasr_amx_emu::store(t, ptr, stride_bytes)
#define TILE_RELEASE() qasr_amx_emu::release()
#define TILE_MEMORY_BARRIER() ((void)0)
