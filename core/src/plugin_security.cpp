#include "kdispatch/plugin_security.hpp"

#include <fcntl.h>
#include <openssl/evp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <functional>
#include <memory>
#include <stdexcept>
#include <system_error>

#include "file_check.hpp"
#include "unique_fd.hpp"

namespace kdispatch {
namespace fs = std::filesystem;

namespace {

// `inner` is `outer` or below it. Both are canonical, so comparing the
// components is exact (no "..", no symlinks left).
bool is_within(const fs::path& inner, const fs::path& outer) {
  auto i = inner.begin();
  for (auto o = outer.begin(); o != outer.end(); ++o, ++i) {
    if (o->empty()) continue;  // a trailing separator
    if (i == inner.end() || *i != *o) return false;
  }
  return true;
}

// Someone other than root and the user running kdispatch could replace the
// file, so loading it would run their code as this user. `st` is its stat.
std::optional<std::string> insecure_reason(const fs::path& path, const struct stat& st, const char* what) {
  const unsigned mode = st.st_mode & 07777U;
  const uid_t euid = ::geteuid();
  if (st.st_uid != 0 && st.st_uid != euid) {
    return fmt::format(
        "{} {} is owned by uid {} (mode {:04o}), neither root nor the current user (uid {})",
        what, path.string(), st.st_uid, mode, euid);
  }
  // A sticky directory owned by root (/tmp) lets each user rename or
  // remove only their own entries.
  const bool sticky_root = S_ISDIR(st.st_mode) && (st.st_mode & S_ISVTX) != 0 && st.st_uid == 0;
  if (sticky_root) return std::nullopt;
  if ((st.st_mode & S_IWOTH) != 0) {
    return fmt::format("{} {} is world-writable (mode {:04o}, owner uid {}); run chmod o-w on it",
                       what, path.string(), mode, st.st_uid);
  }
  if ((st.st_mode & S_IWGRP) != 0) {
    return fmt::format("{} {} is group-writable (mode {:04o}, owner uid {}, group gid {}); run chmod g-w on it",
                       what, path.string(), mode, st.st_uid, st.st_gid);
  }
  return std::nullopt;
}

// Why `dir` (canonical) or a directory above it up to `/` is unsafe, or
// nullopt. Whoever can write to any of them can rename the plugin's folder
// or one above it and put another in its place.
std::optional<std::string> insecure_chain(const fs::path& dir) {
  const char* what = "plugin directory";
  for (fs::path d = dir;; d = d.parent_path()) {
    struct stat st{};
    if (::lstat(d.c_str(), &st) != 0) {
      return fmt::format("cannot stat {} {}: {}", what, d.string(), std::strerror(errno));
    }
    if (std::optional<std::string> reason = insecure_reason(d, st, what)) return reason;
    if (!d.has_relative_path()) return std::nullopt;  // `/` checked
    what = "directory above the plugin,";
  }
}

// Where the file open as `fd` lies, every link resolved.
std::optional<fs::path> real_path_of(int fd) {
  std::error_code ec;
  fs::path real = fs::read_symlink(fmt::format("/proc/self/fd/{}", fd), ec);
  if (ec || !real.is_absolute()) return std::nullopt;
  return real;
}

struct MdCtxFree {
  void operator()(EVP_MD_CTX* ctx) const noexcept { EVP_MD_CTX_free(ctx); }
};

std::string lowercase(std::string text) {
  std::transform(text.begin(), text.end(), text.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return text;
}

}  // namespace

std::string CheckedFile::descriptor_path() const { return fmt::format("/proc/self/fd/{}", file.fd); }

const LocationChecks::Directory& LocationChecks::directory(const fs::path& dir) {
  auto [it, inserted] = directories_.try_emplace(dir.string());
  if (inserted) it->second.canonical = fs::canonical(dir, it->second.error);
  return it->second;
}

const std::optional<std::string>& LocationChecks::insecure_directory(const fs::path& canonical) {
  auto [it, inserted] = insecure_.try_emplace(canonical.string());
  if (inserted) it->second = insecure_chain(canonical);
  return it->second;
}

std::optional<Problem> LocationChecks::library(const Manifest& manifest, CheckedFile* opened) {
  const fs::path manifest_path = fs::absolute(fs::path(manifest.path));
  const fs::path library = fs::absolute(manifest.library_path());

  // stat first for the messages (and so that a FIFO or device is never
  // opened); what counts is the fstat of the descriptor opened below.
  struct stat st{};
  if (::stat(library.c_str(), &st) != 0) {
    const std::string cause = errno == ENOENT ? "library not found" : std::strerror(errno);
    return Problem{ErrorCode::manifest_bad_library_path, manifest.path,
                   fmt::format("{}: {} (declared by {})", cause, library.string(), manifest.path)};
  }
  if (!S_ISREG(st.st_mode)) {
    return Problem{ErrorCode::manifest_bad_library_path, manifest.path,
                   fmt::format("library {} is not a regular file (declared by {})",
                               library.string(), manifest.path)};
  }
  CheckedFile file;
  std::string why;
  file.file = UniqueFd{open_regular_file(library, O_RDONLY, why)};
  if (file.file.fd < 0 || ::fstat(file.file.fd, &file.st) != 0) {
    if (why.empty()) why = std::strerror(errno);
    return Problem{ErrorCode::manifest_bad_library_path, manifest.path,
                   fmt::format("cannot open library {}: {} (declared by {})", library.string(), why, manifest.path)};
  }

  // Where the opened file really lies: a link in the plugin folder must not
  // pull in a file from elsewhere.
  const std::optional<fs::path> real_library = real_path_of(file.file.fd);
  if (!real_library) {
    return Problem{ErrorCode::manifest_bad_library_path, manifest.path,
                   fmt::format("cannot resolve library {}: /proc/self/fd is not readable", library.string())};
  }
  const Directory& dir = directory(manifest_path.parent_path());
  if (dir.error) {
    return Problem{ErrorCode::manifest_bad_library_path, manifest.path,
                   fmt::format("cannot resolve the directory of {}: {}", manifest.path, dir.error.message())};
  }
  const fs::path& manifest_dir = dir.canonical;
  if (!is_within(*real_library, manifest_dir)) {
    return Problem{ErrorCode::manifest_bad_library_path, manifest.path,
                   fmt::format("library {} resolves to {}, which escapes the manifest directory {} "
                               "(declared by {})",
                               library.string(), real_library->string(), manifest_dir.string(),
                               manifest.path)};
  }

  // The library lies in the manifest's directory or below it, so the chain
  // of its own directory covers the manifest's.
  std::optional<std::string> reason = insecure_reason(*real_library, file.st, "plugin library");
  if (!reason) reason = insecure_directory(real_library->parent_path());
  if (reason) {
    return Problem{ErrorCode::plugin_insecure, real_library->string(),
                   fmt::format("refusing to load {}: {}", library.string(), *reason)};
  }
  file.real = *real_library;
  if (opened != nullptr) *opened = std::move(file);
  return std::nullopt;
}

std::optional<Problem> LocationChecks::manifest(const fs::path& manifest, CheckedFile* opened) {
  // The manifest decides which library is loaded and holds its sha256, so
  // whoever can rewrite it can choose the code that runs: the rule for
  // libraries applies to it and its directories too.
  CheckedFile file;
  std::string why;
  file.file = UniqueFd{open_regular_file(manifest, O_RDONLY, why)};
  if (file.file.fd < 0 || ::fstat(file.file.fd, &file.st) != 0) {
    if (why.empty()) why = std::strerror(errno);
    return Problem{ErrorCode::manifest_bad_json, manifest.string(),
                   fmt::format("{}: cannot read: {}", manifest.string(), why)};
  }
  std::optional<std::string> reason = insecure_reason(manifest, file.st, "plugin manifest");
  const std::optional<fs::path> real = real_path_of(file.file.fd);
  if (!reason && !real) reason = fmt::format("cannot resolve {}: /proc/self/fd is not readable", manifest.string());
  // The directory it was found in (a link there could be replaced) and,
  // when it is a link, the directory of the file it leads to.
  const Directory& dir = directory(fs::absolute(manifest).parent_path());
  if (!reason && !dir.error) reason = insecure_directory(dir.canonical);
  if (!reason && real && (dir.error || real->parent_path() != dir.canonical)) {
    reason = insecure_directory(real->parent_path());
  }
  if (reason) {
    return Problem{ErrorCode::plugin_insecure, manifest.string(),
                   fmt::format("refusing to read manifest {}: {}", manifest.string(), *reason)};
  }
  file.real = *real;
  if (opened != nullptr) *opened = std::move(file);
  return std::nullopt;
}

std::optional<Problem> check_library_location(const Manifest& manifest) { return LocationChecks().library(manifest); }

std::optional<Problem> check_manifest_security(const fs::path& manifest) { return LocationChecks().manifest(manifest); }

std::optional<Problem> check_program_security(const fs::path& program, const char* what) {
  // O_PATH: a program may be executable without being readable.
  const UniqueFd file{::open(program.c_str(), O_PATH | O_CLOEXEC)};
  struct stat st{};
  if (file.fd < 0 || ::fstat(file.fd, &st) != 0) {
    return Problem{ErrorCode::plugin_insecure, program.string(),
                   fmt::format("refusing to run {} {}: {}", what, program.string(), std::strerror(errno))};
  }
  std::optional<std::string> reason;
  if (!S_ISREG(st.st_mode)) {
    reason = fmt::format("{} {} is {}, not a regular file", what, program.string(), file_kind(st.st_mode));
  }
  const std::optional<fs::path> real = real_path_of(file.fd);
  if (!reason && !real) reason = fmt::format("cannot resolve {}: /proc/self/fd is not readable", program.string());
  if (!reason) reason = insecure_reason(*real, st, what);
  if (!reason) reason = insecure_chain(real->parent_path());
  if (!reason) return std::nullopt;
  return Problem{ErrorCode::plugin_insecure, program.string(),
                 fmt::format("refusing to run {} {}: {}", what, program.string(), *reason)};
}

namespace {

std::optional<Problem> checksum_problem(const Manifest& manifest, const fs::path& library,
                                        const std::function<std::string()>& digest) {
  std::string actual;
  try {
    actual = digest();
  } catch (const std::exception& e) {
    return Problem{ErrorCode::plugin_checksum_mismatch, library.string(),
                   fmt::format("cannot verify sha256 of {}: {}", library.string(), e.what())};
  }
  const std::string expected = lowercase(*manifest.sha256);
  if (actual != expected) {
    return Problem{ErrorCode::plugin_checksum_mismatch, library.string(),
                   fmt::format("sha256 mismatch for {}: manifest {} says {}, file has {}",
                               library.string(), manifest.path, expected, actual)};
  }
  return std::nullopt;
}

}  // namespace

std::optional<Problem> verify_library_checksum(const Manifest& manifest) {
  if (!manifest.sha256) return std::nullopt;
  const fs::path library = fs::absolute(manifest.library_path());
  return checksum_problem(manifest, library, [&] { return sha256_file(library); });
}

std::optional<Problem> verify_library_checksum(const Manifest& manifest, const CheckedFile& checked) {
  if (!manifest.sha256) return std::nullopt;
  const fs::path library = fs::absolute(manifest.library_path());
  return checksum_problem(manifest, library, [&] { return sha256_fd(checked.file.fd, library.string()); });
}

std::string sha256_file(const fs::path& path) {
  std::string why;
  UniqueFd file{open_regular_file(path, O_RDONLY, why)};
  if (file.fd < 0) throw std::runtime_error(fmt::format("cannot open {}: {}", path.string(), why));
  return sha256_fd(file.fd, path.string());
}

std::string sha256_fd(int fd, const std::string& name) {
  std::unique_ptr<EVP_MD_CTX, MdCtxFree> ctx(EVP_MD_CTX_new());
  if (!ctx || EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr) != 1) {
    throw std::runtime_error("libcrypto could not start a SHA-256 digest");
  }
  // Plugins with device code run to hundreds of MB: stream, never slurp.
  std::array<unsigned char, 1 << 16> buffer{};
  off_t offset = 0;
  for (;;) {
    const ssize_t n = ::pread(fd, buffer.data(), buffer.size(), offset);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw std::runtime_error(fmt::format("cannot read {}: {}", name, std::strerror(errno)));
    }
    if (n == 0) break;
    offset += n;
    if (EVP_DigestUpdate(ctx.get(), buffer.data(), static_cast<size_t>(n)) != 1) {
      throw std::runtime_error("libcrypto failed while hashing " + name);
    }
  }
  std::array<unsigned char, EVP_MAX_MD_SIZE> digest{};
  unsigned int length = 0;
  if (EVP_DigestFinal_ex(ctx.get(), digest.data(), &length) != 1) {
    throw std::runtime_error("libcrypto failed to finish the digest of " + name);
  }
  std::string hex;
  hex.reserve(2 * length);
  for (unsigned int i = 0; i < length; ++i) hex += fmt::format("{:02x}", digest[i]);
  return hex;
}

}  // namespace kdispatch
