// When a parallel loop is worth waking the thread team for (decoder_ops.cpp, int8_common.h).
#pragma once

#include <algorithm>
#include <cstdint>

// The grain of an at::parallel_for over `rows` rows holding `values` values: one chunk below 64k values (waking
// the team costs more than the work), else `grain`.
inline int64_t grain_for(int64_t rows, int64_t values, int64_t grain = 1) {
  return values < (int64_t(1) << 16) ? std::max<int64_t>(rows, 1) : grain;
}
