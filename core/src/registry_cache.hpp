// The registry cache, under $XDG_CACHE_HOME/kdispatch/ (or
// ~/.cache/kdispatch/): what earlier processes learnt about plugin files,
// so that the next one need not learn it again (GStreamer's registry is the
// model). It holds two kinds of entries:
//
//  - scan outcomes (scanner.hpp), keyed by the library path and stamped
//    with the library's device, inode, size, mtime and ctime, the sha256 of
//    its content and the manifest's sha256. Only definite outcomes are
//    stored (ScanOutcome::definite);
//  - parsed manifests (manifest_record.hpp), keyed by the manifest's
//    absolute path and stamped with its device, inode, size, mtime and
//    ctime, so that discovery over unchanged manifests reads no JSON.
//    Only manifests that parsed without any error or warning are kept:
//    those with findings are parsed again each time, so every finding is
//    reported as the parser words it.
//
// Any change to a stamp makes the entry stale. One file per kdispatch
// version and plugin ABI, so two versions never read each other's entries;
// its first line names the format and the build of the core that wrote it,
// and a file from another build is rebuilt rather than read. The file is
// rewritten whole under a temporary name and renamed into place; a corrupt,
// truncated or unreadable cache is ignored (with a warning) and rebuilt, an
// unwritable one only warned about.
#pragma once

#include <sys/stat.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "kdispatch/manifest.hpp"
#include "scanner.hpp"

namespace kdispatch {

std::filesystem::path registry_cache_path();

// Why the folder `dir` of the cache (or of the conformance verdicts beside
// it) cannot be used, or empty: it is made 0700 when missing, and must be a
// folder of this user's open to no one else (one of this user's that is
// open to others is made 0700).
std::string registry_cache_dir_problem(const std::filesystem::path& dir);

// Replaces the file at `path` by one holding `text`: written beside it,
// synced and renamed over it, so a reader sees the old file or the new one.
// On failure nothing is left behind and the result is strerror's words.
std::optional<std::string> replace_file(const std::filesystem::path& path, std::string_view text);

// The recorded outcome for `manifest`'s library, when its stamps match.
std::optional<ScanOutcome> cache_lookup(const Manifest& manifest);

// Records `outcome` for `manifest`'s library.
void cache_store(const Manifest& manifest, const ScanOutcome& outcome);

// What identifies one version of a file's content without reading it.
struct FileStamp {
  uint64_t device = 0, inode = 0, size = 0;
  int64_t mtime_ns = 0, ctime_ns = 0;
  static FileStamp of(const struct stat& st);
  bool operator==(const FileStamp&) const = default;
};

// The manifests of one discovery, read through the registry cache. Under
// KDISPATCH_SCAN=cache the cache file is read once (on the first read())
// and unchanged manifests come from it; under `always` every manifest is
// parsed and the cache rewritten; under `off` the cache is neither read
// nor written. save() writes the changes back once, at the end.
class ManifestCache {
 public:
  explicit ManifestCache(ScanPolicy policy);

  // The manifest at `path`, as read_manifest would give it.
  ManifestResult read(const std::filesystem::path& path);
  // The same for the manifest already open as `fd` (`st` its fstat): what
  // is parsed, or looked up by its stamp, is that file, read from its start.
  ManifestResult read(const std::filesystem::path& path, int fd, const struct stat& st);

  // Writes the cache when this discovery added, replaced or dropped an
  // entry. Entries of other manifests stay while their files are unchanged.
  void save();

  // How many read() calls were answered from the cache.
  size_t hits() const { return hits_; }

  // An entry of the cache file: the stamp and where its record lies in the
  // file's text.
  struct Stored {
    FileStamp stamp;
    std::string_view record;
  };
  struct Fresh {
    FileStamp stamp;
    std::string record;
  };

 private:
  void load();

  bool use_ = false;    // look manifests up
  bool write_ = false;  // record what was parsed
  bool loaded_ = false;
  size_t hits_ = 0;
  std::unique_ptr<const std::string> text_;              // the cache file as read
  std::map<std::string, Stored> stored_;                 // by absolute manifest path, into text_
  std::map<std::string, std::optional<Fresh>> changes_;  // to write: new entries, or nullopt to drop
};

// The library file as the manifests' entries key theirs: device, inode,
// size, and modification and change times (a copy that keeps the size and
// mtime, `cp -p` or `rsync -t`, is a new inode or a new ctime), plus the
// sha256 of its content (a file rewritten in place within one clock tick
// keeps every time stamp), and the manifest's sha256.
struct ScanStamp {
  std::string library_file, manifest_sha256;
  bool operator==(const ScanStamp&) const = default;
};

struct ScanEntry {
  ScanStamp stamp;
  ScanOutcome outcome;
};

// The entries of a cache file.
struct CacheFile {
  std::unique_ptr<std::string> text = std::make_unique<std::string>();  // the file; records point into it
  std::map<std::string, ScanEntry> scans;                               // by library path
  std::map<std::string, ManifestCache::Stored> manifests;               // by absolute manifest path
};

// The entry lines of a cache file (all after its first line) into `file`
// (manifest entries only when `manifests`), pointing into `text`, which
// must outlive them; returns how many lines were dropped as malformed.
size_t parse_cache_entries(std::string_view text, bool manifests, CacheFile& file);

// The entry lines of `file`, as parse_cache_entries reads them.
std::string format_cache_entries(const CacheFile& file);

}  // namespace kdispatch
