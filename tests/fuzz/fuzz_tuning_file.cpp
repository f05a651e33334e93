// libFuzzer target: the files of choices read from outside, on arbitrary
// bytes: the tuning file (JSON, each "when" compiled against its op's
// schema) and the preference file. The registry holds the shipped op
// schemas (manifests/ops), each op with a "cpu" and a "reference" kernel.
// A tuning file is taken whole or refused with ManifestError KD-E010 or
// KD-E011; what is taken must come back unchanged when tuning_file_text
// writes it and it is read again, that text must be a fixed point, and
// each compiled "when" is evaluated on values drawn from the input (no
// crash, no overflow the evaluator does not report). A preference file
// either has errors and no preferences or no errors.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kdispatch/error.hpp"
#include "kdispatch/manifest.hpp"
#include "kdispatch/registry.hpp"
#include "kdispatch/tuning.hpp"
#include "preference_file.hpp"
#include "schema_check.hpp"
#include "tuning_set.hpp"

namespace {

kdispatch::KernelRegistry* registry = nullptr;
std::map<std::string, std::unique_ptr<kdispatch::CompiledSchema>, std::less<>>* compiled = nullptr;

bool same(const kdispatch::TuningMeasurement& a, const kdispatch::TuningMeasurement& b) {
  return a.op == b.op && a.dtype == b.dtype && a.sizes == b.sizes && a.us == b.us;
}

bool same(const kdispatch::TuningFile& a, const kdispatch::TuningFile& b) {
  if (a.path != b.path || !(a.key == b.key) || a.choices.size() != b.choices.size()) return false;
  for (size_t i = 0; i < a.choices.size(); ++i) {
    const kdispatch::TuningChoice& x = a.choices[i];
    const kdispatch::TuningChoice& y = b.choices[i];
    if (x.op != y.op || x.dtype != y.dtype || x.when != y.when || x.backend != y.backend ||
        x.measured.size() != y.measured.size()) {
      return false;
    }
    for (size_t j = 0; j < x.measured.size(); ++j) {
      if (!same(x.measured[j], y.measured[j])) return false;
    }
  }
  return true;
}

// Values for the names of a "when": symbols, the dtype and int/bool
// attributes, taken from the input's bytes, edges included.
int64_t value_at(std::string_view bytes, size_t i) {
  static constexpr int64_t kEdges[] = {0, 1, -1, 2, 7, 64, 4096, INT64_MAX, INT64_MIN, INT64_MAX / 2};
  if (bytes.empty()) return 1;
  const auto b = static_cast<uint8_t>(bytes[i % bytes.size()]);
  return b < 160 ? kEdges[b % std::size(kEdges)] : static_cast<int64_t>(b) - 200;
}

void evaluate_choices(const kdispatch::TuningSet& set, std::string_view bytes) {
  size_t next = 0;
  for (const auto& [op, choices] : set.by_op) {
    const auto it = compiled->find(op);
    if (it == compiled->end()) __builtin_trap();  // the file names only ops of the registry
    const kdispatch::CompiledSchema& schema = *it->second;
    std::vector<int64_t> symbols(schema.constraint_symbols().size());
    std::vector<kd_attr> attrs(schema.schema().attrs.size());
    for (const kdispatch::TunedChoice& c : choices) {
      if (!c.when) continue;
      for (int64_t& s : symbols) s = value_at(bytes, next++);
      for (kd_attr& a : attrs) {
        std::memset(&a, 0, sizeof a);
        a.value.i = value_at(bytes, next++);
      }
      kdispatch::ConstraintInput in;
      in.symbols = symbols.data();
      in.dtype = c.dtype;
      in.attrs = attrs.data();
      const kdispatch::Constraint::Result r = c.when->evaluate(in);
      (void)c.when->explain(r, in);
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  registry = new kdispatch::KernelRegistry();
  compiled = new std::map<std::string, std::unique_ptr<kdispatch::CompiledSchema>, std::less<>>();
  for (const auto& entry : std::filesystem::directory_iterator(KDISPATCH_FUZZ_OP_SCHEMA_DIR)) {
    if (entry.path().extension() != ".json") continue;
    std::ifstream in(entry.path());
    const std::string text{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
    const kdispatch::SchemaFileResult parsed = kdispatch::parse_op_schemas(text, entry.path().string());
    if (!parsed.errors.empty()) __builtin_trap();
    for (const kdispatch::OpSchema& schema : parsed.schemas) {
      registry->add_schema(schema);
      compiled->emplace(schema.op, std::make_unique<kdispatch::CompiledSchema>(schema));
      for (const char* backend : {"cpu", "reference"}) {
        kdispatch::KernelSpec spec;
        spec.op = schema.op;
        spec.backend = backend;
        spec.plugin = backend;
        spec.symbol = std::string("kd_fuzz_") + backend;
        if (spec.backend == "reference") spec.role = kdispatch::KernelRole::reference;
        registry->add(spec);
      }
    }
  }
  if (compiled->empty()) __builtin_trap();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);

  const kdispatch::PreferenceFileResult preferences = kdispatch::parse_preference_file(text, "fuzz-preferences.json");
  if (!preferences.errors.empty() && !preferences.preferences.empty()) __builtin_trap();
  for (const auto& [op, backends] : preferences.preferences) {
    if (!kdispatch::is_valid_op_id(op)) __builtin_trap();
    for (const std::string& b : backends) {
      if (!kdispatch::is_valid_name(b)) __builtin_trap();
    }
  }

  kdispatch::TuningFile file;
  try {
    file = kdispatch::parse_tuning_file(text, "fuzz-tuning.json", *registry);
  } catch (const kdispatch::ManifestError& e) {
    if (e.code() != kdispatch::ErrorCode::manifest_bad_json && e.code() != kdispatch::ErrorCode::manifest_bad_field) {
      __builtin_trap();
    }
    return 0;
  }
  const std::string written = kdispatch::tuning_file_text(file);
  const kdispatch::TuningFile again = kdispatch::parse_tuning_file(written, "fuzz-tuning.json", *registry);
  if (!same(file, again)) __builtin_trap();
  if (kdispatch::tuning_file_text(again) != written) __builtin_trap();
  evaluate_choices(*kdispatch::compile_tuning(file, *registry), text);
  return 0;
}
