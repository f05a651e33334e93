// A program built against the installed kdispatch package only (find_package
// or pkg-config): calls layernorm.rmsnorm on its own buffers through the
// dispatcher and checks the result against a float64 loop.
#include <kdispatch/context.hpp>
#include <kdispatch/dispatcher.hpp>
#include <kdispatch/error.hpp>
#include <kdispatch/version.h>

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
  for (float& v : x) v = dist(rng);
  for (float& v : weight) v = dist(rng);
  std::vector<int64_t> matrix{rows, hidden}, vector{hidden};

  try {
    kdispatch::Context context;
    kdispatch::Dispatcher dispatch(context);
    auto rmsnorm = dispatch.op("layernorm.rmsnorm");
    rmsnorm({tensor_of(out, matrix), tensor_of(x, matrix), tensor_of(weight, vector)}, {{"eps", eps}});
  } catch (const kdispatch::Error& e) {
    std::fprintf(stderr, "consumer: error[%s]: %s\n", e.code_string().c_str(), e.what());
    return 1;
  }

  double max_rel = 0.0;
  for (int64_t r = 0; r < rows; ++r) {
    double sum = 0.0;
    for (int64_t j = 0; j < hidden; ++j) sum += double(x[r * hidden + j]) * x[r * hidden + j];
    const double scale = 1.0 / std::sqrt(sum / hidden + eps);
    for (int64_t j = 0; j < hidden; ++j) {
      const double want = double(x[r * hidden + j]) * scale * weight[j];
      const double got = out[r * hidden + j];
      const double rel = std::fabs(got - want) / std::max(std::fabs(want), 1e-6);
      if (!(rel <= max_rel)) max_rel = std::isnan(rel) ? std::numeric_limits<double>::infinity() : rel;
    }
  }
  const bool ok = max_rel < 1e-5;
  std::printf("consumer (kdispatch %s, built with %s): layernorm.rmsnorm %lldx%lld float32, max rel err %.2e: %s\n",
              kdispatch::version(), KDISPATCH_VERSION_STRING, static_cast<long long>(rows),
              static_cast<long long>(hidden), max_rel, ok ? "ok" : "MISMATCH");
  return ok ? 0 : 1;
}
