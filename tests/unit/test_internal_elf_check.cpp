// The strict ELF check before dlopen: every library the build makes and the
// system's own pass; single-byte corruptions that made the dynamic loader
// crash are refused with the structure they broke.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <vector>

#include "elf_check.hpp"

using namespace kdispatch;

namespace {

std::vector<unsigned char> read_bytes(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

const std::filesystem::path kGood =
    std::filesystem::path(KDISPATCH_BINARY_DIR) / "tests/fixtures/plugins/fx_good/libfx_good.so";

}  // namespace

TEST_CASE("elf check: built plugins and system libraries pass") {
  CHECK(elf_file_load_problem(kGood) == "");
  CHECK(elf_file_load_problem(std::string(KDISPATCH_PLUGIN_DIR) + "/libkdispatch-cpu.so") == "");
  for (const char* lib : {"/lib/x86_64-linux-gnu/libstdc++.so.6", "/lib/x86_64-linux-gnu/libm.so.6",
                          "/lib/x86_64-linux-gnu/libcrypto.so.3"}) {
    if (std::filesystem::exists(lib)) CHECK_MESSAGE(elf_file_load_problem(lib) == "", lib);
  }
}

TEST_CASE("elf check: corrupted bytes are named, not loaded") {
  const std::vector<unsigned char> good = read_bytes(kGood);
  REQUIRE(good.size() > 4096);
  const auto problem = [&](size_t offset, unsigned char value) {
    std::vector<unsigned char> bad = good;
    bad.at(offset) = value;
    return elf_load_problem(bad);
  };
  CHECK(problem(0, 0) == "not an ELF file (no ELF magic)");
  CHECK(problem(33, 0xff).find("the program header table at offset") == 0);                  // e_phoff
  CHECK(problem(64, 0xff).find("lies outside the loadable segments") != std::string::npos);  // first p_type
  CHECK_FALSE(problem(56, 0x7f).empty());                                                    // e_phnum
  // Truncated: the segments end past the file.
  CHECK(elf_load_problem(std::span(good).first(4096)).find("lie outside the file") != std::string::npos);
  // Every prefix and every single-byte change of the header and program
  // headers is checked without crashing the checker itself.
  for (size_t n = 0; n < 1024; n += 7) (void)elf_load_problem(std::span(good).first(n));
  for (size_t i = 0; i < 64 + 56 * 12 && i < good.size(); ++i)
    (void)problem(i, static_cast<unsigned char>(good[i] ^ 0x80));
}
