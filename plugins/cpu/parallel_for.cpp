#include "parallel_for.hpp"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

#include "kd_plugin.hpp"

namespace kdispatch::cpu {
namespace {

constexpr long kMaxThreads = 1024;

// CPUs this process may run on (a container or taskset may allow fewer than
// the machine has).
int cpus_of_process() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n >= 1) return n;
  }
  const unsigned n = std::thread::hardware_concurrency();
  return n >= 1 ? static_cast<int>(n) : 1;
}

// KDISPATCH_CPU_THREADS overrides, e.g. for benchmarks (empty is unset). A
// value that is not a whole number from 1 to kMaxThreads is ignored with a
// warning (kd_plugin::warn).
int thread_count_from_environment() {
  const int cpus = cpus_of_process();
  const char* env = secure_getenv("KDISPATCH_CPU_THREADS");
  if (env == nullptr || *env == '\0') return cpus;
  char* end = nullptr;
  errno = 0;
  const long n = std::strtol(env, &end, 10);
  if (end != env && *end == '\0' && errno == 0 && n >= 1 && n <= kMaxThreads) return static_cast<int>(n);
  kd_plugin::warn("KDISPATCH_CPU_THREADS='%s' is not a whole number from 1 to %ld; using %d (one per CPU this "
                  "process may run on)",
                  env, kMaxThreads, cpus);
  return cpus;
}

class ThreadPool {
 public:
  explicit ThreadPool(int threads) : owner_pid_(getpid()) {
    // A thread that cannot be created just leaves the pool smaller.
    try {
      workers_.reserve(static_cast<size_t>(threads - 1));
      for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { worker_loop(); });
    } catch (...) {
    }
  }

  int threads() const { return static_cast<int>(workers_.size()) + 1; }

  // Runs the job on the pool and the calling thread; false (nothing run) when
  // the pool is busy with another caller's job or unusable in this process.
  bool try_run(int64_t count, int64_t chunk, RangeCallback callback, void* context) {
    // A forked child inherits this object but none of its threads.
    if (getpid() != owner_pid_) return false;
    std::unique_lock<std::mutex> submit(submit_mutex_, std::try_to_lock);
    if (!submit.owns_lock()) return false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      callback_ = callback;
      context_ = context;
      count_ = count;
      chunk_ = chunk;
      next_.store(0, std::memory_order_relaxed);
      busy_workers_ = static_cast<int>(workers_.size());
      ++generation_;
    }
    wake_.notify_all();
    run_chunks();
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [this] { return busy_workers_ == 0; });
    return true;
  }

 private:
  void run_chunks() {
    for (;;) {
      const int64_t begin = next_.fetch_add(chunk_, std::memory_order_relaxed);
      if (begin >= count_) return;
      callback_(context_, begin, std::min(count_, begin + chunk_));
    }
  }

  void worker_loop() {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return generation_ != seen; });
        seen = generation_;
      }
      run_chunks();
      bool last = false;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        last = --busy_workers_ == 0;
      }
      if (last) done_.notify_one();
    }
  }

  const pid_t owner_pid_;
  std::vector<std::thread> workers_;
  std::mutex submit_mutex_;  // one job at a time
  std::mutex mutex_;         // guards the job fields and counters below
  std::condition_variable wake_;
  std::condition_variable done_;
  uint64_t generation_ = 0;
  int busy_workers_ = 0;
  RangeCallback callback_ = nullptr;
  void* context_ = nullptr;
  int64_t count_ = 0;
  int64_t chunk_ = 1;
  std::atomic<int64_t> next_{0};
};

// Created on first use and never destroyed: plugins are never unloaded, and
// joining threads from a static destructor at exit can hang.
ThreadPool& pool() {
  static ThreadPool* instance = new ThreadPool(thread_count_from_environment());
  return *instance;
}

}  // namespace

int parallel_threads() noexcept {
  try {
    return pool().threads();
  } catch (...) {
    return 1;
  }
}

void run_parallel(int64_t count, int64_t work_per_item, RangeCallback callback,
                  void* context) noexcept {
  if (count <= 0) return;
  const int64_t work = count * std::max<int64_t>(work_per_item, 1);
  if (count > 1 && work >= kParallelMinWork) {
    try {
      ThreadPool& p = pool();
      if (p.threads() > 1) {
        // A few chunks per thread balance uneven progress; chunks never drop
        // below the inline threshold's worth of work.
        const int64_t per_item = std::max<int64_t>(work_per_item, 1);
        const int64_t min_chunk = std::max<int64_t>(1, kParallelMinWork / 4 / per_item);
        const int64_t chunk =
            std::max(min_chunk, (count + 4 * p.threads() - 1) / (4 * p.threads()));
        if (p.try_run(count, chunk, callback, context)) return;
      }
    } catch (...) {
      // Threads could not be created: fall back to the calling thread.
    }
  }
  callback(context, 0, count);
}

}  // namespace kdispatch::cpu
