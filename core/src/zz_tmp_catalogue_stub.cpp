// TEMPORARY: lets this branch link before the error catalogue lands.
// Drop this file when error_catalogue.cpp is merged.
#include "kdispatch/error_catalogue.hpp"

namespace kdispatch {

const CatalogueEntry* find_catalogue_entry(ErrorCode) {
  static CatalogueEntry entry{};
  return &entry;
}

std::span<const CatalogueEntry> error_catalogue() { return {}; }

}  // namespace kdispatch
