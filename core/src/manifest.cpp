// Plugin manifests and op-schema files (docs/manifest.md, docs/op-schema.md). The only file of
// the core that includes nlohmann/json: everything else sees the validated
// structs of manifest.hpp and schema.hpp.
//
// Validation collects every problem it can find instead of stopping at the
// first, so that one `kdispatch validate` run lists all of them. Each message
// names the file and the JSON pointer of the field, says what was expected
// and what was found.
#include "kdispatch/manifest.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <map>
#include <memory>
#include <set>

#include "constraint.hpp"
#include "file_check.hpp"
#include "json_depth.hpp"
#include "kdispatch/plugin_api.h"
#include "manifest_for_cache.hpp"
#include "kdispatch/selector.hpp"
#include "schema_check.hpp"
#include "unique_fd.hpp"

namespace kdispatch {

namespace {

using nlohmann::json;

constexpr std::string_view kDtypeNames =
    "float32, float16, bfloat16, float64, int32, int64, uint8, bool, float8_e4m3fn or float8_e5m2";
constexpr std::string_view kNameExpected = "a name of [a-z0-9_]+";
constexpr std::string_view kValuesExpected = "\"uniform\", \"cos_sin\" or \"distinct\"";
constexpr std::string_view kRoleExpected = "\"backend\" or \"reference\"";
constexpr std::string_view kVersionExpected = "a string \"major.minor\" (e.g. \"1.0\")";
constexpr std::string_view kArchExpected = "\"major.minor\" (e.g. \"9.0\")";
constexpr std::string_view kIdentifierExpected = "an identifier [A-Za-z_][A-Za-z0-9_]*";
constexpr std::string_view kShapeTokenExpected =
    "a shape token: \"*\" (leading dims, first only), a symbol (\"H\"), a positive integer "
    "(64) or a multiple (\"2*D\")";
// Discovery scans whole directories for *.json; a huge file there is a
// mistake, not a manifest, and should not stall every process that starts.
constexpr size_t kMaxManifestBytes = size_t{16} << 20;

constexpr auto kMaxInt64 = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());

bool is_lower_name_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_';
}
bool is_digit(char c) { return c >= '0' && c <= '9'; }
bool is_all_digits(std::string_view s) { return !s.empty() && std::all_of(s.begin(), s.end(), is_digit); }

bool is_identifier(std::string_view s) {
  const auto head = [](char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; };
  return !s.empty() && head(s.front()) &&
         std::all_of(s.begin() + 1, s.end(), [&](char c) { return head(c) || is_digit(c); });
}

bool is_sha256_hex(std::string_view s) {
  return s.size() == 64 && std::all_of(s.begin(), s.end(), [](char c) {
           return is_digit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
         });
}

// A positive decimal integer, digits only (no sign, no spaces); nullopt on
// anything else, overflow included.
std::optional<int64_t> parse_positive(std::string_view s) {
  if (!is_all_digits(s)) return std::nullopt;
  int64_t value = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), value);
  if (ec != std::errc() || end != s.data() + s.size() || value <= 0) return std::nullopt;
  return value;
}

struct Version {
  int major = 0;
  int minor = 0;
};

// "major.minor", both plain decimal numbers ("1.0", "1.12").
std::optional<Version> parse_version(std::string_view s) {
  const auto dot = s.find('.');
  if (dot == std::string_view::npos) return std::nullopt;
  const auto major = s.substr(0, dot);
  const auto minor = s.substr(dot + 1);
  if (!is_all_digits(major) || !is_all_digits(minor) || major.size() > 4 || minor.size() > 4) {
    return std::nullopt;
  }
  Version v;
  std::from_chars(major.data(), major.data() + major.size(), v.major);
  std::from_chars(minor.data(), minor.data() + minor.size(), v.minor);
  return v;
}

// Empty when `name` is a plain shared-library file name; otherwise why not.
// Lexical only: whether the file exists is the loader's business.
std::string library_name_problem(std::string_view name) {
  if (name.empty()) return "is empty";
  if (name.front() == '/') return "is an absolute path";
  if (name.find("..") != std::string_view::npos) return "contains \"..\"";
  if (name.find('/') != std::string_view::npos || name.find('\\') != std::string_view::npos) {
    return "contains a directory separator";
  }
  if (std::any_of(name.begin(), name.end(), [](char c) { return static_cast<unsigned char>(c) < 0x20 || c == 0x7f; })) {
    return "contains a control character";
  }
  // Accept "x.so" and versioned "x.so.1.2": strip trailing ".<digits>" groups.
  std::string_view stem = name;
  while (true) {
    const auto dot = stem.rfind('.');
    if (dot == std::string_view::npos || !is_all_digits(stem.substr(dot + 1))) break;
    stem = stem.substr(0, dot);
  }
  if (!stem.ends_with(".so") || stem.size() == 3) {
    return "is not a shared library name (expected NAME.so or NAME.so.N, e.g. \"libkdispatch-cuda.so\")";
  }
  return {};
}

// 999990 -> "999,990", as counts read in summaries.
std::string with_thousands(size_t n) {
  const std::string digits = std::to_string(n);
  std::string out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i != 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

std::string pointer_key(std::string_view pointer, std::string_view key) {
  std::string out(pointer);
  out += '/';
  for (char c : key) {
    if (c == '~') {
      out += "~0";
    } else if (c == '/') {
      out += "~1";
    } else {
      out += c;
    }
  }
  return out;
}
std::string pointer_index(std::string_view pointer, size_t index) {
  return fmt::format("{}/{}", pointer, index);
}

// How a found value reads in a message: strings quoted, containers by kind.
std::string describe(const json& value) {
  switch (value.type()) {
    case json::value_t::string: {
      const auto& s = value.get_ref<const std::string&>();
      constexpr size_t kMax = 60;
      const json shown = s.size() > kMax ? json(s.substr(0, kMax) + "...") : value;
      // Replace rather than throw: a cut may split a UTF-8 sequence.
      return shown.dump(-1, ' ', false, json::error_handler_t::replace);
    }
    case json::value_t::object: return "an object";
    case json::value_t::array: return "an array";
    case json::value_t::null: return "null";
    case json::value_t::boolean: return fmt::format("boolean {}", value.get<bool>() ? "true" : "false");
    case json::value_t::number_integer:
    case json::value_t::number_unsigned:
    case json::value_t::number_float: return "number " + value.dump();
    default: return "a value of an unexpected kind";
  }
}

std::string join_keys(std::initializer_list<std::string_view> keys) {
  std::string out;
  for (auto k : keys) {
    if (k.starts_with('$')) continue;  // editor metadata, not worth advertising
    if (!out.empty()) out += ", ";
    out += k;
  }
  return out;
}

// Walks one document, tracking problems. Every report says FILE: POINTER: ...
class Reader {
 public:
  Reader(std::string file, std::vector<Problem>& errors, std::vector<Problem>& warnings)
      : file_(std::move(file)), errors_(errors), warnings_(warnings) {}

  const std::string& file() const { return file_; }
  size_t error_count() const { return errors_.size(); }

  void error(ErrorCode code, std::string_view pointer, std::string_view what) {
    errors_.push_back({code, file_, format(pointer, what)});
  }
  void raw_error(ErrorCode code, std::string message) { errors_.push_back({code, file_, std::move(message)}); }
  void warn(ErrorCode code, std::string_view pointer, std::string_view what) {
    warnings_.push_back({code, file_, format(pointer, what), /*warning=*/true});
  }
  void bad(std::string_view pointer, std::string_view expected, const json& found) {
    error(ErrorCode::manifest_bad_field, pointer, fmt::format("expected {}, found {}", expected, describe(found)));
  }

  // The member `key` of `object`, or nullptr; a missing required key is
  // reported with what should be there.
  const json* get(const json& object, std::string_view pointer, std::string_view key, bool required,
                  std::string_view expected) {
    // A std::string key: nlohmann before 3.11 has no string_view lookup.
    const auto it = object.find(std::string(key));
    if (it != object.end()) return &*it;
    if (required) {
      error(ErrorCode::manifest_bad_field, pointer_key(pointer, key),
            fmt::format("missing required key; expected {}", expected));
    }
    return nullptr;
  }

  std::optional<std::string> string(const json& object, std::string_view pointer, std::string_view key,
                                    bool required, std::string_view expected) {
    const json* value = get(object, pointer, key, required, expected);
    if (value == nullptr) return std::nullopt;
    if (!value->is_string()) {
      bad(pointer_key(pointer, key), expected, *value);
      return std::nullopt;
    }
    return value->get<std::string>();
  }

  // A string member that must also pass `valid`.
  std::optional<std::string> checked_string(const json& object, std::string_view pointer, std::string_view key,
                                            bool required, std::string_view expected,
                                            bool (*valid)(std::string_view)) {
    auto value = string(object, pointer, key, required, expected);
    if (value && !valid(*value)) {
      bad(pointer_key(pointer, key), expected, object.at(std::string(key)));
      return std::nullopt;
    }
    return value;
  }

  std::optional<bool> boolean(const json& object, std::string_view pointer, std::string_view key) {
    const json* value = get(object, pointer, key, false, "");
    if (value == nullptr) return std::nullopt;
    if (!value->is_boolean()) {
      bad(pointer_key(pointer, key), "true or false", *value);
      return std::nullopt;
    }
    return value->get<bool>();
  }

  // The array member `key`, or nullptr when absent or not an array.
  const json* array(const json& object, std::string_view pointer, std::string_view key, bool required,
                    std::string_view expected) {
    const json* value = get(object, pointer, key, required, expected);
    if (value != nullptr && !value->is_array()) {
      bad(pointer_key(pointer, key), expected, *value);
      return nullptr;
    }
    return value;
  }

  // Unknown keys are warnings: a newer minor format may add keys, and an
  // older kdispatch must still load the manifest.
  // The first kMaxUnknownKeys are reported one by one; finish() sums up
  // the rest in one line.
  void unknown_keys(const json& object, std::string_view pointer, std::initializer_list<std::string_view> known) {
    for (const auto& item : object.items()) {
      if (std::find(known.begin(), known.end(), item.key()) != known.end()) continue;
      if (++unknown_keys_ > kMaxUnknownKeys) continue;
      warn(ErrorCode::manifest_bad_field, pointer_key(pointer, item.key()),
           fmt::format("unknown key, ignored (known keys here: {})", join_keys(known)));
    }
  }

  // Adds the summary of what was counted but not reported one by one.
  void finish() {
    if (unknown_keys_ > kMaxUnknownKeys) {
      warnings_.push_back({ErrorCode::manifest_bad_field, file_,
                           fmt::format("{}: and {} more unknown keys, ignored", file_,
                                       with_thousands(unknown_keys_ - kMaxUnknownKeys)),
                           /*warning=*/true});
    }
  }

  static constexpr size_t kMaxUnknownKeys = 10;

 private:
  // A pointer into a deeply nested document can be longer than the document
  // is useful to read: its middle is cut, its ends stay.
  std::string format(std::string_view pointer, std::string_view what) const {
    constexpr size_t kKeep = 100;
    if (pointer.size() > 2 * kKeep + 40) {
      return fmt::format("{}: {}...({} characters)...{}: {}", file_, pointer.substr(0, kKeep),
                         with_thousands(pointer.size() - 2 * kKeep), pointer.substr(pointer.size() - kKeep), what);
    }
    return fmt::format("{}: {}: {}", file_, pointer.empty() ? "(top level)" : pointer, what);
  }

  std::string file_;
  std::vector<Problem>& errors_;
  std::vector<Problem>& warnings_;
  size_t unknown_keys_ = 0;
};

// --- JSON text -----------------------------------------------------------------

// nlohmann keeps the last of repeated object keys silently. A repeated
// "library" or "sha256" could then mean different things to different tools,
// so repeats are found while parsing and reported with their pointer. The
// pointer of the current position is kept as one string that grows and
// shrinks with the nesting, so each event costs the length of its own key,
// not the depth of the document.
class DuplicateKeyFinder {
 public:
  bool on_event(json::parse_event_t event, const json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start: push(true); break;
      case json::parse_event_t::array_start: push(false); break;
      case json::parse_event_t::key: {
        Frame& top = frames_.back();
        std::string key = parsed.get<std::string>();
        pointer_.resize(top.base);
        pointer_ += pointer_key("", key);
        if (!top.keys.insert(std::move(key)).second) {
          if (duplicates_.size() < kMaxReported) duplicates_.push_back(pointer_);
          ++duplicate_count_;
        }
        break;
      }
      case json::parse_event_t::object_end:
      case json::parse_event_t::array_end:
        pointer_.resize(frames_.back().base);
        frames_.pop_back();
        next_element();
        break;
      case json::parse_event_t::value: next_element(); break;
    }
    return true;
  }
  // The first kMaxReported repeats; duplicate_count() counts all of them.
  const std::vector<std::string>& duplicates() const { return duplicates_; }
  size_t duplicate_count() const { return duplicate_count_; }

  static constexpr size_t kMaxReported = 10;

 private:
  struct Frame {
    bool object;
    size_t base;   // length of the pointer of this container
    size_t index;  // arrays: elements seen so far
    std::set<std::string> keys;
  };
  void push(bool object) {
    // The container is the current element of its parent array, if any.
    if (!frames_.empty() && !frames_.back().object) set_index(frames_.back());
    frames_.push_back({object, pointer_.size(), 0, {}});
  }
  void set_index(const Frame& array) {
    pointer_.resize(array.base);
    pointer_ += '/';
    pointer_ += std::to_string(array.index);
  }
  void next_element() {
    if (!frames_.empty() && !frames_.back().object) ++frames_.back().index;
  }
  std::vector<Frame> frames_;
  std::string pointer_;
  std::vector<std::string> duplicates_;
  size_t duplicate_count_ = 0;
};

// 1-based line and column (in bytes) of nlohmann's error position, which
// counts the characters read including the offending one.
std::pair<size_t, size_t> line_and_column(std::string_view text, size_t bytes_read) {
  const size_t offset = std::min(bytes_read == 0 ? 0 : bytes_read - 1, text.size());
  size_t line = 1;
  size_t column = 1;
  for (size_t i = 0; i < offset; ++i) {
    if (text[i] == '\n') {
      ++line;
      column = 1;
    } else {
      ++column;
    }
  }
  return {line, column};
}

// The parser's own words without its "[json.exception...] ... column N: " prefix,
// which would repeat the position in another form.
std::string parser_message(const json::exception& e) {
  std::string_view what = e.what();
  if (const auto column = what.find("column "); column != std::string_view::npos) {
    if (const auto colon = what.find(": ", column); colon != std::string_view::npos) {
      return std::string(what.substr(colon + 2));
    }
  }
  if (const auto bracket = what.find("] "); bracket != std::string_view::npos) {
    return std::string(what.substr(bracket + 2));
  }
  return std::string(what);
}

// nlohmann refuses a number beyond the range of a double with out_of_range
// 406, which carries no position. Its SAX interface is given the position:
// reading the text again through this handler finds it.
class ErrorPosition {
 public:
  bool null() { return true; }
  bool boolean(bool /*value*/) { return true; }
  bool number_integer(json::number_integer_t /*value*/) { return true; }
  bool number_unsigned(json::number_unsigned_t /*value*/) { return true; }
  bool number_float(json::number_float_t /*value*/, const json::string_t& /*text*/) { return true; }
  bool string(json::string_t& /*value*/) { return true; }
  bool binary(json::binary_t& /*value*/) { return true; }
  bool start_object(std::size_t /*size*/) { return true; }
  bool key(json::string_t& /*value*/) { return true; }
  bool end_object() { return true; }
  bool start_array(std::size_t /*size*/) { return true; }
  bool end_array() { return true; }
  bool parse_error(std::size_t position, const std::string& /*token*/, const nlohmann::detail::exception& /*e*/) {
    bytes_read = position;
    return false;
  }
  size_t bytes_read = 0;  // as json::parse_error::byte counts them
};

// Parses `text`; nullopt after reporting KD-E010 or repeated keys.
std::optional<json> parse_json(std::string_view text, Reader& r) {
  DuplicateKeyFinder finder;
  json doc;
  try {
    doc = json::parse(
        text.begin(), text.end(),
        [&finder](int /*depth*/, json::parse_event_t event, json& parsed) { return finder.on_event(event, parsed); },
        /*allow_exceptions=*/true, /*ignore_comments=*/false);
  } catch (const json::parse_error& e) {
    // KD-E010 reads FILE:LINE:COL: message, as compilers print it.
    const auto [line, column] = line_and_column(text, e.byte);
    r.raw_error(ErrorCode::manifest_bad_json,
                fmt::format("{}:{}:{}: {}", r.file(), line, column, parser_message(e)));
    return std::nullopt;
  } catch (const json::out_of_range& e) {
    // While parsing, only a number too large for a double ("1e400").
    ErrorPosition position;
    json::sax_parse(text.begin(), text.end(), &position);
    const auto [line, column] = line_and_column(text, position.bytes_read);
    r.raw_error(ErrorCode::manifest_bad_json,
                fmt::format("{}:{}:{}: {}", r.file(), line, column, parser_message(e)));
    return std::nullopt;
  }
  for (const auto& pointer : finder.duplicates()) {
    r.error(ErrorCode::manifest_bad_field, pointer,
            "key appears more than once in this object; parsers disagree on which one counts, so "
            "repeats are refused");
  }
  if (const size_t more = finder.duplicate_count() - finder.duplicates().size(); more > 0) {
    r.raw_error(ErrorCode::manifest_bad_field,
                fmt::format("{}: and {} more repeated keys", r.file(), with_thousands(more)));
  }
  if (finder.duplicate_count() != 0) return std::nullopt;
  if (auto deep = json_depth_error(text, r.file())) {
    r.raw_error(ErrorCode::manifest_bad_json, std::move(*deep));
    return std::nullopt;
  }
  return doc;
}

// --- op schemas ------------------------------------------------------------------

std::optional<ShapeToken> parse_shape_token(const json& value, bool first) {
  ShapeToken token;
  if (value.is_number_integer()) {
    // number_unsigned values above int64's range are not dims of any real tensor.
    if (value.is_number_unsigned() && value.get<uint64_t>() > kMaxInt64) return std::nullopt;
    const auto n = value.get<int64_t>();
    if (n <= 0) return std::nullopt;
    token.kind = ShapeToken::Kind::constant;
    token.value = n;
    return token;
  }
  if (!value.is_string()) return std::nullopt;
  const auto& s = value.get_ref<const std::string&>();
  if (s == "*") {
    if (!first) return std::nullopt;
    token.kind = ShapeToken::Kind::leading;
    return token;
  }
  if (is_identifier(s)) {
    token.kind = ShapeToken::Kind::symbol;
    token.symbol = s;
    return token;
  }
  if (const auto n = parse_positive(s)) {
    token.kind = ShapeToken::Kind::constant;
    token.value = *n;
    return token;
  }
  const auto star = s.find('*');
  if (star == std::string::npos) return std::nullopt;
  const auto factor = parse_positive(std::string_view(s).substr(0, star));
  const auto symbol = std::string_view(s).substr(star + 1);
  if (!factor || !is_identifier(symbol)) return std::nullopt;
  token.kind = ShapeToken::Kind::multiple;
  token.value = *factor;
  token.symbol = std::string(symbol);
  return token;
}

std::optional<std::vector<ShapeToken>> read_shape(Reader& r, const json& shape, const std::string& pointer) {
  const size_t before = r.error_count();
  std::vector<ShapeToken> tokens;
  for (size_t i = 0; i < shape.size(); ++i) {
    const auto& value = shape[i];
    if (auto token = parse_shape_token(value, i == 0)) {
      tokens.push_back(std::move(*token));
    } else if (value.is_string() && value.get_ref<const std::string&>() == "*") {
      r.error(ErrorCode::manifest_bad_field, pointer_index(pointer, i),
              "\"*\" (any number of leading dims) may only be the first token of a shape");
    } else {
      r.bad(pointer_index(pointer, i), kShapeTokenExpected, value);
    }
  }
  if (r.error_count() != before) return std::nullopt;
  return tokens;
}

std::optional<AttrValue> attr_default(AttrType type, const json& value) {
  switch (type) {
    case AttrType::float_:
      if (value.is_number()) return AttrValue(value.get<double>());
      break;
    case AttrType::int_:
      if (value.is_number_unsigned() && value.get<uint64_t>() > kMaxInt64) break;
      if (value.is_number_integer()) return AttrValue(value.get<int64_t>());
      break;
    case AttrType::bool_:
      if (value.is_boolean()) return AttrValue(value.get<bool>());
      break;
    case AttrType::string:
      if (value.is_string()) return AttrValue(value.get<std::string>());
      break;
  }
  return std::nullopt;
}

std::optional<AttrType> parse_attr_type(std::string_view name) {
  for (AttrType t : {AttrType::float_, AttrType::int_, AttrType::bool_, AttrType::string}) {
    if (attr_type_name(t) == name) return t;
  }
  return std::nullopt;
}

// A list of dtype names ("dtypes" of a kernel or a dtype variable). Empty
// lists are refused: [] reads as "none" but would behave as "any".
std::optional<std::vector<Dtype>> read_dtype_list(Reader& r, const json& list, const std::string& pointer,
                                                  std::string_view empty_hint) {
  if (!list.is_array()) {
    r.bad(pointer, fmt::format("a list of dtype names ({})", kDtypeNames), list);
    return std::nullopt;
  }
  if (list.empty()) {
    r.error(ErrorCode::manifest_bad_field, pointer, fmt::format("expected a non-empty list of dtype names, found []; {}", empty_hint));
    return std::nullopt;
  }
  const size_t before = r.error_count();
  std::vector<Dtype> dtypes;
  for (size_t i = 0; i < list.size(); ++i) {
    const auto& item = list[i];
    const auto dtype = item.is_string() ? parse_dtype(item.get_ref<const std::string&>()) : std::nullopt;
    if (!dtype) {
      r.bad(pointer_index(pointer, i), fmt::format("a dtype name ({})", kDtypeNames), item);
    } else if (std::find(dtypes.begin(), dtypes.end(), *dtype) != dtypes.end()) {
      r.warn(ErrorCode::manifest_bad_field, pointer_index(pointer, i),
             fmt::format("dtype \"{}\" is listed twice", dtype_name(*dtype)));
    } else {
      dtypes.push_back(*dtype);
    }
  }
  if (r.error_count() != before) return std::nullopt;
  return dtypes;
}

std::optional<TensorArg> read_tensor(Reader& r, const json& j, const std::string& pointer,
                                     const std::set<std::string>& declared_vars,
                                     std::set<std::string>& used_vars) {
  if (!j.is_object()) {
    r.bad(pointer, "a tensor object {\"name\", \"shape\", \"dtype\"}", j);
    return std::nullopt;
  }
  const size_t before = r.error_count();
  r.unknown_keys(j, pointer,
                 {"name", "shape", "dtype", "written", "inplace", "layout", "strided", "optional", "exact", "range",
                  "values", "flattened"});
  TensorArg t;
  t.name = r.checked_string(j, pointer, "name", true, kIdentifierExpected, is_identifier).value_or("");
  if (const json* shape = r.array(j, pointer, "shape", true, "a list of shape tokens (e.g. [\"*\", \"H\"])")) {
    t.shape = read_shape(r, *shape, pointer_key(pointer, "shape")).value_or(std::vector<ShapeToken>{});
  }
  const auto dtype_expected = fmt::format("a dtype variable declared in \"dtypes\" or a dtype name ({})", kDtypeNames);
  // "dtype": one name, or a list whose first entry may be a variable and
  // whose others are dtype names (["T", "float32"]).
  const json* dtype_json = r.get(j, pointer, "dtype", true, dtype_expected);
  if (dtype_json != nullptr && dtype_json->is_array()) {
    const auto list_pointer = pointer_key(pointer, "dtype");
    if (dtype_json->empty()) {
      r.bad(list_pointer, "a non-empty list: a dtype variable or dtype name, then dtype names", *dtype_json);
    }
    for (size_t i = 0; i < dtype_json->size(); ++i) {
      const json& item = (*dtype_json)[i];
      const std::string name = item.is_string() ? item.get<std::string>() : std::string();
      if (i == 0 && declared_vars.count(name) != 0) {
        used_vars.insert(name);
        t.dtype = name;
      } else if (!item.is_string() || !parse_dtype(name)) {
        r.bad(pointer_index(list_pointer, i),
              i == 0 ? dtype_expected : fmt::format("a dtype name ({}): only the first entry may be a variable",
                                                    kDtypeNames),
              item);
      } else if (i == 0) {
        t.dtype = name;
      } else if (name == t.dtype || std::find(t.dtype_alternatives.begin(), t.dtype_alternatives.end(), name) !=
                                        t.dtype_alternatives.end()) {
        r.warn(ErrorCode::manifest_bad_field, pointer_index(list_pointer, i),
               fmt::format("dtype \"{}\" is listed twice", name));
      } else {
        t.dtype_alternatives.push_back(name);
      }
    }
  } else if (auto dtype = r.string(j, pointer, "dtype", true, dtype_expected)) {
    if (declared_vars.count(*dtype) != 0) {
      used_vars.insert(*dtype);
    } else if (!parse_dtype(*dtype)) {
      r.error(ErrorCode::manifest_bad_field, pointer_key(pointer, "dtype"),
              fmt::format("expected {}, found \"{}\", which is neither", dtype_expected, *dtype));
    }
    t.dtype = std::move(*dtype);
  }
  t.written = r.boolean(j, pointer, "written").value_or(false);
  t.inplace = r.boolean(j, pointer, "inplace").value_or(false);
  t.written = t.written || t.inplace;
  constexpr std::string_view layout_expected = "\"contiguous\", \"rows\" or \"any\"";
  if (r.boolean(j, pointer, "strided").value_or(false)) t.layout = Layout::any;
  if (auto layout = r.string(j, pointer, "layout", false, layout_expected)) {
    if (*layout == "rows") {
      t.layout = Layout::rows;
    } else if (*layout == "any") {
      t.layout = Layout::any;
    } else if (*layout != "contiguous") {
      r.bad(pointer_key(pointer, "layout"), layout_expected, j.at("layout"));
    }
  }
  t.optional = r.boolean(j, pointer, "optional").value_or(false);
  t.exact = r.boolean(j, pointer, "exact").value_or(false);
  // "flattened": an int attribute; whether the op has it, with default 0, is
  // the call checker's to say (CompiledSchema).
  t.flattened = r.checked_string(j, pointer, "flattened", false, "the name of an int attribute of the op",
                                 is_identifier).value_or("");
  // "range": [min, max) of an integer input, max a constant or a symbol.
  if (const json* range = r.get(j, pointer, "range", false, ""); range != nullptr) {
    constexpr std::string_view range_expected = "[min, max) as [integer, integer or shape symbol], e.g. [0, \"P\"]";
    const auto range_pointer = pointer_key(pointer, "range");
    std::optional<ShapeToken> max;
    if (range->is_array() && range->size() == 2) max = parse_shape_token((*range)[1], false);
    if (!range->is_array() || range->size() != 2 || !(*range)[0].is_number_integer() || !max ||
        max->kind == ShapeToken::Kind::multiple) {
      r.bad(range_pointer, range_expected, *range);
    } else {
      t.range_min = (*range)[0].get<int64_t>();
      t.range_max = std::move(*max);
    }
  }
  if (auto values = r.string(j, pointer, "values", false, kValuesExpected)) {
    if (*values == "cos_sin") {
      t.values = TensorValues::cos_sin;
    } else if (*values == "distinct") {
      t.values = TensorValues::distinct;
    } else if (*values != "uniform") {
      r.bad(pointer_key(pointer, "values"), kValuesExpected, j.at("values"));
    }
  }
  if (r.error_count() != before) return std::nullopt;
  return t;
}

std::optional<AttrArg> read_attr(Reader& r, const json& j, const std::string& pointer) {
  if (!j.is_object()) {
    r.bad(pointer, "an attribute object {\"name\", \"type\"}", j);
    return std::nullopt;
  }
  const size_t before = r.error_count();
  r.unknown_keys(j, pointer, {"name", "type", "default", "doc"});
  AttrArg a;
  a.name = r.checked_string(j, pointer, "name", true, kIdentifierExpected, is_identifier).value_or("");
  constexpr std::string_view type_expected = "an attribute type: \"float\", \"int\", \"bool\" or \"string\"";
  std::optional<AttrType> type;
  if (const auto name = r.string(j, pointer, "type", true, type_expected)) {
    type = parse_attr_type(*name);
    if (!type) r.bad(pointer_key(pointer, "type"), type_expected, j.at("type"));
  }
  if (type) a.type = *type;
  if (const json* value = r.get(j, pointer, "default", false, ""); value != nullptr && type) {
    a.default_value = attr_default(*type, *value);
    if (!a.default_value) {
      r.bad(pointer_key(pointer, "default"), fmt::format("a default of type {}", attr_type_name(*type)), *value);
    }
  }
  a.doc = r.string(j, pointer, "doc", false, "a string").value_or("");
  if (r.error_count() != before) return std::nullopt;
  return a;
}

// Sizes of one call: {"*": [64], "H": 4096}.
std::optional<Sizes> read_sizes(Reader& r, const json& j, const std::string& pointer) {
  if (!j.is_object()) {
    r.bad(pointer, "an object of sizes, e.g. {\"*\": [64], \"H\": 4096}", j);
    return std::nullopt;
  }
  const size_t before = r.error_count();
  Sizes sizes;
  for (const auto& item : j.items()) {
    const auto item_pointer = pointer_key(pointer, item.key());
    const json& v = item.value();
    if (item.key() == "*") {
      bool ok = v.is_array();
      for (size_t i = 0; ok && i < v.size(); ++i) ok = v[i].is_number_integer() && v[i].get<int64_t>() >= 0;
      if (!ok) {
        r.bad(item_pointer, "a list of leading dim sizes, e.g. [64]", v);
      } else {
        sizes.leading = v.get<std::vector<int64_t>>();
      }
    } else if (!v.is_number_integer() || v.get<int64_t>() < 0) {
      r.bad(item_pointer, "a size (a non-negative integer)", v);
    } else {
      sizes.symbols[item.key()] = v.get<int64_t>();
    }
  }
  if (r.error_count() != before) return std::nullopt;
  return sizes;
}

// One entry of "tests"/"special" (SpecialValues); its tensor and outputs
// must be the schema's, which are read before.
std::optional<SpecialValues> read_special(Reader& r, const json& j, const std::string& pointer, const OpSchema& s) {
  if (!j.is_object()) {
    r.bad(pointer, "an object {\"what\", \"tensors\", \"values\" or \"every_value\", ...}", j);
    return std::nullopt;
  }
  const size_t before = r.error_count();
  r.unknown_keys(j, pointer,
                 {"what", "tensors", "values", "ulps", "fraction", "columns", "every_value", "sizes", "unchecked"});
  SpecialValues v;
  v.what = r.string(j, pointer, "what", true, "a string saying what the values exercise").value_or("");
  const auto find = [&](const std::string& name) {
    return std::find_if(s.tensors.begin(), s.tensors.end(), [&](const TensorArg& t) { return t.name == name; });
  };
  constexpr std::string_view tensors_expected = "a non-empty list of names of tensors the op reads";
  if (const json* names = r.get(j, pointer, "tensors", true, tensors_expected); names != nullptr) {
    const auto tensors_pointer = pointer_key(pointer, "tensors");
    if (!names->is_array() || names->empty()) r.bad(tensors_pointer, tensors_expected, *names);
    for (size_t i = 0; names->is_array() && i < names->size(); ++i) {
      const json& item = (*names)[i];
      const auto t = item.is_string() ? find(item.get<std::string>()) : s.tensors.end();
      if (t == s.tensors.end() || (t->written && !t->inplace)) {
        r.bad(pointer_index(tensors_pointer, i), "the name of a tensor the op reads", item);
      } else {
        v.tensors.push_back(t->name);
      }
    }
  }
  v.every_value = r.boolean(j, pointer, "every_value").value_or(false);
  constexpr std::string_view values_expected = "a non-empty list of numbers or \"nan\", \"inf\", \"-inf\"";
  if (const json* values = r.get(j, pointer, "values", !v.every_value, values_expected); values != nullptr) {
    const auto values_pointer = pointer_key(pointer, "values");
    if (!values->is_array() || values->empty()) r.bad(values_pointer, values_expected, *values);
    for (size_t i = 0; values->is_array() && i < values->size(); ++i) {
      const json& item = (*values)[i];
      if (item.is_number()) {
        v.values.push_back(item.get<double>());
      } else if (item == "nan" || item == "inf" || item == "-inf") {
        const double inf = std::numeric_limits<double>::infinity();
        v.values.push_back(item == "nan" ? std::numeric_limits<double>::quiet_NaN() : item == "inf" ? inf : -inf);
      } else {
        r.bad(pointer_index(values_pointer, i), values_expected, item);
      }
    }
  }
  if (const json* ulps = r.get(j, pointer, "ulps", false, ""); ulps != nullptr) {
    if (!ulps->is_number_integer() || ulps->get<int64_t>() < 0 || ulps->get<int64_t>() > 1000000) {
      r.bad(pointer_key(pointer, "ulps"), "a number of steps of the dtype, 0 to 1000000", *ulps);
    } else {
      v.ulps = ulps->get<int64_t>();
    }
  }
  if (const json* fraction = r.get(j, pointer, "fraction", false, ""); fraction != nullptr) {
    if (!fraction->is_number() || !(fraction->get<double>() > 0) || fraction->get<double>() > 1) {
      r.bad(pointer_key(pointer, "fraction"), "a share of the elements, greater than 0 and at most 1", *fraction);
    } else {
      v.fraction = fraction->get<double>();
    }
  }
  if (const json* columns = r.get(j, pointer, "columns", false, ""); columns != nullptr) {
    constexpr std::string_view columns_expected = "[from, to) in the last dim, each an integer or a shape symbol";
    std::optional<ShapeToken> from;
    std::optional<ShapeToken> to;
    const auto bound = [](const json& value) -> std::optional<ShapeToken> {
      if (value.is_number_integer() && value == 0) {
        ShapeToken zero;
        zero.kind = ShapeToken::Kind::constant;
        return zero;
      }
      return parse_shape_token(value, false);
    };
    if (columns->is_array() && columns->size() == 2) {
      from = bound((*columns)[0]);
      to = bound((*columns)[1]);
    }
    const auto plain = [](const std::optional<ShapeToken>& t) {
      return t && (t->kind == ShapeToken::Kind::constant || t->kind == ShapeToken::Kind::symbol);
    };
    if (!plain(from) || !plain(to)) {
      r.bad(pointer_key(pointer, "columns"), columns_expected, *columns);
    } else {
      v.columns = std::pair{*from, *to};
    }
  }
  if (const json* sizes = r.get(j, pointer, "sizes", false, ""); sizes != nullptr) {
    const auto sizes_pointer = pointer_key(pointer, "sizes");
    if (!sizes->is_array()) r.bad(sizes_pointer, "a list of size objects", *sizes);
    for (size_t i = 0; sizes->is_array() && i < sizes->size(); ++i) {
      if (auto one = read_sizes(r, (*sizes)[i], pointer_index(sizes_pointer, i))) v.sizes.push_back(std::move(*one));
    }
  }
  if (const json* unchecked = r.get(j, pointer, "unchecked", false, ""); unchecked != nullptr) {
    const auto unchecked_pointer = pointer_key(pointer, "unchecked");
    if (!unchecked->is_array()) r.bad(unchecked_pointer, "a list of names of tensors the op writes", *unchecked);
    for (size_t i = 0; unchecked->is_array() && i < unchecked->size(); ++i) {
      const json& item = (*unchecked)[i];
      const auto t = item.is_string() ? find(item.get<std::string>()) : s.tensors.end();
      if (t == s.tensors.end() || !t->written) {
        r.bad(pointer_index(unchecked_pointer, i), "the name of a tensor the op writes", item);
      } else {
        v.unchecked.push_back(t->name);
      }
    }
  }
  if (r.error_count() != before) return std::nullopt;
  return v;
}

// "tests": {"sizes": [{...}, ...], "attrs": {"NAME": [values...]},
// "special": [...]}; the tensors and attributes must be the schema's, which
// are read before.
void read_tests(Reader& r, const json& j, const std::string& pointer, OpSchema& s) {
  if (!j.is_object()) {
    r.bad(pointer, "an object {\"sizes\": [...], \"attrs\": {...}, \"special\": [...]}", j);
    return;
  }
  r.unknown_keys(j, pointer, {"sizes", "attrs", "special"});
  if (const json* special = r.get(j, pointer, "special", false, ""); special != nullptr) {
    const auto special_pointer = pointer_key(pointer, "special");
    if (!special->is_array()) r.bad(special_pointer, "a list of special-value sets", *special);
    for (size_t i = 0; special->is_array() && i < special->size(); ++i) {
      if (auto one = read_special(r, (*special)[i], pointer_index(special_pointer, i), s)) {
        s.test_special.push_back(std::move(*one));
      }
    }
  }
  if (const json* sizes = r.array(j, pointer, "sizes", true, "a list of size objects")) {
    for (size_t i = 0; i < sizes->size(); ++i) {
      if (auto one = read_sizes(r, (*sizes)[i], pointer_index(pointer_key(pointer, "sizes"), i))) {
        s.test_sizes.push_back(std::move(*one));
      }
    }
  }
  const json* attrs = r.get(j, pointer, "attrs", false, "");
  if (attrs == nullptr) return;
  const auto attrs_pointer = pointer_key(pointer, "attrs");
  if (!attrs->is_object()) {
    r.bad(attrs_pointer, "an object of attribute value lists, e.g. {\"is_neox\": [true, false]}", *attrs);
    return;
  }
  for (const auto& item : attrs->items()) {
    const auto item_pointer = pointer_key(attrs_pointer, item.key());
    const auto arg = std::find_if(s.attrs.begin(), s.attrs.end(), [&](const AttrArg& a) { return a.name == item.key(); });
    if (arg == s.attrs.end()) {
      r.error(ErrorCode::manifest_bad_field, item_pointer, fmt::format("the op has no attribute \"{}\"", item.key()));
      continue;
    }
    const json& list = item.value();
    if (!list.is_array() || list.empty()) {
      r.bad(item_pointer, fmt::format("a non-empty list of {} values", attr_type_name(arg->type)), list);
      continue;
    }
    std::vector<AttrValue> values;
    for (size_t i = 0; i < list.size(); ++i) {
      const json& v = list[i];
      const bool ok = (arg->type == AttrType::float_ && v.is_number()) ||
                      (arg->type == AttrType::int_ && v.is_number_integer()) ||
                      (arg->type == AttrType::bool_ && v.is_boolean()) || (arg->type == AttrType::string && v.is_string());
      if (!ok) {
        r.bad(pointer_index(item_pointer, i), fmt::format("a {} value", attr_type_name(arg->type)), v);
      } else if (arg->type == AttrType::float_) {
        values.emplace_back(v.get<double>());
      } else if (arg->type == AttrType::int_) {
        values.emplace_back(v.get<int64_t>());
      } else if (arg->type == AttrType::bool_) {
        values.emplace_back(v.get<bool>());
      } else {
        values.emplace_back(v.get<std::string>());
      }
    }
    s.test_attrs.emplace_back(item.key(), std::move(values));
  }
}

// "tolerance": {"<dtype>": {"ulps": N, "atol": X, "mean_ulps": M}, ...}; a
// dtype's entry replaces its default as a whole, so all three are required.
void read_tolerances(Reader& r, const json& j, const std::string& pointer, std::map<Dtype, Tolerance>& out) {
  constexpr std::string_view kExpected =
      "an object of tolerances by output dtype, e.g. {\"bfloat16\": {\"ulps\": 2, \"atol\": 1e-5, "
      "\"mean_ulps\": 0.8}}";
  if (!j.is_object()) {
    r.bad(pointer, kExpected, j);
    return;
  }
  for (const auto& item : j.items()) {
    const auto dtype_pointer = pointer_key(pointer, item.key());
    const std::optional<Dtype> dtype = parse_dtype(item.key());
    if (!dtype) {
      r.error(ErrorCode::manifest_bad_field, dtype_pointer,
              fmt::format("expected a dtype name, found \"{}\"", item.key()));
      continue;
    }
    const json& v = item.value();
    if (!v.is_object()) {
      r.bad(dtype_pointer, "an object {\"ulps\", \"atol\", \"mean_ulps\"}", v);
      continue;
    }
    r.unknown_keys(v, dtype_pointer, {"ulps", "atol", "mean_ulps"});
    Tolerance t;
    bool ok = true;
    for (auto [key, field] : {std::pair{"ulps", &t.ulps}, std::pair{"atol", &t.atol}, std::pair{"mean_ulps", &t.mean_ulps}}) {
      const auto field_pointer = pointer_key(dtype_pointer, key);
      const auto it = v.find(key);
      if (it == v.end()) {
        r.error(ErrorCode::manifest_bad_field, field_pointer, "missing (a non-negative number)");
        ok = false;
      } else if (!it->is_number() || !(it->get<double>() >= 0)) {
        r.bad(field_pointer, "a non-negative number", *it);
        ok = false;
      } else {
        *field = it->get<double>();
      }
    }
    if (ok) out[*dtype] = t;
  }
}

// One op schema. A symbol seen only inside multiples ("2*R" with no plain
// "R") is accepted: the checker binds it by dividing the dim by the factor,
// which the rotary embedding's head dim needs.
std::optional<OpSchema> read_op_schema(Reader& r, const json& j, const std::string& pointer) {
  if (!j.is_object()) {
    r.bad(pointer, "an op schema object {\"op\", \"tensors\", ...}", j);
    return std::nullopt;
  }
  const size_t before = r.error_count();
  r.unknown_keys(j, pointer,
                 {"op", "doc", "tensors", "attrs", "dtypes", "requires", "out_of_place", "example", "bench", "tests",
                  "tolerance"});
  OpSchema s;
  s.source = r.file();
  s.op = r.checked_string(j, pointer, "op", true, "an op id <group>.<name> of [a-z0-9_]+", is_valid_op_id)
             .value_or("");
  s.doc = r.string(j, pointer, "doc", false, "a string").value_or("");
  s.out_of_place = r.checked_string(j, pointer, "out_of_place", false, "an op id <group>.<name> of [a-z0-9_]+",
                                    is_valid_op_id)
                       .value_or("");

  // dtypes first: tensors refer to its variables. A variable whose list is
  // bad still counts as declared, so its users are not reported as well.
  std::set<std::string> declared_vars;
  if (const json* vars = r.get(j, pointer, "dtypes", false, ""); vars != nullptr) {
    const auto vars_pointer = pointer_key(pointer, "dtypes");
    if (!vars->is_object()) {
      r.bad(vars_pointer, "an object mapping dtype variables to dtype lists ({\"T\": [\"float32\"]})", *vars);
    } else {
      for (const auto& item : vars->items()) {
        const auto var_pointer = pointer_key(vars_pointer, item.key());
        if (!is_identifier(item.key()) || parse_dtype(item.key())) {
          r.error(ErrorCode::manifest_bad_field, var_pointer,
                  fmt::format("expected a dtype variable name ({} that is not a dtype name), found \"{}\"",
                              kIdentifierExpected, item.key()));
          continue;
        }
        declared_vars.insert(item.key());
        if (auto list = read_dtype_list(r, item.value(), var_pointer, "a variable needs at least one dtype")) {
          s.dtype_vars.emplace(item.key(), std::move(*list));
        }
      }
    }
  }

  std::set<std::string> used_vars;
  std::map<std::string, std::string> arg_names;  // name -> pointer of its first use
  const auto claim_name = [&](const std::string& name, const std::string& name_pointer, std::string_view what) {
    if (name.empty()) return;
    const auto [it, inserted] = arg_names.emplace(name, name_pointer);
    if (!inserted) {
      r.error(ErrorCode::manifest_bad_field, name_pointer,
              fmt::format("duplicate {} name \"{}\" (already used at {})", what, name, it->second));
    }
  };
  if (const json* tensors = r.array(j, pointer, "tensors", true, "a list of tensor objects")) {
    for (size_t i = 0; i < tensors->size(); ++i) {
      const auto t_pointer = pointer_index(pointer_key(pointer, "tensors"), i);
      if (auto t = read_tensor(r, (*tensors)[i], t_pointer, declared_vars, used_vars)) {
        claim_name(t->name, pointer_key(t_pointer, "name"), "argument");
        s.tensors.push_back(std::move(*t));
      }
    }
  }
  if (const json* attrs = r.array(j, pointer, "attrs", false, "a list of attribute objects")) {
    for (size_t i = 0; i < attrs->size(); ++i) {
      const auto a_pointer = pointer_index(pointer_key(pointer, "attrs"), i);
      // Attributes share the tensors' namespace: tools address both by name.
      if (auto a = read_attr(r, (*attrs)[i], a_pointer)) {
        claim_name(a->name, pointer_key(a_pointer, "name"), "argument");
        s.attrs.push_back(std::move(*a));
      }
    }
  }
  // "requires": ["2*R <= D"], relations the call checker compiles (and
  // refuses below when it cannot).
  if (const json* reqs = r.array(j, pointer, "requires", false, "a list of relations such as \"2*R <= D\"")) {
    for (size_t i = 0; i < reqs->size(); ++i) {
      const json& item = (*reqs)[i];
      if (!item.is_string()) {
        r.bad(pointer_index(pointer_key(pointer, "requires"), i), "a relation such as \"2*R <= D\"", item);
      } else {
        s.requirements.push_back(item.get<std::string>());
      }
    }
  }
  // "example": sizes that tools use by default, {"*": [64], "H": 4096}.
  if (const json* example = r.get(j, pointer, "example", false, ""); example != nullptr) {
    if (auto sizes = read_sizes(r, *example, pointer_key(pointer, "example"))) {
      s.example_leading = std::move(sizes->leading);
      s.example_sizes = std::move(sizes->symbols);
    }
  }
  if (const json* bench = r.get(j, pointer, "bench", false, ""); bench != nullptr) {
    s.bench_sizes = read_sizes(r, *bench, pointer_key(pointer, "bench"));
  }
  if (const json* tests = r.get(j, pointer, "tests", false, ""); tests != nullptr) {
    read_tests(r, *tests, pointer_key(pointer, "tests"), s);
  }
  if (const json* tolerance = r.get(j, pointer, "tolerance", false, ""); tolerance != nullptr) {
    read_tolerances(r, *tolerance, pointer_key(pointer, "tolerance"), s.tolerances);
  }
  for (const auto& var : declared_vars) {
    if (used_vars.count(var) == 0) {
      r.warn(ErrorCode::manifest_bad_field, pointer_key(pointer_key(pointer, "dtypes"), var),
             fmt::format("dtype variable \"{}\" is not used by any tensor", var));
    }
  }
  if (r.error_count() != before) return std::nullopt;
  // A schema the call checker cannot compile (more shape symbols or tensors
  // than it has slots for) could be listed but never called.
  try {
    const CompiledSchema compiled(s);
  } catch (const Error& e) {
    std::string why = e.message();
    if (why.starts_with(s.source + ": ")) why.erase(0, s.source.size() + 2);
    r.error(ErrorCode::manifest_bad_field, pointer, fmt::format("the call checker cannot take it: {}", why));
    return std::nullopt;
  }
  return s;
}

// A list of op schemas (an op-schema file, or a manifest's "ops").
void read_op_schema_list(Reader& r, const json& list, const std::string& pointer, std::vector<OpSchema>& out) {
  std::map<std::string, std::pair<std::string, size_t>> seen;  // op -> (pointer, index in out)
  for (size_t i = 0; i < list.size(); ++i) {
    const auto s_pointer = pointer_index(pointer, i);
    auto schema = read_op_schema(r, list[i], s_pointer);
    if (!schema) continue;
    const auto [it, inserted] = seen.emplace(schema->op, std::make_pair(s_pointer, out.size()));
    if (inserted) {
      out.push_back(std::move(*schema));
    } else if (out[it->second.second].same_signature(*schema)) {
      r.warn(ErrorCode::conflicting_registration, s_pointer,
             fmt::format("op '{}' is defined again, identically (first at {}); the repeat is ignored", schema->op,
                         it->second.first));
    } else {
      r.error(ErrorCode::conflicting_registration, s_pointer,
              fmt::format("Conflicting definitions of op '{}': {} != {}", schema->op, it->second.first, s_pointer));
    }
  }
}

// --- manifests ---------------------------------------------------------------------

std::optional<Target> read_target(Reader& r, const json& j, const std::string& pointer) {
  if (!j.is_object()) {
    r.bad(pointer, "a target object {\"device\": \"cpu\"|\"cuda\"|\"hip\", ...}", j);
    return std::nullopt;
  }
  const size_t before = r.error_count();
  r.unknown_keys(j, pointer, {"device", "min_arch", "max_arch", "archs", "features"});
  constexpr std::string_view device_expected = "a device: \"cpu\", \"cuda\" or \"hip\"";
  Target t;
  std::optional<DeviceType> device;
  if (const auto name = r.string(j, pointer, "device", true, device_expected)) {
    device = parse_device_type(*name);
    if (device) {
      t.device = *device;
    } else {
      r.bad(pointer_key(pointer, "device"), device_expected, j.at("device"));
    }
  }
  // A field of another device's target is refused rather than ignored: the
  // author meant a constraint, and ignoring it would widen where it runs.
  const auto only_for = [&](std::string_view key, DeviceType wanted) {
    if (!device || *device == wanted || !j.contains(std::string(key))) return true;
    r.error(ErrorCode::manifest_bad_field, pointer_key(pointer, key),
            fmt::format("{} applies to {} targets only; this target's device is \"{}\"", key,
                        device_type_name(wanted), device_type_name(*device)));
    return false;
  };
  for (const auto key : {"min_arch", "max_arch"}) {
    if (!only_for(key, DeviceType::cuda)) continue;
    auto text = r.string(j, pointer, key, false, kArchExpected);
    if (!text) continue;
    const auto arch = CudaArch::parse(*text);
    if (!arch) {
      r.bad(pointer_key(pointer, key), kArchExpected, j.at(key));
    } else {
      (std::string_view(key) == "min_arch" ? t.min_arch : t.max_arch) = arch;
    }
  }
  if (t.min_arch && t.max_arch && *t.min_arch > *t.max_arch) {
    r.error(ErrorCode::manifest_bad_field, pointer_key(pointer, "max_arch"),
            fmt::format("inverted arch window: min_arch {} is above max_arch {}, so no device matches",
                        t.min_arch->str(), t.max_arch->str()));
  }
  const auto read_list = [&](const char* key, DeviceType wanted, std::string_view expected,
                             bool (*valid)(std::string_view), bool allow_empty, std::vector<std::string>& out) {
    if (!only_for(key, wanted)) return;
    const auto list_expected = fmt::format("a list of {}", expected);
    const json* list = r.array(j, pointer, key, false, list_expected);
    if (list == nullptr) return;
    if (list->empty() && !allow_empty) {
      r.error(ErrorCode::manifest_bad_field, pointer_key(pointer, key),
              fmt::format("expected a non-empty list of {}, found []; omit \"{}\" to accept any", expected, key));
      return;
    }
    for (size_t i = 0; i < list->size(); ++i) {
      const auto& item = (*list)[i];
      if (!item.is_string() || !valid(item.get_ref<const std::string&>())) {
        r.bad(pointer_index(pointer_key(pointer, key), i), expected, item);
      } else {
        out.push_back(item.get<std::string>());
      }
    }
  };
  // An empty "archs" would read as "no arch" but match every one; an empty
  // "features" really means "needs nothing", so it is fine.
  read_list("archs", DeviceType::hip, "hip archs (e.g. \"gfx90a\")", is_hip_arch, false, t.archs);
  read_list("features", DeviceType::cpu, "cpu features of [a-z0-9_]+ (e.g. \"avx2\")", is_valid_name, true,
            t.features);
  if (r.error_count() != before) return std::nullopt;
  return t;
}

std::optional<std::vector<Target>> read_targets(Reader& r, const json& list, const std::string& pointer) {
  const size_t before = r.error_count();
  std::vector<Target> targets;
  for (size_t i = 0; i < list.size(); ++i) {
    if (auto t = read_target(r, list[i], pointer_index(pointer, i))) targets.push_back(std::move(*t));
  }
  if (r.error_count() != before) return std::nullopt;
  return targets;
}

constexpr std::string_view kTargetsExpected = "a list of target objects";

// One kernel entry; nullopt after reporting its problems. Its op id goes
// into `declared_ops` whenever the id itself is valid, so that an invalid
// manifest still says which ops it would provide.
std::optional<KernelSpec> read_kernel(Reader& r, const json& j, const std::string& pointer, const Manifest& m,
                                      std::vector<std::string>& declared_ops) {
  if (!j.is_object()) {
    r.bad(pointer, "a kernel object {\"op\", \"symbol\", ...}", j);
    return std::nullopt;
  }
  const size_t before = r.error_count();
  r.unknown_keys(j, pointer, {"op", "symbol", "dtypes", "targets", "description", "role", "opt_in", "constraints",
                          "priority", "supports"});
  KernelSpec k;
  k.op = r.checked_string(j, pointer, "op", true, "an op id <group>.<name> of [a-z0-9_]+", is_valid_op_id)
             .value_or("");
  if (!k.op.empty() && std::find(declared_ops.begin(), declared_ops.end(), k.op) == declared_ops.end()) {
    declared_ops.push_back(k.op);
  }
  k.symbol = r.checked_string(j, pointer, "symbol", true, "a C identifier [A-Za-z_][A-Za-z0-9_]*", is_identifier)
                 .value_or("");
  if (const json* dtypes = r.get(j, pointer, "dtypes", false, "")) {
    k.dtypes = read_dtype_list(r, *dtypes, pointer_key(pointer, "dtypes"), "omit \"dtypes\" to accept any dtype")
                   .value_or(std::vector<Dtype>{});
  }
  // A kernel's own targets replace the manifest's, even when empty ([] = any device).
  if (const json* targets = r.array(j, pointer, "targets", false, kTargetsExpected)) {
    k.targets = read_targets(r, *targets, pointer_key(pointer, "targets")).value_or(std::vector<Target>{});
  } else {
    k.targets = m.targets;
  }
  k.description = r.string(j, pointer, "description", false, "a string").value_or("");
  k.plugin = m.plugin;
  k.backend = m.backend;
  k.manifest = m.path;
  // A kernel's own "role" replaces the manifest's: a plugin may ship the
  // reference of its own op beside its fast kernels. Such a kernel is the
  // backend "reference" (kernel_backend), so that it neither clashes with
  // the plugin's kernel for the same op nor needs a plugin of its own.
  k.role = m.role;
  if (auto role = r.string(j, pointer, "role", false, kRoleExpected)) {
    if (*role == "reference") {
      k.role = KernelRole::reference;
    } else if (*role == "backend") {
      k.role = KernelRole::backend;
    } else {
      r.bad(pointer_key(pointer, "role"), kRoleExpected, j.at("role"));
    }
  }
  k.backend = kernel_backend(m, k.role);
  k.opt_in = r.boolean(j, pointer, "opt_in").value_or(false);
  k.supports_symbol = r.checked_string(j, pointer, "supports", false, "a C identifier [A-Za-z_][A-Za-z0-9_]*", is_identifier)
                   .value_or("");
  constexpr std::string_view kPriorityExpected = "an integer in [-1000, 1000] (the higher wins a tie)";
  if (const json* priority = r.get(j, pointer, "priority", false, kPriorityExpected)) {
    if (priority->is_number_integer() && priority->get<int64_t>() >= -1000 && priority->get<int64_t>() <= 1000) {
      k.priority = static_cast<int32_t>(priority->get<int64_t>());
    } else {
      r.bad(pointer_key(pointer, "priority"), kPriorityExpected, *priority);
    }
  }
  // "constraints": ["H % 8 == 0"], conditions on a call (docs/manifest.md).
  // Their syntax is checked here; their names against the op's schema when
  // the kernel is registered, once the schema is known.
  constexpr std::string_view kConstraintExpected = "a list of conditions such as \"H % 8 == 0\"";
  if (const json* list = r.array(j, pointer, "constraints", false, kConstraintExpected)) {
    for (size_t i = 0; i < list->size(); ++i) {
      const json& item = (*list)[i];
      const std::string item_pointer = pointer_index(pointer_key(pointer, "constraints"), i);
      if (!item.is_string()) {
        r.bad(item_pointer, "a condition such as \"H % 8 == 0\"", item);
        continue;
      }
      const std::string text = item.get<std::string>();
      try {
        Constraint::compile(text, nullptr);
        k.constraints.push_back(text);
      } catch (const std::invalid_argument& e) {
        r.error(ErrorCode::manifest_bad_field, item_pointer, fmt::format("constraint \"{}\": {}", text, e.what()));
      }
    }
  }
  if (r.error_count() != before) return std::nullopt;
  return k;
}

void read_kernels(Reader& r, const json& list, Manifest& m, std::vector<std::string>& declared_ops) {
  // (op, backend) -> (pointer, index in m.kernels): an op may have one
  // kernel of the plugin's backend and one reference.
  std::map<std::pair<std::string, std::string>, std::pair<std::string, size_t>> seen;
  for (size_t i = 0; i < list.size(); ++i) {
    const auto pointer = pointer_index("/kernels", i);
    auto k = read_kernel(r, list[i], pointer, m, declared_ops);
    if (!k) continue;
    const auto [it, inserted] = seen.emplace(std::pair{k->op, k->backend}, std::make_pair(pointer, m.kernels.size()));
    if (inserted) {
      m.kernels.push_back(std::move(*k));
      continue;
    }
    const KernelSpec& first = m.kernels[it->second.second];
    if (first.same_implementation(*k)) {
      // Same rule as the registry (docs/manifest.md, kernels): the same symbol again is a no-op.
      r.warn(ErrorCode::conflicting_registration, pointer,
             fmt::format("op '{}' is declared again with the same symbol '{}' (first at {}); only the first "
                         "entry counts",
                         k->op, k->symbol, it->second.first));
    } else {
      r.error(ErrorCode::conflicting_registration, pointer,
              fmt::format("Conflicting kernel registration for op '{}', backend '{}': symbol '{}' ({}) != "
                          "symbol '{}' ({})",
                          k->op, k->backend, first.symbol, it->second.first, k->symbol, pointer));
    }
  }
}

// Returns false when the version refuses the rest of the document.
bool read_format_version(Reader& r, const json& doc, Manifest& m) {
  const auto text = r.string(doc, "", "kdispatch_manifest", true, kVersionExpected);
  if (!text) return true;  // reported; check the rest as 1.x
  const auto version = parse_version(*text);
  if (!version) {
    r.bad("/kdispatch_manifest", kVersionExpected, doc.at("kdispatch_manifest"));
    return true;
  }
  m.format = *text;
  if (version->major != kManifestFormatMajor) {
    r.error(ErrorCode::manifest_bad_version, "/kdispatch_manifest",
            fmt::format("format {} is not supported; this kdispatch reads {}.x", *text, kManifestFormatMajor));
    // Another major may mean other fields: checking them as 1.x would only add noise.
    return false;
  }
  if (version->minor > kManifestFormatMinor) {
    r.warn(ErrorCode::manifest_bad_version, "/kdispatch_manifest",
           fmt::format("format {} is newer than this kdispatch ({}.{}); keys it does not know are ignored", *text,
                       kManifestFormatMajor, kManifestFormatMinor));
  }
  return true;
}

// Reads `doc` into `m`, field by field: a field that does not validate is
// reported and left empty, and the others are still read, so that an
// invalid manifest keeps the names that did validate (`declared_ops`: the
// op ids of its kernels, valid kernels or not).
void read_manifest_document(Reader& r, const json& doc, Manifest& m, std::vector<std::string>& declared_ops) {
  if (!doc.is_object()) {
    r.bad("", "a manifest object {\"kdispatch_manifest\": \"1.0\", ...}", doc);
    return;
  }
  if (!read_format_version(r, doc, m)) return;
  r.unknown_keys(doc, "", {"$schema", "kdispatch_manifest", "plugin", "backend", "library", "abi", "sha256",
                           "description", "role", "targets", "kernels", "ops"});

  m.plugin = r.checked_string(doc, "", "plugin", true, kNameExpected, is_valid_name).value_or("");
  m.backend = r.checked_string(doc, "", "backend", true, kNameExpected, is_valid_name).value_or("");

  if (auto library = r.string(doc, "", "library", true, "a shared library file name (e.g. \"libkdispatch-cpu.so\")")) {
    if (const auto why = library_name_problem(*library); !why.empty()) {
      r.error(ErrorCode::manifest_bad_library_path, "/library",
              fmt::format("{} {}; give a plain file name, which is resolved next to the manifest", describe(doc.at("library")),
                          why));
    }
    m.library = std::move(*library);
  }

  if (auto abi = r.string(doc, "", "abi", true, kVersionExpected)) {
    const auto version = parse_version(*abi);
    if (!version) {
      r.bad("/abi", kVersionExpected, doc.at("abi"));
    } else if (version->major != KDISPATCH_ABI_MAJOR) {
      r.error(ErrorCode::manifest_bad_field, "/abi",
              fmt::format("abi {} is not supported by this host ({}.x)", *abi, KDISPATCH_ABI_MAJOR));
    }
    m.abi = std::move(*abi);
  }

  if (auto sha = r.string(doc, "", "sha256", false, "64 hex digits")) {
    if (!is_sha256_hex(*sha)) {
      r.bad("/sha256", "64 hex digits", doc.at("sha256"));
    } else {
      std::transform(sha->begin(), sha->end(), sha->begin(),
                     [](char c) { return c >= 'A' && c <= 'F' ? static_cast<char>(c - 'A' + 'a') : c; });
      m.sha256 = std::move(*sha);
    }
  }
  m.description = r.string(doc, "", "description", false, "a string").value_or("");
  // "role" before kernels: every kernel of the manifest takes it.
  if (auto role = r.string(doc, "", "role", false, kRoleExpected)) {
    if (*role == "reference") {
      m.role = KernelRole::reference;
    } else if (*role != "backend") {
      r.bad("/role", kRoleExpected, doc.at("role"));
    }
  }

  // Top-level targets before kernels: they are the kernels' default.
  if (const json* targets = r.array(doc, "", "targets", false, kTargetsExpected)) {
    m.targets = read_targets(r, *targets, "/targets").value_or(std::vector<Target>{});
  }
  if (const json* kernels = r.array(doc, "", "kernels", true, "a list of kernel objects (may be empty)")) {
    read_kernels(r, *kernels, m, declared_ops);
  }
  if (const json* ops = r.array(doc, "", "ops", false, "a list of op schemas")) {
    read_op_schema_list(r, *ops, "/ops", m.ops);
  }
}

}  // namespace

bool is_valid_name(std::string_view name) {
  return !name.empty() && std::all_of(name.begin(), name.end(), is_lower_name_char);
}

bool is_valid_op_id(std::string_view op) {
  const auto dot = op.find('.');
  return dot != std::string_view::npos && is_valid_name(op.substr(0, dot)) && is_valid_name(op.substr(dot + 1));
}

std::string kernel_backend(const Manifest& m, KernelRole role) {
  if (role == KernelRole::reference && m.role != KernelRole::reference) return std::string(kReferenceBackend);
  return m.backend;
}

std::filesystem::path Manifest::library_path() const {
  return std::filesystem::path(path).parent_path() / library;
}

std::vector<std::string> Manifest::kernel_ops() const {
  std::vector<std::string> ids;
  ids.reserve(kernels.size());
  for (const KernelSpec& k : kernels) ids.push_back(k.op);
  return ids;
}

namespace {

// parse_manifest; with `ops_json`, also the document's "ops" list as
// compact JSON (empty when it has none).
ManifestResult parse_manifest_document(std::string_view text, const std::string& path, std::string* ops_json) {
  ManifestResult result;
  Reader r(path, result.errors, result.warnings);
  try {
    const auto doc = parse_json(text, r);
    if (!doc) return result;
    Manifest m;
    m.path = path;
    read_manifest_document(r, *doc, m, result.ops);
    r.finish();
    result.plugin = m.plugin;
    result.backend = m.backend;
    if (result.errors.empty()) {
      if (ops_json != nullptr && !m.ops.empty()) *ops_json = doc->at("ops").dump();
      result.manifest = std::move(m);
    }
  } catch (const std::exception& e) {
    // Validation reports problems instead of throwing; reaching this is a bug
    // here, and still must not take down a process that only scans plugins.
    result.manifest.reset();
    result.internal_error = true;
    r.error(ErrorCode::manifest_bad_field, "", fmt::format("internal error while validating: {}", e.what()));
  }
  return result;
}

}  // namespace

std::vector<Target> parse_targets(std::string_view json_list, const std::string& what) {
  std::vector<Problem> errors;
  std::vector<Problem> warnings;
  Reader r(what, errors, warnings);
  std::vector<Target> targets;
  if (const auto doc = parse_json(json_list, r)) {
    if (!doc->is_array()) {
      r.bad("", kTargetsExpected, *doc);
    } else if (auto read = read_targets(r, *doc, "")) {
      targets = std::move(*read);
    }
  }
  // An unknown key is refused here: nothing else would report it.
  if (errors.empty() && !warnings.empty()) errors.push_back(warnings.front());
  if (!errors.empty()) throw ManifestError(errors.front().code, errors.front().message);
  return targets;
}

ManifestResult parse_manifest(std::string_view text, const std::string& path) {
  return parse_manifest_document(text, path, nullptr);
}

ManifestResult parse_manifest_for_cache(std::string_view text, const std::string& path, std::string& ops_json) {
  ops_json.clear();
  return parse_manifest_document(text, path, &ops_json);
}

std::optional<std::string> read_manifest_text(const std::filesystem::path& path, Problem& problem) {
  std::string why;
  const UniqueFd file{open_regular_file(path, O_RDONLY, why)};
  if (file.fd < 0) {
    const std::string name = path.string();
    problem = {ErrorCode::manifest_bad_json, name, fmt::format("{}: cannot read: {}", name, why)};
    return std::nullopt;
  }
  return read_manifest_text_from(file.fd, path.string(), problem);
}

std::optional<std::string> read_manifest_text_from(int fd, const std::string& name, Problem& problem) {
  const auto unreadable = [&](std::string_view why) {
    problem = {ErrorCode::manifest_bad_json, name, fmt::format("{}: cannot read: {}", name, why)};
    return std::nullopt;
  };
  std::string text;
  char buffer[16384];
  while (true) {
    const ssize_t n = ::pread(fd, buffer, sizeof buffer, static_cast<off_t>(text.size()));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return unreadable(std::strerror(errno));
    if (n == 0) break;
    text.append(buffer, static_cast<size_t>(n));
    if (text.size() > kMaxManifestBytes) {
      return unreadable(fmt::format("larger than the {} MiB a manifest may have", kMaxManifestBytes >> 20));
    }
  }
  return text;
}

ManifestResult read_manifest(const std::filesystem::path& path) {
  Problem problem{};
  const std::optional<std::string> text = read_manifest_text(path, problem);
  if (!text) {
    ManifestResult result;
    result.errors.push_back(std::move(problem));
    return result;
  }
  return parse_manifest(*text, path.string());
}

SchemaFileResult parse_op_schemas(std::string_view text, const std::string& path) {
  SchemaFileResult result;
  Reader r(path, result.errors, result.warnings);
  try {
    const auto doc = parse_json(text, r);
    if (!doc) return result;
    if (!doc->is_array()) {
      r.bad("", "a list of op schemas [{\"op\": ...}, ...]", *doc);
      return result;
    }
    read_op_schema_list(r, *doc, "", result.schemas);
    r.finish();
  } catch (const std::exception& e) {
    // As in parse_manifest_document: a bug, flagged as one.
    result.internal_error = true;
    r.error(ErrorCode::manifest_bad_field, "", fmt::format("internal error while validating: {}", e.what()));
  }
  return result;
}

}  // namespace kdispatch
