// Each cpu op at a large size against a memcpy moving the same bytes in the
// same run (DESIGN target: kernel time <= 1.5x memcpy). A kernel that reads
// and writes B bytes in all is compared with memcpy of B/2 bytes, which also
// reads B/2 and writes B/2.
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
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>
#include <map>
#include <memory>

#include "bench_defaults.hpp"
#include "harness.hpp"
#include "kdispatch/context.hpp"
#include "kdispatch/dispatcher.hpp"

using namespace kdispatch;

namespace {

// The threads the cpu kernels run on (the cpu plugin's pool decides; the
// memcpy runs on one), so that the table says what it compares.
std::string kernel_threads() {
  if (const char* env = std::getenv("KDISPATCH_CPU_THREADS")) {
    return fmt::format("KDISPATCH_CPU_THREADS={}", env);
  }
  return "one per CPU this process may use";
}

std::unique_ptr<Context> g_context;
std::unique_ptr<Dispatcher> g_dispatch;

// Records each benchmark's time so the ratio table can be printed last.
class RatioReporter : public benchmark::ConsoleReporter {
 public:
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
    fmt::print("\ncpu kernel threads: {}; memcpy: one thread\n", kernel_threads());
    fmt::print("{:<30} {:<9} {:>12} {:>12} {:>7}\n", "op", "dtype", "kernel_us", "memcpy_us", "ratio");
    for (const auto& [name, t] : times_) {
      if (name.rfind("kernel/", 0) != 0) continue;
      const std::string rest = name.substr(7);
      auto it = times_.find("memcpy/" + rest);
      if (it == times_.end()) continue;
      // "<op>/<dtype>/min_time:.../real_time": the dtype is the second part.
      const auto slash = rest.find('/');
      const auto end = rest.find('/', slash + 1);
      fmt::print("{:<30} {:<9} {:>12.1f} {:>12.1f} {:>7.2f}\n", rest.substr(0, slash),
                 rest.substr(slash + 1, end == std::string::npos ? std::string::npos : end - slash - 1), t, it->second,
                 t / it->second);
    }
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
