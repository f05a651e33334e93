// Runs the kdispatch binary as a child process and captures what it prints.
#pragma once

#include <map>
#include <string>
#include <vector>

struct ToolResult {
  int exit_code = -1;
  std::string out;
  std::string err;
};

// `env` entries are set in the child, replacing inherited ones (an empty
// value unsets the variable).
// The child never inherits KDISPATCH_* from the test's environment, and is
// killed by SIGALRM (exit code 142) after 60 s.
ToolResult run_tool(const std::vector<std::string>& args, const std::map<std::string, std::string>& env = {});

// A fresh empty directory under the system temp dir.
std::string make_temp_dir();
