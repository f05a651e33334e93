// Opening a file that must be a regular file: a manifest, a plugin library,
// the KDISPATCH_TRACE file. A FIFO blocks open() and read() until someone
// writes, a device may do anything when opened, and a directory named
// x.json reads as an error deep inside a parser. Each open here looks at
// the file first and refuses anything but a regular file, with the kind of
// file found, and never blocks.
#pragma once

#include <sys/types.h>

#include <filesystem>
#include <string>
#include <string_view>

namespace kdispatch {

// "a FIFO", "a directory", "a character device", ... for a st_mode.
std::string_view file_kind(mode_t mode);

// Why `path` cannot be opened as a regular file ("a FIFO, not a regular
// file", "No such file or directory"), or empty. Uses stat (follows links).
std::string regular_file_problem(const std::filesystem::path& path);

// Opens `path` with `flags` (plus O_CLOEXEC and O_NOCTTY) when it is a
// regular file; with O_CREAT in `flags` a missing file is created with
// `mode`. Returns the descriptor, or -1 with `why` set. Never blocks on a
// FIFO or device: such files are refused before and after the open.
int open_regular_file(const std::filesystem::path& path, int flags, std::string& why, mode_t mode = 0644);

}  // namespace kdispatch
