// Hostile input to the core: pathological JSON (deep nesting with repeated
// keys, a million unknown keys, a huge op id) must be diagnosed in linear
// time with capped output.
#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "kdispatch/error.hpp"
#include "kdispatch/manifest.hpp"
#include "kdispatch/selector.hpp"

using namespace kdispatch;

namespace {

constexpr const char* kHead = R"({"kdispatch_manifest": "1.0", "plugin": "p", "backend": "p",
  "library": "libp.so", "abi": "1.0", "kernels": [])";

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
  CHECK(took < 10.0);
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
  CHECK(seconds_since(start) < 20.0);
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
  CHECK(seconds_since(start) < 1.0);
  // Typos still get their suggestion.
  CHECK(closest_ops("layernorm.rmsnrom", ops) == std::vector<std::string>{"layernorm.rmsnorm"});
  CHECK(closest_ops("rmsnorm", ops) == std::vector<std::string>{"layernorm.rmsnorm"});
}
