// The strict check a plugin file passes before dlopen. The dynamic loader
// trusts the file it maps: a program header, dynamic entry, hash table,
// relocation or version record that points outside the file or its
// segments makes it read or write wild memory, and the process dies of
// SIGSEGV inside dlopen. This check reads the same structures the loader
// reads, bounds-checks every offset, address and count in them, and names
// the first one that is wrong. It reads bytes only: nothing of the file
// runs, and it is safe on any input (tests/fuzz has a target for it).
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <string>

namespace kdispatch {

// Why the dynamic loader could not load `image` (the whole file) safely,
// or empty. Only 64-bit little-endian shared libraries for the machine this
// process runs on pass.
std::string elf_load_problem(std::span<const unsigned char> image);

// elf_load_problem() of the file at `path`, which is mapped read-only for
// the check; a file that cannot be opened or mapped is a problem too.
std::string elf_file_load_problem(const std::filesystem::path& path);

}  // namespace kdispatch
