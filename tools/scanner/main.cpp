// kdispatch-plugin-scanner MANIFEST: opens the plugin that MANIFEST
// declares, as the core would in-process (every check, dlopen, entry, ABI,
// embedded manifest, probe, kernel symbols), and reports on file
// descriptor 3: "ok" or "error<TAB>CODE<TAB>MESSAGE". Its parent
// (core/src/scanner.cpp) reads a crash, hang, exit or output to stdout
// from how this process ends. Not meant to be run by hand.
#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <cstdio>
#include <optional>
#include <string>

#include "kdispatch/manifest.hpp"
#include "kdispatch/plugin_loader.hpp"
#include "kdispatch/plugin_security.hpp"
#include "manifest_for_cache.hpp"

namespace {

void report(const std::string& line) {
  // fd 3 when the core started us; stderr when run by hand.
  const int fd = ::fcntl(3, F_GETFD) != -1 ? 3 : 2;
  const std::string text = line + "\n";
  if (::write(fd, text.data(), text.size()) < 0) std::perror("kdispatch-plugin-scanner");
}

std::string one_line(std::string text) {
  for (char& c : text) {
    if (c == '\n' || c == '\t') c = ' ';
  }
  return text;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace kdispatch;
  if (argc != 2) {
    std::fprintf(stderr, "usage: kdispatch-plugin-scanner MANIFEST\n");
    return 1;
  }
  try {
    // The manifest is checked as discovery checks it and read from the
    // checked descriptor; the library is checked by the loader.
    CheckedFile opened;
    if (std::optional<Problem> problem = LocationChecks().manifest(argv[1], &opened)) {
      report(fmt::format("error\t{}\t{}", static_cast<int>(problem->code), one_line(problem->message)));
      return 0;
    }
    Problem unreadable{};
    const std::optional<std::string> text = read_manifest_text_from(opened.file.fd, argv[1], unreadable);
    if (!text) {
      report(fmt::format("error\t{}\t{}", static_cast<int>(unreadable.code), one_line(unreadable.message)));
      return 0;
    }
    const ManifestResult parsed = parse_manifest(*text, argv[1]);
    if (!parsed.ok()) {
      const Problem& p = parsed.errors.front();
      report(fmt::format("error\t{}\t{}", static_cast<int>(p.code), one_line(p.message)));
      return 0;
    }
    load_plugin_binary(*parsed.manifest);
    report("ok");
  } catch (const Error& e) {
    report(fmt::format("error\t{}\t{}", static_cast<int>(e.code()), one_line(e.message())));
  } catch (const std::exception& e) {
    report(fmt::format("error\t{}\t{}", static_cast<int>(ErrorCode::plugin_open_failed), one_line(e.what())));
  }
  // The report is written: leave without running the plugin's destructors
  // and atexit handlers, which are not what was asked about.
  std::fflush(nullptr);
  ::_exit(0);
}
