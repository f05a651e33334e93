// Hostile input to the core: pathological JSON (deep nesting with repeated
// keys, a million unknown keys, a huge op id) must be diagnosed in linear
// time with capped output, JSON nested deeper than kMaxJsonDepth is refused
// before anything writes a value of it (dump() recurses per level), and sizes that overflow or lie through the C++
// API must be refused with KD-E030 naming the argument, never reach a kernel.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "json_depth.hpp"
#include "kdispatch/error.hpp"
#include "kdispatch/manifest.hpp"
#include "kdispatch/registry.hpp"
#include "kdispatch/tuning.hpp"
#include "manifest_for_cache.hpp"
#include "preference_file.hpp"
#include "schema_check.hpp"
#include "kdispatch/selector.hpp"

using namespace kdispatch;

namespace {

constexpr const char* kHead = R"({"kdispatch_manifest": "1.0", "plugin": "p", "backend": "p",
  "library": "libp.so", "abi": "1.0", "kernels": [])";

// Sanitizer builds run this code several times slower, and map shadow
// memory over most of the address space, so a wild pointer there can look
// like mapped memory to the byte_offset probe.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif
constexpr double kSlowdown = kSanitized ? 10.0 : 1.0;

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

// --- pathological JSON ------------------------------------------------------------

TEST_CASE("hostile json: 200,000-deep nesting with repeated keys at the bottom is diagnosed in linear time") {
  constexpr size_t kDepth = 200000;
  std::string text = std::string(kHead) + ", \"x\": ";
  for (size_t i = 0; i < kDepth; ++i) text += "{\"a\": [";
  for (int i = 0; i < 50; ++i) text += R"({"k": 1, "k": 2},)";
  text += "{}";
  for (size_t i = 0; i < kDepth; ++i) text += "]}";
  text += "}";
  const auto start = std::chrono::steady_clock::now();
  const ManifestResult r = parse_manifest(text, "deep.json");
  const double took = seconds_since(start);
  CHECK(took < 10.0 * kSlowdown);
  CHECK_FALSE(r.ok());
  // Ten repeats one by one, then one line for the rest.
  REQUIRE(r.errors.size() == 11);
  const std::string& first = r.errors[0].message;
  CHECK(first.find("deep.json: /x/a/0/a/0/a/0") == 0);
  CHECK(first.find("characters)...") != std::string::npos);
  CHECK(first.find("/a/0/k: key appears more than once") != std::string::npos);
  CHECK(first.size() < 500);
  CHECK(r.errors.back().message == "deep.json: and 40 more repeated keys");
}

TEST_CASE("hostile json: a million unknown keys give ten warnings and a summary") {
  std::string text = kHead;
  for (int i = 0; i < 1000000; ++i) text += ", \"u" + std::to_string(i) + "\": 0";
  text += "}";
  const auto start = std::chrono::steady_clock::now();
  const ManifestResult r = parse_manifest(text, "many.json");
  CHECK(seconds_since(start) < 20.0 * kSlowdown);
  CHECK(r.ok());
  REQUIRE(r.warnings.size() == 11);
  CHECK(r.warnings[0].message.find("unknown key, ignored") != std::string::npos);
  CHECK(r.warnings.back().message == "many.json: and 999,990 more unknown keys, ignored");
}

TEST_CASE("hostile json: did-you-mean for a 1 MB op id returns at once") {
  const std::vector<std::string> ops{"layernorm.rmsnorm", "activation.silu_and_mul", "moe.topk_softmax"};
  const std::string huge(size_t{1} << 20, 'r');
  const auto start = std::chrono::steady_clock::now();
  CHECK(closest_ops(huge, ops).empty());
  CHECK(closest_ops(std::string(200, 'x') + "rmsnorm", ops).empty());
  CHECK(seconds_since(start) < 1.0 * kSlowdown);
  // Typos still get their suggestion.
  CHECK(closest_ops("layernorm.rmsnrom", ops) == std::vector<std::string>{"layernorm.rmsnorm"});
  CHECK(closest_ops("rmsnorm", ops) == std::vector<std::string>{"layernorm.rmsnorm"});
}

namespace {

// `levels` arrays, one inside the other.
std::string nested(size_t levels) { return std::string(levels, '[') + std::string(levels, ']'); }

// A valid manifest with one op schema whose entry has an unknown key of
// `value`: the key is warned about and the "ops" list goes into the
// registry cache record as written.
std::string manifest_with(const std::string& value) {
  return std::string(kHead).substr(0, std::string(kHead).size() - std::string(R"("kernels": [])").size()) +
         R"("kernels": [{"op": "test.deep", "symbol": "kd_deep"}],
  "ops": [{"op": "test.deep", "note": )" + value + R"(,
    "tensors": [{"name": "out", "shape": ["N"], "dtype": "float32", "written": true}]}]})";
}

}  // namespace

TEST_CASE("hostile json: nesting deeper than kMaxJsonDepth is KD-E010 with its position, never a stack overflow") {
  // 300,000 levels: far more than a thread's stack holds for a recursive
  // dump() of them.
  constexpr size_t kDeep = 300000;
  REQUIRE(kMaxJsonDepth == 128);

  // A manifest: the op entry is level 3 of the document, so its key's value
  // may nest 125 arrays and no more. The deep one is refused at the '[' of
  // level 129 (column counted on the line of the key).
  std::string ops_json;
  const ManifestResult fits = parse_manifest_for_cache(manifest_with(nested(125)), "fits.json", ops_json);
  REQUIRE_MESSAGE(fits.ok(), (fits.errors.empty() ? std::string() : fits.errors[0].message));
  CHECK(ops_json.find(nested(125)) != std::string::npos);
  const std::string one_more = manifest_with(nested(126));
  const ManifestResult over = parse_manifest_for_cache(one_more, "over.json", ops_json);
  REQUIRE(over.errors.size() == 1);
  CHECK(over.errors[0].code == ErrorCode::manifest_bad_json);
  const size_t at = one_more.find(nested(126));
  const size_t line_start = one_more.rfind('\n', at) + 1;
  const auto line = std::count(one_more.begin(), one_more.begin() + static_cast<std::ptrdiff_t>(at), '\n') + 1;
  CHECK(over.errors[0].message == "over.json:" + std::to_string(line) + ":" + std::to_string(at - line_start + 126) +
                                      ": arrays and objects nested deeper than 128 levels");
  for (const ManifestResult& r : {parse_manifest_for_cache(manifest_with(nested(kDeep)), "deep.json", ops_json),
                                  parse_manifest(manifest_with(nested(kDeep)), "deep.json")}) {
    CHECK_FALSE(r.ok());
    REQUIRE(r.errors.size() == 1);
    CHECK(r.errors[0].code == ErrorCode::manifest_bad_json);
    CHECK(r.errors[0].message.find("nested deeper than 128 levels") != std::string::npos);
  }
  // An op-schema file the same.
  const SchemaFileResult schemas = parse_op_schemas("[{\"op\": \"test.deep\", \"doc\": " + nested(kDeep) + "}]",
                                                    "deep-ops.json");
  REQUIRE(schemas.errors.size() == 1);
  CHECK(schemas.errors[0].code == ErrorCode::manifest_bad_json);
  CHECK(schemas.errors[0].message.find("deep-ops.json:1:") == 0);

  // A tuning file whose version is a deep list: the message would show it.
  KernelRegistry registry;
  try {
    (void)parse_tuning_file("{\"kdispatch_tuning\": " + nested(kDeep) + "}", "deep-tuning.json", registry);
    FAIL("a deep tuning file was taken");
  } catch (const ManifestError& e) {
    CHECK(e.code() == ErrorCode::manifest_bad_json);
    CHECK(std::string(e.what()).find(
              "deep-tuning.json:1:149: arrays and objects nested deeper than 128 levels") !=
          std::string::npos);
  }
  // 128 levels are read, and the field is then refused as usual.
  try {
    (void)parse_tuning_file("{\"kdispatch_tuning\": " + nested(127) + "}", "tuning.json", registry);
    FAIL("a list was taken for the version");
  } catch (const ManifestError& e) {
    CHECK(e.code() == ErrorCode::manifest_bad_field);
    CHECK(std::string(e.what()).find("tuning.json: /kdispatch_tuning: expected 1, found [[[[") != std::string::npos);
  }

  // A preference file whose backends are a deep list.
  const PreferenceFileResult preferences =
      parse_preference_file("{\"preferences\": {\"a.b\": " + nested(kDeep) + "}}", "deep-preferences.json");
  CHECK(preferences.preferences.empty());
  REQUIRE(preferences.errors.size() == 1);
  CHECK(preferences.errors[0].code == ErrorCode::manifest_bad_json);
  CHECK(preferences.errors[0].message ==
        "deep-preferences.json:1:151: arrays and objects nested deeper than 128 levels");
  const PreferenceFileResult shallow =
      parse_preference_file("{\"preferences\": {\"a.b\": " + nested(126) + "}}", "preferences.json");
  REQUIRE(shallow.errors.size() == 1);
  CHECK(shallow.errors[0].code == ErrorCode::manifest_bad_field);
}

// --- sizes that overflow or lie -----------------------------------------------------

namespace {

OpSchema scale_schema() {
  SchemaFileResult parsed = parse_op_schemas(R"([{"op": "test.scale",
    "tensors": [{"name": "out", "shape": ["*", "H"], "dtype": "float32", "written": true},
                {"name": "x", "shape": ["*", "H"], "dtype": "float32"}]}])",
                                             "<test>");
  REQUIRE(parsed.errors.empty());
  return parsed.schemas.at(0);
}

std::string refusal(const CompiledSchema& schema, std::vector<DLTensor> tensors) {
  try {
    schema.check(tensors);
  } catch (const CallError& e) {
    CHECK(e.code() == ErrorCode::bad_arguments);
    return e.what();
  }
  return "accepted";
}

}  // namespace

TEST_CASE("hostile sizes: overflowing counts, negative dims and bad byte_offset are KD-E030 naming the argument") {
  const OpSchema schema = scale_schema();
  const CompiledSchema compiled(schema);
  std::vector<float> storage(64);
  std::vector<float> out_storage(64);
  int64_t good_shape[2] = {4, 16};
  const DLTensor good{storage.data(), {kDLCPU, 0}, 2, {kDLFloat, 32, 1}, good_shape, nullptr, 0};
  DLTensor good_out = good;
  good_out.data = out_storage.data();
  CHECK(refusal(compiled, {good_out, good}) == "accepted");

  SUBCASE("element count past 64 bits, null data") {
    // 2^32 * 2^32 elements wrap to 0, which would make null data look fine.
    int64_t shape[2] = {int64_t{1} << 32, int64_t{1} << 32};
    DLTensor t{nullptr, {kDLCPU, 0}, 2, {kDLFloat, 32, 1}, shape, nullptr, 0};
    const std::string why = refusal(compiled, {t, t});
    CHECK(why.find("argument 0 'out'") != std::string::npos);
    CHECK(why.find("more elements or bytes than 64 bits count") != std::string::npos);
  }
  SUBCASE("byte count past 64 bits") {
    int64_t shape[2] = {int64_t{1} << 31, int64_t{1} << 31};
    DLTensor t{storage.data(), {kDLCPU, 0}, 2, {kDLFloat, 32, 1}, shape, nullptr, 0};
    CHECK(refusal(compiled, {t, t}).find("more elements or bytes than 64 bits count") != std::string::npos);
  }
  SUBCASE("negative leading dim") {
    int64_t shape[2] = {-4, 16};
    DLTensor t{storage.data(), {kDLCPU, 0}, 2, {kDLFloat, 32, 1}, shape, nullptr, 0};
    const std::string why = refusal(compiled, {t, t});
    CHECK(why.find("argument 0 'out': has a negative dim in [-4, 16]") != std::string::npos);
    CHECK(why.find("no detail found") == std::string::npos);
  }
  SUBCASE("byte_offset of 2^40 past real data") {
    DLTensor t = good;
    t.byte_offset = uint64_t{1} << 40;
    if (!kSanitized) {
      const std::string why = refusal(compiled, {good_out, t});
      CHECK(why.find("argument 1 'x'") != std::string::npos);
      CHECK(why.find("byte_offset 1099511627776 puts the tensor's 256 bytes outside this process's memory") !=
            std::string::npos);
    }
    // Past the end of the address space: refused under any memory layout.
    t.byte_offset = uint64_t{1} << 47;
    CHECK(refusal(compiled, {good_out, t}).find("outside this process's memory") != std::string::npos);
  }
  SUBCASE("byte_offset that overflows or is misaligned") {
    DLTensor t = good;
    t.byte_offset = ~uint64_t{0} - 15;
    CHECK(refusal(compiled, {t, good}).find("overflows 64 bits") != std::string::npos);
    t.byte_offset = 2;
    CHECK(refusal(compiled, {t, good}).find("not a multiple of the element size (4 bytes)") != std::string::npos);
  }
  SUBCASE("a valid byte_offset still passes, every time") {
    DLTensor t = good;
    int64_t shape[2] = {3, 16};
    t.shape = shape;
    t.byte_offset = 16 * sizeof(float);
    DLTensor o = t;
    o.data = out_storage.data();
    o.byte_offset = 0;
    CHECK(refusal(compiled, {o, t}) == "accepted");
    CHECK(refusal(compiled, {o, t}) == "accepted");
    t.byte_offset = uint64_t{1} << 47;  // same shapes as an accepted call: still checked
    CHECK(refusal(compiled, {o, t}) != "accepted");
  }
}

TEST_CASE("overlapping memory: a written tensor sharing a byte with another argument is KD-E030 naming both") {
  const OpSchema schema = scale_schema();
  const CompiledSchema compiled(schema);
  std::vector<float> storage(256);
  int64_t shape[2] = {4, 16};
  int64_t wide[2] = {16, 1};  // rows of 16 floats
  int64_t padded[2] = {32, 1};  // rows of 32 floats: two tensors side by side
  const DLTensor base{storage.data(), {kDLCPU, 0}, 2, {kDLFloat, 32, 1}, shape, wide, 0};
  const auto at = [&](size_t offset, int64_t* strides) {
    DLTensor t = base;
    t.data = storage.data() + offset;
    t.strides = strides;
    return t;
  };
  const std::string overlaps = "argument 0 'out': is written by the op, and its memory overlaps that of argument 1 'x'";
  CHECK(refusal(compiled, {at(0, wide), at(64, wide)}) == "accepted");
  CHECK(refusal(compiled, {at(0, wide), at(64, wide)}) == "accepted");  // remembered
  SUBCASE("one tensor as both") { CHECK(refusal(compiled, {at(0, wide), at(0, wide)}).find(overlaps) != std::string::npos); }
  SUBCASE("shifted by one element, after an accepted call of the same shapes") {
    CHECK(refusal(compiled, {at(1, wide), at(0, wide)}).find(overlaps) != std::string::npos);
    CHECK(refusal(compiled, {at(63, nullptr), at(0, nullptr)}).find(overlaps) != std::string::npos);
  }
  // Strided views (refused by this schema's contiguous layout) through may_overlap.
  SUBCASE("interleaved rows of one buffer share no byte") {
    CHECK(may_overlap(at(0, padded), at(16, padded)) == false);
    CHECK(may_overlap(at(16, padded), at(0, padded)) == false);
    CHECK(may_overlap(at(8, padded), at(16, padded)) == true);
    CHECK(may_overlap(at(16, padded), at(47, padded)) == true);  // the next row's first float
  }
  SUBCASE("even and odd columns") {
    int64_t cols[2] = {32, 2};
    CHECK(may_overlap(at(0, cols), at(1, cols)) == false);
    CHECK(may_overlap(at(0, cols), at(2, cols)) == true);
    CHECK(may_overlap(at(0, cols), at(0, padded)) == true);
  }
  SUBCASE("negative strides reach below the data pointer") {
    int64_t reversed[2] = {-16, 1};
    CHECK(may_overlap(at(64, wide), at(112, reversed)) == true);
    CHECK(may_overlap(at(0, wide), at(112, reversed)) == false);
  }
  SUBCASE("tensors without elements never overlap") {
    int64_t empty[2] = {0, 16};
    DLTensor out = at(0, wide);
    DLTensor x = at(0, wide);
    out.shape = x.shape = empty;
    CHECK(refusal(compiled, {out, x}) == "accepted");
  }
  SUBCASE("a byte_offset counts") {
    DLTensor x = at(0, wide);
    x.byte_offset = 60 * sizeof(float);
    CHECK(refusal(compiled, {at(0, wide), x}).find(overlaps) != std::string::npos);
    x.byte_offset = 64 * sizeof(float);
    CHECK(refusal(compiled, {at(0, wide), x}) == "accepted");
  }
}

TEST_CASE("overlapping memory: strided tensors of a remembered call are refused when they share a byte, every time") {
  SchemaFileResult parsed = parse_op_schemas(R"([{"op": "test.strided_scale",
    "tensors": [{"name": "out", "shape": ["*", "H"], "dtype": "float32", "written": true, "strided": true},
                {"name": "x", "shape": ["*", "H"], "dtype": "float32", "strided": true}]}])",
                                             "<test>");
  REQUIRE(parsed.errors.empty());
  const CompiledSchema compiled(parsed.schemas.at(0));
  std::vector<float> storage(256);
  int64_t shape[2] = {4, 16};
  int64_t wide[2] = {16, 1};
  int64_t padded[2] = {32, 1};     // rows of 32 floats: two tensors side by side
  int64_t reversed[2] = {-16, 1};  // the rows below the data pointer
  const auto at = [&](size_t offset, int64_t* strides) {
    return DLTensor{storage.data() + offset, {kDLCPU, 0}, 2, {kDLFloat, 32, 1}, shape, strides, 0};
  };
  const std::string overlaps = "argument 0 'out': is written by the op, and its memory overlaps that of argument 1 'x'";
  SUBCASE("interleaved rows of one buffer") {
    for (int i = 0; i < 3; ++i) CHECK(refusal(compiled, {at(0, padded), at(16, padded)}) == "accepted");
    CHECK(refusal(compiled, {at(8, padded), at(16, padded)}).find(overlaps) != std::string::npos);
    CHECK(refusal(compiled, {at(16, padded), at(47, padded)}).find(overlaps) != std::string::npos);
    CHECK(refusal(compiled, {at(16, padded), at(0, padded)}) == "accepted");
  }
  SUBCASE("negative strides reach below the data pointer") {
    // x's rows start at floats 112, 96, 80 and 64: it covers [64, 128).
    for (int i = 0; i < 3; ++i) CHECK(refusal(compiled, {at(0, wide), at(112, reversed)}) == "accepted");
    CHECK(refusal(compiled, {at(48, wide), at(112, reversed)}).find(overlaps) != std::string::npos);
    CHECK(refusal(compiled, {at(128, wide), at(112, reversed)}) == "accepted");
    CHECK(refusal(compiled, {at(112, wide), at(112, reversed)}).find(overlaps) != std::string::npos);
  }
  SUBCASE("the same strides given, or none") {
    for (int i = 0; i < 3; ++i) CHECK(refusal(compiled, {at(0, wide), at(64, nullptr)}) == "accepted");
    CHECK(refusal(compiled, {at(0, nullptr), at(63, wide)}).find(overlaps) != std::string::npos);
    CHECK(refusal(compiled, {at(1, wide), at(64, nullptr)}).find(overlaps) != std::string::npos);
  }
}
