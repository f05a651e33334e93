// A program built against the installed kdispatch package only (find_package
// or pkg-config): calls layernorm.rmsnorm on its own buffers through the
// dispatcher, once as a user would (the cpu backend) and once on the
// installed reference backend, and checks that the two agree. The package
// installs no comparison function (the tests' harness is not part of it),
// so the agreement asked for is a loose 1e-5 relative: this checks the
// installation, the conformance suite checks the kernels.
#include <kdispatch/context.hpp>
#include <kdispatch/dispatcher.hpp>
#include <kdispatch/error.hpp>
#include <kdispatch/version.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <vector>

namespace {

DLTensor tensor_of(std::vector<float>& data, std::vector<int64_t>& shape) {
  DLTensor t{};
  t.data = data.data();
  t.device = {kDLCPU, 0};
  t.ndim = static_cast<int32_t>(shape.size());
  t.dtype = {kDLFloat, 32, 1};
  t.shape = shape.data();
  return t;
}

}  // namespace

int main() {
  constexpr int64_t rows = 7;
  constexpr int64_t hidden = 4097;
  constexpr double eps = 1e-5;
  std::mt19937 rng(20261201);
  std::uniform_real_distribution<float> dist(-2.0f, 2.0f);
  std::vector<float> x(rows * hidden), weight(hidden);
  std::vector<float> out(rows * hidden, std::numeric_limits<float>::quiet_NaN());  // poisoned
  std::vector<float> want(out);
  for (float& v : x) v = dist(rng);
  for (float& v : weight) v = dist(rng);
  std::vector<int64_t> matrix{rows, hidden}, vector{hidden};

  try {
    kdispatch::Context context;
    kdispatch::Dispatcher dispatch(context);
    auto rmsnorm = dispatch.op("layernorm.rmsnorm");
    rmsnorm({tensor_of(out, matrix), tensor_of(x, matrix), tensor_of(weight, vector)}, {{"eps", eps}});
    auto reference = dispatch.op("layernorm.rmsnorm", "reference");
    reference({tensor_of(want, matrix), tensor_of(x, matrix), tensor_of(weight, vector)}, {{"eps", eps}});
  } catch (const kdispatch::Error& e) {
    std::fprintf(stderr, "consumer: error[%s]: %s\n", e.code_string().c_str(), e.what());
    return 1;
  }

  double max_rel = 0.0;
  for (size_t i = 0; i < out.size(); ++i) {
    const double rel = std::fabs(double(out[i]) - want[i]) / std::max(std::fabs(double(want[i])), 1e-6);
    if (!(rel <= max_rel)) max_rel = std::isnan(rel) ? std::numeric_limits<double>::infinity() : rel;
  }
  const bool ok = max_rel < 1e-5;
  std::printf("consumer (kdispatch %s, built with %s): layernorm.rmsnorm %lldx%lld float32, cpu against the reference "
              "backend, max rel err %.2e: %s\n",
              kdispatch::version(), KDISPATCH_VERSION_STRING, static_cast<long long>(rows),
              static_cast<long long>(hidden), max_rel, ok ? "ok" : "MISMATCH");
  return ok ? 0 : 1;
}
