// The command-line defaults both benchmark programs add unless the command
// line sets them: every benchmark repeated 5 times, the repetitions of all of
// them shuffled together, and only the aggregates (mean, median, stddev, cv)
// reported. On a shared or virtual machine single runs of a few-nanosecond
// call or of a memory-bound kernel drift with the host, and two benchmarks
// compared with each other should see the same stretch of it.
#pragma once

#include <algorithm>
#include <string>
#include <string_view>
#include <vector>

namespace kdispatch::bench {

// argv with the defaults appended, and null-terminated as benchmark::Initialize
// expects; its strings are argv's own and static ones.
inline std::vector<char*> with_default_flags(int argc, char** argv) {
  static std::string repetitions = "--benchmark_repetitions=5";
  static std::string interleave = "--benchmark_enable_random_interleaving=true";
  static std::string aggregates = "--benchmark_report_aggregates_only=true";
  std::vector<char*> args(argv, argv + argc);
  const auto given = [&](std::string_view flag) {
    return std::any_of(args.begin() + 1, args.end(),
                       [&](const char* a) { return std::string_view(a).starts_with(flag); });
  };
  if (!given("--benchmark_repetitions")) args.push_back(repetitions.data());
  if (!given("--benchmark_enable_random_interleaving")) args.push_back(interleave.data());
  if (!given("--benchmark_report_aggregates_only") && !given("--benchmark_display_aggregates_only")) {
    args.push_back(aggregates.data());
  }
  args.push_back(nullptr);
  return args;
}

}  // namespace kdispatch::bench
