// The error catalogue: for every code, what it means, common causes and the
// fix. `kdispatch explain KD-Ennn` prints an entry.
#pragma once

#include <kdispatch/export.h>

#include <span>
#include <string_view>

#include "kdispatch/error.hpp"

namespace kdispatch KDISPATCH_API {

struct CatalogueEntry {
  ErrorCode code;
  std::string_view title;    // one line
  std::string_view meaning;  // what happened
  std::string_view causes;   // common causes, one per line
  std::string_view fix;      // what to do, one step per line
};

std::span<const CatalogueEntry> error_catalogue();
// nullptr when the code has no entry (every ErrorCode has one; a test checks).
const CatalogueEntry* find_catalogue_entry(ErrorCode code);

}  // namespace kdispatch
