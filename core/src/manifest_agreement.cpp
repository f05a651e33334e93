#include "kdispatch/manifest_agreement.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <iterator>
#include <set>
#include <utility>

namespace kdispatch {
namespace {

using KernelSet = std::set<std::pair<std::string, std::string>>;  // (op, symbol)

KernelSet kernel_set(const Manifest& manifest) {
  KernelSet out;
  for (const KernelSpec& k : manifest.kernels) out.emplace(k.op, k.symbol);
  return out;
}

// The kernels of `a` that `b` does not list, as "op -> symbol".
std::vector<std::string> only_in(const KernelSet& a, const KernelSet& b) {
  KernelSet only;
  std::set_difference(a.begin(), a.end(), b.begin(), b.end(), std::inserter(only, only.end()));
  std::vector<std::string> out;
  for (const auto& [op, symbol] : only) out.push_back(fmt::format("{} -> {}", op, symbol));
  return out;
}

}  // namespace

std::vector<std::string> manifest_differences(const Manifest& file, const Manifest& embedded) {
  std::vector<std::string> out;
  if (embedded.plugin != file.plugin) {
    out.push_back(fmt::format("plugin: embedded '{}', file '{}'", embedded.plugin, file.plugin));
  }
  if (embedded.backend != file.backend) {
    out.push_back(fmt::format("backend: embedded '{}', file '{}'", embedded.backend, file.backend));
  }
  const KernelSet in_file = kernel_set(file);
  const KernelSet in_binary = kernel_set(embedded);
  if (const auto only = only_in(in_file, in_binary); !only.empty()) {
    out.push_back(fmt::format("kernels only in the file: [{}]", fmt::join(only, ", ")));
  }
  if (const auto only = only_in(in_binary, in_file); !only.empty()) {
    out.push_back(fmt::format("kernels only in the binary: [{}]", fmt::join(only, ", ")));
  }
  return out;
}

}  // namespace kdispatch
