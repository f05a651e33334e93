#include "manifest_record.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cstring>
#include <iterator>

namespace kdispatch {

namespace {

// A kernel's targets field when they are the manifest's.
constexpr std::string_view kSameTargets = "=";

// A dtype as one digit: its place in kAllDtypes.
char dtype_digit(Dtype dtype) {
  const auto* at = std::find(std::begin(kAllDtypes), std::end(kAllDtypes), dtype);
  return static_cast<char>('0' + (at - std::begin(kAllDtypes)));
}

class RecordWriter {
 public:
  void text(std::string_view field) {
    separate();
    if (field.find_first_of("\\\t\n") == std::string_view::npos) {
      out_ += field;
      return;
    }
    for (char c : field) {
      if (c == '\\') {
        out_ += "\\\\";
      } else if (c == '\t') {
        out_ += "\\t";
      } else if (c == '\n') {
        out_ += "\\n";
      } else {
        out_ += c;
      }
    }
  }
  void count(size_t n) {
    separate();
    out_ += fmt::format_int(n).str();
  }
  std::string take() { return std::move(out_); }

 private:
  void separate() {
    if (!first_) out_ += '\t';
    first_ = false;
  }
  std::string out_;
  bool first_ = true;
};

// Reads the fields of a record in order. Every read fails (returns false)
// once the record runs out or a field is malformed, so a decoder can read
// on and check once.
class RecordReader {
 public:
  explicit RecordReader(std::string_view record) : rest_(record) {}

  bool text(std::string& out) {
    std::string_view raw;
    if (!next(raw)) return false;
    if (raw.find('\\') == std::string_view::npos) {
      out.assign(raw);
      return true;
    }
    out.clear();
    for (size_t i = 0; i < raw.size(); ++i) {
      if (raw[i] != '\\') {
        out += raw[i];
        continue;
      }
      const char c = ++i < raw.size() ? raw[i] : '\0';
      if (c == '\\') {
        out += '\\';
      } else if (c == 't') {
        out += '\t';
      } else if (c == 'n') {
        out += '\n';
      } else {
        return fail();
      }
    }
    return true;
  }
  // A plain field (no escapes possible in what it holds: names, numbers).
  bool raw(std::string_view& out) {
    if (!next(out)) return false;
    return out.find('\\') == std::string_view::npos || fail();
  }
  // A list length. Each item takes at least one field, so a length beyond
  // what is left of the record is corrupt (and is never allocated).
  bool count(size_t& n) {
    std::string_view digits;
    return raw(digits) && count_of(digits, n);
  }
  // The same, of a field already read.
  bool count_of(std::string_view digits, size_t& n) {
    const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), n);
    if (ec != std::errc() || end != digits.data() + digits.size() || digits.empty()) return fail();
    return n <= rest_.size() + 1 || fail();
  }
  // True when every field was read, and read well.
  bool finished() const { return ok_ && at_end_; }
  bool ok() const { return ok_; }

 private:
  bool next(std::string_view& out) {
    if (!ok_ || at_end_) return fail();
    const size_t tab = rest_.find('\t');
    if (tab == std::string_view::npos) {
      out = rest_;
      rest_ = {};
      at_end_ = true;
    } else {
      out = rest_.substr(0, tab);
      rest_.remove_prefix(tab + 1);
    }
    return true;
  }
  bool fail() {
    ok_ = false;
    return false;
  }
  std::string_view rest_;
  bool at_end_ = false;
  bool ok_ = true;
};

void write_target(RecordWriter& w, const Target& t) {
  w.text(device_type_name(t.device));
  w.text(t.min_arch ? t.min_arch->str() : std::string());
  w.text(t.max_arch ? t.max_arch->str() : std::string());
  w.count(t.archs.size());
  for (const auto& a : t.archs) w.text(a);
  w.count(t.features.size());
  for (const auto& f : t.features) w.text(f);
}

void write_targets(RecordWriter& w, const std::vector<Target>& targets) {
  w.count(targets.size());
  for (const auto& t : targets) write_target(w, t);
}

bool read_arch(RecordReader& r, std::optional<CudaArch>& out) {
  std::string_view text;
  if (!r.raw(text)) return false;
  if (text.empty()) return true;
  out = CudaArch::parse(text);
  return out.has_value();
}

bool read_strings(RecordReader& r, std::vector<std::string>& out) {
  size_t n = 0;
  if (!r.count(n)) return false;
  out.resize(n);
  for (auto& s : out) {
    if (!r.text(s)) return false;
  }
  return true;
}

bool read_target_list(RecordReader& r, size_t n, std::vector<Target>& out) {
  out.resize(n);
  for (Target& t : out) {
    std::string_view device;
    if (!r.raw(device)) return false;
    const std::optional<DeviceType> type = parse_device_type(device);
    if (!type) return false;
    t.device = *type;
    if (!read_arch(r, t.min_arch) || !read_arch(r, t.max_arch) || !read_strings(r, t.archs) ||
        !read_strings(r, t.features)) {
      return false;
    }
  }
  return true;
}

bool read_targets(RecordReader& r, std::vector<Target>& out) {
  size_t n = 0;
  return r.count(n) && read_target_list(r, n, out);
}

// A kernel's priority, as the parser bounds it.
bool parse_priority(std::string_view field, int32_t& out) {
  const auto [end, ec] = std::from_chars(field.data(), field.data() + field.size(), out);
  return ec == std::errc() && end == field.data() + field.size() && !field.empty() && out >= -1000 && out <= 1000;
}

bool read_kernel(RecordReader& r, const Manifest& m, KernelSpec& k) {
  std::string_view dtypes;
  if (!r.text(k.op) || !r.text(k.symbol) || !r.text(k.description) || !r.raw(dtypes)) return false;
  k.dtypes.resize(dtypes.size());
  for (size_t i = 0; i < dtypes.size(); ++i) {
    const auto index = static_cast<size_t>(dtypes[i] - '0');
    if (index >= std::size(kAllDtypes)) return false;
    k.dtypes[i] = kAllDtypes[index];
  }
  std::string_view targets;
  if (!r.raw(targets)) return false;
  if (targets == kSameTargets) {
    k.targets = m.targets;
  } else {
    size_t n = 0;
    if (!r.count_of(targets, n) || !read_target_list(r, n, k.targets)) return false;
  }
  std::string_view flags;  // role (r: reference, b: backend), then o when opt-in
  if (!r.raw(flags) || flags.empty() || (flags[0] != 'r' && flags[0] != 'b') ||
      (flags.size() == 2 && flags[1] != 'o') || flags.size() > 2) {
    return false;
  }
  k.plugin = m.plugin;
  k.manifest = m.path;
  k.role = flags[0] == 'r' ? KernelRole::reference : KernelRole::backend;
  k.backend = kernel_backend(m, k.role);
  k.opt_in = flags.size() == 2;
  std::string_view priority;
  if (!r.raw(priority) || !parse_priority(priority, k.priority)) return false;
  size_t constraints = 0;
  if (!r.count(constraints)) return false;
  k.constraints.resize(constraints);
  for (std::string& c : k.constraints) {
    if (!r.text(c)) return false;
  }
  return r.text(k.supports_symbol);
}

}  // namespace

std::string encode_manifest_record(const Manifest& m, std::string_view ops_json) {
  RecordWriter w;
  w.text(m.format);
  w.text(m.plugin);
  w.text(m.backend);
  w.text(m.library);
  w.text(m.abi);
  w.text(m.sha256.value_or(""));
  w.text(m.description);
  w.text(m.role == KernelRole::reference ? "reference" : "backend");
  write_targets(w, m.targets);
  w.count(m.kernels.size());
  for (const KernelSpec& k : m.kernels) {
    w.text(k.op);
    w.text(k.symbol);
    w.text(k.description);
    std::string dtypes;
    for (Dtype d : k.dtypes) dtypes += dtype_digit(d);
    w.text(dtypes);
    if (k.targets == m.targets) {
      w.text(kSameTargets);
    } else {
      write_targets(w, k.targets);
    }
    w.text(std::string(k.role == KernelRole::reference ? "r" : "b") + (k.opt_in ? "o" : ""));
    w.text(std::to_string(k.priority));
    w.count(k.constraints.size());
    for (const std::string& c : k.constraints) w.text(c);
    w.text(k.supports_symbol);
  }
  w.text(ops_json);
  return w.take();
}

std::optional<Manifest> decode_manifest_record(std::string_view record, const std::string& path) {
  RecordReader r(record);
  Manifest m;
  m.path = path;
  std::string sha256;
  std::string_view role;
  if (!r.text(m.format) || !r.text(m.plugin) || !r.text(m.backend) || !r.text(m.library) || !r.text(m.abi) ||
      !r.text(sha256) || !r.text(m.description) || !r.raw(role)) {
    return std::nullopt;
  }
  if (!sha256.empty()) m.sha256 = std::move(sha256);
  if (role == "reference") {
    m.role = KernelRole::reference;
  } else if (role != "backend") {
    return std::nullopt;
  }
  if (!read_targets(r, m.targets)) return std::nullopt;
  size_t kernels = 0;
  if (!r.count(kernels)) return std::nullopt;
  m.kernels.resize(kernels);
  for (KernelSpec& k : m.kernels) {
    if (!read_kernel(r, m, k)) return std::nullopt;
  }
  std::string ops_json;
  if (!r.text(ops_json) || !r.finished()) return std::nullopt;
  if (!ops_json.empty()) {
    SchemaFileResult ops = parse_op_schemas(ops_json, path);
    if (!ops.errors.empty() || !ops.warnings.empty()) return std::nullopt;
    m.ops = std::move(ops.schemas);
  }
  return m;
}

}  // namespace kdispatch
