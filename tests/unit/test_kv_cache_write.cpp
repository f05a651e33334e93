// kvcache.reshape_and_cache_flash on the cpu and reference backends: each
// token's key and value land in its slot of the paged caches, slot -1 is
// skipped, the slots no token names keep their bits; the check compares
// every cache element, so one token written a slot off fails it; an fp8
// cache holds each value divided by its scale, rounded once, saturating; a
// kv_cache_dtype that disagrees with the caches and a slot beyond the
// caches are refused; generated slots
// ("values": "distinct") never repeat, so no two tokens race for a slot.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "harness.hpp"
#include "kdispatch/context.hpp"
#include "kdispatch/dispatcher.hpp"
#include "kdispatch/error.hpp"
#include "kdispatch/plugin_helpers.hpp"

using namespace kdispatch;

namespace {

constexpr const char* kOp = "kvcache.reshape_and_cache_flash";

std::unique_ptr<Context> cache_context() {
  ContextOptions options;
  options.search.replace = {KDISPATCH_PLUGIN_DIR};
  options.search.use_environment = false;
  options.search.select = {"cpu", "reference"};
  return std::make_unique<Context>(options);
}

// 3 tokens of 2 heads x 4 values into 2 pages of 2 slots, random keys,
// values and cache contents (make_call fills in-place tensors like
// inputs); slot_mapping set to `slots`, attributes at their defaults.
harness::CallData cache_call(const OpSchema& schema, Dtype dtype, std::vector<int64_t> slots,
                             const harness::Variant& variant = {}) {
  harness::Shapes shapes{{}, {{"N", 3}, {"H", 2}, {"D", 4}, {"NB", 2}, {"BS", 2}, {"S", 4}}};
  harness::CallData data = harness::make_call(schema, dtype, shapes, 11, variant);
  for (size_t t = 0; t < slots.size(); ++t) data.tensors[4].set(t, static_cast<double>(slots[t]));
  return data;
}

}  // namespace

TEST_CASE("kvcache.reshape_and_cache_flash: tokens land in their slots, slot -1 skipped, other slots untouched") {
  auto ctx = cache_context();
  Dispatcher dispatch(*ctx);
  for (const char* backend : {"cpu", "reference"}) {
    for (Dtype dtype : {Dtype::float32, Dtype::bfloat16}) {
      const OpHandle op = dispatch.op(kOp, backend);
      INFO(backend << " " << dtype_name(dtype));
      harness::CallData data = cache_call(op.schema(), dtype, {2, -1, 0});
      const harness::CallData before = cache_call(op.schema(), dtype, {2, -1, 0});
      std::vector<DLTensor> tensors = data.dl();
      op(tensors, data.attrs);
      for (size_t c = 2; c < 4; ++c) {     // key_cache, value_cache
        const size_t source = c - 2;       // key, value
        for (int64_t slot = 0; slot < 4; ++slot) {
          for (int64_t j = 0; j < 8; ++j) {  // H x D values of a slot
            const size_t at = static_cast<size_t>(slot * 8 + j);
            const double got = data.tensors[c].at(at);
            double want = before.tensors[c].at(at);  // slots 1 and 3: no token
            if (slot == 2) want = before.tensors[source].at(static_cast<size_t>(j));       // token 0
            if (slot == 0) want = before.tensors[source].at(static_cast<size_t>(16 + j));  // token 2
            CHECK(std::memcmp(&got, &want, sizeof(double)) == 0);
          }
        }
      }
    }
  }
}

TEST_CASE("kvcache.reshape_and_cache_flash: the check compares every cache element, so a token one slot off fails") {
  auto ctx = cache_context();
  Dispatcher dispatch(*ctx);
  const OpHandle cpu = dispatch.op(kOp, "cpu");
  const OpHandle reference = dispatch.op(kOp, "reference");
  const OpSchema& schema = reference.schema();
  harness::CallData want = cache_call(schema, Dtype::float16, {2, -1, 0});
  std::vector<DLTensor> want_dl = want.dl();
  reference(want_dl, want.attrs);
  harness::CallData same = cache_call(schema, Dtype::float16, {2, -1, 0});
  std::vector<DLTensor> same_dl = same.dl();
  cpu(same_dl, same.attrs);
  const harness::Comparison ok = harness::compare(schema, same, want);
  CHECK_MESSAGE(ok.ok, ok.first_mismatch);
  for (std::vector<int64_t> off : {std::vector<int64_t>{3, -1, 0}, std::vector<int64_t>{2, -1, 1},
                                   std::vector<int64_t>{2, 1, 0}}) {
    harness::CallData got = cache_call(schema, Dtype::float16, off);
    std::vector<DLTensor> got_dl = got.dl();
    cpu(got_dl, got.attrs);
    const harness::Comparison c = harness::compare(schema, got, want);
    CHECK_FALSE(c.ok);
    CHECK(c.first_mismatch.find("key_cache") != std::string::npos);
  }
}

TEST_CASE("kvcache.reshape_and_cache_flash: an fp8 cache holds fp8(float32(x) / scale), rounded once, saturating") {
  auto ctx = cache_context();
  Dispatcher dispatch(*ctx);
  // key_cache in float8_e4m3fn, value_cache in float8_e5m2: each cache as
  // its dtype says, with its own scale.
  harness::Variant fp8;
  fp8.dtypes = {Dtype::bfloat16, Dtype::bfloat16, Dtype::float8_e4m3fn, Dtype::float8_e5m2,
                Dtype::int64,    Dtype::float32,  Dtype::float32};
  for (const char* backend : {"cpu", "reference"}) {
    INFO(backend);
    const OpHandle op = dispatch.op(kOp, backend);
    harness::CallData data = cache_call(op.schema(), Dtype::bfloat16, {2, -1, 0}, fp8);
    const harness::CallData before = cache_call(op.schema(), Dtype::bfloat16, {2, -1, 0}, fp8);
    data.tensors[5].set(0, 0.0625);  // k_scale: values up to 2 / 0.0625 = 32
    data.tensors[6].set(0, 1e-5);    // v_scale: most values beyond 57344, so saturated
    std::vector<DLTensor> tensors = data.dl();
    op(tensors, data.attrs);
    int saturated = 0;
    for (size_t c = 2; c < 4; ++c) {
      const auto scale = static_cast<float>(data.tensors[c + 3].at(0));
      for (int64_t j = 0; j < 8; ++j) {
        const auto x = static_cast<float>(before.tensors[c - 2].at(static_cast<size_t>(j)));  // token 0 -> slot 2
        const float q = x / scale;
        const double want = c == 2 ? kd_plugin::to_float(kd_plugin::from_float<kd_plugin::Float8E4M3FN>(q))
                                   : kd_plugin::to_float(kd_plugin::from_float<kd_plugin::Float8E5M2>(q));
        saturated += std::fabs(want) == 57344.0;
        CHECK(data.tensors[c].at(static_cast<size_t>(16 + j)) == want);
        CHECK(data.tensors[c].at(static_cast<size_t>(8 + j)) == before.tensors[c].at(static_cast<size_t>(8 + j)));
      }
    }
    CHECK(saturated > 0);
    // Named fp8 kinds: "fp8" and "fp8_e4m3" need float8_e4m3fn caches.
    harness::CallData e4m3 = cache_call(op.schema(), Dtype::bfloat16, {2, -1, 0}, [&] {
      harness::Variant v = fp8;
      v.dtypes[3] = Dtype::float8_e4m3fn;
      return v;
    }());
    std::vector<DLTensor> e4m3_dl = e4m3.dl();
    for (const char* name : {"fp8", "fp8_e4m3"}) op(e4m3_dl, std::vector<NamedAttr>{{"kv_cache_dtype", std::string(name)}});
    try {
      op(e4m3_dl, std::vector<NamedAttr>{{"kv_cache_dtype", std::string("fp8_e5m2")}});
      FAIL("fp8_e5m2 with float8_e4m3fn caches was accepted");
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::kernel_failed);
      CHECK_MESSAGE(std::string(e.what()).find("kv_cache_dtype 'fp8_e5m2'") != std::string::npos, e.what());
    }
  }
}

TEST_CASE("kvcache.reshape_and_cache_flash: a kv_cache_dtype that disagrees with the caches and a slot beyond the caches are refused") {
  auto ctx = cache_context();
  Dispatcher dispatch(*ctx);
  for (const char* backend : {"cpu", "reference"}) {
    INFO(backend);
    const OpHandle op = dispatch.op(kOp, backend);
    harness::CallData fp8 = cache_call(op.schema(), Dtype::float32, {2, -1, 0});
    std::vector<DLTensor> fp8_dl = fp8.dl();
    try {
      op(fp8_dl, std::vector<NamedAttr>{{"kv_cache_dtype", std::string("fp8")}});
      FAIL("an fp8 cache was accepted");
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::kernel_failed);
      CHECK_MESSAGE(std::string(e.what()).find("kv_cache_dtype 'fp8'") != std::string::npos, e.what());
    }
    harness::CallData beyond = cache_call(op.schema(), Dtype::float32, {2, 4, 0});
    std::vector<DLTensor> beyond_dl = beyond.dl();
    try {
      op(beyond_dl, beyond.attrs);
      FAIL("slot 4 of 4 was accepted");
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::kernel_failed);
      CHECK_MESSAGE(std::string(e.what()).find("slot_mapping[1] = 4 is beyond the caches' 4 slots") !=
                        std::string::npos,
                    e.what());
    }
  }
}

TEST_CASE("kvcache.reshape_and_cache_flash: generated slots are distinct, and a range too small for them is refused") {
  auto ctx = cache_context();
  Dispatcher dispatch(*ctx);
  const OpSchema& schema = dispatch.op(kOp, "reference").schema();
  for (uint64_t seed : {1, 2, 3}) {
    // 300 tokens, slots drawn from [-1, 300): 301 values, so nearly all.
    harness::Shapes shapes{{}, {{"N", 300}, {"H", 1}, {"D", 1}, {"NB", 3}, {"BS", 100}, {"S", 300}}};
    const harness::CallData data = harness::make_call(schema, Dtype::float32, shapes, seed);
    std::set<double> seen;
    for (size_t t = 0; t < 300; ++t) {
      const double s = data.tensors[4].at(t);
      CHECK(s >= -1);
      CHECK(s < 300);
      CHECK(seen.insert(s).second);
    }
  }
  harness::Shapes crowded{{}, {{"N", 302}, {"H", 1}, {"D", 1}, {"NB", 3}, {"BS", 100}, {"S", 300}}};
  try {
    (void)harness::make_call(schema, Dtype::float32, crowded, 1);
    FAIL("302 distinct slots drawn from 301 values");
  } catch (const std::invalid_argument& e) {
    CHECK(std::string(e.what()) == "tensor 'slot_mapping': 302 distinct values do not fit its range [-1, 300)");
  }
}
