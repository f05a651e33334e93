// Whether a plugin's manifest file and the manifest compiled into its binary
// describe the same plugin. The loader refuses a plugin whose two disagree
// (KD-E023); `kdispatch inspect` reports the same differences without
// loading it.
#pragma once

#include <string>
#include <vector>

#include "kdispatch/manifest.hpp"

namespace kdispatch {

// One line per difference between `file` and `embedded`: the plugin name,
// the backend name, and the kernels (op -> symbol) that only one of them
// lists ("kernels only in the file: [op -> symbol, ...]"). Empty when they
// agree.
std::vector<std::string> manifest_differences(const Manifest& file, const Manifest& embedded);

}  // namespace kdispatch
