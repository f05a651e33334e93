// fork() while another thread loads a plugin: the child can load plugins
// and run their kernels. The loading thread opens fx_ctor_loop, whose
// constructor never returns: the plugin scanner's helper process runs into
// its time limit, so that load lasts seconds. A child forked meanwhile loads
// fx_good from the same Context and runs its kernel; an alarm ends a child
// that blocks, so a deadlock fails the test instead of hanging it.
#include <doctest/doctest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>

#include "kdispatch/context.hpp"

using namespace kdispatch;

namespace {

// What the child does: 0 when fx_good loads and its kernel runs.
int load_and_call(Context& ctx) {
  try {
    const KernelSpec& spec = ctx.select({"fixture.scale", "fx_good", Device::host_cpu(), std::nullopt});
    const kd_kernel_fn fn = ctx.kernel(spec);
    float x[3] = {1.0f, -2.0f, 0.5f};
    float out[3] = {0, 0, 0};
    int64_t shape[1] = {3};
    DLTensor tensors[2] = {{out, {kDLCPU, 0}, 1, {kDLFloat, 32, 1}, shape, nullptr, 0},
                           {x, {kDLCPU, 0}, 1, {kDLFloat, 32, 1}, shape, nullptr, 0}};
    kd_attr factor{};
    factor.name = "factor";
    factor.type = KD_ATTR_TYPE_FLOAT;
    factor.value.f = 3.0;
    char error[256] = "";
    const kd_call_args args{sizeof(kd_call_args), tensors, 2, 1, &factor, nullptr, error, sizeof error, nullptr};
    if (fn(&args) != KD_STATUS_OK) return 2;
    return out[1] == -6.0f ? 0 : 3;
  } catch (...) {
    return 4;
  }
}

}  // namespace

TEST_CASE("fork: a child forked while another thread loads a plugin loads plugins and calls") {
  const std::filesystem::path fixtures = std::string(KDISPATCH_BINARY_DIR) + "/tests/fixtures";
  REQUIRE(std::filesystem::exists(fixtures / "hostile" / "fx_ctor_loop"));
  REQUIRE(std::filesystem::exists(fixtures / "plugins" / "fx_good"));
  ::setenv("KDISPATCH_SCAN", "always", 1);
  ::setenv("KDISPATCH_SCAN_TIMEOUT", "3", 1);
  ContextOptions options;
  options.search.use_environment = false;
  options.search.replace = {fixtures / "hostile" / "fx_ctor_loop", fixtures / "plugins" / "fx_good"};
  Context ctx(options);

  const auto started = std::chrono::steady_clock::now();
  std::thread loader([&ctx] {
    try {
      ctx.load_plugin("fx_ctor_loop");
    } catch (const PluginError&) {
      // KD-E027: it hung in the scanner, as it should.
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    ::alarm(20);
    ::_exit(load_and_call(ctx));
  }
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  loader.join();
  // The fork happened while the load was under way.
  CHECK(std::chrono::steady_clock::now() - started > std::chrono::seconds(2));
  CHECK_MESSAGE(!WIFSIGNALED(status), "the child was killed by signal " << WTERMSIG(status));
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  // The parent's own state is whole: the hung plugin failed, fx_good loads.
  REQUIRE(ctx.load_state("fx_ctor_loop").has_value());
  CHECK(ctx.load_state("fx_ctor_loop")->failure.has_value());
  CHECK(load_and_call(ctx) == 0);
  ::unsetenv("KDISPATCH_SCAN");
  ::unsetenv("KDISPATCH_SCAN_TIMEOUT");
}
