#include "registry_cache.hpp"

#include <dlfcn.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <mutex>
#include <vector>

#include "file_check.hpp"
#include "kdispatch/environment.hpp"
#include "kdispatch/log.hpp"
#include "kdispatch/plugin_api.h"
#include "kdispatch/plugin_security.hpp"
#include "line_fields.hpp"
#include "kdispatch/version.h"
#include "manifest_for_cache.hpp"
#include "manifest_record.hpp"
#include "unique_fd.hpp"

namespace kdispatch {
namespace fs = std::filesystem;

namespace {

// The layout of the lines below; bump it when they change.
constexpr int kFileFormat = 4;
constexpr std::string_view kHeaderWord = "kdispatch-registry-cache";
constexpr std::string_view kScanKind = "scan";
constexpr std::string_view kManifestKind = "manifest";
// The largest cache file read: a thousand manifests of twenty kernels take
// a few MiB.
constexpr uint64_t kMaxCacheBytes = uint64_t{64} << 20;

// A file changed this shortly before it is parsed may change again without
// a new stamp: timestamps advance in clock ticks (or whole seconds where a
// file system keeps no nanoseconds), so a second write within the same
// tick keeps mtime and ctime. Such a manifest is parsed again next time
// rather than cached.
constexpr int64_t kSettleNs = 100'000'000;
constexpr int64_t kSettleNsWholeSeconds = 2'000'000'000;

std::mutex& cache_mutex() {
  static std::mutex mutex;
  return mutex;
}

int64_t nanoseconds(const struct timespec& t) { return static_cast<int64_t>(t.tv_sec) * 1'000'000'000 + t.tv_nsec; }

// The size and mtime of the file that holds this code (libkdispatch.so, or
// a program linked with the core statically): a rebuilt core may parse
// manifests differently, so its cache starts afresh.
const std::string& core_build() {
  // Never destroyed: plugins may still load on other threads while the process exits.
  static const auto* const stamp = new std::string([] {
    Dl_info info{};
    struct stat st {};
    if (dladdr(reinterpret_cast<void*>(&registry_cache_path), &info) == 0 || info.dli_fname == nullptr ||
        ::stat(info.dli_fname, &st) != 0) {
      return std::string("unknown");
    }
    return fmt::format("{}:{}", st.st_size, nanoseconds(st.st_mtim));
  }());
  return *stamp;
}

std::string header() {
  return fmt::format("{} {} manifest-record {} core {}", kHeaderWord, kFileFormat, kManifestRecordFormat, core_build());
}

// Detects a damaged record (a cut, a flipped byte); not a defence against
// someone who can write the cache, who could as well write the manifests.
uint64_t checksum(std::string_view text) {
  uint64_t h = 0xcbf29ce484222325ULL ^ text.size();
  size_t i = 0;
  for (; i + 8 <= text.size(); i += 8) {
    uint64_t word = 0;
    std::memcpy(&word, text.data() + i, 8);
    h = (h ^ word) * 0x100000001b3ULL;
    h ^= h >> 29;
  }
  for (; i < text.size(); ++i) h = (h ^ static_cast<unsigned char>(text[i])) * 0x100000001b3ULL;
  return h ^ (h >> 32);
}

std::optional<ScanStamp> scan_stamp_of(const Manifest& manifest) {
  struct stat st {};
  const fs::path library = fs::absolute(manifest.library_path());
  std::string why;
  // One descriptor for the stamp and the digest: both describe one file.
  const UniqueFd file{open_regular_file(library, O_RDONLY, why)};
  if (file.fd < 0 || ::fstat(file.fd, &st) != 0) return std::nullopt;
  ScanStamp s;
  try {
    s.library_file = fmt::format("{}:{}:{}:{}:{}:{}", static_cast<uint64_t>(st.st_dev),
                                 static_cast<uint64_t>(st.st_ino), static_cast<int64_t>(st.st_size),
                                 nanoseconds(st.st_mtim), nanoseconds(st.st_ctim), sha256_fd(file.fd, library.string()));
    s.manifest_sha256 = sha256_file(manifest.path);
  } catch (const std::exception&) {
    return std::nullopt;
  }
  return s;
}

// The first `n` tab-separated fields of `line` into `fields`, and the rest
// of the line (after the n-th tab) into `rest`; false when it has fewer.
bool split_fields(std::string_view line, size_t n, std::vector<std::string_view>& fields, std::string_view& rest) {
  fields.clear();
  for (size_t i = 0; i < n; ++i) {
    const size_t tab = line.find('\t');
    if (tab == std::string_view::npos) return false;
    fields.push_back(line.substr(0, tab));
    line.remove_prefix(tab + 1);
  }
  rest = line;
  return true;
}

template <class Int>
bool parse_number(std::string_view text, Int& out, int base = 10) {
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), out, base);
  return !text.empty() && ec == std::errc() && end == text.data() + text.size();
}

bool parse_scan_line(std::string_view line, CacheFile& file) {
  std::vector<std::string_view> f;
  std::string_view detail;
  if (!split_fields(line, 5, f, detail) || detail.find('\t') != std::string_view::npos) return false;
  // f: library, its file stamp (device:inode:size:mtime:ctime:sha256), manifest sha256, verdict, code
  ScanOutcome outcome;
  if (!parse_scan_verdict(f[3], &outcome.verdict) || f[4].size() > 10 || !parse_number(f[4], outcome.code)) {
    return false;
  }
  outcome.detail = unescape_field(detail);
  file.scans[unescape_field(f[0])] = {{std::string(f[1]), std::string(f[2])}, std::move(outcome)};
  return true;
}

bool parse_manifest_line(std::string_view line, CacheFile& file) {
  std::vector<std::string_view> f;
  std::string_view record;
  if (!split_fields(line, 7, f, record)) return false;
  // f: path, device, inode, size, mtime, ctime, checksum
  ManifestCache::Stored entry;
  uint64_t sum = 0;
  if (!parse_number(f[1], entry.stamp.device) || !parse_number(f[2], entry.stamp.inode) ||
      !parse_number(f[3], entry.stamp.size) || !parse_number(f[4], entry.stamp.mtime_ns) ||
      !parse_number(f[5], entry.stamp.ctime_ns) || !parse_number(f[6], sum, 16) || sum != checksum(record)) {
    return false;
  }
  entry.record = record;
  file.manifests[unescape_field(f[0])] = entry;
  return true;
}

// Why the cache's folder cannot be trusted, or empty: it must be a folder
// (not a link) owned by this user and open to no one else. It is created
// 0700 when missing; one of ours that others can read or write (made by an
// older build, or by hand) is made 0700. Anything else is not used: a
// cache another user can write would let them forge scan verdicts.
std::string cache_dir_problem(const fs::path& dir) {
  std::error_code ec;
  fs::create_directories(dir.parent_path(), ec);
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
    return fmt::format("its folder {} cannot be made ({})", dir.string(), std::strerror(errno));
  }
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0) return fmt::format("its folder {}: {}", dir.string(), std::strerror(errno));
  if (!S_ISDIR(st.st_mode)) return fmt::format("its folder {} is not a folder", dir.string());
  if (st.st_uid != ::geteuid()) {
    return fmt::format("its folder {} belongs to uid {}, not to this user (uid {})", dir.string(), st.st_uid,
                       ::geteuid());
  }
  if ((st.st_mode & 077) != 0 && ::chmod(dir.c_str(), 0700) != 0) {
    return fmt::format("its folder {} is open to other users (mode {:o}) and cannot be made private ({})",
                       dir.string(), st.st_mode & 07777, std::strerror(errno));
  }
  return {};
}

// A broken cache is reported once: read_cache() runs several times in one
// process (manifests read and then saved, scan outcomes looked up and
// stored), and each read of the same broken file would otherwise warn
// again. The file is known by `key`: its path and, once opened, its stamp,
// so that a cache broken again after its rebuild is reported again. Later
// reports of the same file go to the debug level. Guarded by cache_mutex().
template <class... Args>
void warn_broken(const std::string& key, fmt::format_string<Args...> format, Args&&... args) {
  static auto* last = new std::string();  // never destroyed: used until exit
  const bool repeat = *last == key;
  if (!repeat) *last = key;
  log(repeat ? LogLevel::debug : LogLevel::warn, format, std::forward<Args>(args)...);
}

// Every well-formed entry of the cache file (manifest entries only when
// `manifests`); lines that do not parse are dropped, a file of another
// format or build is ignored whole.
CacheFile read_cache(bool manifests) {
  CacheFile file;
  std::string& text = *file.text;
  const fs::path path = registry_cache_path();
  if (const std::string problem = cache_dir_problem(path.parent_path()); !problem.empty()) {
    // Writing it fails too, and says so once (cache_store, ManifestCache).
    log(LogLevel::debug, "registry cache {} is not read: {}", path.string(), problem);
    return file;
  }
  std::string why;
  UniqueFd fd{open_regular_file(path, O_RDONLY, why)};
  if (fd.fd < 0) {
    if (why != std::strerror(ENOENT)) {
      warn_broken(path.string() + '\t' + why, "registry cache {}: {}; rebuilding it", path.string(), why);
    }
    return file;
  }
  // No cache of real plugin folders comes near this; a larger (or sparse)
  // file is not read, so that it costs neither the memory nor the time.
  struct stat st {};
  const bool stamped = ::fstat(fd.fd, &st) == 0;
  const FileStamp stamp = stamped ? FileStamp::of(st) : FileStamp{};
  const std::string key = fmt::format("{}\t{}:{}:{}:{}:{}", path.string(), stamp.device, stamp.inode, stamp.size,
                                      stamp.mtime_ns, stamp.ctime_ns);
  const auto too_large = [&path, &key](uint64_t bytes) {
    warn_broken(key, "registry cache {} is {} bytes, more than a cache holds ({} MiB); rebuilding it",
                path.string(), bytes, kMaxCacheBytes >> 20);
    return CacheFile();
  };
  if (stamped && st.st_uid != ::geteuid()) {
    warn_broken(key, "registry cache {} belongs to uid {}, not to this user; rebuilding it", path.string(),
                st.st_uid);
    return file;
  }
  if (st.st_size > 0) {
    if (static_cast<uint64_t>(st.st_size) > kMaxCacheBytes) return too_large(static_cast<uint64_t>(st.st_size));
    text.reserve(static_cast<size_t>(st.st_size));
  }
  char buffer[65536];
  while (true) {
    const ssize_t n = ::read(fd.fd, buffer, sizeof buffer);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      warn_broken(key, "registry cache {}: {}; rebuilding it", path.string(), std::strerror(errno));
      return file;
    }
    if (n == 0) break;
    // A file that grows while it is read.
    if (text.size() + static_cast<size_t>(n) > kMaxCacheBytes) {
      return too_large(text.size() + static_cast<size_t>(n));
    }
    text.append(buffer, static_cast<size_t>(n));
  }
  std::string_view rest = text;
  const auto next_line = [&rest](std::string_view& line) {
    if (rest.empty()) return false;
    const size_t newline = rest.find('\n');
    line = rest.substr(0, newline);
    rest.remove_prefix(newline == std::string_view::npos ? rest.size() : newline + 1);
    return true;
  };
  std::string_view line;
  if (!next_line(line) || line != header()) {
    if (text.empty()) return file;
    if (line.starts_with(kHeaderWord)) {
      log(LogLevel::info, "registry cache {} was written by another build of kdispatch; rebuilding it", path.string());
    } else {
      warn_broken(key, "registry cache {} is not a cache of this format; rebuilding it", path.string());
    }
    return CacheFile();
  }
  const size_t dropped = parse_cache_entries(rest, manifests, file);
  if (dropped > 0) warn_broken(key, "registry cache {}: {} corrupt entries dropped", path.string(), dropped);
  return file;
}

// Writes the cache file; on failure returns why.
std::optional<std::string> write_cache(const CacheFile& file) {
  const fs::path path = registry_cache_path();
  if (const std::string problem = cache_dir_problem(path.parent_path()); !problem.empty()) {
    return fmt::format("registry cache {} cannot be written: {}", path.string(), problem);
  }
  const std::string text = header() + "\n" + format_cache_entries(file);
  if (auto error = replace_file(path, text)) {
    return fmt::format("registry cache {} cannot be written ({})", path.string(), *error);
  }
  return std::nullopt;
}

// One warning per process for a cache that cannot be written, whether a
// scan outcome or parsed manifests were to be stored.
void warn_unwritable(const std::string& failed) {
  static std::once_flag warned;
  std::call_once(warned, [&] {
    log(LogLevel::warn, "{}; plugins are scanned and manifests parsed again next time", failed);
  });
}

// The stamp of the file at `path` now, or nullopt when it is no regular file.
std::optional<FileStamp> stamp_of_path(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return std::nullopt;
  return FileStamp::of(st);
}

bool settled(const FileStamp& stamp) {
  struct timespec now {};
  ::clock_gettime(CLOCK_REALTIME, &now);
  const bool whole_seconds = stamp.mtime_ns % 1'000'000'000 == 0 && stamp.ctime_ns % 1'000'000'000 == 0;
  return nanoseconds(now) - stamp.ctime_ns >= (whole_seconds ? kSettleNsWholeSeconds : kSettleNs);
}

}  // namespace

std::optional<std::string> replace_file(const fs::path& path, std::string_view text) {
  std::string temporary = path.string() + ".tmp-XXXXXX";
  const int fd = ::mkstemp(temporary.data());
  bool ok = fd >= 0;
  if (ok) {
    ok = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size()) && ::fsync(fd) == 0;
    ok = ::close(fd) == 0 && ok;
    ok = ok && std::rename(temporary.c_str(), path.c_str()) == 0;
    const int error = errno;
    if (!ok) ::unlink(temporary.c_str());
    errno = error;
  }
  if (ok) return std::nullopt;
  return std::string(std::strerror(errno));
}

std::string registry_cache_dir_problem(const fs::path& dir) { return cache_dir_problem(dir); }

size_t parse_cache_entries(std::string_view text, bool manifests, CacheFile& file) {
  size_t dropped = 0;
  while (!text.empty()) {
    const size_t newline = text.find('\n');
    const std::string_view line = text.substr(0, newline);
    text.remove_prefix(newline == std::string_view::npos ? text.size() : newline + 1);
    const size_t tab = line.find('\t');
    const std::string_view kind = line.substr(0, tab);
    const std::string_view fields = tab == std::string_view::npos ? std::string_view() : line.substr(tab + 1);
    bool ok = false;
    if (kind == kScanKind) {
      ok = parse_scan_line(fields, file);
    } else if (kind == kManifestKind) {
      ok = !manifests || parse_manifest_line(fields, file);
    }
    if (!ok) ++dropped;
  }
  return dropped;
}

std::string format_cache_entries(const CacheFile& file) {
  std::string text;
  for (const auto& [library, e] : file.scans) {
    text += fmt::format("{}\t{}\t{}\t{}\t{}\t{}\t{}\n", kScanKind, escape_field(library), e.stamp.library_file,
                        e.stamp.manifest_sha256, scan_verdict_name(e.outcome.verdict), e.outcome.code,
                        escape_field(e.outcome.detail));
  }
  for (const auto& [manifest, e] : file.manifests) {
    text += fmt::format("{}\t{}\t{}\t{}\t{}\t{}\t{}\t{:x}\t", kManifestKind, escape_field(manifest), e.stamp.device,
                        e.stamp.inode, e.stamp.size, e.stamp.mtime_ns, e.stamp.ctime_ns, checksum(e.record));
    text += e.record;
    text += '\n';
  }
  return text;
}

FileStamp FileStamp::of(const struct stat& st) {
  return {static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino), static_cast<uint64_t>(st.st_size),
          nanoseconds(st.st_mtim), nanoseconds(st.st_ctim)};
}

fs::path registry_cache_path() {
  fs::path dir;
  if (auto xdg = get_env("XDG_CACHE_HOME"); xdg && !xdg->empty() && fs::path(*xdg).is_absolute()) {
    dir = *xdg;
  } else if (auto home = get_env("HOME"); home && !home->empty()) {
    dir = fs::path(*home) / ".cache";
  } else {
    // No home: a folder of this user's own in the temporary folder, which
    // cache_dir_problem() checks like any other.
    return fs::temp_directory_path() / fmt::format("kdispatch-{}", ::geteuid()) /
           fmt::format("registry-{}-abi{}.{}.cache", KDISPATCH_VERSION_STRING, KDISPATCH_ABI_MAJOR, KDISPATCH_ABI_MINOR);
  }
  return dir / "kdispatch" /
         fmt::format("registry-{}-abi{}.{}.cache", KDISPATCH_VERSION_STRING, KDISPATCH_ABI_MAJOR, KDISPATCH_ABI_MINOR);
}

std::optional<ScanOutcome> cache_lookup(const Manifest& manifest) {
  const std::optional<ScanStamp> stamp = scan_stamp_of(manifest);
  if (!stamp) return std::nullopt;
  std::lock_guard lock(cache_mutex());
  const CacheFile file = read_cache(/*manifests=*/false);
  const auto it = file.scans.find(fs::absolute(manifest.library_path()).string());
  if (it == file.scans.end() || !(it->second.stamp == *stamp)) return std::nullopt;
  return it->second.outcome;
}

void cache_store(const Manifest& manifest, const ScanOutcome& outcome) {
  const std::optional<ScanStamp> stamp = scan_stamp_of(manifest);
  if (!stamp) return;
  std::lock_guard lock(cache_mutex());
  CacheFile file = read_cache(/*manifests=*/true);
  file.scans[fs::absolute(manifest.library_path()).string()] = {*stamp, outcome};
  if (const std::optional<std::string> failed = write_cache(file)) warn_unwritable(*failed);
}

ManifestCache::ManifestCache(ScanPolicy policy)
    : use_(policy == ScanPolicy::cache), write_(policy != ScanPolicy::off) {}

void ManifestCache::load() {
  loaded_ = true;
  std::lock_guard lock(cache_mutex());
  CacheFile file = read_cache(/*manifests=*/true);
  text_ = std::move(file.text);
  stored_ = std::move(file.manifests);
}

ManifestResult ManifestCache::read(const fs::path& path) {
  std::string why;
  const UniqueFd file{open_regular_file(path, O_RDONLY, why)};
  struct stat st {};
  if (file.fd < 0 || ::fstat(file.fd, &st) != 0) {
    ManifestResult result;
    result.errors.push_back({ErrorCode::manifest_bad_json, path.string(),
                             fmt::format("{}: cannot read: {}", path.string(), why.empty() ? std::strerror(errno) : why)});
    return result;
  }
  return read(path, file.fd, st);
}

ManifestResult ManifestCache::read(const fs::path& path, int fd, const struct stat& st) {
  // The text of the descriptor, or a result that reports why it has none.
  ManifestResult unread;
  const auto read_text = [&]() -> std::optional<std::string> {
    Problem unreadable{};
    std::optional<std::string> text = read_manifest_text_from(fd, path.string(), unreadable);
    if (!text) unread.errors.push_back(std::move(unreadable));
    return text;
  };
  const auto parse = [&] {
    const std::optional<std::string> text = read_text();
    return text ? parse_manifest(*text, path.string()) : std::move(unread);
  };
  if (!write_) return parse();
  if (use_ && !loaded_) load();
  if (!S_ISREG(st.st_mode)) return parse();
  const FileStamp stamp = FileStamp::of(st);
  const std::string key = fs::absolute(path).string();
  if (const auto it = stored_.find(key); it != stored_.end()) {
    if (it->second.stamp == stamp) {
      if (std::optional<Manifest> cached = decode_manifest_record(it->second.record, path.string())) {
        ++hits_;
        ManifestResult result;
        result.plugin = cached->plugin;
        result.backend = cached->backend;
        result.ops = cached->kernel_ops();
        result.manifest = std::move(cached);
        return result;
      }
    }
    changes_[key] = std::nullopt;  // stale or undecodable: replaced below, or dropped
  }

  const std::optional<std::string> text = read_text();
  if (!text) return unread;
  std::string ops_json;
  ManifestResult result = parse_manifest_for_cache(*text, path.string(), ops_json);
  // The stamp was taken before the read: should the file change in
  // between, the next process sees a new stamp and parses it again.
  if (result.ok() && result.warnings.empty() && settled(stamp)) {
    std::string record = encode_manifest_record(*result.manifest, ops_json);
    // Op schemas come back through JSON: a record whose schemas would not
    // decode to the same ones is not kept (it would be rewritten each time).
    if (ops_json.empty() || decode_manifest_record(record, path.string()) == result.manifest) {
      changes_[key] = Fresh{stamp, std::move(record)};
    }
  }
  return result;
}

void ManifestCache::save() {
  if (changes_.empty()) return;
  std::lock_guard lock(cache_mutex());
  // Read again: another process may have written entries meanwhile.
  CacheFile file = read_cache(/*manifests=*/true);
  for (auto it = file.manifests.begin(); it != file.manifests.end();) {
    const std::optional<FileStamp> now = changes_.count(it->first) != 0 ? std::nullopt : stamp_of_path(it->first);
    it = now && *now == it->second.stamp ? std::next(it) : file.manifests.erase(it);
  }
  for (const auto& [key, entry] : changes_) {
    if (entry) file.manifests[key] = {entry->stamp, entry->record};
  }
  if (const std::optional<std::string> failed = write_cache(file)) warn_unwritable(*failed);
  changes_.clear();
}

}  // namespace kdispatch
