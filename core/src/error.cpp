#include "kdispatch/error.hpp"

#include <fmt/format.h>

#include <cctype>
#include <charconv>

#include "kdispatch/error_catalogue.hpp"

namespace kdispatch {

std::string code_string(ErrorCode code) {
  return fmt::format("KD-E{:03d}", static_cast<int>(code));
}

bool parse_code(std::string_view text, ErrorCode* out) {
  std::string upper;
  for (char c : text) upper.push_back(static_cast<char>(std::toupper(static_cast<unsigned char>(c))));
  std::string_view rest = upper;
  if (rest.starts_with("KD-")) rest.remove_prefix(3);
  if (rest.starts_with("E")) rest.remove_prefix(1);
  int number = 0;
  auto [end, ec] = std::from_chars(rest.data(), rest.data() + rest.size(), number);
  if (ec != std::errc() || end != rest.data() + rest.size() || rest.empty()) return false;
  const auto code = static_cast<ErrorCode>(number);
  if (find_catalogue_entry(code) == nullptr) return false;
  *out = code;
  return true;
}

Error::Error(ErrorCode code, std::string message, std::vector<std::string> hints)
    : std::runtime_error(message), code_(code), message_(std::move(message)), hints_(std::move(hints)) {}

}  // namespace kdispatch
