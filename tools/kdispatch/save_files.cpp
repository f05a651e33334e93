#include "save_files.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <stdexcept>

#include "common.hpp"
#include "kdispatch/error.hpp"

namespace kdispatch::cli {

namespace {

[[noreturn]] void fail(const std::string& path, const std::string& why) {
  throw Error(ErrorCode::file_not_writable, fmt::format("cannot write {}: {}", path, why));
}

// A new, empty file beside `path`: its name with a random suffix.
std::string make_temporary(const std::string& path) {
  std::string name = path + ".tmp-XXXXXX";
  const int fd = ::mkstemp(name.data());
  if (fd < 0) fail(path, fmt::format("cannot create a temporary file in its directory: {}", std::strerror(errno)));
  ::close(fd);
  return name;
}

// fsync reports a write that the page cache accepted but the disk did not.
void flush_to_disk(const std::string& path, const std::string& temporary) {
  const int fd = ::open(temporary.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0 || ::fsync(fd) != 0) {
    const int error = errno;
    if (fd >= 0) ::close(fd);
    fail(path, std::strerror(error));
  }
  ::close(fd);
}

}  // namespace

void check_save_dir(const std::string& dir) {
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  if (error) throw UsageError(fmt::format("--save {}: cannot create the directory: {}", dir, error.message()));
  if (!std::filesystem::is_directory(dir, error)) throw UsageError(fmt::format("--save {}: not a directory", dir));
  std::string probe = dir + "/.kdispatch-save-XXXXXX";
  const int fd = ::mkstemp(probe.data());
  if (fd < 0) {
    throw UsageError(fmt::format("--save {}: cannot create files in the directory: {}", dir, std::strerror(errno)));
  }
  ::close(fd);
  ::unlink(probe.c_str());
}

void write_atomically(const std::string& path, const std::function<void(const std::string&)>& write) {
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) fail(path, "exists and is not a regular file");
  const std::string temporary = make_temporary(path);
  try {
    write(temporary);
    flush_to_disk(path, temporary);
    if (std::rename(temporary.c_str(), path.c_str()) != 0) fail(path, std::strerror(errno));
  } catch (const Error&) {
    ::unlink(temporary.c_str());
    throw;
  } catch (const std::exception& e) {
    ::unlink(temporary.c_str());
    fail(path, e.what());
  }
}

}  // namespace kdispatch::cli
