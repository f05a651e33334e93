#include "file_check.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

#include <cerrno>
#include <cstring>

namespace kdispatch {

std::string_view file_kind(mode_t mode) {
  if (S_ISREG(mode)) return "a regular file";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISLNK(mode)) return "a symbolic link";
  return "a special file";
}

std::string regular_file_problem(const std::filesystem::path& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return std::strerror(errno);
  if (!S_ISREG(st.st_mode)) return fmt::format("{}, not a regular file", file_kind(st.st_mode));
  return {};
}

int open_regular_file(const std::filesystem::path& path, int flags, std::string& why, mode_t mode) {
  struct stat st {};
  const bool exists = ::stat(path.c_str(), &st) == 0;
  if (!exists && !(errno == ENOENT && (flags & O_CREAT) != 0)) {
    why = std::strerror(errno);
    return -1;
  }
  if (exists && !S_ISREG(st.st_mode)) {
    why = fmt::format("{}, not a regular file", file_kind(st.st_mode));
    return -1;
  }
  // O_NONBLOCK: should the path become a FIFO between the stat and the
  // open, the open still returns at once (and fstat refuses it).
  const int fd = ::open(path.c_str(), flags | O_NONBLOCK | O_CLOEXEC | O_NOCTTY, mode);
  if (fd < 0) {
    why = std::strerror(errno);
    return -1;
  }
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    why = fmt::format("{}, not a regular file", file_kind(st.st_mode));
    ::close(fd);
    return -1;
  }
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  return fd;
}

}  // namespace kdispatch
