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
  if ((st.st_mode & S_IWOTH) != 0) {
    return fmt::format("{} {} is world-writable (mode {:04o}, owner uid {}); run chmod o-w on it",
                       what, path.string(), mode, st.st_uid);
  }
  const uid_t euid = ::geteuid();
  if (st.st_uid != 0 && st.st_uid != euid) {
    return fmt::format(
        "{} {} is owned by uid {} (mode {:04o}), neither root nor the current user (uid {})",
        what, path.string(), st.st_uid, mode, euid);
  }
  return std::nullopt;
}

std::optional<std::string> insecure_reason(const fs::path& path, const char* what) {
  struct stat st{};
  if (::stat(path.c_str(), &st) != 0) {
    return fmt::format("cannot stat {} {}: {}", what, path.string(), std::strerror(errno));
  }
  return insecure_reason(path, st, what);
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

const LocationChecks::Directory& LocationChecks::directory(const fs::path& dir) {
  auto [it, inserted] = directories_.try_emplace(dir.string());
  if (inserted) it->second.canonical = fs::canonical(dir, it->second.error);
  return it->second;
}

const std::optional<std::string>& LocationChecks::insecure_directory(const fs::path& canonical) {
  auto [it, inserted] = insecure_.try_emplace(canonical.string());
  if (inserted) it->second = insecure_reason(canonical, "plugin directory");
  return it->second;
}

std::optional<Problem> LocationChecks::library(const Manifest& manifest) {
  const fs::path manifest_path = fs::absolute(fs::path(manifest.path));
  const fs::path library = fs::absolute(manifest.library_path());

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

  // Resolving every symlink shows where the code really comes from: a link
  // in the plugin folder must not pull in a file from elsewhere. The
  // library is a plain file name in its directory, so when it is not a link
  // itself it resolves to its directory's resolution and its name.
  std::error_code ec;
  fs::path real_library;
  struct stat link{};
  const Directory& library_dir = directory(library.parent_path());
  const bool plain = !library_dir.error && ::lstat(library.c_str(), &link) == 0 && !S_ISLNK(link.st_mode);
  if (plain) {
    real_library = library_dir.canonical / library.filename();
  } else {
    real_library = fs::canonical(library, ec);
  }
  if (ec) {
    return Problem{ErrorCode::manifest_bad_library_path, manifest.path,
                   fmt::format("cannot resolve library {}: {}", library.string(), ec.message())};
  }
  const Directory& dir = directory(manifest_path.parent_path());
  if (dir.error) {
    return Problem{ErrorCode::manifest_bad_library_path, manifest.path,
                   fmt::format("cannot resolve the directory of {}: {}", manifest.path, dir.error.message())};
  }
  const fs::path& manifest_dir = dir.canonical;
  const bool in_manifest_dir = plain && &library_dir == &dir;
  if (!in_manifest_dir && !is_within(real_library, manifest_dir)) {
    return Problem{ErrorCode::manifest_bad_library_path, manifest.path,
                   fmt::format("library {} resolves to {}, which escapes the manifest directory {} "
                               "(declared by {})",
                               library.string(), real_library.string(), manifest_dir.string(),
                               manifest.path)};
  }

  // stat() followed every link: `st` is the real library's.
  std::optional<std::string> reason = insecure_reason(real_library, st, "plugin library");
  if (!reason && in_manifest_dir) {
    reason = insecure_directory(manifest_dir);
  } else if (!reason) {
    reason = insecure_directory(real_library.parent_path());
    if (!reason && real_library.parent_path() != manifest_dir) reason = insecure_directory(manifest_dir);
  }
  if (reason) {
    return Problem{ErrorCode::plugin_insecure, real_library.string(),
                   fmt::format("refusing to load {}: {}", library.string(), *reason)};
  }
  return std::nullopt;
}

std::optional<Problem> LocationChecks::manifest(const fs::path& manifest) {
  // The manifest decides which library is loaded and holds its sha256, so
  // whoever can rewrite it can choose the code that runs: the rule for
  // libraries applies to it and its directory too.
  std::optional<std::string> reason = insecure_reason(manifest, "plugin manifest");
  if (!reason) {
    const Directory& dir = directory(fs::absolute(manifest).parent_path());
    if (!dir.error) reason = insecure_directory(dir.canonical);
  }
  if (!reason) return std::nullopt;
  return Problem{ErrorCode::plugin_insecure, manifest.string(),
                 fmt::format("refusing to read manifest {}: {}", manifest.string(), *reason)};
}

std::optional<Problem> check_library_location(const Manifest& manifest) { return LocationChecks().library(manifest); }

std::optional<Problem> check_manifest_security(const fs::path& manifest) { return LocationChecks().manifest(manifest); }

std::optional<Problem> verify_library_checksum(const Manifest& manifest) {
  if (!manifest.sha256) return std::nullopt;
  const fs::path library = fs::absolute(manifest.library_path());
  std::string actual;
  try {
    actual = sha256_file(library);
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

std::string sha256_file(const fs::path& path) {
  std::string why;
  UniqueFd file{open_regular_file(path, O_RDONLY, why)};
  if (file.fd < 0) throw std::runtime_error(fmt::format("cannot open {}: {}", path.string(), why));
  std::unique_ptr<EVP_MD_CTX, MdCtxFree> ctx(EVP_MD_CTX_new());
  if (!ctx || EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr) != 1) {
    throw std::runtime_error("libcrypto could not start a SHA-256 digest");
  }
  // Plugins with device code run to hundreds of MB: stream, never slurp.
  std::array<unsigned char, 1 << 16> buffer{};
  for (;;) {
    const ssize_t n = ::read(file.fd, buffer.data(), buffer.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      throw std::runtime_error(fmt::format("cannot read {}: {}", path.string(), std::strerror(errno)));
    }
    if (n == 0) break;
    if (EVP_DigestUpdate(ctx.get(), buffer.data(), static_cast<size_t>(n)) != 1) {
      throw std::runtime_error("libcrypto failed while hashing " + path.string());
    }
  }
  std::array<unsigned char, EVP_MAX_MD_SIZE> digest{};
  unsigned int length = 0;
  if (EVP_DigestFinal_ex(ctx.get(), digest.data(), &length) != 1) {
    throw std::runtime_error("libcrypto failed to finish the digest of " + path.string());
  }
  std::string hex;
  hex.reserve(2 * length);
  for (unsigned int i = 0; i < length; ++i) hex += fmt::format("{:02x}", digest[i]);
  return hex;
}

}  // namespace kdispatch
