#include "kdispatch/kernel_spec.hpp"

#include <fmt/format.h>

#include <algorithm>

namespace kdispatch {

bool KernelSpec::supports(Dtype dtype) const {
  return dtypes.empty() || std::find(dtypes.begin(), dtypes.end(), dtype) != dtypes.end();
}

std::string KernelSpec::describe() const {
  if (is_runtime()) return fmt::format("kernel registered at run time (backend '{}')", backend);
  return fmt::format("plugin '{}' symbol '{}' ({})", plugin, symbol, manifest.empty() ? "<api>" : manifest);
}

}  // namespace kdispatch
