// Splits row loops across a small persistent thread pool.
//
// Kernels call parallel_for for every call; small calls (and calls made while
// another thread holds the pool) run inline on the calling thread, so there is
// no thread hand-off cost where it would dominate and no oversubscription when
// the host calls kernels from several threads at once.
#pragma once

#include <cstdint>
#include <type_traits>

namespace kdispatch::cpu {

// Work below this many elements is not worth waking the pool for: the
// hand-off costs a few microseconds, the time to stream ~64K elements.
inline constexpr int64_t kParallelMinWork = int64_t{1} << 16;

using RangeCallback = void (*)(void* context, int64_t begin, int64_t end) noexcept;

// Calls callback(context, begin, end) on disjoint ranges covering
// [0, count), possibly from several threads at once, and returns when all are
// done. `work_per_item` (elements touched per item) decides whether threads
// are used at all. The callback must not throw.
void run_parallel(int64_t count, int64_t work_per_item, RangeCallback callback,
                  void* context) noexcept;

// Number of threads the pool uses, the calling thread included.
int parallel_threads() noexcept;

template <class Body>
void parallel_for(int64_t count, int64_t work_per_item, Body&& body) noexcept {
  using BodyT = std::remove_reference_t<Body>;
  static_assert(std::is_nothrow_invocable_v<BodyT&, int64_t, int64_t>,
                "parallel_for bodies must be noexcept(int64_t begin, int64_t end)");
  run_parallel(
      count, work_per_item,
      [](void* context, int64_t begin, int64_t end) noexcept {
        (*static_cast<BodyT*>(context))(begin, end);
      },
      const_cast<void*>(static_cast<const void*>(&body)));
}

}  // namespace kdispatch::cpu
