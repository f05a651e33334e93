// libFuzzer target: the strict ELF check that runs before dlopen. It reads
// only the bytes it is given and must never read outside them.
#include <cstddef>
#include <cstdint>
#include <span>

#include "elf_check.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  (void)kdispatch::elf_load_problem(std::span<const unsigned char>(data, size));
  return 0;
}
