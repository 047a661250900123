// When a parallel loop is worth waking the thread team for (decoder_ops.cpp, int8_common.h).
#pragma once

#include <algorithm>
#include <cstdint>

// The grain of an at::parallel_for over `rows` rows holding `values` values in all: below ~64k values one thread
// beats waking the team (the fork and join cost more than the work), so the whole range is one chunk; else `grain`.
inline int64_t grain_for(int64_t rows, int64_t values, int64_t grain = 1) {
  return values < (int64_t(1) << 16) ? std::max<int64_t>(rows, 1) : grain;
}
