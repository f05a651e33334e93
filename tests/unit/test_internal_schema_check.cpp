// The schema check's tiers agree: a call gets the same verdict (and the same
// dtype and device) from a check that remembers accepted calls as from a
// fresh one that runs the compiled plan, for every single and paired change
// of a valid call. Covers a concrete dtype, two dtype variables, leading
// dims, constants, a "2*R" multiple, a strided argument, and calls too big
// to remember.
#include <doctest/doctest.h>

#include <array>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "kdispatch/error.hpp"
#include "kdispatch/manifest.hpp"
#include "schema_check.hpp"

using namespace kdispatch;

namespace {

constexpr const char* kSchemas = R"([
  {"op": "test.mix",
   "doc": "every kind of dim and dtype",
   "tensors": [
     {"name": "ids", "shape": ["*"],              "dtype": "int32"},
     {"name": "a",   "shape": ["*", "H", "2*R"],  "dtype": "T"},
     {"name": "b",   "shape": ["*", 4, "2*R"],    "dtype": "T", "strided": true},
     {"name": "c",   "shape": ["R"],              "dtype": "U"}],
   "dtypes": {"T": ["float32", "bfloat16"], "U": ["float16", "float32"]}}
])";

OpSchema mix_schema() {
  SchemaFileResult parsed = parse_op_schemas(kSchemas, "<test>");
  REQUIRE(parsed.errors.empty());
  REQUIRE(parsed.schemas.size() == 1);
  return parsed.schemas[0];
}

// A call whose tensors own their shapes and strides, so it can be copied and
// changed freely.
struct Call {
  std::array<std::vector<int64_t>, 4> shapes{{{3}, {3, 5, 4}, {3, 4, 4}, {2}}};
  // Strides are made for the final shape, as DLPack requires ndim of them.
  enum class Layout { none, contiguous, strided };  // NULL, explicit row-major, not row-major
  std::array<Layout, 4> layouts{};
  std::array<std::vector<int64_t>, 4> strides;
  std::array<DLTensor, 4> tensors{};
  std::array<float, 4> storage{};

  Call() {
    const DLDataType i32{kDLInt, 32, 1}, f32{kDLFloat, 32, 1}, f16{kDLFloat, 16, 1};
    const DLDataType dtypes[] = {i32, f32, f32, f16};
    for (size_t i = 0; i < 4; ++i) {
      tensors[i].data = &storage[i];
      tensors[i].device = DLDevice{kDLCPU, 0};
      tensors[i].dtype = dtypes[i];
    }
  }
  std::array<DLTensor, 4> view() {
    std::array<DLTensor, 4> out = tensors;
    for (size_t i = 0; i < 4; ++i) {
      auto& s = shapes[i];
      strides[i].assign(s.size(), 1);
      for (size_t k = s.size(); k-- > 1;) strides[i][k - 1] = strides[i][k] * s[k];
      if (layouts[i] == Layout::strided && !s.empty()) strides[i][0] += 1000;
      out[i].ndim = static_cast<int32_t>(s.size());
      out[i].shape = s.data();
      out[i].strides = layouts[i] == Layout::none ? nullptr : strides[i].data();
    }
    return out;
  }
};


// Single changes of a valid call; some keep it valid. The last four are
// valid calls of other shapes or dtypes.
using Changes = std::vector<std::pair<std::string, std::function<void(Call&)>>>;

Changes changes() {
  Changes out;
  for (size_t i = 0; i < 4; ++i) {
    const std::string t = "tensor " + std::to_string(i);
    out.emplace_back(t + " on cuda", [i](Call& c) { c.tensors[i].device = DLDevice{kDLCUDA, 0}; });
    out.emplace_back(t + " on cpu:1", [i](Call& c) { c.tensors[i].device = DLDevice{kDLCPU, 1}; });
    for (DLDataType d : {DLDataType{kDLFloat, 32, 1}, DLDataType{kDLBfloat, 16, 1}, DLDataType{kDLFloat, 16, 1},
                         DLDataType{kDLInt, 32, 1}, DLDataType{kDLFloat, 32, 2}}) {
      out.emplace_back(t + " dtype " + std::to_string(d.code) + "/" + std::to_string(d.bits) + "x" +
                           std::to_string(d.lanes),
                       [i, d](Call& c) { c.tensors[i].dtype = d; });
    }
    out.emplace_back(t + " null data", [i](Call& c) { c.tensors[i].data = nullptr; });
    out.emplace_back(t + " one more leading dim", [i](Call& c) { c.shapes[i].insert(c.shapes[i].begin(), 1); });
    out.emplace_back(t + " one dim less", [i](Call& c) { c.shapes[i].pop_back(); });
    out.emplace_back(t + " eight dims", [i](Call& c) {
      c.shapes[i].insert(c.shapes[i].begin(), 8 - c.shapes[i].size(), 1);
    });
    for (size_t k = 0; k < 3; ++k) {
      for (int64_t delta : {-1, 1, 2}) {
        out.emplace_back(t + " dim " + std::to_string(k) + " + " + std::to_string(delta), [i, k, delta](Call& c) {
          if (k < c.shapes[i].size()) c.shapes[i][k] += delta;
        });
      }
    }
    out.emplace_back(t + " contiguous strides", [i](Call& c) { c.layouts[i] = Call::Layout::contiguous; });
    out.emplace_back(t + " padded rows", [i](Call& c) { c.layouts[i] = Call::Layout::strided; });
  }
  out.emplace_back("every T bfloat16", [](Call& c) { c.tensors[1].dtype = c.tensors[2].dtype = {kDLBfloat, 16, 1}; });
  out.emplace_back("leading [3] -> [2, 3]", [](Call& c) {
    for (size_t i = 0; i < 3; ++i) c.shapes[i].insert(c.shapes[i].begin(), 2);
  });
  out.emplace_back("R 2 -> 3", [](Call& c) {
    c.shapes[1][2] = c.shapes[2][2] = 6;
    c.shapes[3][0] = 3;
  });
  out.emplace_back("empty leading dim, null data", [](Call& c) {
    for (size_t i = 0; i < 3; ++i) {
      c.shapes[i][0] = 0;
      c.tensors[i].data = nullptr;
    }
  });
  return out;
}

std::optional<CompiledSchema::CallInfo> verdict(const CompiledSchema& schema, std::span<const DLTensor> tensors) {
  try {
    return schema.check(tensors);
  } catch (const CallError& e) {
    CHECK(e.code() == ErrorCode::bad_arguments);
    return std::nullopt;
  }
}

void same_verdict(const std::optional<CompiledSchema::CallInfo>& a, const std::optional<CompiledSchema::CallInfo>& b,
                  const std::string& what) {
  INFO(what);
  REQUIRE(a.has_value() == b.has_value());
  if (a) {
    CHECK(a->dtype == b->dtype);
    CHECK(a->device.device_type == b->device.device_type);
    CHECK(a->device.device_id == b->device.device_id);
  }
}

}  // namespace

TEST_CASE("schema check: a remembering check and a fresh one agree on every single and paired change") {
  const OpSchema schema = mix_schema();
  const auto all = changes();
  // Warm: remembers the base call and three others (a full set of entries).
  CompiledSchema warm(schema);
  {
    Call base;
    auto v = base.view();
    REQUIRE(verdict(warm, v).has_value());
    for (size_t k : {all.size() - 4, all.size() - 3, all.size() - 2}) {
      Call other;
      all[k].second(other);
      auto o = other.view();
      REQUIRE_MESSAGE(verdict(warm, o).has_value(), all[k].first);
    }
  }
  size_t accepted = 0, refused = 0;
  for (size_t x = 0; x < all.size(); ++x) {
    for (size_t y = x; y < all.size(); ++y) {
      Call call;
      all[x].second(call);
      if (y != x) all[y].second(call);
      const auto v = call.view();
      const CompiledSchema fresh(schema);
      const auto expected = verdict(fresh, v);
      const std::string what = all[x].first + (y != x ? " + " + all[y].first : "");
      same_verdict(expected, verdict(warm, v), what);
      // Once more: an accepted call is now remembered, a refused one is not.
      same_verdict(expected, verdict(warm, v), what + " (again)");
      (expected ? accepted : refused) += 1;
    }
  }
  // Both verdicts occur often enough for the comparison to mean something.
  CHECK(accepted > 100);
  CHECK(refused > 1000);
  // The base call, accepted again, is among the remembered ones.
  Call base;
  auto v = base.view();
  CompiledSchema::CallInfo info;
  REQUIRE(verdict(warm, v).has_value());
  CHECK(warm.matches_remembered(v, &info));
  CHECK(info.dtype == Dtype::float32);
}

TEST_CASE("schema check: known verdicts of the mixed schema") {
  const CompiledSchema schema(mix_schema());
  Call base;
  auto v = base.view();
  const auto info = schema.check(v);
  CHECK(info.dtype == Dtype::float32);  // T, the first variable, selects
  Call bf16;
  bf16.tensors[1].dtype = bf16.tensors[2].dtype = {kDLBfloat, 16, 1};
  auto vb = bf16.view();
  CHECK(schema.check(vb).dtype == Dtype::bfloat16);
  Call odd;  // 2*R must be even
  odd.shapes[1][2] = odd.shapes[2][2] = 5;
  auto vo = odd.view();
  CHECK_THROWS_WITH_AS(schema.check(vo), doctest::Contains("must be a multiple of 2 (2*R)"), CallError);
  Call deep;  // more dims than a remembered row holds: checked by the plan every time
  for (size_t i = 0; i < 3; ++i) deep.shapes[i].insert(deep.shapes[i].begin(), 6, 1);
  auto vd = deep.view();
  CHECK(schema.check(vd).dtype == Dtype::float32);
  CompiledSchema::CallInfo out;
  CHECK_FALSE(schema.matches_remembered(vd, &out));
  CHECK(schema.check(vd).dtype == Dtype::float32);
}

namespace {

constexpr const char* kRowsSchemas = R"([
  {"op": "test.rows",
   "doc": "row-strided views, a dtype list, an optional tensor, a requirement",
   "tensors": [
     {"name": "pos", "shape": ["*"],              "dtype": ["int64", "int32"]},
     {"name": "q",   "shape": ["*", "H", "D"],    "dtype": "T", "layout": "rows"},
     {"name": "k",   "shape": ["*", "G", "D"],    "dtype": "T", "layout": "rows", "optional": true},
     {"name": "cache", "shape": ["P", "2*R"],     "dtype": ["T", "float32"]}],
   "requires": ["2*R <= D"],
   "dtypes": {"T": ["float16", "bfloat16"]}}
])";

struct RowsCall {
  std::vector<int64_t> pos_shape{3}, q_shape{3, 4, 8}, k_shape{3, 2, 8}, cache_shape{16, 6};
  std::vector<int64_t> q_strides{100, 8, 1}, k_strides{100, 8, 1};
  std::array<uint16_t, 512> storage{};
  std::array<DLTensor, 4> tensors{};
  RowsCall() {
    const DLDataType i64{kDLInt, 64, 1}, bf16{kDLBfloat, 16, 1}, f32{kDLFloat, 32, 1};
    tensors[0] = DLTensor{storage.data(), {kDLCPU, 0}, 1, i64, pos_shape.data(), nullptr, 0};
    tensors[1] = DLTensor{storage.data(), {kDLCPU, 0}, 3, bf16, q_shape.data(), q_strides.data(), 0};
    tensors[2] = DLTensor{storage.data(), {kDLCPU, 0}, 3, bf16, k_shape.data(), k_strides.data(), 0};
    tensors[3] = DLTensor{storage.data(), {kDLCPU, 0}, 2, f32, cache_shape.data(), nullptr, 0};
  }
};

std::string refusal(const CompiledSchema& compiled, std::span<const DLTensor> tensors) {
  try {
    compiled.check(tensors);
  } catch (const CallError& e) {
    return e.message();
  }
  return "";
}

}  // namespace

TEST_CASE("schema check: rows layout, dtype lists, optional tensors and requirements") {
  SchemaFileResult parsed = parse_op_schemas(kRowsSchemas, "<test>");
  REQUIRE(parsed.errors.empty());
  const CompiledSchema compiled(parsed.schemas.at(0));
  RowsCall call;
  CHECK(refusal(compiled, call.tensors) == "");
  CHECK(compiled.check(call.tensors).dtype == Dtype::bfloat16);
  SUBCASE("the other entries of dtype lists") {
    call.tensors[0].dtype = DLDataType{kDLInt, 32, 1};
    call.tensors[3].dtype = DLDataType{kDLBfloat, 16, 1};
    CHECK(refusal(compiled, call.tensors) == "");
    call.tensors[3].dtype = DLDataType{kDLFloat, 16, 1};
    CHECK(refusal(compiled, call.tensors).find("expected dtype T = bfloat16 (as 'q') or float32, got float16") !=
          std::string::npos);
  }
  SUBCASE("an absent optional tensor, a present one again") {
    call.tensors[2] = DLTensor{};
    CHECK(refusal(compiled, call.tensors) == "");
    CHECK(refusal(compiled, call.tensors) == "");  // remembered
    RowsCall again;
    CHECK(refusal(compiled, again.tensors) == "");
  }
  SUBCASE("strides beyond 2^31 elements and an odd stride on a size-1 dim") {
    call.q_strides = {int64_t{3} << 31, 8, 1};
    call.q_shape[0] = 1;
    call.pos_shape[0] = 1;
    call.k_shape[0] = 1;
    call.q_strides[0] = 7;
    CHECK(refusal(compiled, call.tensors) == "");
  }
  SUBCASE("a last dim that is not contiguous") {
    call.q_strides = {100, 16, 2};
    CHECK(refusal(compiled, call.tensors).find("'q': must have a contiguous last dim") != std::string::npos);
  }
  SUBCASE("strides whose extent overflows") {
    call.q_strides = {int64_t{1} << 62, 8, 1};
    CHECK(refusal(compiled, call.tensors).find("addresses more bytes than 64 bits count") != std::string::npos);
  }
  SUBCASE("a broken requirement names the symbols") {
    call.cache_shape[1] = 10;
    CHECK(refusal(compiled, call.tensors) ==
          "op 'test.rows': the call breaks the schema's requirement 2*R <= D: R = 5 (from 'cache'), D = 8 (from 'q')");
  }
}

TEST_CASE("schema check: 8-bit float tensors where the schema declares them, KD-E030 elsewhere") {
  SchemaFileResult parsed = parse_op_schemas(R"([
    {"op": "test.quant",
     "tensors": [{"name": "out", "shape": ["*", "H"], "dtype": "Q", "written": true},
                 {"name": "x", "shape": ["*", "H"], "dtype": "T"},
                 {"name": "scale", "shape": [1], "dtype": "float32"}],
     "dtypes": {"T": ["float32", "bfloat16"], "Q": ["float8_e4m3fn", "float8_e5m2"]}}])",
                                             "<test>");
  REQUIRE(parsed.errors.empty());
  const CompiledSchema compiled(parsed.schemas.at(0));
  std::vector<int64_t> shape{3, 8}, one{1};
  std::array<uint8_t, 24> out{};
  std::array<float, 24> x{};
  float scale = 1.0f;
  const DLDataType e4m3{KD_DLPACK_FLOAT8_E4M3FN, 8, 1}, e5m2{KD_DLPACK_FLOAT8_E5M2, 8, 1}, f32{kDLFloat, 32, 1};
  std::array<DLTensor, 3> tensors{DLTensor{out.data(), {kDLCPU, 0}, 2, e4m3, shape.data(), nullptr, 0},
                                  DLTensor{x.data(), {kDLCPU, 0}, 2, f32, shape.data(), nullptr, 0},
                                  DLTensor{&scale, {kDLCPU, 0}, 1, f32, one.data(), nullptr, 0}};
  CHECK(refusal(compiled, tensors) == "");
  tensors[0].dtype = e5m2;
  CHECK(refusal(compiled, tensors) == "");
  // The dtype of the first dtype variable's tensor selects the kernel.
  CHECK(compiled.check(tensors).dtype == Dtype::float8_e5m2);
  tensors[0].dtype = DLDataType{11, 8, 1};  // float8_e4m3fnuz
  CHECK(refusal(compiled, tensors).find("'out'") != std::string::npos);
  CHECK(refusal(compiled, tensors).find("expected dtype Q in [float8_e4m3fn, float8_e5m2], got a DLPack 1.1 8-, "
                                        "6- or 4-bit float kdispatch does not handle (code 11") != std::string::npos);
  tensors[0].dtype = e4m3;
  tensors[1].dtype = e4m3;
  CHECK(refusal(compiled, tensors).find("'x'") != std::string::npos);
  CHECK(refusal(compiled, tensors).find("expected dtype T in [float32, bfloat16], got float8_e4m3fn") !=
        std::string::npos);
  tensors[1].dtype = f32;
  tensors[2].dtype = e5m2;
  CHECK(refusal(compiled, tensors).find("'scale'") != std::string::npos);
  CHECK(refusal(compiled, tensors).find("float8_e5m2") != std::string::npos);
}

TEST_CASE("schema check: requirements are conditions of the kernel constraint language") {
  std::string text = kRowsSchemas;
  const std::string from = R"("requires": ["2*R <= D"])";
  text.replace(text.find(from), from.size(), R"("requires": ["2*R <= D and D % 4 == 0", "P / (H - 4) > 0"])");
  SchemaFileResult parsed = parse_op_schemas(text, "<test>");
  REQUIRE(parsed.errors.empty());
  const CompiledSchema compiled(parsed.schemas.at(0));
  RowsCall call;  // H = 4
  CHECK(refusal(compiled, call.tensors) ==
        "op 'test.rows': the call breaks the schema's requirement P / (H - 4) > 0 (division by zero): P = 16 (from "
        "'cache'), H = 4 (from 'q')");
  call.q_shape[1] = 5;
  CHECK(refusal(compiled, call.tensors) == "");
  call.q_shape[2] = call.k_shape[2] = 6;
  CHECK(refusal(compiled, call.tensors) ==
        "op 'test.rows': the call breaks the schema's requirement 2*R <= D and D % 4 == 0: R = 3 (from 'cache'), D = "
        "6 (from 'q')");
}

TEST_CASE("schema check: bad uses of the new schema keys are KD-E011") {
  const auto errors_of = [](const std::string& tensors, const std::string& extra) {
    const std::string text = R"([{"op": "test.bad", "tensors": [)" + tensors + "]" + extra +
                             R"(, "dtypes": {"T": ["float32"]}}])";
    SchemaFileResult parsed = parse_op_schemas(text, "<test>");
    std::string all;
    for (const auto& e : parsed.errors) all += e.message + "\n";
    return all;
  };
  const std::string x = R"({"name": "x", "shape": ["*", "D"], "dtype": "T"})";
  CHECK(errors_of(R"({"name": "x", "shape": ["D"], "dtype": "T", "optional": true})", "")
            .find("the first tensor cannot be optional") != std::string::npos);
  CHECK(errors_of(x + R"(, {"name": "y", "shape": ["D"], "dtype": "T", "layout": "diagonal"})", "")
            .find("\"contiguous\", \"rows\" or \"any\"") != std::string::npos);
  CHECK(errors_of(x + R"(, {"name": "y", "shape": ["D"], "dtype": ["float32", "T"]})", "")
            .find("only the first entry may be a variable") != std::string::npos);
  CHECK(errors_of(x, R"(, "requires": ["D <= Q"])").find("no tensor's shape has the symbol Q") != std::string::npos);
  CHECK(errors_of(x, R"(, "requires": ["D"])").find("not a condition: compare it with one of ==, !=, <, <=, >, >=") != std::string::npos);
  CHECK(errors_of(x + R"(, {"name": "y", "shape": ["E"], "dtype": "T", "optional": true}, )"
                      R"({"name": "z", "shape": ["E"], "dtype": "T"})",
                  "")
            .find("which only the optional tensor 'y' binds") != std::string::npos);
  // "flattened": an int attribute with default 0, a pattern of two dims
  // after "*", not the tensor that binds "*".
  const std::string ids = R"({"name": "ids", "shape": ["*"], "dtype": "int32"}, )";
  const std::string q = R"({"name": "q", "shape": ["*", "H", "D"], "dtype": "T", "flattened": "hs"})";
  const std::string hs0 = R"(, "attrs": [{"name": "hs", "type": "int", "default": 0}])";
  CHECK(errors_of(ids + q, hs0).empty());
  CHECK(errors_of(ids + q, "").find("\"flattened\": the op has no attribute 'hs'") != std::string::npos);
  CHECK(errors_of(ids + q, R"(, "attrs": [{"name": "hs", "type": "float", "default": 0.0}])")
            .find("attribute 'hs' must be an int with default 0") != std::string::npos);
  CHECK(errors_of(ids + q, R"(, "attrs": [{"name": "hs", "type": "int", "default": 64}])")
            .find("attribute 'hs' must be an int with default 0") != std::string::npos);
  CHECK(errors_of(ids + q, R"(, "attrs": [{"name": "hs", "type": "int"}])")
            .find("attribute 'hs' must be an int with default 0") != std::string::npos);
  CHECK(errors_of(ids + R"({"name": "q", "shape": ["*", "D"], "dtype": "T", "flattened": "hs"})", hs0)
            .find("needs two dims after \"*\"") != std::string::npos);
  CHECK(errors_of(q, hs0).find("the first tensor with \"*\" cannot be flattened") != std::string::npos);
  CHECK(errors_of(ids + R"({"name": "q", "shape": ["*", "H", "D"], "dtype": "T", "flattened": 3})", hs0)
            .find("the name of an int attribute of the op") != std::string::npos);
}

TEST_CASE("schema check: unflatten splits [*, L] into [*, L/N, N] and leaves every other call as it is") {
  SchemaFileResult parsed = parse_op_schemas(R"([{"op": "test.flat", "tensors": [
      {"name": "ids", "shape": ["*"], "dtype": "int32"},
      {"name": "q", "shape": ["*", "H", "D"], "dtype": "T", "layout": "rows", "flattened": "hs"},
      {"name": "k", "shape": ["*", "G", "D"], "dtype": "T", "layout": "rows", "optional": true, "flattened": "hs"}],
    "attrs": [{"name": "eps", "type": "float", "default": 0.5}, {"name": "hs", "type": "int", "default": 0}],
    "dtypes": {"T": ["float32"]}}])",
                                             "<test>");
  REQUIRE(parsed.errors.empty());
  const CompiledSchema compiled(parsed.schemas[0]);
  CHECK(compiled.has_flattened());
  std::array<float, 64> data{};
  std::array<int32_t, 2> ids{};
  std::vector<int64_t> ishape{2}, qshape{2, 12}, qstrides{20, 1}, kshape{2, 4};
  const DLDataType f32{kDLFloat, 32, 1};
  std::array<DLTensor, 3> call{DLTensor{ids.data(), {kDLCPU, 0}, 1, {kDLInt, 32, 1}, ishape.data(), nullptr, 0},
                               DLTensor{data.data(), {kDLCPU, 0}, 2, f32, qshape.data(), qstrides.data(), 0},
                               DLTensor{data.data() + 40, {kDLCPU, 0}, 2, f32, kshape.data(), nullptr, 0}};
  const auto attrs = [](int64_t hs) {
    return std::array<kd_attr, 2>{kd_attr{"eps", KD_ATTR_TYPE_FLOAT, 0, {.f = 0.5}},
                                  kd_attr{"hs", KD_ATTR_TYPE_INT, 0, {.i = hs}}};
  };
  UnflattenedCall storage;
  // hs 0: nothing split, the call as it is.
  CHECK(compiled.unflatten(call, attrs(0), &storage).data() == call.data());
  // hs 4: q [2, 12] strides [20, 1] -> [2, 3, 4] strides [20, 4, 1]; k dense [2, 4] -> [2, 1, 4] dense.
  const auto a4 = attrs(4);
  const std::span<DLTensor> seen = compiled.unflatten(call, a4, &storage);
  REQUIRE(seen.data() == storage.tensors.data());
  CHECK(seen[0].shape == call[0].shape);
  CHECK(std::vector<int64_t>(seen[1].shape, seen[1].shape + seen[1].ndim) == std::vector<int64_t>{2, 3, 4});
  CHECK(std::vector<int64_t>(seen[1].strides, seen[1].strides + seen[1].ndim) == std::vector<int64_t>{20, 4, 1});
  CHECK(seen[1].data == call[1].data);
  CHECK(std::vector<int64_t>(seen[2].shape, seen[2].shape + seen[2].ndim) == std::vector<int64_t>{2, 1, 4});
  CHECK(seen[2].strides == nullptr);
  CHECK(call[1].ndim == 2);  // the given tensors are left alone
  CHECK_NOTHROW(compiled.check_plan(seen, call, a4));
  // An absent optional tensor stays absent.
  call[2] = DLTensor{nullptr, {kDLCPU, 0}, 0, {0, 0, 0}, nullptr, nullptr, 0};
  const std::span<DLTensor> without_k = compiled.unflatten(call, a4, &storage);
  CHECK(without_k[2].data == nullptr);
  CHECK(without_k[2].ndim == 0);
  CHECK_NOTHROW(compiled.check_plan(without_k, call, a4));
  // The plain form with hs = D is left as it is.
  std::vector<int64_t> plain{2, 3, 4}, plain_strides{20, 4, 1};
  call[1].ndim = 3;
  call[1].shape = plain.data();
  call[1].strides = plain_strides.data();
  CHECK(compiled.unflatten(call, a4, &storage).data() == call.data());
  // Every split dim of a flattened tensor with leading dims [2, 1].
  std::vector<int64_t> ishape2{2, 1}, qshape2{2, 1, 12};
  call[0].ndim = 2;
  call[0].shape = ishape2.data();
  call[1].ndim = 3;
  call[1].shape = qshape2.data();
  call[1].strides = nullptr;
  const auto a3 = attrs(3);
  const std::span<DLTensor> split = compiled.unflatten(call, a3, &storage);
  CHECK(std::vector<int64_t>(split[1].shape, split[1].shape + split[1].ndim) == std::vector<int64_t>{2, 1, 4, 3});
}
