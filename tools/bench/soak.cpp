// kdispatch-soak [CALLS]: checked calls through one Dispatcher, 10 million
// by default, on the do-nothing bench.noop kernel, cycling through six
// shapes (more than the schema check remembers, so the compiled plan runs
// too) with every thousandth call invalid (refused with KD-E030). Prints
// the process's resident memory after a warm-up and after the calls: a
// leak per call, on the accepted or the refused path, shows as growth.
#include <dlpack/dlpack.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "kdispatch/context.hpp"
#include "kdispatch/dispatcher.hpp"
#include "kdispatch/error.hpp"

namespace {

long rss_kib() {
  std::ifstream status("/proc/self/status");
  std::string key;
  while (status >> key) {
    if (key == "VmRSS:") {
      long kib = 0;
      status >> kib;
      return kib;
    }
    status.ignore(1 << 12, '\n');
  }
  return -1;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace kdispatch;
  const long calls = argc > 1 ? std::atol(argv[1]) : 10'000'000;
  ContextOptions options;
  options.search.use_environment = false;
  options.search.replace.push_back(KDISPATCH_BENCH_PLUGIN_DIR);
  Context ctx(options);
  Dispatcher dispatch(ctx);
  const OpHandle op = dispatch.op("bench.noop");

  std::vector<float> storage(64 * 64);
  std::array<std::array<int64_t, 2>, 6> shapes{{{1, 64}, {2, 64}, {4, 32}, {8, 16}, {16, 8}, {64, 64}}};
  std::array<int64_t, 1> weight_shape{};
  long refused = 0;
  const auto call = [&](long i) {
    auto& shape = shapes[static_cast<size_t>(i) % shapes.size()];
    weight_shape[0] = shape[1];
    DLTensor out{storage.data(), {kDLCPU, 0}, 2, {kDLFloat, 32, 1}, shape.data(), nullptr, 0};
    DLTensor x = out;
    DLTensor w{storage.data(), {kDLCPU, 0}, 1, {kDLFloat, 32, 1}, weight_shape.data(), nullptr, 0};
    if (i % 1000 == 999) w.dtype = {kDLFloat, 64, 1};
    std::array<DLTensor, 3> tensors{out, x, w};
    try {
      op(tensors);
    } catch (const CallError&) {
      ++refused;
    }
  };
  for (long i = 0; i < 100'000; ++i) call(i);
  const long before = rss_kib();
  const auto start = std::chrono::steady_clock::now();
  for (long i = 0; i < calls; ++i) call(i);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const long after = rss_kib();
  std::printf("%ld checked calls (%ld refused) in %.2f s, %.1f ns per call\n", calls, refused, seconds,
              seconds * 1e9 / static_cast<double>(calls));
  std::printf("RSS after warm-up %ld KiB, after the calls %ld KiB (%+ld KiB)\n", before, after, after - before);
  return 0;
}
