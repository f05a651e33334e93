// libFuzzer target: the registry cache's entry lines on arbitrary bytes.
// Parsing may drop lines but must not crash, hang or leak; what it keeps
// must come back unchanged when it is written and read again (escaping,
// numbers, checksums), and each kept manifest record goes through the
// record decoder as ManifestCache::read would take it.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "manifest_record.hpp"
#include "registry_cache.hpp"

namespace {

bool same(const kdispatch::CacheFile& a, const kdispatch::CacheFile& b) {
  if (a.scans.size() != b.scans.size() || a.manifests.size() != b.manifests.size()) return false;
  for (auto i = a.scans.begin(), j = b.scans.begin(); i != a.scans.end(); ++i, ++j) {
    const kdispatch::ScanOutcome& x = i->second.outcome;
    const kdispatch::ScanOutcome& y = j->second.outcome;
    if (i->first != j->first || !(i->second.stamp == j->second.stamp) || x.verdict != y.verdict ||
        x.code != y.code || x.detail != y.detail) {
      return false;
    }
  }
  for (auto i = a.manifests.begin(), j = b.manifests.begin(); i != a.manifests.end(); ++i, ++j) {
    if (i->first != j->first || !(i->second.stamp == j->second.stamp) || i->second.record != j->second.record) {
      return false;
    }
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kdispatch::CacheFile file;
  file.text->assign(reinterpret_cast<const char*>(data), size);
  const size_t dropped = kdispatch::parse_cache_entries(*file.text, /*manifests=*/true, file);
  if (dropped > size + 1) __builtin_trap();
  for (const auto& [path, entry] : file.manifests) (void)kdispatch::decode_manifest_record(entry.record, path);

  kdispatch::CacheFile again;
  *again.text = kdispatch::format_cache_entries(file);
  if (kdispatch::parse_cache_entries(*again.text, /*manifests=*/true, again) != 0) __builtin_trap();
  if (!same(file, again)) __builtin_trap();
  return 0;
}
