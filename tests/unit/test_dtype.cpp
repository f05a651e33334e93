// The dtype table (names, sizes, DLPack codes) and the 8-bit floats in op
// schemas and manifests.
#include <doctest/doctest.h>

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "kdispatch/dtype.hpp"
#include "kdispatch/manifest.hpp"
#include "kdispatch/schema.hpp"

using namespace kdispatch;

namespace {

bool same(DLDataType a, DLDataType b) { return a.code == b.code && a.bits == b.bits && a.lanes == b.lanes; }

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("dtype table: every dtype's name parses back and its DLPack type maps back") {
  for (Dtype d : kAllDtypes) {
    INFO(dtype_name(d));
    CHECK(parse_dtype(dtype_name(d)) == d);
    CHECK(to_dlpack(d).bits == dtype_size(d) * 8);
    CHECK(to_dlpack(d).lanes == 1);
    // bool travels as an unsigned byte, which reads back as uint8.
    if (d != Dtype::bool_) CHECK(from_dlpack(to_dlpack(d)) == d);
    CHECK(describe_unknown_dlpack(to_dlpack(d)).empty());
  }
}

TEST_CASE("dtype table: the 8-bit floats, with DLPack 1.1's codes") {
  CHECK(parse_dtype("float8_e4m3fn") == Dtype::float8_e4m3fn);
  CHECK(parse_dtype("float8_e5m2") == Dtype::float8_e5m2);
  CHECK(dtype_name(Dtype::float8_e4m3fn) == "float8_e4m3fn");
  CHECK(dtype_name(Dtype::float8_e5m2) == "float8_e5m2");
  CHECK_FALSE(parse_dtype("float8"));
  CHECK_FALSE(parse_dtype("float8_e4m3"));
  CHECK(dtype_size(Dtype::float8_e4m3fn) == 1);
  CHECK(dtype_size(Dtype::float8_e5m2) == 1);
  CHECK(is_floating(Dtype::float8_e4m3fn));
  CHECK(is_floating(Dtype::float8_e5m2));
  CHECK_FALSE(is_floating(Dtype::uint8));
  // DLDataTypeCode of DLPack 1.1: kDLFloat8_e4m3fn = 10, kDLFloat8_e5m2 = 12.
  CHECK(same(to_dlpack(Dtype::float8_e4m3fn), DLDataType{10, 8, 1}));
  CHECK(same(to_dlpack(Dtype::float8_e5m2), DLDataType{12, 8, 1}));
  CHECK(from_dlpack(DLDataType{10, 8, 1}) == Dtype::float8_e4m3fn);
  CHECK(from_dlpack(DLDataType{12, 8, 1}) == Dtype::float8_e5m2);
  CHECK_FALSE(from_dlpack(DLDataType{10, 16, 1}));
  CHECK_FALSE(from_dlpack(DLDataType{12, 8, 4}));
  // DLPack 1.1's other narrow floats (e4m3fnuz 11, e5m2fnuz 13, e8m0fnu 14, ...).
  for (const int number : {7, 8, 9, 11, 13, 14, 15, 16, 17}) {
    const auto code = static_cast<uint8_t>(number);
    INFO("code " << number);
    CHECK_FALSE(from_dlpack(DLDataType{code, 8, 1}));
    const std::string why = describe_unknown_dlpack(DLDataType{code, 8, 1});
    CHECK(contains(why, "DLPack 1.1 8-, 6- or 4-bit float kdispatch does not handle"));
    CHECK(contains(why, "code " + std::to_string(number) + ", 8 bits, 1 lanes"));
    CHECK(contains(why, "float8_e4m3fn (code 10) and float8_e5m2 (code 12)"));
  }
  CHECK(contains(describe_unknown_dlpack(DLDataType{kDLFloat, 32, 4}), "vector type"));
  CHECK(contains(describe_unknown_dlpack(DLDataType{kDLComplex, 64, 1}), "DLPack type kdispatch does not handle"));
}

TEST_CASE("op schemas and manifests take the 8-bit floats") {
  const auto r = parse_op_schemas(R"([{"op": "t.quant",
      "tensors": [{"name": "out", "shape": ["N"], "dtype": "Q", "written": true},
                  {"name": "x", "shape": ["N"], "dtype": "T"},
                  {"name": "scale", "shape": [1], "dtype": ["float32", "float8_e5m2"]}],
      "dtypes": {"T": ["float32", "bfloat16"], "Q": ["float8_e4m3fn", "float8_e5m2"]},
      "tolerance": {"float8_e4m3fn": {"ulps": 0, "atol": 0, "mean_ulps": 0}}}])",
                                  "inline.json");
  REQUIRE(r.errors.empty());
  REQUIRE(r.schemas.size() == 1);
  const OpSchema& s = r.schemas[0];
  CHECK(s.dtype_vars.at("Q") == std::vector<Dtype>{Dtype::float8_e4m3fn, Dtype::float8_e5m2});
  CHECK(s.tensors[2].dtype_alternatives == std::vector<std::string>{"float8_e5m2"});
  CHECK(s.tolerance(Dtype::float8_e4m3fn) == Tolerance{0, 0, 0});
  // The default: one ulp of the 8-bit float, no absolute slack.
  CHECK(s.tolerance(Dtype::float8_e5m2) == Tolerance{1, 0, 0.25});
  CHECK(default_tolerance(Dtype::float8_e4m3fn) == Tolerance{1, 0, 0.25});

  const auto m = parse_manifest(R"({"kdispatch_manifest": "1.0", "plugin": "p", "backend": "b",
      "library": "libp.so", "abi": "1.0",
      "kernels": [{"op": "g.x", "symbol": "x", "dtypes": ["float8_e4m3fn", "float8_e5m2"]}]})",
                                "inline.json");
  REQUIRE(m.ok());
  CHECK(m.manifest->kernels.at(0).dtypes == std::vector<Dtype>{Dtype::float8_e4m3fn, Dtype::float8_e5m2});

  const auto bad = parse_op_schemas(R"([{"op": "t.op", "tensors": [{"name": "a", "shape": ["N"], "dtype": "T"}],
      "dtypes": {"T": ["float8_e4m3"]}}])",
                                    "inline.json");
  REQUIRE(bad.errors.size() == 1);
  CHECK(bad.errors[0].code == ErrorCode::manifest_bad_field);
  CHECK(contains(bad.errors[0].message, "float8_e4m3fn or float8_e5m2"));
}
