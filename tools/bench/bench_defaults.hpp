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

// Points argc and argv at argv with the defaults appended, held in
// `storage` (null-terminated, as benchmark::Initialize expects).
inline void add_default_flags(int& argc, char**& argv, std::vector<char*>& storage) {
  static std::string repetitions = "--benchmark_repetitions=5";
  static std::string interleave = "--benchmark_enable_random_interleaving=true";
  static std::string aggregates = "--benchmark_report_aggregates_only=true";
  storage.assign(argv, argv + argc);
  const auto given = [&](std::string_view flag) {
    return std::any_of(storage.begin() + 1, storage.end(),
                       [&](const char* a) { return std::string_view(a).starts_with(flag); });
  };
  if (!given("--benchmark_repetitions")) storage.push_back(repetitions.data());
  if (!given("--benchmark_enable_random_interleaving")) storage.push_back(interleave.data());
  if (!given("--benchmark_report_aggregates_only") && !given("--benchmark_display_aggregates_only")) {
    storage.push_back(aggregates.data());
  }
  argc = static_cast<int>(storage.size());
  storage.push_back(nullptr);
  argv = storage.data();
}

}  // namespace kdispatch::bench
