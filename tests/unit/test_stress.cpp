// Many threads at once on one Context and Dispatcher while the cpu plugin is
// loaded for the first time (through the plugin scanner where it is built):
// checked calls of random ops, shapes and invalid arguments. Every valid
// call's result is the reference backend's (within the op schema's
// tolerances), every invalid one is refused with KD-E030, and the plugin is
// loaded once. Meant for the tsan preset as much as the others.
#include <doctest/doctest.h>

#include <atomic>
#include <cmath>
#include <random>
#include <thread>
#include <vector>

#include "harness.hpp"
#include "kdispatch/context.hpp"
#include "kdispatch/dispatcher.hpp"
#include "kdispatch/error.hpp"

using namespace kdispatch;

namespace {

constexpr int kThreads = 16;
constexpr int kCallsPerThread = 300;

DLTensor tensor(std::vector<float>& data, std::vector<int64_t>& shape) {
  return DLTensor{data.empty() ? nullptr : data.data(),
                  {kDLCPU, 0},
                  static_cast<int32_t>(shape.size()),
                  {kDLFloat, 32, 1},
                  shape.data(),
                  nullptr,
                  0};
}

struct Counts {
  std::atomic<int> valid{0}, refused{0}, wrong{0};
};

// One random call of rmsnorm or silu_and_mul, valid or broken in one way.
void one_call(Dispatcher& dispatch, std::mt19937& rng, Counts& counts) {
  const int64_t rows = 1 + static_cast<int64_t>(rng() % 5);
  const int64_t dims[] = {1, 7, 64, 129};
  const int64_t h = dims[rng() % 4];
  const int broken = static_cast<int>(rng() % 8);  // 0..3: one kind of bad argument; else valid
  std::uniform_real_distribution<float> value(-2.0f, 2.0f);
  const bool rms = rng() % 2 == 0;
  std::vector<int64_t> out_shape{rows, h}, x_shape{rows, rms ? h : 2 * h}, w_shape{h};
  std::vector<float> out(static_cast<size_t>(rows * h), NAN), x(static_cast<size_t>(rows * (rms ? h : 2 * h))),
      w(static_cast<size_t>(h));
  for (float& v : x) v = value(rng);
  for (float& v : w) v = value(rng);
  if (broken == 0) x_shape[1] += 1;       // a dim that disagrees
  if (broken == 1) out_shape[0] = -rows;  // a negative dim
  std::vector<float> none;
  DLTensor t_out = tensor(broken == 2 ? none : out, out_shape);  // null data
  DLTensor t_x = tensor(x, x_shape);
  DLTensor t_w = tensor(w, w_shape);
  if (broken == 3) t_x.dtype = {kDLFloat, 64, 1};  // a dtype the op does not take
  const char* op = rms ? "layernorm.rmsnorm" : "activation.silu_and_mul";
  std::vector<DLTensor> args{t_out, t_x, t_w};
  if (!rms) args.pop_back();
  try {
    dispatch.op(op)(args);
  } catch (const CallError& e) {
    (broken < 4 && e.code() == ErrorCode::bad_arguments ? counts.refused : counts.wrong)++;
    return;
  }
  if (broken < 4) {
    counts.wrong++;
    return;
  }
  // The same inputs through the reference backend.
  std::vector<float> want_out(out.size(), NAN);
  std::vector<DLTensor> want = args;
  want[0].data = want_out.data();
  dispatch.op(op, "reference")(want);
  const OpHandle handle = dispatch.op(op);
  (harness::compare(handle.schema(), args, want).ok ? counts.valid : counts.wrong)++;
}

}  // namespace

TEST_CASE("stress: 16 threads of checked calls, valid and invalid, while the plugin loads lazily") {
  ContextOptions options;
  options.search.use_environment = false;
  options.search.replace.push_back(KDISPATCH_PLUGIN_DIR);
  options.search.select = {"cpu", "reference"};
  Context ctx(options);
  REQUIRE_FALSE(ctx.load_state("cpu").has_value());  // nothing opened yet
  Dispatcher dispatch(ctx);
  Counts counts;
  std::atomic<bool> go{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(static_cast<unsigned>(1234 + t));
      while (!go.load()) std::this_thread::yield();
      for (int i = 0; i < kCallsPerThread; ++i) one_call(dispatch, rng, counts);
    });
  }
  go = true;
  for (auto& th : threads) th.join();
  CHECK(counts.wrong.load() == 0);
  CHECK(counts.valid.load() > 0);
  CHECK(counts.refused.load() > 0);
  CHECK(counts.valid.load() + counts.refused.load() == kThreads * kCallsPerThread);
  // Loaded once: every thread saw the same binary, and asking again opens nothing new.
  const auto state = ctx.load_state("cpu");
  REQUIRE(state.has_value());
  REQUIRE(state->binary != nullptr);
  CHECK(&ctx.load_plugin("cpu") == state->binary);
}
