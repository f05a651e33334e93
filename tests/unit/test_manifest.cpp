// Manifest and op-schema parsing: the fixtures under tests/fixtures/manifests,
// the shipped manifests, and the rules of DESIGN.md section 5.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <set>
#include <string>
#include <vector>

#include "kdispatch/manifest.hpp"

namespace fs = std::filesystem;
using namespace kdispatch;

namespace {

const fs::path kFixtures = fs::path(KDISPATCH_FIXTURES_DIR) / "manifests";
const fs::path kSource = KDISPATCH_SOURCE_DIR;
const fs::path kGpuManifests = KDISPATCH_GPU_MANIFEST_DIR;  // cuda.json, hip.json

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

std::vector<fs::path> json_files(const fs::path& dir) {
  std::vector<fs::path> files;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.path().extension() == ".json") files.push_back(entry.path());
  }
  std::sort(files.begin(), files.end());
  return files;
}

std::string all_messages(const std::vector<Problem>& problems) {
  std::string out;
  for (const auto& p : problems) out += code_string(p.code) + " " + p.message + "\n";
  return out;
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

struct Expectation {
  std::string code;
  std::string substring;
};

// EXPECTED.txt: "FILE CODE SUBSTRING..." per line; '#' starts a comment line.
std::map<std::string, Expectation> read_expectations(const fs::path& path) {
  std::map<std::string, Expectation> out;
  std::istringstream lines(read_text(path));
  std::string line;
  while (std::getline(lines, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream fields(line);
    std::string file;
    Expectation e;
    fields >> file >> e.code;
    std::getline(fields >> std::ws, e.substring);
    out.emplace(file, e);
  }
  return out;
}

const char* const kMinimalHead = R"({"kdispatch_manifest": "1.0", "plugin": "p", "backend": "b",
  "library": "libp.so", "abi": "1.0", )";

ManifestResult parse_with(const std::string& rest) {
  return parse_manifest(std::string(kMinimalHead) + rest + "}", "inline.json");
}

// A one-op schema file whose first tensor has `shape` (a JSON list).
SchemaFileResult schema_with_shape(const std::string& shape) {
  return parse_op_schemas(R"([{"op": "t.op", "tensors": [{"name": "a", "shape": )" + shape +
                              R"(, "dtype": "float32"}]}])",
                          "inline.json");
}

}  // namespace

TEST_CASE("bad manifest fixtures: one error each, with its code, the file and the field") {
  const fs::path dir = kFixtures / "bad";
  const auto expected = read_expectations(dir / "EXPECTED.txt");
  const auto files = json_files(dir);
  CHECK(files.size() >= 30);
  CHECK(files.size() == expected.size());
  for (const auto& path : files) {
    const std::string name = path.filename().string();
    CAPTURE(name);
    const auto it = expected.find(name);
    REQUIRE_MESSAGE(it != expected.end(), name << " is not listed in EXPECTED.txt");
    const auto result = read_manifest(path);
    CAPTURE(all_messages(result.errors));
    CHECK_FALSE(result.ok());
    REQUIRE(result.errors.size() == 1);
    const Problem& p = result.errors[0];
    CHECK(code_string(p.code) == it->second.code);
    CHECK(p.file == path.string());
    CHECK(contains(p.message, path.string()));
    CHECK(contains(p.message, it->second.substring));
  }
  for (const auto& entry : expected) {
    const std::string& name = entry.first;  // not a structured binding: doctest captures it in a lambda
    CHECK_MESSAGE(fs::exists(dir / name), "EXPECTED.txt lists a missing file: " << name);
  }
}

TEST_CASE("good manifest fixtures parse") {
  const fs::path dir = kFixtures / "good";
  for (const auto& path : json_files(dir)) {
    CAPTURE(path.string());
    const auto result = read_manifest(path);
    CAPTURE(all_messages(result.errors));
    CHECK(result.ok());
  }

  SUBCASE("minimal: no kernels") {
    const auto r = read_manifest(dir / "minimal.json");
    REQUIRE(r.ok());
    CHECK(r.warnings.empty());
    CHECK(r.manifest->kernels.empty());
    CHECK(r.manifest->targets.empty());
    CHECK(r.manifest->format == "1.0");
    CHECK(r.manifest->library_path() == dir / "libkdispatch-empty.so");
  }
  SUBCASE("targets of each kind, inherited and replaced") {
    const auto r = read_manifest(dir / "all_targets.json");
    REQUIRE(r.ok());
    CHECK(r.warnings.empty());
    const Manifest& m = *r.manifest;
    CHECK(m.library == "libkdispatch-multi.so.1");
    CHECK(m.sha256 == std::string("0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"));
    REQUIRE(m.targets.size() == 3);
    CHECK(m.targets[0].device == DeviceType::cpu);
    CHECK(m.targets[0].features == std::vector<std::string>{"avx2", "fma"});
    CHECK(m.targets[1].device == DeviceType::cuda);
    CHECK(m.targets[1].min_arch == CudaArch{8, 0});
    CHECK(m.targets[1].max_arch == CudaArch{9, 0});
    CHECK(m.targets[2].archs == std::vector<std::string>{"gfx90a", "gfx942"});
    REQUIRE(m.kernels.size() == 4);
    CHECK(m.kernels[0].targets == m.targets);
    CHECK(m.kernels[0].dtypes.empty());
    CHECK(m.kernels[0].description == "inherits the three targets");
    REQUIRE(m.kernels[1].targets.size() == 1);
    CHECK(m.kernels[1].targets[0].str() == "cuda[9.0, -]");
    CHECK(m.kernels[1].dtypes == std::vector<Dtype>{Dtype::float16, Dtype::bfloat16});
    CHECK(m.kernels[2].targets.empty());
    CHECK(m.kernels[3].targets.size() == 3);
    for (const auto& k : m.kernels) {
      CHECK(k.plugin == "multi");
      CHECK(k.backend == "multi");
      CHECK(k.manifest == (dir / "all_targets.json").string());
    }
  }
  SUBCASE("a newer minor format loads with a warning") {
    const auto r = read_manifest(dir / "newer_minor.json");
    REQUIRE(r.ok());
    REQUIRE(r.warnings.size() == 1);
    CHECK(r.warnings[0].code == ErrorCode::manifest_bad_version);
    CHECK(contains(r.warnings[0].message, "/kdispatch_manifest: format 1.3 is newer"));
  }
  SUBCASE("unknown keys are warnings naming their pointer; $schema is accepted silently") {
    const auto r = read_manifest(dir / "unknown_keys.json");
    REQUIRE(r.ok());
    const auto text = all_messages(r.warnings);
    CAPTURE(text);
    CHECK(r.warnings.size() == 3);
    CHECK(contains(text, "/color: unknown key"));
    CHECK(contains(text, "/kernels/0/weight: unknown key"));
    CHECK(contains(text, "/targets/0/vendor: unknown key"));
    CHECK_FALSE(contains(text, "$schema"));
  }
  SUBCASE("a third-party plugin defines its own op") {
    const auto r = read_manifest(dir / "third_party_op.json");
    REQUIRE(r.ok());
    CHECK(r.warnings.empty());
    REQUIRE(r.manifest->ops.size() == 1);
    const OpSchema& s = r.manifest->ops[0];
    CHECK(s.op == "acme.scale");
    CHECK(s.source == (dir / "third_party_op.json").string());
    REQUIRE(s.tensors.size() == 4);
    CHECK(s.tensors[1].layout == Layout::any);
    CHECK(s.tensors[3].shape[0].str() == "16");
    CHECK(s.tensors[3].shape[1].str() == "4*N");
    CHECK(s.allowed_dtypes(s.tensors[3]) == std::vector<Dtype>{Dtype::int32});
    CHECK(s.allowed_dtypes(s.tensors[0]) == std::vector<Dtype>{Dtype::float32, Dtype::float64});
    REQUIRE(s.attrs.size() == 4);
    CHECK(s.attrs[0].default_value == AttrValue(1.0));  // an integer literal for a float attr
    CHECK(s.attrs[1].default_value == AttrValue(std::string("fast")));
    CHECK(s.attrs[1].doc == "fast or exact");
    CHECK_FALSE(s.attrs[2].default_value.has_value());
    CHECK(s.attrs[2].type == AttrType::int_);
    CHECK(s.attrs[3].default_value == AttrValue(false));
  }
}

TEST_CASE("shipped manifests and op schemas parse with no errors and no warnings") {
  auto manifests = json_files(kSource / "manifests");
  for (const auto& path : json_files(kGpuManifests)) manifests.push_back(path);
  CHECK(manifests.size() >= 4);
  for (const auto& path : manifests) {
    CAPTURE(path.string());
    const auto r = read_manifest(path);
    CAPTURE(all_messages(r.errors) + all_messages(r.warnings));
    REQUIRE(r.ok());
    CHECK(r.warnings.empty());
    CHECK_FALSE(r.manifest->kernels.empty());
    CHECK(r.manifest->plugin == r.manifest->backend);
    CHECK(r.manifest->library == "libkdispatch-" + r.manifest->plugin + ".so");
    for (const auto& k : r.manifest->kernels) CHECK(k.targets == r.manifest->targets);
  }
  const auto schema_files = json_files(kSource / "manifests" / "ops");
  CHECK(schema_files.size() >= 4);
  std::set<std::string> ops;
  for (const auto& path : schema_files) {
    CAPTURE(path.string());
    const auto r = parse_op_schemas(read_text(path), path.string());
    CAPTURE(all_messages(r.errors) + all_messages(r.warnings));
    CHECK(r.errors.empty());
    CHECK(r.warnings.empty());
    for (const auto& s : r.schemas) ops.insert(s.op);
  }
  CHECK(ops.size() >= 7);
  // Every shipped op has its reference kernel.
  const auto reference = read_manifest(kSource / "manifests" / "reference.json");
  REQUIRE(reference.ok());
  CHECK(reference.manifest->role == KernelRole::reference);
  std::set<std::string> referenced;
  for (const auto& k : reference.manifest->kernels) referenced.insert(k.op);
  CHECK(referenced == ops);
}

TEST_CASE("shipped op schemas: tokens, dtypes and attributes") {
  const auto path = kSource / "manifests" / "ops";
  const auto layernorm = parse_op_schemas(read_text(path / "layernorm.json"), "layernorm.json");
  REQUIRE(layernorm.schemas.size() >= 2);
  const OpSchema& rms = layernorm.schemas[0];
  CHECK(rms.op == "layernorm.rmsnorm");
  REQUIRE(rms.tensors.size() == 3);
  CHECK(rms.tensors[0].written);
  CHECK_FALSE(rms.tensors[1].written);
  CHECK(rms.tensors[0].shape == std::vector<ShapeToken>{{ShapeToken::Kind::leading, "", 0},
                                                         {ShapeToken::Kind::symbol, "H", 0}});
  CHECK(rms.dtype_vars.at("T") == std::vector<Dtype>{Dtype::float32, Dtype::float16, Dtype::bfloat16});
  REQUIRE(rms.attrs.size() == 1);
  CHECK(rms.attrs[0].type == AttrType::float_);
  CHECK(std::get<double>(*rms.attrs[0].default_value) == doctest::Approx(1e-6));

  const auto activation = parse_op_schemas(read_text(path / "activation.json"), "activation.json");
  REQUIRE(activation.schemas.size() == 3);
  const auto& x = activation.schemas[0].tensors[1];
  REQUIRE(x.shape.size() == 2);
  CHECK(x.shape[1].kind == ShapeToken::Kind::multiple);
  CHECK(x.shape[1].value == 2);
  CHECK(x.shape[1].symbol == "D");
  CHECK(x.shape[1].str() == "2*D");

  const auto rotary = parse_op_schemas(read_text(path / "embeddings.json"), "embeddings.json");
  REQUIRE(rotary.schemas.size() == 1);
  CHECK(rotary.schemas[0].tensors[0].shape.size() == 1);
  CHECK(rotary.schemas[0].tensors[0].shape[0].str() == "*");
  CHECK(rotary.schemas[0].allowed_dtypes(rotary.schemas[0].tensors[0]) == (std::vector<Dtype>{Dtype::int64, Dtype::int32}));
  CHECK(rotary.schemas[0].attrs[0].default_value == AttrValue(true));

  const auto moe = parse_op_schemas(read_text(path / "moe.json"), "moe.json");
  const auto topk = std::find_if(moe.schemas.begin(), moe.schemas.end(),
                                 [](const OpSchema& s) { return s.op == "moe.topk_softmax"; });
  REQUIRE(topk != moe.schemas.end());
  CHECK(topk->tensors[0].dtype == "float32");
  CHECK(topk->tensors[1].dtype == "int32");
}

TEST_CASE("shape tokens") {
  SUBCASE("accepted forms") {
    const auto r = schema_with_shape(R"(["*", "H", 64, "128", "2*D", "16*D", "_x1"])");
    CAPTURE(all_messages(r.errors));
    REQUIRE(r.errors.empty());
    const auto& shape = r.schemas.at(0).tensors.at(0).shape;
    REQUIRE(shape.size() == 7);
    CHECK(shape[0].kind == ShapeToken::Kind::leading);
    CHECK(shape[1].kind == ShapeToken::Kind::symbol);
    CHECK(shape[2].kind == ShapeToken::Kind::constant);
    CHECK(shape[2].value == 64);
    CHECK(shape[3].kind == ShapeToken::Kind::constant);
    CHECK(shape[3].value == 128);
    CHECK(shape[4].kind == ShapeToken::Kind::multiple);
    CHECK(shape[5].value == 16);
    std::vector<std::string> strs;
    for (const auto& t : shape) strs.push_back(t.str());
    CHECK(strs == std::vector<std::string>{"*", "H", "64", "128", "2*D", "16*D", "_x1"});
  }
  SUBCASE("an empty shape is a scalar") {
    const auto r = schema_with_shape("[]");
    CHECK(r.errors.empty());
    CHECK(r.schemas.at(0).tensors.at(0).shape.empty());
  }
  SUBCASE("refused forms name the token's pointer") {
    for (std::string bad : {R"("0")", "0", "-1", "1.5", "true", "null", R"("2*")", R"("*D")", R"("D*2")",
                            R"("0*D")", R"("x-y")", R"("")", R"("2 * D")", R"("99999999999999999999")",
                            "99999999999999999999", "[1]"}) {
      CAPTURE(bad);
      const auto r = schema_with_shape(std::string("[\"H\", ") + bad + "]");
      REQUIRE(r.errors.size() == 1);
      CHECK(r.errors[0].code == ErrorCode::manifest_bad_field);
      CHECK(contains(r.errors[0].message, "inline.json: /0/tensors/0/shape/1: expected a shape token"));
      CHECK(r.schemas.empty());
    }
  }
  SUBCASE("\"*\" only first") {
    const auto r = schema_with_shape(R"(["H", "*"])");
    REQUIRE(r.errors.size() == 1);
    CHECK(contains(r.errors[0].message, "/0/tensors/0/shape/1: \"*\""));
  }
}

TEST_CASE("KD-E010 reports file:line:column") {
  const auto error_of = [](const std::string& text) {
    const auto r = parse_manifest(text, "m.json");
    REQUIRE(r.errors.size() == 1);
    CHECK(r.errors[0].code == ErrorCode::manifest_bad_json);
    return r.errors[0].message;
  };
  CHECK(error_of("{\n  \"a\": 1,\n}").starts_with("m.json:3:1: "));
  CHECK(error_of("{\"a\" 1}").starts_with("m.json:1:6: "));
  CHECK(error_of("").starts_with("m.json:1:1: "));
  CHECK(error_of("{\n").starts_with("m.json:2:1: "));
  CHECK(error_of("{\"a\": [1, 2,,]}").starts_with("m.json:1:13: "));
  CHECK(error_of("{\"a\": 1} x").starts_with("m.json:1:10: "));
  CHECK(error_of("\n\n   nul").starts_with("m.json:3:7: "));  // the end of input, after "nul"
  CHECK(error_of("[1,\n  2,\n  x]").starts_with("m.json:3:3: "));
  // The parser's own words follow, without nlohmann's exception prefix.
  const auto message = error_of("{\"a\" 1}");
  CHECK(contains(message, "syntax error"));
  CHECK_FALSE(contains(message, "json.exception"));
  // A number beyond a double is bad JSON too, at its last character.
  CHECK(error_of("{\"a\": [1,\n  1e400]}") == "m.json:2:7: number overflow parsing '1e400'");
  CHECK(error_of("11111E211111E2").starts_with("m.json:1:12: number overflow"));
}

TEST_CASE("target inheritance and replacement") {
  const auto r = parse_with(R"("targets": [{"device": "cuda", "min_arch": "8.0"}],
    "kernels": [{"op": "g.inherit", "symbol": "a"},
                {"op": "g.replace", "symbol": "b", "targets": [{"device": "hip", "archs": ["gfx90a"]}]},
                {"op": "g.any", "symbol": "c", "targets": []}])");
  CAPTURE(all_messages(r.errors));
  REQUIRE(r.ok());
  const auto& k = r.manifest->kernels;
  REQUIRE(k.size() == 3);
  CHECK(k[0].targets == r.manifest->targets);
  CHECK(k[0].targets.at(0).str() == "cuda[8.0, -]");
  REQUIRE(k[1].targets.size() == 1);
  CHECK(k[1].targets[0].device == DeviceType::hip);
  CHECK(k[2].targets.empty());

  const auto none = parse_with(R"("kernels": [{"op": "g.x", "symbol": "x"}])");
  REQUIRE(none.ok());
  CHECK(none.manifest->kernels.at(0).targets.empty());
}

TEST_CASE("a manifest's role reaches every kernel") {
  const auto reference = parse_with(R"("role": "reference", "kernels": [{"op": "g.x", "symbol": "x"}])");
  REQUIRE(reference.ok());
  CHECK(reference.manifest->role == KernelRole::reference);
  CHECK(reference.manifest->kernels.at(0).is_reference());
  const auto plain = parse_with(R"("kernels": [{"op": "g.x", "symbol": "x"}])");
  REQUIRE(plain.ok());
  CHECK_FALSE(plain.manifest->kernels.at(0).is_reference());
  CHECK(parse_with(R"("role": "backend", "kernels": [])").ok());
  const auto bad = parse_with(R"("role": "oracle", "kernels": [])");
  REQUIRE(bad.errors.size() == 1);
  CHECK(bad.errors[0].code == ErrorCode::manifest_bad_field);
  CHECK(contains(bad.errors[0].message, "/role: expected \"backend\" or \"reference\""));
}

TEST_CASE("op schema tolerances: declared per output dtype, defaults for the rest") {
  const auto with_tolerance = [](const std::string& tolerance) {
    return parse_op_schemas(R"([{"op": "t.op", "tensors": [{"name": "a", "shape": ["N"], "dtype": "T"}],
                                 "dtypes": {"T": ["float32", "bfloat16"]}, "tolerance": )" +
                                tolerance + "}]",
                            "inline.json");
  };
  const auto good = with_tolerance(R"({"bfloat16": {"ulps": 3, "atol": 1e-4, "mean_ulps": 0.25}})");
  REQUIRE(good.errors.empty());
  REQUIRE(good.schemas.size() == 1);
  const OpSchema& s = good.schemas[0];
  CHECK(s.tolerance(Dtype::bfloat16) == Tolerance{3, 1e-4, 0.25});
  CHECK(s.tolerance(Dtype::float32) == default_tolerance(Dtype::float32));
  CHECK(default_tolerance(Dtype::int32) == Tolerance{});  // integers compare exactly
  struct Bad {
    std::string tolerance, says;
  };
  for (const Bad& bad : {Bad{R"([1])", "/0/tolerance: expected an object of tolerances by output dtype"},
                         Bad{R"({"float8": {"ulps": 1, "atol": 0, "mean_ulps": 0}})",
                             "/0/tolerance/float8: expected a dtype name"},
                         Bad{R"({"float32": {"ulps": 1, "atol": 0}})", "/0/tolerance/float32/mean_ulps: missing"},
                         Bad{R"({"float32": {"ulps": -1, "atol": 0, "mean_ulps": 0}})",
                             "/0/tolerance/float32/ulps: expected a non-negative number, found"},
                         Bad{R"({"float32": {"ulps": "4", "atol": 0, "mean_ulps": 0}})",
                             "/0/tolerance/float32/ulps: expected a non-negative number"}}) {
    const auto r = with_tolerance(bad.tolerance);
    INFO(bad.tolerance);
    REQUIRE(r.errors.size() == 1);
    CHECK(r.errors[0].code == ErrorCode::manifest_bad_field);
    CHECK(contains(r.errors[0].message, bad.says));
  }
}

TEST_CASE("op schema: input values, bench sizes and conformance cases") {
  const auto parse = [](const std::string& rest) {
    return parse_op_schemas(R"([{"op": "t.op", "tensors": [{"name": "a", "shape": ["*", "2*R"], "dtype": "float32",
                                  "values": "cos_sin"}],
                                 "attrs": [{"name": "flag", "type": "bool", "default": true},
                                           {"name": "eps", "type": "float", "default": 0.5}])" +
                                rest + "}]",
                            "inline.json");
  };
  const auto good = parse(R"(, "bench": {"*": [8192], "R": 64},
      "tests": {"sizes": [{"*": [1], "R": 1}, {"*": [2, 3], "R": 7}], "attrs": {"flag": [true, false], "eps": [1]}})");
  REQUIRE(good.errors.empty());
  const OpSchema& s = good.schemas.at(0);
  CHECK(s.tensors[0].values == TensorValues::cos_sin);
  REQUIRE(s.bench_sizes.has_value());
  CHECK(*s.bench_sizes == Sizes{{8192}, {{"R", 64}}});
  CHECK(s.test_sizes == std::vector<Sizes>{{{1}, {{"R", 1}}}, {{2, 3}, {{"R", 7}}}});
  REQUIRE(s.test_attrs.size() == 2);
  CHECK(s.test_attrs[0].first == "eps");                         // by name
  CHECK(s.test_attrs[0].second == std::vector<AttrValue>{1.0});  // an integer is a float value
  CHECK(s.test_attrs[1].first == "flag");
  CHECK(s.test_attrs[1].second == std::vector<AttrValue>{true, false});
  struct Bad {
    std::string rest, says;
  };
  for (const Bad& bad : {Bad{R"(, "bench": {"R": -1})", "/0/bench/R: expected a size"},
                         Bad{R"(, "tests": {"attrs": {}})", "/0/tests/sizes"},
                         Bad{R"(, "tests": {"sizes": [], "attrs": {"nope": [1]}})", "the op has no attribute \"nope\""},
                         Bad{R"(, "tests": {"sizes": [], "attrs": {"flag": [1]}})", "/0/tests/attrs/flag/0: expected a bool value"},
                         Bad{R"(, "tests": {"sizes": [], "attrs": {"flag": []}})", "expected a non-empty list of bool values"}}) {
    const auto r = parse(bad.rest);
    INFO(bad.rest);
    REQUIRE(r.errors.size() == 1);
    CHECK(contains(r.errors[0].message, bad.says));
  }
  const auto bad_values = parse_op_schemas(
      R"([{"op": "t.op", "tensors": [{"name": "a", "shape": ["N"], "dtype": "float32", "values": "gaussian"}]}])",
      "inline.json");
  REQUIRE(bad_values.errors.size() == 1);
  CHECK(contains(bad_values.errors[0].message, "/0/tensors/0/values: expected \"uniform\", \"cos_sin\" or \"distinct\""));
}

TEST_CASE("manifest rules beyond the fixtures") {
  SUBCASE("the same op twice with the same symbol only warns") {
    const auto r = parse_with(R"("kernels": [{"op": "g.x", "symbol": "x"}, {"op": "g.x", "symbol": "x"}])");
    REQUIRE(r.ok());
    CHECK(r.manifest->kernels.size() == 1);
    REQUIRE(r.warnings.size() == 1);
    CHECK(r.warnings[0].code == ErrorCode::conflicting_registration);
    CHECK(contains(r.warnings[0].message, "/kernels/1:"));
  }
  SUBCASE("several problems are all reported") {
    const auto r = parse_manifest(R"({"kdispatch_manifest": "1.0", "plugin": "A", "backend": 3,
      "library": "../x.so", "abi": "1.0", "kernels": [{"op": "x", "symbol": "1"}]})",
                                  "many.json");
    CHECK_FALSE(r.ok());
    CHECK(r.errors.size() == 5);
  }
  SUBCASE("an unknown major stops validation, with one error") {
    const auto r = parse_manifest(R"({"kdispatch_manifest": "3.1", "plugin": "A"})", "v3.json");
    REQUIRE(r.errors.size() == 1);
    CHECK(r.errors[0].code == ErrorCode::manifest_bad_version);
    CHECK(contains(r.errors[0].message, "format 3.1 is not supported; this kdispatch reads 1.x"));
  }
  SUBCASE("library names") {
    const auto with_library = [](const std::string& json_string) {
      return parse_manifest(R"({"kdispatch_manifest": "1.0", "plugin": "p", "backend": "b", "abi": "1.0",
                                "kernels": [], "library": )" + json_string + "}",
                            "lib.json");
    };
    for (std::string ok : {"libx.so", "x.so", "libx.so.1", "libx.so.1.2.3", "libkdispatch-cuda.so"}) {
      CAPTURE(ok);
      CHECK(with_library('"' + ok + '"').errors.empty());
    }
    for (std::string bad : {".so", "libx.so.", "libx.so.a", "libx.a", "libx", "libx.so\\t", "..", "."}) {
      CAPTURE(bad);
      const auto r = with_library('"' + bad + '"');
      REQUIRE(r.errors.size() == 1);
      CHECK(r.errors[0].code == ErrorCode::manifest_bad_library_path);
    }
  }
  SUBCASE("duplicate dtypes warn") {
    const auto r = parse_with(R"("kernels": [{"op": "g.x", "symbol": "x", "dtypes": ["float32", "float32"]}])");
    REQUIRE(r.ok());
    CHECK(r.manifest->kernels[0].dtypes == std::vector<Dtype>{Dtype::float32});
    CHECK(r.warnings.size() == 1);
  }
  SUBCASE("a missing or unreadable file is KD-E010 naming it") {
    const auto missing = read_manifest(kFixtures / "no_such_manifest.json");
    REQUIRE(missing.errors.size() == 1);
    CHECK(missing.errors[0].code == ErrorCode::manifest_bad_json);
    CHECK(contains(missing.errors[0].message, "no_such_manifest.json: cannot read: No such file"));
    const auto directory = read_manifest(kFixtures);
    REQUIRE(directory.errors.size() == 1);
    CHECK(directory.errors[0].code == ErrorCode::manifest_bad_json);
  }
  SUBCASE("repeated keys are found at any depth") {
    const auto r = parse_with(R"("kernels": [{"op": "g.x", "symbol": "x"},
                                             {"op": "g.y", "symbol": "y", "symbol": "z"}])");
    REQUIRE(r.errors.size() == 1);
    CHECK(contains(r.errors[0].message, "inline.json: /kernels/1/symbol: key appears more than once"));
  }
}

TEST_CASE("an invalid manifest still says which plugin, backend and ops it declares") {
  SUBCASE("one misspelt dtype: every name of the shipped cuda manifest is kept") {
    const std::string text = read_text(kGpuManifests / "cuda.json");
    const auto valid = parse_manifest(text, "cuda.json");
    REQUIRE(valid.ok());
    std::string misspelt = text;
    for (size_t at = misspelt.find("\"float32\""); at != std::string::npos; at = misspelt.find("\"float32\"", at)) {
      misspelt.replace(at, 9, "\"floatt32\"");
    }
    const auto r = parse_manifest(misspelt, "cuda.json");
    CHECK_FALSE(r.ok());
    CHECK(r.errors.size() > 1);
    CHECK(contains(r.errors[0].message, "found \"floatt32\""));
    CHECK(r.plugin == "cuda");
    CHECK(r.backend == "cuda");
    CHECK(r.ops == valid.manifest->kernel_ops());
  }
  SUBCASE("a field that does not validate stays empty; the others are kept") {
    const auto r = parse_manifest(R"({"kdispatch_manifest": "1.0", "plugin": "Bad-Name", "backend": "b",
      "library": "libp.so", "abi": "1.0", "kernels": [
        {"op": "no_group", "symbol": "a"},
        {"op": "g.x", "symbol": "x", "dtypes": ["nope"]},
        {"op": "g.y", "symbol": "1y"},
        {"op": "g.x", "symbol": "x2"},
        {"op": 7, "symbol": "z"},
        "not a kernel"]})",
                                  "partial.json");
    CHECK_FALSE(r.ok());
    CHECK(r.plugin.empty());
    CHECK(r.backend == "b");
    CHECK(r.ops == std::vector<std::string>{"g.x", "g.y"});
  }
  SUBCASE("a valid manifest names what its manifest holds") {
    const auto r = read_manifest(kSource / "manifests" / "cpu.json");
    REQUIRE(r.ok());
    CHECK(r.plugin == r.manifest->plugin);
    CHECK(r.backend == r.manifest->backend);
    CHECK(r.ops == r.manifest->kernel_ops());
    CHECK_FALSE(r.ops.empty());
  }
  SUBCASE("nothing is read from text that is not a manifest of this format") {
    for (const std::string text : {
             R"({"kdispatch_manifest": "1.0", "plugin": "p", "backend": "b", "kernels": [{"op": "g.x",)",
             R"({"kdispatch_manifest": "3.0", "plugin": "p", "backend": "b", "kernels": [{"op": "g.x"}]})",
             R"({"kdispatch_manifest": "1.0", "plugin": "p", "plugin": "q", "backend": "b", "kernels": []})",
             R"([{"kdispatch_manifest": "1.0", "plugin": "p"}])"}) {
      CAPTURE(text);
      const auto r = parse_manifest(text, "other.json");
      CHECK_FALSE(r.ok());
      CHECK(r.plugin.empty());
      CHECK(r.backend.empty());
      CHECK(r.ops.empty());
    }
  }
}

TEST_CASE("op-schema files") {
  SUBCASE("not a list") {
    const auto r = parse_op_schemas(R"({"op": "a.b"})", "ops.json");
    REQUIRE(r.errors.size() == 1);
    CHECK(contains(r.errors[0].message, "ops.json: (top level): expected a list of op schemas"));
  }
  SUBCASE("the same op twice: identical warns, different conflicts") {
    const std::string op = R"({"op": "a.b", "tensors": [{"name": "x", "shape": ["N"], "dtype": "float32"}]})";
    const auto same = parse_op_schemas("[" + op + "," + op + "]", "ops.json");
    CHECK(same.errors.empty());
    CHECK(same.schemas.size() == 1);
    CHECK(same.warnings.size() == 1);
    const std::string other = R"({"op": "a.b", "tensors": [{"name": "x", "shape": ["M"], "dtype": "float32"}]})";
    const auto conflict = parse_op_schemas("[" + op + "," + other + "]", "ops.json");
    REQUIRE(conflict.errors.size() == 1);
    CHECK(conflict.errors[0].code == ErrorCode::conflicting_registration);
    CHECK(contains(conflict.errors[0].message, "ops.json: /1: Conflicting definitions of op 'a.b': /0 != /1"));
  }
  SUBCASE("an unused dtype variable warns") {
    const auto r = parse_op_schemas(
        R"([{"op": "a.b", "tensors": [], "dtypes": {"T": ["float32"], "U": ["int32"]}}])", "ops.json");
    CHECK(r.errors.empty());
    REQUIRE(r.warnings.size() == 2);
    CHECK(contains(r.warnings[0].message, "/0/dtypes/T:"));
  }
  SUBCASE("attribute defaults must match their type") {
    const auto r = parse_op_schemas(R"([{"op": "a.b", "tensors": [], "attrs": [
        {"name": "i", "type": "int", "default": 3},
        {"name": "f", "type": "float", "default": "1"},
        {"name": "b", "type": "bool", "default": 0},
        {"name": "s", "type": "string", "default": null}]}])",
                                    "ops.json");
    CHECK(r.errors.size() == 3);
  }
}

TEST_CASE("names and op ids") {
  CHECK(is_valid_name("cuda"));
  CHECK(is_valid_name("my_backend2"));
  CHECK_FALSE(is_valid_name(""));
  CHECK_FALSE(is_valid_name("Cuda"));
  CHECK_FALSE(is_valid_name("a-b"));
  CHECK_FALSE(is_valid_name("a.b"));
  CHECK(is_valid_op_id("layernorm.rmsnorm"));
  CHECK(is_valid_op_id("a.b"));
  CHECK_FALSE(is_valid_op_id("rmsnorm"));
  CHECK_FALSE(is_valid_op_id(".rmsnorm"));
  CHECK_FALSE(is_valid_op_id("layernorm."));
  CHECK_FALSE(is_valid_op_id("a.b.c"));
  CHECK(attr_type_name(AttrType::float_) == "float");
  CHECK(attr_type_name(AttrType::string) == "string");
}

// parse_manifest and parse_op_schemas catch every exception, their own bugs
// included, so that nothing escapes is no evidence: what shows a bug is
// internal_error, which no input may set.
TEST_CASE("parsing never throws nor fails internally, whatever the text") {
  const auto check = [](std::string_view text, const std::string& path) {
    ManifestResult r;
    CHECK_NOTHROW(r = parse_manifest(text, path));
    CHECK_MESSAGE(!r.internal_error, path << ": " << all_messages(r.errors));
    CHECK(r.ok() == r.errors.empty());
    SchemaFileResult s;
    CHECK_NOTHROW(s = parse_op_schemas(text, path));
    CHECK_MESSAGE(!s.internal_error, path << ": " << all_messages(s.errors));
  };
  // Every fixture whole: each breaks one rule, so each takes a path that
  // reports a problem.
  for (const char* dir : {"bad", "good"}) {
    for (const auto& path : json_files(kFixtures / dir)) check(read_text(path), path.string());
  }
  const std::string text = read_text(kSource / "manifests" / "cpu.json");
  REQUIRE_FALSE(text.empty());
  // Every prefix: truncated files are the commonest damage.
  for (size_t n = 0; n < text.size(); n += 7) check(std::string_view(text).substr(0, n), "prefix.json");
  // Random byte changes, reproducible.
  std::mt19937 rng(12345);
  std::uniform_int_distribution<size_t> pos(0, text.size() - 1);
  std::uniform_int_distribution<int> byte(0, 255);
  for (int i = 0; i < 500; ++i) {
    std::string damaged = text;
    for (int k = 0; k < 3; ++k) damaged[pos(rng)] = static_cast<char>(byte(rng));
    check(damaged, "damaged.json");
  }
}

TEST_CASE("a kernel's own role and opt_in: a plugin ships the reference of its op beside its kernel") {
  const ManifestResult r = parse_with(R"("kernels": [
      {"op": "example.op", "symbol": "kd_fast"},
      {"op": "example.op", "symbol": "kd_reference", "role": "reference"},
      {"op": "activation.silu_and_mul", "symbol": "kd_second", "opt_in": true}])");
  for (const Problem& e : r.errors) INFO(e.message);
  REQUIRE(r.ok());
  const auto& k = r.manifest->kernels;
  REQUIRE(k.size() == 3);
  CHECK(k[0].backend == "b");
  CHECK_FALSE(k[0].is_reference());
  // The reference is the backend "reference" of the same plugin: no clash
  // with the plugin's kernel for the op, no plugin of its own.
  CHECK(k[1].backend == "reference");
  CHECK(k[1].plugin == "p");
  CHECK(k[1].is_reference());
  CHECK(k[2].opt_in);
  CHECK_FALSE(k[0].opt_in);
  // Two kernels of one backend for an op still conflict.
  const ManifestResult twice = parse_with(R"("kernels": [
      {"op": "example.op", "symbol": "kd_one", "role": "reference"},
      {"op": "example.op", "symbol": "kd_two", "role": "reference"}])");
  REQUIRE_FALSE(twice.ok());
  CHECK(twice.errors[0].message.find("backend 'reference'") != std::string::npos);
  // A role that is neither is refused, naming the field.
  const ManifestResult bad = parse_with(R"("kernels": [{"op": "example.op", "symbol": "kd_x", "role": "oracle"}])");
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.errors[0].message.find("/kernels/0/role") != std::string::npos);
}

TEST_CASE("a kernel's priority: an integer in [-1000, 1000], else KD-E011 naming the field") {
  const ManifestResult r = parse_with(R"("kernels": [
      {"op": "example.op", "symbol": "kd_fast", "priority": 20},
      {"op": "activation.silu_and_mul", "symbol": "kd_second", "priority": -1000}])");
  for (const Problem& e : r.errors) INFO(e.message);
  REQUIRE(r.ok());
  CHECK(r.manifest->kernels[0].priority == 20);
  CHECK(r.manifest->kernels[1].priority == -1000);
  for (const char* value : {"1001", "1.5", "\"high\"", "true", "99999999999999999999"}) {
    CAPTURE(value);
    const ManifestResult bad =
        parse_with(std::string(R"("kernels": [{"op": "example.op", "symbol": "kd_x", "priority": )") + value + "}]");
    REQUIRE_FALSE(bad.ok());
    CHECK(bad.errors[0].code == ErrorCode::manifest_bad_field);
    CHECK(bad.errors[0].message.find("/kernels/0/priority: expected an integer in [-1000, 1000]") !=
          std::string::npos);
  }
}
