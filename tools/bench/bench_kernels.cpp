// Each cpu op at a large size against a memcpy moving the same bytes in the
// same run (performance target: kernel time <= 1.5x memcpy). A kernel that reads
// and writes B bytes in all is compared with memcpy of B/2 bytes, which also
// reads B/2 and writes B/2.
//
// The kernels run on the cpu plugin's thread pool, so the memcpy that the
// target compares them with runs on as many threads: the B/2 bytes split
// into one contiguous slice per thread (cache-line aligned), the slices
// copied at once by a persistent pool that sleeps between calls, as the
// plugin's does. The thread count follows the plugin's rule
// (kd_plugin::cpu_thread_count()): KDISPATCH_CPU_THREADS when it is a whole
// number from 1 to 1024, else one per CPU this process may run on. The table
// printed last gives both ratios: against that memcpy (the target's) and
// against a one-thread memcpy (what one core's bandwidth alone would give).
//
// By default every benchmark runs 5 times, the repetitions of all of them
// shuffled together, and the ratio is that of the medians: on a shared or
// virtual machine memory bandwidth and clock drift over a run, and a kernel
// and its memcpy timed seconds apart would see different machines. Passing
// --benchmark_repetitions or --benchmark_enable_random_interleaving
// overrides these defaults.
#include <benchmark/benchmark.h>
#include <fmt/format.h>

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <kdispatch/plugin_helpers.hpp>

#include "bench_defaults.hpp"
#include "harness.hpp"
#include "kdispatch/context.hpp"
#include "kdispatch/dispatcher.hpp"

using namespace kdispatch;

namespace {

// The threads the cpu plugin's pool runs its kernels on, by the plugin's
// rule (kd_plugin::cpu_thread_count() of <kdispatch/plugin_helpers.hpp>).
int kernel_threads() { return kd_plugin::cpu_thread_count(); }

std::string kernel_threads_source() {
  const char* env = std::getenv("KDISPATCH_CPU_THREADS");
  return env != nullptr && *env != '\0' ? fmt::format("KDISPATCH_CPU_THREADS={}", env)
                                         : std::string("one per CPU this process may use");
}

// memcpy split over a fixed number of threads: the caller copies the first
// slice, workers (woken per call, asleep in between) the others.
class ParallelMemcpy {
 public:
  explicit ParallelMemcpy(int threads) {
    for (int i = 1; i < threads; ++i) workers_.emplace_back([this, i] { worker(i); });
  }
  ~ParallelMemcpy() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : workers_) t.join();
  }
  int threads() const { return static_cast<int>(workers_.size()) + 1; }

  void operator()(char* dst, const char* src, size_t bytes) {
    {
      std::lock_guard lock(mutex_);
      dst_ = dst;
      src_ = src;
      bytes_ = bytes;
      pending_ = static_cast<int>(workers_.size());
      ++generation_;
    }
    wake_.notify_all();
    copy_slice(0);
    std::unique_lock lock(mutex_);
    done_.wait(lock, [this] { return pending_ == 0; });
  }

 private:
  // Slice i of threads(), its bounds rounded to 64 bytes.
  void copy_slice(int i) const {
    const size_t n = static_cast<size_t>(threads());
    const auto bound = [&](size_t k) { return std::min(bytes_, (bytes_ * k / n + 63) & ~size_t{63}); };
    const size_t begin = bound(static_cast<size_t>(i));
    const size_t end = i + 1 == threads() ? bytes_ : bound(static_cast<size_t>(i) + 1);
    if (end > begin) std::memcpy(dst_ + begin, src_ + begin, end - begin);
  }
  void worker(int i) {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
      }
      copy_slice(i);
      std::lock_guard lock(mutex_);
      if (--pending_ == 0) done_.notify_one();
    }
  }

  std::vector<std::thread> workers_;
  std::mutex mutex_;  // guards everything below; the job fields are read after a wake
  std::condition_variable wake_;
  std::condition_variable done_;
  uint64_t generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
  char* dst_ = nullptr;
  const char* src_ = nullptr;
  size_t bytes_ = 0;
};

std::unique_ptr<Context> g_context;
std::unique_ptr<Dispatcher> g_dispatch;
std::unique_ptr<ParallelMemcpy> g_memcpy;  // on kernel_threads() threads

// Records each benchmark's time so the ratio table can be printed last.
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  // Colours only on a terminal, as Google Benchmark's own console reporter.
  RatioReporter() : ConsoleReporter(isatty(STDOUT_FILENO) ? OO_Color : OO_None) {}

  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& r : runs) {
      // The median when repeated, else the one run.
      if (r.run_type == Run::RT_Aggregate && r.aggregate_name == "median") {
        times_[r.run_name.str()] = r.GetAdjustedRealTime();
      } else if (r.run_type == Run::RT_Iteration && r.repetitions <= 1) {
        times_[r.run_name.str()] = r.GetAdjustedRealTime();
      }
    }
  }
  void print_table() const {
    const int threads = g_memcpy->threads();
    fmt::print("\ncpu kernel threads: {} ({}); memcpy: one thread, and {} thread{}\n", threads,
               kernel_threads_source(), threads, threads == 1 ? "" : "s");
    fmt::print("{:<30} {:<9} {:>12} {:>12} {:>12} {:>9} {:>9}\n", "op", "dtype", "kernel_us", "memcpy1_us",
               fmt::format("memcpy{}_us", threads), "ratio_1", fmt::format("ratio_{}", threads));
    for (const auto& [name, t] : times_) {
      if (name.rfind("kernel/", 0) != 0) continue;
      const std::string rest = name.substr(7);
      const auto one = times_.find("memcpy/" + rest);
      if (one == times_.end()) continue;
      // With one kernel thread the one-thread memcpy is the same-threads one.
      const auto same = threads == 1 ? one : times_.find("memcpy_threads/" + rest);
      if (same == times_.end()) continue;
      // "<op>/<dtype>/min_time:.../real_time": the dtype is the second part.
      const auto slash = rest.find('/');
      const auto end = rest.find('/', slash + 1);
      fmt::print("{:<30} {:<9} {:>12.1f} {:>12.1f} {:>12.1f} {:>9.2f} {:>9.2f}\n", rest.substr(0, slash),
                 rest.substr(slash + 1, end == std::string::npos ? std::string::npos : end - slash - 1), t,
                 one->second, same->second, t / one->second, t / same->second);
    }
    fmt::print("ratio_1: kernel / one-thread memcpy; ratio_{}: kernel / memcpy on the kernel's {} thread{} "
               "(the performance target, <= 1.5)\n",
               threads, threads, threads == 1 ? "" : "s");
  }

 private:
  std::map<std::string, double> times_;
};

void register_op(const OpSchema& schema, Dtype dtype) {
  const std::string suffix = fmt::format("{}/{}", schema.op, dtype_name(dtype));
  const harness::Shapes shapes = schema.bench_sizes.value_or(harness::example_shapes(schema));
  auto data = std::make_shared<harness::CallData>(harness::make_call(schema, dtype, shapes, 7));
  const size_t bytes = data->bytes_moved(schema);
  benchmark::RegisterBenchmark(("kernel/" + suffix).c_str(), [data, op = schema.op, bytes](benchmark::State& st) {
    const OpHandle handle = g_dispatch->op(op, "cpu");
    std::vector<DLTensor> tensors = data->dl();
    for (auto _ : st) handle(tensors, data->attrs);
    st.SetBytesProcessed(static_cast<int64_t>(st.iterations() * bytes));
  })->Unit(benchmark::kMicrosecond)->UseRealTime()->MinTime(0.2);
  benchmark::RegisterBenchmark(("memcpy/" + suffix).c_str(), [bytes](benchmark::State& st) {
    std::vector<char> src(bytes / 2, 1);
    std::vector<char> dst(bytes / 2, 0);
    for (auto _ : st) {
      std::memcpy(dst.data(), src.data(), src.size());
      benchmark::ClobberMemory();
    }
    st.SetBytesProcessed(static_cast<int64_t>(st.iterations() * bytes));
  })->Unit(benchmark::kMicrosecond)->UseRealTime()->MinTime(0.2);
  if (g_memcpy->threads() == 1) return;
  benchmark::RegisterBenchmark(("memcpy_threads/" + suffix).c_str(), [bytes](benchmark::State& st) {
    std::vector<char> src(bytes / 2, 1);
    std::vector<char> dst(bytes / 2, 0);
    for (auto _ : st) {
      (*g_memcpy)(dst.data(), src.data(), src.size());
      benchmark::ClobberMemory();
    }
    st.SetBytesProcessed(static_cast<int64_t>(st.iterations() * bytes));
  })->Unit(benchmark::kMicrosecond)->UseRealTime()->MinTime(0.2);
}

// Takes --plugin-dir=DIR out of the command line: the folder the cpu plugin
// is loaded from (default: this build's), so that one benchmark program can
// time the plugins of several builds (tools/bench/compare_builds.py).
std::string take_plugin_dir(int& argc, char** argv) {
  std::string dir = KDISPATCH_PLUGIN_DIR;
  constexpr std::string_view kFlag = "--plugin-dir=";
  int kept = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg.starts_with(kFlag)) {
      dir = std::string(arg.substr(kFlag.size()));
    } else {
      argv[kept++] = argv[i];
    }
  }
  argc = kept;
  return dir;
}

}  // namespace

int main(int argc, char** argv) {
  ContextOptions options;
  options.search.replace = {take_plugin_dir(argc, argv)};
  options.search.use_environment = false;
  g_context = std::make_unique<Context>(options);
  g_dispatch = std::make_unique<Dispatcher>(*g_context);
  g_memcpy = std::make_unique<ParallelMemcpy>(kernel_threads());
  // Every op of the cpu backend at its schema's "bench" sizes, in each dtype
  // the kernel declares.
  for (const OpSchema* schema : g_context->registry().schemas()) {
    const KernelSpec* spec = g_context->registry().get_backend(schema->op, "cpu");
    if (spec == nullptr) continue;
    for (Dtype d : spec->dtypes) register_op(*schema, d);
  }
  // The defaults of bench_defaults.hpp (5 shuffled repetitions, medians),
  // unless the command line sets them.
  std::vector<char*> args;
  bench::add_default_flags(argc, argv, args);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  RatioReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  reporter.print_table();
  benchmark::Shutdown();
  return 0;
}
