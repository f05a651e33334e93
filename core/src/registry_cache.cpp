#include "registry_cache.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <vector>

#include "file_check.hpp"
#include "kdispatch/environment.hpp"
#include "kdispatch/log.hpp"
#include "kdispatch/version.h"
#include "kdispatch/plugin_api.h"
#include "kdispatch/plugin_security.hpp"

namespace kdispatch {
namespace fs = std::filesystem;

namespace {

constexpr std::string_view kHeader = "kdispatch-scan-cache 1";

struct Stamp {
  std::string library_size, library_mtime, manifest_sha256;
  bool operator==(const Stamp&) const = default;
};

struct Entry {
  Stamp stamp;
  ScanOutcome outcome;
};

std::mutex& cache_mutex() {
  static std::mutex mutex;
  return mutex;
}

std::optional<Stamp> stamp_of(const Manifest& manifest) {
  struct stat st {};
  const fs::path library = fs::absolute(manifest.library_path());
  if (::stat(library.c_str(), &st) != 0) return std::nullopt;
  Stamp s;
  s.library_size = std::to_string(st.st_size);
  s.library_mtime = fmt::format("{}.{:09}", st.st_mtim.tv_sec, st.st_mtim.tv_nsec);
  try {
    s.manifest_sha256 = sha256_file(manifest.path);
  } catch (const std::exception&) {
    return std::nullopt;
  }
  return s;
}

// Tabs, newlines and backslashes escaped, so an entry is one line of
// tab-separated fields.
std::string escape(std::string_view text) {
  std::string out;
  for (char c : text) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}
std::string unescape(std::string_view text) {
  std::string out;
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] != '\\' || i + 1 == text.size()) {
      out += text[i];
      continue;
    }
    const char c = text[++i];
    out += c == 't' ? '\t' : c == 'n' ? '\n' : c;
  }
  return out;
}

std::vector<std::string> split_tabs(const std::string& line) {
  std::vector<std::string> fields;
  size_t start = 0;
  while (true) {
    const size_t tab = line.find('\t', start);
    fields.push_back(line.substr(start, tab == std::string::npos ? std::string::npos : tab - start));
    if (tab == std::string::npos) break;
    start = tab + 1;
  }
  return fields;
}

// Every well-formed entry of the cache file; lines that do not parse are
// dropped, a file of another format is ignored whole.
std::map<std::string, Entry> read_cache() {
  std::map<std::string, Entry> entries;
  const fs::path path = registry_cache_path();
  std::string why;
  const int fd = open_regular_file(path, O_RDONLY, why);
  if (fd < 0) {
    if (errno != ENOENT && why != std::strerror(ENOENT)) {
      log(LogLevel::warn, "registry cache {}: {}; rescanning plugins", path.string(), why);
    }
    return entries;
  }
  std::string text;
  char buffer[65536];
  ssize_t n = 0;
  while ((n = ::read(fd, buffer, sizeof buffer)) > 0) text.append(buffer, static_cast<size_t>(n));
  ::close(fd);
  std::istringstream in(text);
  std::string line;
  if (!std::getline(in, line) || line != kHeader) {
    if (!text.empty())
      log(LogLevel::warn, "registry cache {} is not a cache of this format; rebuilding it", path.string());
    return entries;
  }
  size_t dropped = 0;
  while (std::getline(in, line)) {
    const std::vector<std::string> f = split_tabs(line);
    ScanOutcome outcome;
    if (f.size() != 7 || !parse_scan_verdict(f[4], &outcome.verdict) || f[5].empty() ||
        f[5].find_first_not_of("-0123456789") != std::string::npos || f[5].size() > 10) {
      ++dropped;
      continue;
    }
    outcome.code = std::stoi(f[5]);
    outcome.detail = unescape(f[6]);
    entries[unescape(f[0])] = {{f[1], f[2], f[3]}, std::move(outcome)};
  }
  if (dropped > 0) log(LogLevel::warn, "registry cache {}: {} corrupt entries dropped", path.string(), dropped);
  return entries;
}

void write_cache(const std::map<std::string, Entry>& entries) {
  const fs::path path = registry_cache_path();
  std::error_code ec;
  fs::create_directories(path.parent_path(), ec);
  std::string text = std::string(kHeader) + "\n";
  for (const auto& [library, e] : entries) {
    text += fmt::format("{}\t{}\t{}\t{}\t{}\t{}\t{}\n", escape(library), e.stamp.library_size, e.stamp.library_mtime,
                        e.stamp.manifest_sha256, scan_verdict_name(e.outcome.verdict), e.outcome.code,
                        escape(e.outcome.detail));
  }
  std::string temporary = path.string() + ".tmp-XXXXXX";
  const int fd = ::mkstemp(temporary.data());
  bool ok = fd >= 0;
  if (ok) {
    ok = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size()) && ::fsync(fd) == 0;
    ok = ::close(fd) == 0 && ok;
    ok = ok && std::rename(temporary.c_str(), path.c_str()) == 0;
    if (!ok) ::unlink(temporary.c_str());
  }
  if (!ok) {
    static std::once_flag warned;
    std::call_once(warned, [&] {
      log(LogLevel::warn, "registry cache {} cannot be written ({}); plugins are scanned again next time",
          path.string(), std::strerror(errno));
    });
  }
}

}  // namespace

fs::path registry_cache_path() {
  fs::path dir;
  if (auto xdg = get_env("XDG_CACHE_HOME"); xdg && !xdg->empty() && fs::path(*xdg).is_absolute()) {
    dir = *xdg;
  } else if (auto home = get_env("HOME"); home && !home->empty()) {
    dir = fs::path(*home) / ".cache";
  } else {
    dir = fs::temp_directory_path();
  }
  return dir / "kdispatch" /
         fmt::format("scan-{}-abi{}.{}.tsv", KDISPATCH_VERSION_STRING, KDISPATCH_ABI_MAJOR, KDISPATCH_ABI_MINOR);
}

std::optional<ScanOutcome> cache_lookup(const Manifest& manifest) {
  const std::optional<Stamp> stamp = stamp_of(manifest);
  if (!stamp) return std::nullopt;
  std::lock_guard lock(cache_mutex());
  const auto entries = read_cache();
  const auto it = entries.find(fs::absolute(manifest.library_path()).string());
  if (it == entries.end() || !(it->second.stamp == *stamp)) return std::nullopt;
  return it->second.outcome;
}

void cache_store(const Manifest& manifest, const ScanOutcome& outcome) {
  const std::optional<Stamp> stamp = stamp_of(manifest);
  if (!stamp) return;
  std::lock_guard lock(cache_mutex());
  auto entries = read_cache();
  entries[fs::absolute(manifest.library_path()).string()] = {*stamp, outcome};
  write_cache(entries);
}

}  // namespace kdispatch
