// Software prefetch for the row loops that stream large inputs.
//
// On some hosts (the 2-core VMs the benchmarks run on among them) the
// hardware prefetcher alone leaves the compute loops waiting for memory on
// inputs far larger than the caches; asking for the next block's lines while
// computing the current one hides that.
#pragma once

#include <cstdint>

namespace kdispatch::cpu {

inline constexpr int64_t kCacheLine = 64;

// Asks for the cache lines of `bytes` bytes starting `offset` bytes after
// `base`. A prefetch never faults, so the range may lie past the end of the
// data (the last block of the last row): the address is formed as an
// integer, not by pointer arithmetic.
[[gnu::always_inline]] inline void prefetch_range(const void* base, int64_t offset, int64_t bytes) {
  const uintptr_t start = reinterpret_cast<uintptr_t>(base) + static_cast<uintptr_t>(offset);
  for (int64_t b = 0; b < bytes; b += kCacheLine) {
    __builtin_prefetch(reinterpret_cast<const void*>(start + static_cast<uintptr_t>(b)), 0, 3);
  }
}

}  // namespace kdispatch::cpu
