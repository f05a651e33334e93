// The selection rules of DESIGN.md section 4, including the cases of SGLang's
// kernel-registry tests.
#include <doctest/doctest.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "kdispatch/error.hpp"
#include "kdispatch/logging.hpp"
#include "kdispatch/registry.hpp"
#include "kdispatch/selector.hpp"

using namespace kdispatch;

namespace {

Target cuda_target(std::optional<std::string> min_arch, std::optional<std::string> max_arch = std::nullopt) {
  Target t;
  t.device = DeviceType::cuda;
  if (min_arch) t.min_arch = CudaArch::parse(*min_arch);
  if (max_arch) t.max_arch = CudaArch::parse(*max_arch);
  return t;
}

Target cpu_target() { return Target{DeviceType::cpu, {}, {}, {}, {}}; }

Target hip_target(std::vector<std::string> archs) { return Target{DeviceType::hip, {}, {}, std::move(archs), {}}; }

KernelSpec spec(std::string op, std::string backend, std::vector<Target> targets,
                std::vector<Dtype> dtypes = {}) {
  KernelSpec s;
  s.op = std::move(op);
  s.backend = backend;
  s.plugin = backend;
  s.symbol = "kd_" + backend + "_kernel";
  s.targets = std::move(targets);
  s.dtypes = std::move(dtypes);
  s.manifest = backend + ".json";
  return s;
}

SelectRequest req(std::string_view op, std::string_view device, std::string_view backend = {},
                  std::optional<Dtype> dtype = std::nullopt) {
  return SelectRequest{op, backend, Device::parse(device), dtype};
}

// Runs `f`, expecting a kdispatch::Error with `code`; returns its message.
template <class F>
std::string error_of(F&& f, ErrorCode code) {
  try {
    f();
  } catch (const Error& e) {
    CHECK_MESSAGE(e.code() == code, "got " << e.code_string() << ": " << e.what());
    return e.what();
  }
  FAIL("no error thrown, expected " << code_string(code));
  return {};
}

struct CaptureLog {
  std::vector<std::string> lines;
  CaptureLog() {
    set_log_sink([this](LogLevel, std::string_view m) { lines.emplace_back(m); });
  }
  ~CaptureLog() { set_log_sink({}); }
};

}  // namespace

TEST_CASE("a single eligible backend resolves without naming it") {
  KernelRegistry reg;
  reg.add(spec("layernorm.rmsnorm", "cuda", {cuda_target("8.0")}));
  Selector sel(reg);
  CHECK(sel.select(req("layernorm.rmsnorm", "cuda:9.0")).backend == "cuda");
}

TEST_CASE("unknown op raises KD-E001 with did-you-mean") {
  KernelRegistry reg;
  reg.add(spec("layernorm.rmsnorm", "cpu", {cpu_target()}));
  Selector sel(reg);
  const std::string msg =
      error_of([&] { sel.select(req("layernorm.rmsnrom", "cpu")); }, ErrorCode::unknown_op);
  CHECK(msg == "No kernels registered for op 'layernorm.rmsnrom'");
  try {
    sel.select(req("layernorm.rmsnrom", "cpu"));
  } catch (const Error& e) {
    REQUIRE(!e.hints().empty());
    CHECK(e.hints()[0] == "did you mean 'layernorm.rmsnorm'?");
  }
}

TEST_CASE("unknown backend raises KD-E002 naming the registered ones") {
  KernelRegistry reg;
  reg.add(spec("layernorm.rmsnorm", "cpu", {cpu_target()}));
  reg.add(spec("layernorm.rmsnorm", "cuda", {cuda_target("9.0")}));
  Selector sel(reg);
  const std::string msg =
      error_of([&] { sel.select(req("layernorm.rmsnorm", "cpu", "triton")); }, ErrorCode::backend_not_registered);
  CHECK(msg == "No 'triton' backend registered for op 'layernorm.rmsnorm' (registered: [cpu, cuda])");
}

TEST_CASE("KD-E002 says why a plugin declaring the backend did not load") {
  KernelRegistry reg;
  reg.add(spec("layernorm.rmsnorm", "cpu", {cpu_target()}));
  reg.record_failure({"cuda", "cuda", "/p/cuda.json", {"layernorm.rmsnorm"},
                      Problem{ErrorCode::manifest_bad_library_path, "/p/cuda.json",
                              "library not found: /p/libkdispatch-cuda.so"}});
  Selector sel(reg);
  const std::string msg =
      error_of([&] { sel.select(req("layernorm.rmsnorm", "cpu", "cuda")); }, ErrorCode::backend_not_registered);
  CHECK(msg.starts_with("No 'cuda' backend registered for op 'layernorm.rmsnorm' (registered: [cpu])"));
  CHECK(msg.find("plugin 'cuda' (/p/cuda.json) was not loaded: [KD-E012] library not found: "
                 "/p/libkdispatch-cuda.so") != std::string::npos);
}

TEST_CASE("a plugin whose invalid manifest declares the op is named in KD-E001, E002 and E003") {
  KernelRegistry reg;
  reg.add(spec("layernorm.rmsnorm", "cpu", {cpu_target()}));
  PluginFailure invalid{"cuda", "cuda", "/p/cuda.json", {"layernorm.rmsnorm", "moe.topk_softmax"},
                        Problem{ErrorCode::manifest_bad_field, "/p/cuda.json",
                                "/p/cuda.json: /kernels/0/dtypes/0: expected a dtype name, found \"floatt32\""}};
  invalid.manifest_invalid = true;
  invalid.more_problems = 2;
  reg.record_failure(invalid);
  Selector sel(reg);
  const std::string says =
      "plugin 'cuda' declares backend 'cuda' for this op but its manifest /p/cuda.json is invalid: [KD-E011] "
      "/kernels/0/dtypes/0: expected a dtype name, found \"floatt32\" (and 2 more problems)";
  CHECK(error_of([&] { sel.select(req("layernorm.rmsnorm", "cpu", "cuda")); }, ErrorCode::backend_not_registered) ==
        "No 'cuda' backend registered for op 'layernorm.rmsnorm' (registered: [cpu]): " + says);
  CHECK(error_of([&] { sel.select(req("layernorm.rmsnorm", "cuda:9.0")); }, ErrorCode::no_usable_backend) ==
        "op 'layernorm.rmsnorm' has no backend usable on device 'cuda:9.0' (registered: [cpu]): cpu: targets cpu, "
        "not cuda; " + says);
  CHECK(error_of([&] { sel.select(req("moe.topk_softmax", "cuda:9.0")); }, ErrorCode::unknown_op) ==
        "No kernels registered for op 'moe.topk_softmax': " + says);
  // For an op it does not declare, it is one failed plugin among others.
  try {
    sel.select(req("layernorm.rmsnrom", "cpu"));
    FAIL("no error");
  } catch (const Error& e) {
    CHECK(e.message() == "No kernels registered for op 'layernorm.rmsnrom'");
    REQUIRE(e.hints().size() == 2);
    CHECK(e.hints()[0] == "did you mean 'layernorm.rmsnorm'?");
    CHECK(e.hints()[1] ==
          "plugin 'cuda' (/p/cuda.json) was not loaded: [KD-E011] /p/cuda.json: /kernels/0/dtypes/0: expected a "
          "dtype name, found \"floatt32\" (and 2 more problems)");
  }
}

TEST_CASE("two backends usable on cuda:9.0 raise KD-E004 and resolve once one is named") {
  KernelRegistry reg;
  reg.add(spec("layernorm.rmsnorm", "cuda", {cuda_target("8.0")}));
  reg.add(spec("layernorm.rmsnorm", "triton", {cuda_target("7.5")}));
  Selector sel(reg);
  const std::string msg = error_of([&] { sel.select(req("layernorm.rmsnorm", "cuda:9.0")); },
                                   ErrorCode::ambiguous_backend);
  CHECK(msg ==
        "op 'layernorm.rmsnorm' has multiple backends usable on device 'cuda:9.0' ([cuda, triton]); pass "
        "backend=... to choose one");
  CHECK(sel.select(req("layernorm.rmsnorm", "cuda:9.0", "triton")).backend == "triton");
  CHECK(sel.select(req("layernorm.rmsnorm", "cuda:9.0", "cuda")).backend == "cuda");
}

TEST_CASE("an arch window [9.0, -] rejects cuda:8.0 and accepts cuda:10.0") {
  KernelRegistry reg;
  reg.add(spec("attention.decode", "cuda", {cuda_target("9.0")}));
  Selector sel(reg);
  CHECK(sel.select(req("attention.decode", "cuda:10.0")).backend == "cuda");
  CHECK(sel.select(req("attention.decode", "cuda:9.0")).backend == "cuda");
  const std::string msg =
      error_of([&] { sel.select(req("attention.decode", "cuda:8.0")); }, ErrorCode::no_usable_backend);
  CHECK(msg.starts_with("op 'attention.decode' has no backend usable on device 'cuda:8.0' (registered: [cuda])"));
  CHECK(msg.find("needs cuda arch >= 9.0, device has 8.0") != std::string::npos);
}

TEST_CASE("an inclusive upper bound") {
  KernelRegistry reg;
  reg.add(spec("x.y", "cuda", {cuda_target("8.0", "9.0")}));
  Selector sel(reg);
  CHECK(sel.select(req("x.y", "cuda:9.0")).backend == "cuda");
  CHECK(sel.select(req("x.y", "cuda:8.0")).backend == "cuda");
  error_of([&] { sel.select(req("x.y", "cuda:10.0")); }, ErrorCode::no_usable_backend);
  // A device whose arch is unknown cannot satisfy an arch window.
  error_of([&] { sel.select(req("x.y", "cuda")); }, ErrorCode::no_usable_backend);
}

TEST_CASE("CPU and HIP platforms") {
  KernelRegistry reg;
  reg.add(spec("activation.silu_and_mul", "cpu", {cpu_target()}));
  reg.add(spec("activation.silu_and_mul", "hip", {hip_target({"gfx90a", "gfx1030"})}));
  Selector sel(reg);
  CHECK(sel.select(req("activation.silu_and_mul", "cpu")).backend == "cpu");
  CHECK(sel.select(req("activation.silu_and_mul", "hip:gfx90a")).backend == "hip");
  CHECK(sel.select(req("activation.silu_and_mul", "hip:gfx1030")).backend == "hip");
  const std::string msg =
      error_of([&] { sel.select(req("activation.silu_and_mul", "hip:gfx942")); }, ErrorCode::no_usable_backend);
  CHECK(msg.find("hip: needs hip arch in [gfx90a, gfx1030], device has gfx942") != std::string::npos);
  CHECK(msg.find("cpu: targets cpu, not hip") != std::string::npos);
}

TEST_CASE("CPU feature requirements") {
  KernelRegistry reg;
  reg.add(spec("x.y", "cpu_fancy", {Target{DeviceType::cpu, {}, {}, {}, {"no_such_feature"}}}));
  Selector sel(reg);
  const std::string msg = error_of([&] { sel.select(req("x.y", "cpu")); }, ErrorCode::no_usable_backend);
  CHECK(msg.find("needs cpu feature 'no_such_feature'") != std::string::npos);
}

TEST_CASE("OR over several targets and no targets means any device") {
  KernelRegistry reg;
  reg.add(spec("x.multi", "portable", {cpu_target(), cuda_target("9.0"), hip_target({"gfx90a"})}));
  reg.add(spec("x.any", "generic", {}));
  Selector sel(reg);
  for (const char* dev : {"cpu", "cuda:9.0", "cuda:12.0", "hip:gfx90a"}) {
    CHECK(sel.select(req("x.multi", dev)).backend == "portable");
    CHECK(sel.select(req("x.any", dev)).backend == "generic");
  }
  const std::string msg = error_of([&] { sel.select(req("x.multi", "cuda:8.6")); }, ErrorCode::no_usable_backend);
  CHECK(msg.find("targets cpu, not cuda; needs cuda arch >= 9.0, device has 8.6; targets hip, not cuda") !=
        std::string::npos);
}

TEST_CASE("a single registered CUDA-only backend on cpu raises KD-E003, not silently chosen") {
  KernelRegistry reg;
  reg.add(spec("layernorm.rmsnorm", "cuda", {cuda_target("9.0")}));
  Selector sel(reg);
  const std::string msg =
      error_of([&] { sel.select(req("layernorm.rmsnorm", "cpu")); }, ErrorCode::no_usable_backend);
  CHECK(msg == "op 'layernorm.rmsnorm' has no backend usable on device 'cpu' (registered: [cuda]): cuda: targets "
               "cuda, not cpu");
}

TEST_CASE("a named backend that is registered but not usable raises KD-E006") {
  KernelRegistry reg;
  reg.add(spec("layernorm.rmsnorm", "cuda", {cuda_target("9.0")}));
  reg.add(spec("layernorm.rmsnorm", "cpu", {cpu_target()}));
  Selector sel(reg);
  const std::string msg = error_of([&] { sel.select(req("layernorm.rmsnorm", "cpu", "cuda")); },
                                   ErrorCode::backend_not_usable);
  CHECK(msg.find("targets cuda, not cpu") != std::string::npos);
}

TEST_CASE("dtype gates eligibility and KD-E031 when the backend is named") {
  KernelRegistry reg;
  reg.add(spec("x.y", "cpu", {cpu_target()}, {Dtype::float32}));
  reg.add(spec("x.y", "cpu_half", {cpu_target()}, {Dtype::float16, Dtype::bfloat16}));
  Selector sel(reg);
  CHECK(sel.select(req("x.y", "cpu", {}, Dtype::float32)).backend == "cpu");
  CHECK(sel.select(req("x.y", "cpu", {}, Dtype::bfloat16)).backend == "cpu_half");
  const std::string msg =
      error_of([&] { sel.select(req("x.y", "cpu", "cpu", Dtype::float16)); }, ErrorCode::dtype_not_supported);
  CHECK(msg.find("does not support dtype float16 (supports [float32])") != std::string::npos);
  error_of([&] { sel.select(req("x.y", "cpu", {}, Dtype::int32)); }, ErrorCode::no_usable_backend);
}

TEST_CASE("forced backend wins when eligible and warns once and falls back when not") {
  KernelRegistry reg;
  reg.add(spec("x.y", "cuda", {cuda_target("9.0")}));
  reg.add(spec("x.y", "cpu", {cpu_target()}));
  reg.add(spec("x.y", "triton", {cuda_target("8.0")}));
  SUBCASE("eligible") {
    Selector sel(reg, SelectorOptions{"triton", {}});
    CHECK(sel.select(req("x.y", "cuda:9.0")).backend == "triton");
  }
  SUBCASE("not eligible: warning once, then the normal rules") {
    CaptureLog capture;
    Selector sel(reg, SelectorOptions{"cuda", {}});
    CHECK(sel.select(req("x.y", "cpu")).backend == "cpu");
    CHECK(sel.select(req("x.y", "cpu")).backend == "cpu");
    REQUIRE(capture.lines.size() == 1);
    CHECK(capture.lines[0].find("KDISPATCH_FORCE_BACKEND=cuda is not usable for op 'x.y'") != std::string::npos);
  }
  SUBCASE("an explicit backend beats the forced one") {
    Selector sel(reg, SelectorOptions{"triton", {}});
    CHECK(sel.select(req("x.y", "cuda:9.0", "cuda")).backend == "cuda");
  }
}

TEST_CASE("a reference kernel runs only when named or forced") {
  KernelRegistry reg;
  KernelSpec ref = spec("x.y", "reference", {cpu_target()});
  ref.role = KernelRole::reference;
  reg.add(ref);
  SUBCASE("alone it is not the one usable backend: KD-E003 says why") {
    Selector sel(reg);
    const std::string message = error_of([&] { sel.select(req("x.y", "cpu")); }, ErrorCode::no_usable_backend);
    CHECK(message.find("reference: a reference kernel, which runs only when named") != std::string::npos);
  }
  SUBCASE("beside one backend it makes no call ambiguous") {
    reg.add(spec("x.y", "cpu", {cpu_target()}));
    Selector sel(reg);
    CHECK(sel.select(req("x.y", "cpu")).backend == "cpu");
    SUBCASE("nor does a preference order pick it") {
      Selector ordered(reg, SelectorOptions{{}, {"reference", "cpu"}});
      CHECK(ordered.select(req("x.y", "cpu")).backend == "cpu");
    }
  }
  SUBCASE("beside two backends the call stays ambiguous between those two") {
    reg.add(spec("x.y", "cpu", {cpu_target()}));
    reg.add(spec("x.y", "fast", {cpu_target()}));
    Selector sel(reg);
    const std::string message = error_of([&] { sel.select(req("x.y", "cpu")); }, ErrorCode::ambiguous_backend);
    CHECK(message.find("([cpu, fast])") != std::string::npos);
  }
  SUBCASE("named, it runs") {
    reg.add(spec("x.y", "cpu", {cpu_target()}));
    Selector sel(reg);
    CHECK(sel.select(req("x.y", "cpu", "reference")).backend == "reference");
  }
  SUBCASE("forced, it runs where it is usable") {
    reg.add(spec("x.y", "cpu", {cpu_target()}));
    reg.add(spec("x.y", "cuda", {cuda_target("9.0")}));
    Selector sel(reg, SelectorOptions{"reference", {}});
    CHECK(sel.select(req("x.y", "cpu")).backend == "reference");
    CHECK(sel.select(req("x.y", "cuda:9.0")).backend == "cuda");  // not usable there: the normal rules
  }
  SUBCASE("the registry names it as the op's reference") {
    reg.add(spec("x.y", "cpu", {cpu_target()}));
    REQUIRE(reg.reference("x.y") != nullptr);
    CHECK(reg.reference("x.y")->backend == "reference");
    CHECK(reg.reference("x.z") == nullptr);
  }
}

TEST_CASE("a preference order breaks ties, and only ties") {
  KernelRegistry reg;
  reg.add(spec("x.y", "cuda", {cuda_target("9.0")}));
  reg.add(spec("x.y", "triton", {cuda_target("8.0")}));
  reg.add(spec("x.y", "cpu", {cpu_target()}));
  Selector sel(reg, SelectorOptions{{}, {"triton", "cuda"}});
  CHECK(sel.select(req("x.y", "cuda:9.0")).backend == "triton");
  CHECK(sel.select(req("x.y", "cpu")).backend == "cpu");  // single eligible: not in the order, still wins
  Selector sel2(reg, SelectorOptions{{}, {"hip"}});      // order names none of the tied ones
  error_of([&] { sel2.select(req("x.y", "cuda:9.0")); }, ErrorCode::ambiguous_backend);
}

TEST_CASE("ranking: each rule decides in its turn and says so, with the ranked candidates") {
  KernelRegistry reg;
  KernelSpec cuda = spec("x.y", "cuda", {cuda_target("9.0")});
  KernelSpec triton = spec("x.y", "triton", {cuda_target("8.0")});
  KernelSpec torch = spec("x.y", "torch", {});
  cuda.priority = 10;
  triton.priority = 5;
  torch.priority = 5;
  reg.add(cuda);
  reg.add(triton);
  reg.add(torch);
  const auto names = [](const Selection& s) {
    std::vector<std::string> out;
    for (const KernelSpec* k : s.ranked) out.push_back(k->backend);
    return out;
  };

  // priority: the highest declared priority, when nothing else ranks.
  Selector sel(reg);
  Selection s = sel.choose(req("x.y", "cuda:9.0"));
  CHECK(s.spec->backend == "cuda");
  CHECK(s.rule == SelectionRule::priority);
  CHECK(names(s) == std::vector<std::string>{"cuda", "torch", "triton"});  // equal priorities keep backend order
  CHECK(rule_name(s.rule) == "priority");

  // order: KDISPATCH_BACKEND_ORDER before the priorities.
  Selector ordered(reg, SelectorOptions{{}, {"torch"}});
  s = ordered.choose(req("x.y", "cuda:9.0"));
  CHECK(s.spec->backend == "torch");
  CHECK(s.rule == SelectionRule::order);
  CHECK(names(s) == std::vector<std::string>{"torch", "cuda", "triton"});

  // preference: the op's own ranking before the global order.
  ordered.set_preference("x.y", {"triton"});
  s = ordered.choose(req("x.y", "cuda:9.0"));
  CHECK(s.spec->backend == "triton");
  CHECK(s.rule == SelectionRule::preference);
  CHECK(names(s) == std::vector<std::string>{"triton", "torch", "cuda"});
  // A preferred backend that is not eligible on the device ranks nothing.
  s = ordered.choose(req("x.y", "cpu"));
  CHECK(s.spec->backend == "torch");
  CHECK(s.rule == SelectionRule::only);
  CHECK(ordered.preference("x.y") == std::vector<std::string>{"triton"});
  ordered.set_preference("x.y", {});
  CHECK(ordered.preference("x.y").empty());
  CHECK(ordered.choose(req("x.y", "cuda:9.0")).rule == SelectionRule::order);

  // named and forced.
  s = sel.choose(req("x.y", "cuda:9.0", "triton"));
  CHECK(s.rule == SelectionRule::named);
  CHECK(names(s) == std::vector<std::string>{"triton"});
  Selector forced(reg, SelectorOptions{"torch", {}});
  s = forced.choose(req("x.y", "cuda:9.0"));
  CHECK(s.spec->backend == "torch");
  CHECK(s.rule == SelectionRule::forced);
  CHECK(names(s) == std::vector<std::string>{"torch", "cuda", "triton"});
}

TEST_CASE("ranking: KD-E004 only for a true tie, naming only the tied backends") {
  KernelRegistry reg;
  KernelSpec a = spec("x.y", "a", {});
  KernelSpec b = spec("x.y", "b", {});
  KernelSpec c = spec("x.y", "c", {});
  a.priority = 1;
  b.priority = 1;
  reg.add(a);
  reg.add(b);
  reg.add(c);
  Selector sel(reg);
  const std::string message = error_of([&] { sel.select(req("x.y", "cpu")); }, ErrorCode::ambiguous_backend);
  CHECK(message.find("([a, b])") != std::string::npos);
  // Any rule that tells the tied ones apart decides.
  sel.set_preference("x.y", {"b"});
  CHECK(sel.choose(req("x.y", "cpu")).spec->backend == "b");
}

TEST_CASE("ranking: a bad preference is refused with a KD code and changes nothing") {
  KernelRegistry reg;
  reg.add(spec("x.y", "a", {}));
  reg.add(spec("x.y", "b", {}));
  Selector sel(reg);
  sel.set_preference("x.y", {"b"});
  error_of([&] { sel.set_preference("x.z", {"a"}); }, ErrorCode::unknown_op);
  const std::string missing =
      error_of([&] { sel.set_preference("x.y", {"a", "cdua"}); }, ErrorCode::backend_not_registered);
  CHECK(missing.find("No 'cdua' backend registered for op 'x.y'") != std::string::npos);
  error_of([&] { sel.set_preference("x.y", {"a", "a"}); }, ErrorCode::backend_not_registered);
  CHECK(sel.preference("x.y") == std::vector<std::string>{"b"});
  CHECK(sel.choose(req("x.y", "cpu")).spec->backend == "b");
}

TEST_CASE("ranking: an opt-in kernel joins when the op's preference names it") {
  KernelRegistry reg;
  KernelSpec fast = spec("x.y", "fast", {});
  fast.opt_in = true;
  reg.add(fast);
  reg.add(spec("x.y", "plain", {}));
  Selector sel(reg);
  CHECK(sel.choose(req("x.y", "cpu")).spec->backend == "plain");
  sel.set_preference("x.y", {"fast"});
  const Selection s = sel.choose(req("x.y", "cpu"));
  CHECK(s.spec->backend == "fast");
  CHECK(s.rule == SelectionRule::preference);
}

TEST_CASE("re-registration: identical is a no-op and different is KD-E005 and the first stays") {
  KernelRegistry reg;
  KernelSpec a = spec("x.y", "cuda", {cuda_target("9.0")});
  CHECK(reg.add(a));
  const uint64_t gen = reg.generation();
  CHECK_FALSE(reg.add(a));
  CHECK(reg.generation() == gen);
  KernelSpec b = a;
  b.symbol = "kd_other_symbol";
  b.manifest = "other.json";
  const std::string msg = error_of([&] { reg.add(b); }, ErrorCode::conflicting_registration);
  CHECK(msg ==
        "Conflicting kernel registration for op 'x.y', backend 'cuda': plugin 'cuda' symbol 'kd_cuda_kernel' "
        "(cuda.json) != plugin 'cuda' symbol 'kd_other_symbol' (other.json)");
  CHECK(reg.get_backend("x.y", "cuda")->symbol == "kd_cuda_kernel");
}

TEST_CASE("a selection follows registrations and withdrawals") {
  KernelRegistry reg;
  reg.add(spec("x.y", "cuda", {cuda_target("9.0")}));
  Selector sel(reg);
  CHECK(sel.select(req("x.y", "cuda:9.0")).backend == "cuda");
  CHECK(&sel.select(req("x.y", "cuda:9.0")) == &sel.select(req("x.y", "cuda:9.0")));
  reg.add(spec("x.y", "triton", {cuda_target("8.0")}));
  error_of([&] { sel.select(req("x.y", "cuda:9.0")); }, ErrorCode::ambiguous_backend);
  // A withdrawn plugin (failed to load) is no longer selected.
  reg.withdraw_plugin("triton", Problem{ErrorCode::plugin_open_failed, "libtriton.so", "not found"});
  CHECK(sel.select(req("x.y", "cuda:9.0")).backend == "cuda");
  const std::string msg =
      error_of([&] { sel.select(req("x.y", "cuda:9.0", "triton")); }, ErrorCode::backend_not_registered);
  CHECK(msg.find("plugin 'triton'") != std::string::npos);
  CHECK(msg.find("[KD-E020] not found") != std::string::npos);
}

TEST_CASE("a selection depends on device, arch, dtype and backend request, call after call") {
  KernelRegistry reg;
  reg.add(spec("x.y", "new", {cuda_target("9.0")}, {Dtype::bfloat16}));
  reg.add(spec("x.y", "old", {cuda_target("7.0", "8.9")}));
  reg.add(spec("x.y", "cpu", {cpu_target()}));
  Selector sel(reg);
  for (int round = 0; round < 2; ++round) {
    CHECK(sel.select(req("x.y", "cuda:9.0", {}, Dtype::bfloat16)).backend == "new");
    CHECK(sel.select(req("x.y", "cuda:8.0", {}, Dtype::bfloat16)).backend == "old");
    CHECK(sel.select(req("x.y", "cpu", {}, Dtype::bfloat16)).backend == "cpu");
    CHECK(sel.select(req("x.y", "cuda:8.0", "old")).backend == "old");
    error_of([&] { sel.select(req("x.y", "cuda:9.0", {}, Dtype::float32)); }, ErrorCode::no_usable_backend);
  }
}

TEST_CASE("closest ops for did-you-mean") {
  const std::vector<std::string> ops{"layernorm.rmsnorm", "layernorm.fused_add_rmsnorm", "moe.topk_softmax"};
  CHECK(closest_ops("layernorm.rmsnrom", ops).front() == "layernorm.rmsnorm");
  CHECK(closest_ops("rmsnorm", ops).front() == "layernorm.rmsnorm");
  CHECK(closest_ops("totally.different", ops).empty());
}

TEST_CASE("device strings") {
  CHECK(Device::parse("cuda:9.0").str() == "cuda:9.0");
  CHECK(Device::parse("hip:gfx90a").str() == "hip:gfx90a");
  CHECK(Device::parse("cpu").str() == "cpu");
  CHECK_THROWS_AS(Device::parse("tpu"), std::invalid_argument);
  CHECK_THROWS_AS(Device::parse("cuda:9"), std::invalid_argument);
  CHECK_THROWS_AS(Device::parse("cuda:"), std::invalid_argument);
  CHECK_THROWS_AS(Device::parse("hip:sm_90"), std::invalid_argument);
  CHECK_THROWS_AS(Device::parse("cpu:avx"), std::invalid_argument);
}

TEST_CASE("concurrent selection while another thread registers") {
  KernelRegistry reg;
  reg.add(spec("op.base", "cpu", {cpu_target()}));
  Selector sel(reg);
  std::atomic<bool> stop{false};
  std::atomic<int> wrong{0};
  std::atomic<long> selections{0};
  std::vector<std::thread> readers;
  for (int t = 0; t < 8; ++t) {
    readers.emplace_back([&, t] {
      const Device cpu = Device::parse("cpu");
      const Device gpu = Device::parse("cuda:9.0");
      long n = 0;
      while (!stop.load(std::memory_order_relaxed) || n < 1000) {
        if (sel.select({"op.base", {}, cpu, std::nullopt}).backend != "cpu") wrong.fetch_add(1);
        // Ops registered by the writer: either unknown yet or resolved right.
        const std::string op = "op.n" + std::to_string((n + t) % 64);
        try {
          if (sel.select({op, {}, gpu, std::nullopt}).backend != "cuda") wrong.fetch_add(1);
        } catch (const SelectionError& e) {
          if (e.code() != ErrorCode::unknown_op) wrong.fetch_add(1);
        }
        ++n;
      }
      selections.fetch_add(n);
    });
  }
  std::thread writer([&] {
    for (int i = 0; i < 64; ++i) {
      reg.add(spec("op.n" + std::to_string(i), "cuda", {cuda_target("9.0")}));
      std::this_thread::yield();
    }
    stop.store(true);
  });
  writer.join();
  for (auto& r : readers) r.join();
  CHECK(wrong.load() == 0);
  CHECK(selections.load() >= 8000);
  for (int i = 0; i < 64; ++i) {
    CHECK(sel.select(req("op.n" + std::to_string(i), "cuda:9.0")).backend == "cuda");
  }
}

TEST_CASE("an opt-in kernel changes no call that does not ask for it") {
  KernelRegistry reg;
  reg.add(spec("activation.silu_and_mul", "cpu", {cpu_target()}));
  KernelSpec second = spec("activation.silu_and_mul", "example_cpu", {cpu_target()});
  second.opt_in = true;
  reg.add(second);
  Selector sel(reg);
  // Not named: the one backend that is not opt-in, no KD-E004.
  CHECK(sel.select(req("activation.silu_and_mul", "cpu")).backend == "cpu");
  // Named, forced, or in the preference order: the opt-in kernel.
  CHECK(sel.select(req("activation.silu_and_mul", "cpu", "example_cpu")).backend == "example_cpu");
  Selector forced(reg, SelectorOptions{"example_cpu", {}});
  CHECK(forced.select(req("activation.silu_and_mul", "cpu")).backend == "example_cpu");
  Selector ordered(reg, SelectorOptions{{}, {"example_cpu", "cpu"}});
  CHECK(ordered.select(req("activation.silu_and_mul", "cpu")).backend == "example_cpu");

  // Alone, it is not chosen either, and KD-E003 says why.
  KernelRegistry only;
  only.add(second);
  const std::string why =
      error_of([&] { Selector(only).select(req("activation.silu_and_mul", "cpu")); }, ErrorCode::no_usable_backend);
  CHECK_MESSAGE(why.find("example_cpu: opt-in: runs only when named") != std::string::npos, why);
}

TEST_CASE("backend 'reference' names the op's reference kernel, whatever its backend is called") {
  KernelRegistry reg;
  reg.add(spec("example.op", "example_cpu", {cpu_target()}));
  KernelSpec ref = spec("example.op", "example_ref", {cpu_target()});
  ref.role = KernelRole::reference;
  reg.add(ref);
  Selector sel(reg);
  CHECK(sel.select(req("example.op", "cpu")).backend == "example_cpu");
  CHECK(sel.select(req("example.op", "cpu", "reference")).backend == "example_ref");
  Selector forced(reg, SelectorOptions{"reference", {}});
  CHECK(forced.select(req("example.op", "cpu")).backend == "example_ref");
}
