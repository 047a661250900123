// What both AMX kernels (amx_linear.cpp: bf16, amx_int8.cpp: int8) need before their first tile instruction:
// the process's permission to use tile data, and the one tile configuration they both run with.
#pragma once

#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

namespace amx {

// Linux keeps AMX tile data disabled until the process asks for it (it enlarges every thread's saved
// state). The permission is process-wide, so existing and future threads may all use the tiles.
static inline bool request_tile_permission() {
  constexpr long ARCH_GET_XCOMP_PERM = 0x1022, ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return false;
  unsigned long granted = 0;
  if (syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &granted) != 0) return false;
  return (granted >> XFEATURE_XTILEDATA) & 1ul;
}

// The 64-byte tile configuration (palette 1).
struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];  // bytes per row of tile t
  uint8_t rows[16];    // rows of tile t
};
static_assert(sizeof(TileConfig) == 64, "AMX tile configuration is 64 bytes");

// Tiles 0-7 all 16 rows of 64 bytes: both kernels pad their remainders instead of configuring narrower
// tiles, so one configuration serves every call and shape.
static inline TileConfig full_tiles() {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  return cfg;
}

}  // namespace amx
