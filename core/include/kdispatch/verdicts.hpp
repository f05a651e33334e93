// Conformance verdicts: whether a backend's kernel for an op matched the op's
// reference on a kind of device, as a check found it (`kdispatch run`,
// `bench` and `tune`, `kdispatch-conformance`, the Python
// kdispatch.testing.conformance). Fallback never passes a call to a kernel
// whose latest verdict is "failed" (docs/internals.md, Fallback); `doctor`
// lists such verdicts. Verdicts are kept per user beside the registry cache
// (docs/internals.md, Conformance verdicts), keyed by the plugin library's
// sha256, so a rebuilt library starts with none.
#pragma once

#include <kdispatch/export.h>

#include <cstdint>
#include <string>

namespace kdispatch KDISPATCH_API {

struct Verdict {
  std::string op;
  std::string backend;
  std::string device;   // the kind of device checked on: "cpu", "cuda:9.0", "hip:gfx90a" (Device::str())
  std::string library;  // "sha256:<hex>" of the plugin library; "run-time" for a kernel registered at run time
  bool passed = false;
  int64_t time = 0;     // when it was recorded, in seconds since the epoch
  std::string source;   // the check: "kdispatch run", "kdispatch-conformance", ...
  std::string detail;   // a failure's first mismatch; may be empty
  // "2026-12-05 03:10 UTC".
  std::string date() const;
  // "failed conformance on cpu on 2026-12-05 03:10 UTC (kdispatch run: <detail>)".
  std::string describe() const;
};

}  // namespace kdispatch
