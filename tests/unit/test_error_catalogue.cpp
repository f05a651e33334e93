// Every ErrorCode has a complete catalogue entry, so `kdispatch explain`
// never comes up empty, and codes round-trip through their text form.
#include <doctest/doctest.h>

#include <algorithm>
#include <iterator>
#include <string>
#include <string_view>

#include "kdispatch/error.hpp"
#include "kdispatch/error_catalogue.hpp"

namespace {

using kdispatch::ErrorCode;

// Listed here (not in error.hpp) on purpose: adding an ErrorCode without
// adding it here and to the catalogue fails the size check below.
constexpr ErrorCode kAllCodes[] = {
    ErrorCode::unknown_op,
    ErrorCode::backend_not_registered,
    ErrorCode::no_usable_backend,
    ErrorCode::ambiguous_backend,
    ErrorCode::conflicting_registration,
    ErrorCode::backend_not_usable,
    ErrorCode::manifest_bad_json,
    ErrorCode::manifest_bad_field,
    ErrorCode::manifest_bad_library_path,
    ErrorCode::manifest_bad_version,
    ErrorCode::op_unchecked,
    ErrorCode::plugin_open_failed,
    ErrorCode::plugin_no_entry,
    ErrorCode::plugin_abi_mismatch,
    ErrorCode::plugin_manifest_mismatch,
    ErrorCode::plugin_probe_failed,
    ErrorCode::plugin_insecure,
    ErrorCode::plugin_checksum_mismatch,
    ErrorCode::plugin_scan_failed,
    ErrorCode::plugin_orphan_library,
    ErrorCode::bad_arguments,
    ErrorCode::dtype_not_supported,
    ErrorCode::kernel_failed,
    ErrorCode::device_error,
    ErrorCode::file_not_writable,
};

// Every line non-empty and starting with "- "; no leading/trailing newline.
void check_bullets(std::string_view text, std::string_view what, const std::string& code) {
  INFO(code, " ", what);
  REQUIRE_FALSE(text.empty());
  std::size_t start = 0;
  while (start <= text.size()) {
    const std::size_t end = std::min(text.find('\n', start), text.size());
    const std::string_view line = text.substr(start, end - start);
    CAPTURE(std::string(line));
    CHECK(line.starts_with("- "));
    CHECK(line.size() > 2);
    start = end + 1;
  }
}

}  // namespace

TEST_CASE("every error code has a complete catalogue entry") {
  CHECK(kdispatch::error_catalogue().size() == std::size(kAllCodes));
  for (ErrorCode code : kAllCodes) {
    const std::string name = kdispatch::code_string(code);
    INFO(name);
    const kdispatch::CatalogueEntry* entry = kdispatch::find_catalogue_entry(code);
    REQUIRE(entry != nullptr);
    CHECK(entry->code == code);
    CHECK_FALSE(entry->title.empty());
    CHECK(entry->title.find('\n') == std::string_view::npos);
    CHECK_FALSE(entry->meaning.empty());
    check_bullets(entry->causes, "causes", name);
    check_bullets(entry->fix, "fix", name);
  }
}

TEST_CASE("catalogue codes are unique and sorted") {
  const auto catalogue = kdispatch::error_catalogue();
  REQUIRE_FALSE(catalogue.empty());
  for (std::size_t i = 1; i < catalogue.size(); ++i) {
    CHECK(static_cast<int>(catalogue[i - 1].code) < static_cast<int>(catalogue[i].code));
  }
}

TEST_CASE("find_catalogue_entry returns nullptr for unknown codes") {
  CHECK(kdispatch::find_catalogue_entry(static_cast<ErrorCode>(0)) == nullptr);
  CHECK(kdispatch::find_catalogue_entry(static_cast<ErrorCode>(7)) == nullptr);
  CHECK(kdispatch::find_catalogue_entry(static_cast<ErrorCode>(999)) == nullptr);
}

TEST_CASE("code_string and parse_code round-trip") {
  CHECK(kdispatch::code_string(ErrorCode::backend_not_registered) == "KD-E002");
  CHECK(kdispatch::code_string(ErrorCode::device_error) == "KD-E041");
  for (ErrorCode code : kAllCodes) {
    ErrorCode parsed{};
    REQUIRE(kdispatch::parse_code(kdispatch::code_string(code), &parsed));
    CHECK(parsed == code);
  }
  for (std::string_view text : {"KD-E002", "kd-e002", "E002", "e2", "2"}) {
    CAPTURE(std::string(text));
    ErrorCode parsed{};
    CHECK(kdispatch::parse_code(text, &parsed));
    CHECK(parsed == ErrorCode::backend_not_registered);
  }
  for (std::string_view text : {"KD-E999", "foo", "", "KD-", "E", "7", "2x", "-2"}) {
    CAPTURE(std::string(text));
    ErrorCode parsed = ErrorCode::unknown_op;
    CHECK_FALSE(kdispatch::parse_code(text, &parsed));
    CHECK(parsed == ErrorCode::unknown_op);  // untouched on failure
  }
}
