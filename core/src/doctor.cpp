#include "kdispatch/doctor.hpp"

#include <fmt/format.h>

#include <algorithm>

#include "kdispatch/coverage.hpp"

namespace kdispatch {

DoctorReport doctor_report(Context& context, bool open_plugins) {
  DoctorReport report;
  report.search_path = context.discovery().search_path;
  for (const Problem& q : context.discovery().problems) {
    report.problems.push_back(q);
    report.any_error = true;
  }
  // The tuning file (KDISPATCH_TUNING_FILE): unreadable, or made for
  // another machine (a warning).
  for (Problem& q : context.selector().check_tuning()) {
    report.any_error = report.any_error || !q.warning;
    report.problems.push_back(std::move(q));
  }
  for (const PluginRecord& rec : context.discovery().plugins) {
    PluginReport p;
    p.name = rec.name;
    p.backend = rec.backend;
    p.manifest = rec.manifest_path;
    p.library = rec.library_path;
    p.state = rec.state;
    p.note = rec.note;
    p.problems = rec.problems;
    p.ok = rec.state == PluginState::found;
    // KD-E005 and other warnings leave the plugin loaded: only errors count.
    if (rec.state == PluginState::error) report.any_error = true;
    for (const Problem& q : rec.problems) report.any_error = report.any_error || !q.warning;
    if (rec.state == PluginState::found && open_plugins) {
      try {
        const PluginBinary& bin = context.load_plugin(rec.name);
        p.loaded = true;
        p.version = bin.version;
        p.abi = fmt::format("{}.{}", bin.abi_major, bin.abi_minor);
        p.devices = bin.devices;
      } catch (const Error& e) {
        report.any_error = true;
        p.ok = false;
        p.problems.push_back({e.code(), rec.library_path, e.message()});
      }
    }
    report.problems.insert(report.problems.end(), p.problems.begin(), p.problems.end());
    report.plugins.push_back(std::move(p));
  }
  report.coverage = check_plugins(context);
  report.problems.insert(report.problems.end(), report.coverage.begin(), report.coverage.end());
  for (const std::string& op : context.registry().ops()) {
    if (context.registry().reference(op) == nullptr) report.ops_without_reference.push_back(op);
  }
  report.demotions = context.demotions();
  report.failed_verdicts = context.failed_verdicts();
  return report;
}

size_t DoctorReport::warnings() const {
  return static_cast<size_t>(std::count_if(problems.begin(), problems.end(), [](const Problem& q) { return q.warning; }));
}

}  // namespace kdispatch
