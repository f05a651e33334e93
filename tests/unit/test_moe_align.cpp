// moe.align_block_size on the cpu and reference backends: a worked example
// with the stable order inside each expert, ids outside [0, E) skipped and
// every element of the outputs written; the harness comparison is exact,
// so one element off by one fails it; undersized outputs are refused.
#include <doctest/doctest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "harness.hpp"
#include "kdispatch/context.hpp"
#include "kdispatch/dispatcher.hpp"
#include "kdispatch/error.hpp"

using namespace kdispatch;

namespace {

constexpr const char* kOp = "moe.align_block_size";

std::unique_ptr<Context> align_context() {
  ContextOptions options;
  options.search.replace = {KDISPATCH_PLUGIN_DIR};
  options.search.use_environment = false;
  options.search.select = {"cpu", "reference"};
  return std::make_unique<Context>(options);
}

// topk_ids [3, 2] = [[2, 0], [2, 2], [1, 0]] (int32 or int64), plus one
// pair routed to `stray` (out of range) as a fourth row [stray, 2]; E = 4,
// B = 2; outputs poisoned with -7.
struct AlignCall {
  std::vector<int32_t> ids32{2, 0, 2, 2, 1, 0, 0, 2};
  std::vector<int64_t> ids64;
  std::vector<int32_t> sorted, experts, post_pad{-7};
  std::vector<int64_t> ids_shape{4, 2}, sorted_shape, experts_shape, one{1};
  std::vector<DLTensor> tensors;

  AlignCall(bool wide, int32_t stray, int64_t p, int64_t m) : sorted(p, -7), experts(m, -7) {
    ids32[6] = stray;
    ids64.assign(ids32.begin(), ids32.end());
    sorted_shape = {p};
    experts_shape = {m};
    const DLDevice cpu{kDLCPU, 0};
    const DLDataType i32{kDLInt, 32, 1};
    tensors = {DLTensor{wide ? static_cast<void*>(ids64.data()) : static_cast<void*>(ids32.data()), cpu, 2,
                        DLDataType{kDLInt, static_cast<uint8_t>(wide ? 64 : 32), 1}, ids_shape.data(), nullptr, 0},
               DLTensor{sorted.data(), cpu, 1, i32, sorted_shape.data(), nullptr, 0},
               DLTensor{experts.data(), cpu, 1, i32, experts_shape.data(), nullptr, 0},
               DLTensor{post_pad.data(), cpu, 1, i32, one.data(), nullptr, 0}};
  }
};

const std::vector<NamedAttr> kAttrs{{"num_experts", int64_t{4}}, {"block_size", int64_t{2}}};

}  // namespace

TEST_CASE("moe.align_block_size: pairs grouped by expert in index order, padded with N, the rest N and -1") {
  auto ctx = align_context();
  Dispatcher dispatch(*ctx);
  for (const char* backend : {"cpu", "reference"}) {
    for (bool wide : {false, true}) {
      for (int32_t stray : {4, -1, 1000}) {
        INFO(backend << (wide ? " int64" : " int32") << " stray id " << stray);
        // N = 8, worst case 8 + 4 * (2 - 1) = 12 positions, 6 blocks.
        AlignCall call(wide, stray, 12, 6);
        dispatch.op(kOp, backend)(call.tensors, kAttrs);
        // Expert 0: pairs 1, 5; expert 1: pair 4, padded; expert 2: pairs
        // 0, 2, 3, 7; expert 3: none; pair 6 (the stray id) nowhere.
        CHECK(call.sorted == std::vector<int32_t>{1, 5, 4, 8, 0, 2, 3, 7, 8, 8, 8, 8});
        CHECK(call.experts == std::vector<int32_t>{0, 1, 2, 2, -1, -1});
        CHECK(call.post_pad[0] == 8);
      }
    }
  }
}

TEST_CASE("moe.align_block_size: the check is exact, so one output element off by one fails it") {
  auto ctx = align_context();
  Dispatcher dispatch(*ctx);
  const OpHandle cpu = dispatch.op(kOp, "cpu");
  const OpHandle reference = dispatch.op(kOp, "reference");
  const OpSchema& schema = reference.schema();
  const std::vector<harness::TestCase> cases = harness::test_cases(schema);
  REQUIRE(!cases.empty());
  const harness::TestCase& c = cases[cases.size() / 2];
  INFO(harness::describe(c));
  harness::CallData got = harness::make_case(schema, Dtype::int32, c, 5);
  harness::CallData want = harness::make_case(schema, Dtype::int32, c, 5);
  std::vector<DLTensor> got_dl = got.dl(), want_dl = want.dl();
  cpu(got_dl, got.attrs);
  reference(want_dl, want.attrs);
  const harness::Comparison same = harness::compare(schema, got, want);
  CHECK_MESSAGE(same.ok, same.first_mismatch);
  for (size_t t = 1; t < 4; ++t) {
    INFO("output " << schema.tensors[t].name);
    harness::Buffer& out = got.tensors[t];
    const size_t at = out.numel() / 2;
    out.set(at, out.at(at) + 1);
    const harness::Comparison off = harness::compare(schema, got, want);
    CHECK_FALSE(off.ok);
    CHECK(off.first_mismatch.find(schema.tensors[t].name) != std::string::npos);
    out.set(at, out.at(at) - 1);
  }
  CHECK(harness::compare(schema, got, want).ok);
}

TEST_CASE("moe.align_block_size: outputs smaller than the worst case are refused, naming the sizes") {
  auto ctx = align_context();
  Dispatcher dispatch(*ctx);
  for (const char* backend : {"cpu", "reference"}) {
    INFO(backend);
    for (auto [p, m] : {std::pair<int64_t, int64_t>{11, 6}, {12, 5}}) {
      AlignCall call(false, 4, p, m);
      try {
        dispatch.op(kOp, backend)(call.tensors, kAttrs);
        FAIL("the call was accepted");
      } catch (const Error& e) {
        CHECK(e.code() == ErrorCode::kernel_failed);
        CHECK_MESSAGE(std::string(e.what()).find("= 12 needs at least") != std::string::npos, e.what());
      }
      CHECK(call.post_pad[0] == -7);
    }
  }
}
