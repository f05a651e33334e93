// libFuzzer target: the conformance verdict file's parser on arbitrary
// bytes, as a whole file and as the entry lines after this format's header.
// A file is taken whole or refused with a reason; what is taken must come
// back unchanged when the store's formatter writes it and it is read again
// (escaped fields, times, the key of each verdict), and the formatter's
// text must be a fixed point. Describing a verdict (its date) must not
// fail on any time the parser takes.
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>

#include "verdict_store.hpp"

namespace {

using Verdicts = std::map<std::string, kdispatch::Verdict>;

bool same(const kdispatch::Verdict& a, const kdispatch::Verdict& b) {
  return a.op == b.op && a.backend == b.backend && a.device == b.device && a.library == b.library &&
         a.passed == b.passed && a.time == b.time && a.source == b.source && a.detail == b.detail;
}

void check(std::string_view text) {
  Verdicts first;
  std::string why;
  if (!kdispatch::parse_verdict_file(text, first, why)) {
    if (why.empty()) __builtin_trap();  // a refusal says why
    return;
  }
  for (const auto& [key, v] : first) {
    // The key is the verdict's own (backend, op, device, library).
    if (key != v.backend + "\t" + v.op + "\t" + v.device + "\t" + v.library) __builtin_trap();
    (void)v.describe();
  }
  const std::string written = kdispatch::format_verdict_file(first);
  Verdicts again;
  if (!kdispatch::parse_verdict_file(written, again, why)) __builtin_trap();
  if (again.size() != first.size()) __builtin_trap();
  for (auto i = first.begin(), j = again.begin(); i != first.end(); ++i, ++j) {
    if (i->first != j->first || !same(i->second, j->second)) __builtin_trap();
  }
  if (kdispatch::format_verdict_file(again) != written) __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  check(input);
  // The entries after a header line of this format (an empty map's file is
  // the header alone).
  static const std::string header = kdispatch::format_verdict_file({});
  std::string file = header;
  file.append(input);
  check(file);
  return 0;
}
