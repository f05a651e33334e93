// The conformance verdicts of one Context (kdispatch/verdicts.hpp): the
// per-user verdict file, read once when first needed, and the verdicts this
// process recorded.
//
// The file lies beside the registry cache (registry_cache_path()'s folder,
// under the same rules: a private folder of this user's, else not used) as
// conformance-verdicts-<format>.txt: a header line, then one line per (backend, op,
// device kind, library identity) with its latest verdict. It is read only
// when it is a regular file owned by this user, not writable by its group
// or others, and at most kMaxVerdictFileBytes; a file that breaks any rule
// or any line of which does not parse is ignored whole, with one warning
// naming it and a KD code (KD-E025 ownership or mode, KD-E010 otherwise),
// and rebuilt at the next record. A record re-reads the file under an
// exclusive lock (flock on <file>.lock), merges its verdict and renames a
// new file into place, so concurrent processes lose no verdict.
#pragma once

#include <atomic>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "kdispatch/verdicts.hpp"

namespace kdispatch {

inline constexpr uint64_t kMaxVerdictFileBytes = uint64_t{4} << 20;
// The most verdicts kept in the file; the oldest go first.
inline constexpr size_t kMaxVerdicts = 20000;

std::filesystem::path verdict_file_path();

// "sha256:<hex>" of the library at `path`, once per (path, size, mtime) per
// process; "missing" or "unreadable (...)" when it cannot be hashed.
std::string library_hash(const std::string& path);

class VerdictStore {
 public:
  // enabled: verdicts are recorded and consulted at all (KDISPATCH_VERDICTS);
  // persistent: the file is read and written (not under KDISPATCH_SCAN=off).
  VerdictStore(bool enabled, bool persistent);
  // As the environment says.
  static std::unique_ptr<VerdictStore> from_environment();

  bool enabled() const { return enabled_; }
  bool persistent() const { return persistent_; }

  void record(Verdict verdict);
  // The latest verdict of the key, if any.
  std::optional<Verdict> latest(std::string_view op, std::string_view backend, std::string_view device,
                                std::string_view library) const;
  // Whether any verdict known is a failure; reads the file the first time.
  bool any_failed() const;
  std::vector<Verdict> all() const;
  // True the first time it is asked for (op, backend): fallback warns once.
  bool first_skip(std::string_view op, std::string_view backend);

 private:
  void load_locked() const;
  void refresh_failed_locked() const;

  bool enabled_ = true;
  bool persistent_ = true;
  mutable std::mutex mutex_;
  mutable std::atomic<bool> loaded_{false};  // set once the file was read (or is not to be)
  mutable std::map<std::string, Verdict> file_;  // the file's verdicts, merged with this process's
  std::map<std::string, Verdict> runtime_;       // kernels registered at run time: this process only
  std::set<std::string> failed_here_;            // keys this process recorded a failure for
  std::set<std::string> skipped_;                // (op, backend) pairs fallback warned about
  mutable std::atomic<bool> any_failed_{false};
};

// The verdicts of a verdict file's text; false (and `why`) when any line
// does not parse or the header is not this format's.
bool parse_verdict_file(std::string_view text, std::map<std::string, Verdict>& out, std::string& why);
std::string format_verdict_file(const std::map<std::string, Verdict>& verdicts);

}  // namespace kdispatch
