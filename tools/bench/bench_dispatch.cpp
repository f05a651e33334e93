// What dispatch costs per call, against a plain function-pointer call of a
// kernel that does nothing (performance targets: handle <= 1.2x direct; checked
// call, with and without attributes, <= direct + 25 ns; lookup by op-id
// string <= 30 ns). After the table, with the console output, one line per
// target compares the medians of this run (CPU time, which a neighbour's
// load moves less than wall time).
#include <benchmark/benchmark.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "bench_defaults.hpp"
#include "kdispatch/context.hpp"
#include "kdispatch/dispatcher.hpp"

using namespace kdispatch;

namespace {

struct Fixture {
  std::unique_ptr<Context> context;
  std::unique_ptr<Dispatcher> dispatch;
  std::array<float, 8 * 64> out{}, x{}, weight{};  // room for the [8, 64] calls
  std::array<int64_t, 2> shape2{4, 64};
  std::array<int64_t, 1> shape1{64};
  std::array<DLTensor, 3> tensors{};
  std::array<kd_attr, 1> attrs{};

  Fixture() {
    ContextOptions options;
    options.search.replace = {KDISPATCH_BENCH_PLUGIN_DIR};
    options.search.use_environment = false;
    context = std::make_unique<Context>(options);
    dispatch = std::make_unique<Dispatcher>(*context);
    const DLDataType f32{kDLFloat, 32, 1};
    const DLDevice cpu{kDLCPU, 0};
    x.fill(1.0f);
    weight.fill(1.0f);
    tensors[0] = DLTensor{out.data(), cpu, 2, f32, shape2.data(), nullptr, 0};
    tensors[1] = DLTensor{x.data(), cpu, 2, f32, shape2.data(), nullptr, 0};
    tensors[2] = DLTensor{weight.data(), cpu, 1, f32, shape1.data(), nullptr, 0};
    attrs[0].name = "eps";
    attrs[0].type = KD_ATTR_TYPE_FLOAT;
    attrs[0].value.f = 1e-6;
  }
};

Fixture& fixture() {
  static Fixture f;
  return f;
}

void BM_DirectCall(benchmark::State& state) {
  Fixture& f = fixture();
  const kd_kernel_fn fn = f.dispatch->op("bench.noop").resolve(f.tensors).function();
  char error[512];
  for (auto _ : state) {
    error[0] = '\0';
    const kd_call_args args{sizeof(kd_call_args), f.tensors.data(), 3, 1, f.attrs.data(), nullptr, error, sizeof error,
                            nullptr};
    // A real caller checks the status, as the handle does.
    if (fn(&args) != KD_STATUS_OK) state.SkipWithError("kernel failed");
    benchmark::ClobberMemory();
  }
}
BENCHMARK(BM_DirectCall);

void BM_HandleCall(benchmark::State& state) {
  Fixture& f = fixture();
  const KernelHandle kernel = f.dispatch->op("bench.noop").resolve(f.tensors);
  for (auto _ : state) {
    kernel(f.tensors, f.attrs);
    benchmark::ClobberMemory();
  }
}
BENCHMARK(BM_HandleCall);

// The checked benchmarks each call through a dispatcher of their own: an
// op's handle remembers the last few signatures it accepted, and the
// benchmarks' repetitions run interleaved, so that through a shared one
// BM_CheckedCall found its signature behind those BM_CheckedCallNewShape
// left (each one compared first), and timed the order of the benchmarks.
void BM_CheckedCall(benchmark::State& state) {
  Fixture& f = fixture();
  Dispatcher dispatch(*f.context);
  const OpHandle op = dispatch.op("bench.noop");
  for (auto _ : state) {
    op(f.tensors);
    benchmark::ClobberMemory();
  }
}
BENCHMARK(BM_CheckedCall);

// The checked call of an op whose kernel has constraints ("H % 8 == 0",
// "H <= 8192"), with the same shapes every call: they read only H, which
// the remembered signature fixes, so the kernel kept with it runs without
// evaluating them.
std::unique_ptr<Context> constrained_context(benchmark::State& state) {
  ContextOptions options;
  options.search.use_environment = false;
  options.search.use_default_path = false;
  auto context = std::make_unique<Context>(options);
  ManifestResult parsed = read_manifest(std::string(KDISPATCH_BENCH_PLUGIN_DIR) + "/bench_noop.json");
  if (!parsed.manifest) {
    state.SkipWithError("bench_noop.json does not parse");
    return nullptr;
  }
  parsed.manifest->kernels.at(0).constraints = {"H % 8 == 0", "H <= 8192"};
  context->add_manifest(*parsed.manifest);
  return context;
}

void BM_CheckedCallConstrained(benchmark::State& state) {
  Fixture& f = fixture();
  const std::unique_ptr<Context> context = constrained_context(state);
  if (!context) return;
  Dispatcher dispatch(*context);
  const OpHandle op = dispatch.op("bench.noop");
  for (auto _ : state) {
    op(f.tensors);
    benchmark::ClobberMemory();
  }
}
BENCHMARK(BM_CheckedCallConstrained);

// The same with the attribute given by name, as in BM_CheckedCallWithAttr.
void BM_CheckedCallConstrainedWithAttr(benchmark::State& state) {
  Fixture& f = fixture();
  const std::unique_ptr<Context> context = constrained_context(state);
  if (!context) return;
  Dispatcher dispatch(*context);
  const OpHandle op = dispatch.op("bench.noop");
  const NamedAttr eps[] = {{"eps", 1e-5}};
  for (auto _ : state) {
    op(f.tensors, eps);
    benchmark::ClobberMemory();
  }
}
BENCHMARK(BM_CheckedCallConstrainedWithAttr);

// Checked calls whose shapes change on every call, cycling through five
// ([4..8, 64]), one more than the check remembers: none repeats a recent
// signature, so each runs the whole compiled plan and records its own. The
// worst case of the check.
void BM_CheckedCallNewShape(benchmark::State& state) {
  Fixture& f = fixture();
  Dispatcher dispatch(*f.context);
  const OpHandle op = dispatch.op("bench.noop");
  std::array<std::array<int64_t, 2>, 5> shapes{{{4, 64}, {5, 64}, {6, 64}, {7, 64}, {8, 64}}};
  std::array<DLTensor, 3> tensors = f.tensors;
  size_t next = 0;
  for (auto _ : state) {
    tensors[0].shape = tensors[1].shape = shapes[next].data();
    next = next == shapes.size() - 1 ? 0 : next + 1;
    op(tensors);
    benchmark::ClobberMemory();
  }
}
BENCHMARK(BM_CheckedCallNewShape);

// The attribute given by name, with a value other than its default (a
// model's rmsnorm passes eps = 1e-5 against the schema's 1e-6).
void BM_CheckedCallWithAttr(benchmark::State& state) {
  Fixture& f = fixture();
  Dispatcher dispatch(*f.context);
  const OpHandle op = dispatch.op("bench.noop");
  const NamedAttr eps[] = {{"eps", 1e-5}};
  for (auto _ : state) {
    op(f.tensors, eps);
    benchmark::ClobberMemory();
  }
}
BENCHMARK(BM_CheckedCallWithAttr);

// Dispatcher::call: the op looked up by its id string on every call, then
// the checked call, without and with the attribute.
void BM_CallByName(benchmark::State& state) {
  Fixture& f = fixture();
  Dispatcher dispatch(*f.context);
  for (auto _ : state) {
    dispatch.call("bench.noop", f.tensors);
    benchmark::ClobberMemory();
  }
}
BENCHMARK(BM_CallByName);

void BM_CallByNameWithAttr(benchmark::State& state) {
  Fixture& f = fixture();
  Dispatcher dispatch(*f.context);
  const NamedAttr eps[] = {{"eps", 1e-5}};
  for (auto _ : state) {
    dispatch.call("bench.noop", f.tensors, eps);
    benchmark::ClobberMemory();
  }
}
BENCHMARK(BM_CallByNameWithAttr);

// The op's handle by its id string: what a caller that keeps no handle
// pays before the call itself.
void BM_LookupByName(benchmark::State& state) {
  Fixture& f = fixture();
  f.dispatch->op("bench.noop");  // interned before the loop
  for (auto _ : state) benchmark::DoNotOptimize(f.dispatch->op("bench.noop"));
}
BENCHMARK(BM_LookupByName);

// The selection rules alone, as Context::select applies them to every request
// (the dispatcher caches their result per op).
void BM_Select(benchmark::State& state) {
  Fixture& f = fixture();
  const SelectRequest request{"bench.noop", {}, Device::host_cpu(), Dtype::float32};
  for (auto _ : state) benchmark::DoNotOptimize(&f.context->select(request));
}
BENCHMARK(BM_Select);

// --- a real launch: a tiny CUDA kernel (rmsnorm of 1 x 128 bfloat16) -----------
// Registered only where the cuda plugin finds a device. Host time per call,
// synchronising every 256 calls so the launch queue never fills.
struct GpuFixture {
  std::unique_ptr<Context> context;
  std::unique_ptr<Dispatcher> dispatch;
  const kd_memory_api* memory = nullptr;
  std::array<int64_t, 2> shape2{1, 128};
  std::array<int64_t, 1> shape1{128};
  std::array<DLTensor, 3> tensors{};
  std::array<void*, 3> buffers{};
  std::array<kd_attr, 1> attrs{};
  bool ok = false;

  GpuFixture() {
    ContextOptions options;
    options.search.replace = {KDISPATCH_PLUGIN_DIR};
    options.search.use_environment = false;
    context = std::make_unique<Context>(options);
    dispatch = std::make_unique<Dispatcher>(*context);
    if (!context->registry().has("layernorm.rmsnorm", "cuda")) return;
    const PluginBinary* binary = nullptr;
    try {
      binary = &context->load_plugin("cuda");
    } catch (const Error&) {
      return;
    }
    if (binary->devices.empty() || binary->api->memory == nullptr) return;
    memory = binary->api->memory;
    const DLDataType bf16{kDLBfloat, 16, 1};
    const DLDevice gpu{kDLCUDA, 0};
    std::vector<uint16_t> host(128, 0x3f80);  // 1.0 in bfloat16
    char error[256];
    for (size_t i = 0; i < 3; ++i) {
      if (memory->alloc(0, 256, &buffers[i], error, sizeof error) != KD_STATUS_OK) return;
      memory->copy(0, buffers[i], host.data(), 256, KD_COPY_HOST_TO_DEVICE, error, sizeof error);
    }
    tensors[0] = DLTensor{buffers[0], gpu, 2, bf16, shape2.data(), nullptr, 0};
    tensors[1] = DLTensor{buffers[1], gpu, 2, bf16, shape2.data(), nullptr, 0};
    tensors[2] = DLTensor{buffers[2], gpu, 1, bf16, shape1.data(), nullptr, 0};
    attrs[0].name = "eps";
    attrs[0].type = KD_ATTR_TYPE_FLOAT;
    attrs[0].value.f = 1e-6;
    ok = true;
  }
  void sync() {
    char error[256];
    memory->synchronize(0, error, sizeof error);
  }
};

GpuFixture& gpu_fixture() {
  static GpuFixture f;
  return f;
}

void BM_CudaLaunchDirect(benchmark::State& state) {
  GpuFixture& f = gpu_fixture();
  const kd_kernel_fn fn = f.dispatch->op("layernorm.rmsnorm", "cuda").resolve(f.tensors).function();
  char error[512];
  size_t n = 0;
  for (auto _ : state) {
    error[0] = '\0';
    const kd_call_args args{sizeof(kd_call_args), f.tensors.data(), 3, 1, f.attrs.data(), nullptr, error, sizeof error,
                            nullptr};
    benchmark::DoNotOptimize(fn(&args));
    if (++n % 256 == 0) f.sync();
  }
  f.sync();
}

void BM_CudaLaunchHandle(benchmark::State& state) {
  GpuFixture& f = gpu_fixture();
  const KernelHandle kernel = f.dispatch->op("layernorm.rmsnorm", "cuda").resolve(f.tensors);
  size_t n = 0;
  for (auto _ : state) {
    kernel(f.tensors, f.attrs);
    if (++n % 256 == 0) f.sync();
  }
  f.sync();
}

void BM_CudaLaunchChecked(benchmark::State& state) {
  GpuFixture& f = gpu_fixture();
  const OpHandle op = f.dispatch->op("layernorm.rmsnorm");
  size_t n = 0;
  for (auto _ : state) {
    op(f.tensors);
    if (++n % 256 == 0) f.sync();
  }
  f.sync();
}

// Google Benchmark 1.7 marks a failed run error_occurred, 1.8 and later
// skipped (the GPU machine has 1.8).
template <class Run>
auto run_failed(const Run& run, int) -> decltype(bool(run.error_occurred)) {
  return run.error_occurred;
}
template <class Run>
auto run_failed(const Run& run, long) -> decltype(static_cast<int>(run.skipped) != 0) {
  return static_cast<int>(run.skipped) != 0;
}

// The console table, then the performance targets checked against this run's
// medians (CPU time per call).
class TargetReporter : public benchmark::ConsoleReporter {
 public:
  // Colours only on a terminal, as Google Benchmark's own console reporter.
  TargetReporter() : ConsoleReporter(isatty(STDOUT_FILENO) ? OO_Color : OO_None) {}

  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& run : runs) {
      if (run_failed(run, 0)) continue;
      const std::string name = run.run_name.str();
      if (run.run_type == Run::RT_Aggregate) {
        if (run.aggregate_name == "median") medians_[name] = run.GetAdjustedCPUTime();
      } else {
        samples_[name].push_back(run.GetAdjustedCPUTime());
      }
    }
  }

  void Finalize() override {
    ConsoleReporter::Finalize();
    const auto ns = [&](const std::string& name) -> double {
      if (auto it = medians_.find(name); it != medians_.end()) return it->second;
      auto it = samples_.find(name);
      if (it == samples_.end() || it->second.empty()) return -1;
      std::vector<double> v = it->second;
      std::sort(v.begin(), v.end());
      return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
    };
    const double direct = ns("BM_DirectCall");
    if (direct < 0) return;
    std::printf("\nPerformance targets, medians of CPU time per call (direct call %.2f ns):\n", direct);
    const auto ratio = [&](const char* name, const char* what, double limit) {
      if (const double t = ns(name); t >= 0) {
        std::printf("  %-34s %6.2f ns = %.2fx direct  (target <= %.1fx)  %s\n", what, t, t / direct, limit,
                    t / direct <= limit ? "ok" : "MISSED");
      }
    };
    const auto over = [&](const char* name, const char* what, double limit) {
      if (const double t = ns(name); t >= 0) {
        std::printf("  %-34s %6.2f ns = direct + %.2f ns  (target <= + %.0f ns)  %s\n", what, t, t - direct, limit,
                    t - direct <= limit ? "ok" : "MISSED");
      }
    };
    const auto below = [&](const char* name, const char* what, double limit) {
      if (const double t = ns(name); t >= 0) {
        std::printf("  %-34s %6.2f ns  (target <= %.0f ns)  %s\n", what, t, limit, t <= limit ? "ok" : "MISSED");
      }
    };
    ratio("BM_HandleCall", "handle call", 1.2);
    over("BM_CheckedCall", "checked call", 25);
    over("BM_CheckedCallWithAttr", "checked call with an attribute", 25);
    over("BM_CheckedCallConstrained", "checked call, constrained kernel", 25);
    over("BM_CheckedCallConstrainedWithAttr", "the same with an attribute", 25);
    below("BM_LookupByName", "lookup by op-id string", 30);
  }

 private:
  std::map<std::string, double> medians_;
  std::map<std::string, std::vector<double>> samples_;
};

}  // namespace

int main(int argc, char** argv) {
  // Discovery, manifest parsing and the first resolution happen here, not in
  // the first benchmark's timing (or instruction count).
  Fixture& f = fixture();
  f.dispatch->op("bench.noop")(f.tensors);
  if (gpu_fixture().ok) {
    benchmark::RegisterBenchmark("BM_CudaLaunchDirect", BM_CudaLaunchDirect)->UseRealTime();
    benchmark::RegisterBenchmark("BM_CudaLaunchHandle", BM_CudaLaunchHandle)->UseRealTime();
    benchmark::RegisterBenchmark("BM_CudaLaunchChecked", BM_CudaLaunchChecked)->UseRealTime();
  }
  // The defaults of bench_defaults.hpp (5 shuffled repetitions, medians),
  // unless the command line sets them.
  std::vector<char*> args;
  bench::add_default_flags(argc, argv, args);
  // The targets are printed under the console table only; another
  // --benchmark_format gets Google Benchmark's own reporter.
  const bool console = std::none_of(argv + 1, argv + argc, [](const char* a) {
    const std::string_view arg(a);
    return arg.starts_with("--benchmark_format=") && arg != "--benchmark_format=console";
  });
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  if (console) {
    TargetReporter reporter;
    benchmark::RunSpecifiedBenchmarks(&reporter);
  } else {
    benchmark::RunSpecifiedBenchmarks();
  }
  benchmark::Shutdown();
  return 0;
}
