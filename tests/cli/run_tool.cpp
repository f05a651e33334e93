#include "run_tool.hpp"

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string_view>

extern char** environ;

namespace {

constexpr unsigned kToolTimeoutSeconds = 60;

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace

std::string make_temp_dir() {
  std::string pattern = (std::filesystem::temp_directory_path() / "kdispatch-test-XXXXXX").string();
  if (mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
  return pattern;
}

ToolResult run_tool(const std::vector<std::string>& args, const std::map<std::string, std::string>& env) {
  const std::string dir = make_temp_dir();
  const std::string out_path = dir + "/out";
  const std::string err_path = dir + "/err";
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) {
    if (std::strncmp(*e, "KDISPATCH_", 10) == 0) continue;
    const std::string_view entry = *e;
    if (env.count(std::string(entry.substr(0, entry.find('=')))) != 0) continue;  // set (or unset) below
    env_strings.emplace_back(*e);
  }
  for (const auto& [k, v] : env) {
    if (!v.empty()) env_strings.push_back(k + "=" + v);
  }
  std::vector<char*> envp;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<std::string> argv_strings{KDISPATCH_TOOL};
  argv_strings.insert(argv_strings.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& s : argv_strings) argv.push_back(s.data());
  argv.push_back(nullptr);

  const pid_t pid = fork();
  if (pid == 0) {
    const int out = open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    const int err = open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    dup2(out, 1);
    dup2(err, 2);
    const int devnull = open("/dev/null", O_RDONLY);
    dup2(devnull, 0);
    // A command that hangs (a FIFO opened for reading, a plugin that loops)
    // dies of SIGALRM and fails its test instead of stalling the suite; the
    // timer survives execve.
    alarm(kToolTimeoutSeconds);
    execve(argv[0], argv.data(), envp.data());
    _exit(127);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  ToolResult r;
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  r.out = slurp(out_path);
  r.err = slurp(err_path);
  std::filesystem::remove_all(dir);
  return r;
}
