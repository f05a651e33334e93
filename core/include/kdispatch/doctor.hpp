// The report of `kdispatch doctor` and kdispatch.doctor(): where plugins
// were looked for, every plugin found, whether it loads (its version, ABI
// and the devices its probe reports), every problem with its code, what the
// plugins together leave unchecked (coverage.hpp), the ops no reference
// kernel can check, and the backends demoted so far by fallback and
// the kernels that failed their conformance checks. Made here once; the tool prints it as
// text or JSON and the Python module returns it as dicts, with the same
// fields.
#pragma once

#include <kdispatch/export.h>

#include <string>
#include <vector>

#include "kdispatch/context.hpp"

namespace kdispatch KDISPATCH_API {

struct PluginReport {
  std::string name;
  std::string backend;
  std::string manifest;
  std::string library;
  PluginState state = PluginState::found;  // what discovery made of it
  std::string note;                        // why disabled or shadowed
  bool loaded = false;                     // opened, entry point, ABI and probe checked
  std::string version;                     // when loaded
  std::string abi;                         // "1.0", when loaded
  std::vector<ProbedDevice> devices;       // when loaded; none is no error
  std::vector<Problem> problems;           // discovery's, then why it did not load
  bool ok = true;                          // false: in error, or failed to load
};

struct DoctorReport {
  std::vector<SearchDir> search_path;
  std::vector<PluginReport> plugins;  // in discovery order
  // The search path's own problems, then every plugin's, then `coverage`.
  std::vector<Problem> problems;
  // Warnings on what the plugins found leave unchecked (KD-E014) and on
  // libraries no manifest names (KD-E028): check_plugins().
  std::vector<Problem> coverage;
  // Ops that have kernels but no reference: run and bench report them
  // unchecked, and the conformance suite cannot check them.
  std::vector<std::string> ops_without_reference;
  // Backends demoted in this process (Context::demote): each op's, on one
  // device, with the error that demoted it. A report made in a fresh
  // process (`kdispatch doctor`) has none.
  std::vector<Demotion> demotions;
  // Failed conformance verdicts (Context::failed_verdicts): kernels that
  // fallback never passes a call to, from the per-user verdict file.
  std::vector<Verdict> failed_verdicts;
  // The verdict: a plugin in error, a problem that is not a warning, or a
  // search-path problem.
  bool any_error = false;
  size_t warnings() const;  // problems that are warnings
};

// The report on `context`'s plugins. With `open_plugins`, every plugin found
// is loaded (that is what doctor checks); without, only manifests and files
// are looked at.
DoctorReport doctor_report(Context& context, bool open_plugins = true);

}  // namespace kdispatch
