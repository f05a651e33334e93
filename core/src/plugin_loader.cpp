// The one file of the core that includes Boost.DLL.
#include "kdispatch/plugin_loader.hpp"

// std::filesystem paths, so the core needs no Boost.Filesystem library.
#define BOOST_DLL_USE_STD_FS
#include <boost/dll/shared_library.hpp>

#include <dlfcn.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <system_error>
#include <utility>

#include "elf_check.hpp"
#include "kdispatch/elf_reader.hpp"
#include "kdispatch/error.hpp"
#include "kdispatch/log.hpp"
#include "kdispatch/manifest_agreement.hpp"
#include "kdispatch/plugin_security.hpp"
#include "unique_fd.hpp"

namespace kdispatch {
namespace {

namespace dll = boost::dll;

[[noreturn]] void fail(ErrorCode code, std::string message, std::vector<std::string> hints = {}) {
  throw PluginError(code, std::move(message), std::move(hints));
}

std::string host_machine() {
#if defined(__x86_64__)
  return "x86-64";
#elif defined(__aarch64__)
  return "AArch64";
#else
  return {};
#endif
}

// Turns the dynamic loader's text into the cause a user can act on. glibc
// names the object it failed on first: the library itself, or a dependency.
std::string classify_dlopen_error(const std::string& library, const std::string& text) {
  const std::string own_prefix = library + ": ";
  const bool about_library = text.starts_with(own_prefix);
  const std::string subject = about_library ? library : text.substr(0, text.find(": "));

  if (const auto at = text.find("undefined symbol: "); at != std::string::npos) {
    std::string symbol = text.substr(at + std::strlen("undefined symbol: "));
    symbol = symbol.substr(0, symbol.find_first_of(" ,\n"));
    return about_library ? fmt::format("undefined symbol {}", symbol)
                         : fmt::format("undefined symbol {} (in dependency {})", symbol, subject);
  }
  if (text.find("cannot open shared object file") != std::string::npos) {
    return about_library ? "not found" : fmt::format("missing dependency {}", subject);
  }
  for (const char* marker : {"wrong ELF class", "invalid ELF header", "file too short", "not an ELF",
                             "ELF file", "only ET_DYN and ET_EXEC"}) {
    if (text.find(marker) != std::string::npos) {
      return about_library
                 ? "wrong architecture or not a shared library"
                 : fmt::format("dependency {}: wrong architecture or not a shared library", subject);
    }
  }
  return "the dynamic loader refused it";
}

// Libraries are never unloaded (docs/plugins.md): the table and kernel
// pointers must stay valid until exit, and unloading a library that
// registered atexit handlers or thread-locals (GPU runtimes do) can crash the
// process later. So every opened library is kept in a registry that is never
// destroyed, also when a later check refuses the plugin: its code has
// already run. It is keyed by the file's device and inode, the identity of
// what was checked. (Reachable from a static, so leak checkers stay quiet.)
struct OpenedLibrary {
  // The descriptor the library was loaded through stays open: the dynamic
  // loader knows the library by the name /proc/self/fd/N and would answer a
  // later dlopen of that name with it, so N must never name another file.
  UniqueFd file;
  dll::shared_library library;
};
std::map<std::pair<dev_t, ino_t>, OpenedLibrary>& opened_libraries() {
  static auto* libraries = new std::map<std::pair<dev_t, ino_t>, OpenedLibrary>();
  return *libraries;
}

// Guards opened_libraries(), held only to look up and insert: never across
// a dlopen, whose library constructors may take long, so that a fork()
// meanwhile leaves it free in the child. Two threads opening one library at
// once both dlopen it; the second handle is dropped, the library stays.
std::mutex& opened_libraries_mutex() {
  static auto* mutex = new std::mutex();
  return *mutex;
}

// Opens `checked`, the library of `library` (its path, for messages),
// through its descriptor: /proc/self/fd/N names the checked file whatever
// happens to the path meanwhile.
dll::shared_library* open_library(CheckedFile& checked, const std::string& library) {
  auto& opened = opened_libraries();
  const std::pair<dev_t, ino_t> key{checked.st.st_dev, checked.st.st_ino};
  {
    std::lock_guard lock(opened_libraries_mutex());
    if (const auto it = opened.find(key); it != opened.end()) return &it->second.library;
  }
  const std::string descriptor = checked.descriptor_path();

  // A dlopen of a file cut short can die of SIGBUS inside the dynamic loader
  // (it maps segments without checking the file size), so the file is read
  // with bounds-checked libelf first. This also names a foreign machine,
  // which glibc reports only as "cannot open shared object file".
  ElfInfo elf;
  try {
    elf = read_elf(descriptor);
  } catch (const PluginError& e) {
    // read_elf names the file itself; keep only its cause.
    std::string cause = e.message();
    if (const auto at = cause.find(descriptor + ": "); at != std::string::npos) {
      cause.erase(0, at + descriptor.size() + 2);
    }
    const bool damaged = cause.find("truncated") != std::string::npos ||
                         cause.find("corrupt") != std::string::npos;
    fail(ErrorCode::plugin_open_failed,
         damaged ? fmt::format("cannot open plugin library {}: {}", library, cause)
                 : fmt::format("cannot open plugin library {}: wrong architecture or not a shared "
                               "library ({})",
                               library, cause));
  }
  if (const std::string host = host_machine(); !host.empty() && elf.machine != host) {
    fail(ErrorCode::plugin_open_failed,
         fmt::format("cannot open plugin library {}: wrong architecture: built for {}, this process is {}",
                     library, elf.machine, host));
  }
  // The dynamic loader trusts every header, table and offset of the file:
  // one corrupted byte there is a SIGSEGV inside dlopen. The strict check
  // reads what the loader reads first.
  if (const std::string problem = elf_file_load_problem(descriptor); !problem.empty()) {
    fail(ErrorCode::plugin_open_failed,
         fmt::format("cannot open plugin library {}: corrupt ELF file: {}", library, problem));
  }

  std::error_code ec;
  dll::shared_library lib(std::filesystem::path(descriptor), dll::load_mode::rtld_now | dll::load_mode::rtld_local,
                          ec);
  if (ec || !lib.is_loaded()) {
    // Boost reports only a generic error code; the loader's own text is
    // still pending in dlerror(): Boost makes no dl* call after the failed
    // dlopen on this path (checked with Boost 1.74 and 1.83). It names the
    // descriptor path, shown as the library's.
    const char* raw = ::dlerror();
    std::string text = raw != nullptr ? raw : ec.message();
    for (size_t at = text.find(descriptor); at != std::string::npos; at = text.find(descriptor, at + library.size())) {
      text.replace(at, descriptor.size(), library);
    }
    fail(ErrorCode::plugin_open_failed,
         fmt::format("cannot open plugin library {}: {} ({})", library,
                     classify_dlopen_error(library, text), text));
  }
  log(LogLevel::debug, "opened plugin library {} through {}", library, descriptor);
  std::lock_guard lock(opened_libraries_mutex());
  return &opened.emplace(key, OpenedLibrary{std::move(checked.file), std::move(lib)}).first->second.library;
}

const kd_plugin_api* call_entry(dll::shared_library& lib, const std::string& library) {
  if (!lib.has(KDISPATCH_PLUGIN_ENTRY_SYMBOL)) {
    fail(ErrorCode::plugin_no_entry,
         fmt::format("plugin library {} does not export the entry symbol '{}'", library,
                     KDISPATCH_PLUGIN_ENTRY_SYMBOL),
         {"build plugins with kdispatch_add_plugin(), which exports exactly that symbol"});
  }
  auto& entry = lib.get<const kd_plugin_api*()>(KDISPATCH_PLUGIN_ENTRY_SYMBOL);
  const kd_plugin_api* api = nullptr;
  try {
    api = entry();
  } catch (...) {
    fail(ErrorCode::plugin_no_entry,
         fmt::format("'{}' of plugin library {} threw an exception", KDISPATCH_PLUGIN_ENTRY_SYMBOL, library));
  }
  if (api == nullptr) {
    fail(ErrorCode::plugin_no_entry,
         fmt::format("'{}' of plugin library {} returned NULL (the plugin failed to initialise)",
                     KDISPATCH_PLUGIN_ENTRY_SYMBOL, library));
  }
  return api;
}

void check_abi(const kd_plugin_api& api, const std::string& library) {
  // The major is read before the layout is trusted: only struct_size and the
  // version fields are fixed across majors.
  constexpr size_t version_size = KD_STRUCT_SIZE(kd_plugin_api, abi_minor);
  if (api.struct_size < version_size) {
    fail(ErrorCode::plugin_abi_mismatch,
         fmt::format("plugin library {}: kd_plugin_api struct_size {} too small, need {}", library,
                     api.struct_size, version_size));
  }
  if (api.abi_major != KDISPATCH_ABI_MAJOR) {
    fail(ErrorCode::plugin_abi_mismatch,
         fmt::format("plugin library {} was built for plugin ABI {}.{}, this kdispatch uses ABI {}.{}",
                     library, api.abi_major, api.abi_minor, KDISPATCH_ABI_MAJOR, KDISPATCH_ABI_MINOR),
         {"rebuild the plugin against this kdispatch's plugin_api.h"});
  }
  // Any minor of the major: the table must hold every field of 1.0. Fields
  // appended later are read only where KD_STRUCT_HAS_FIELD says they exist.
  if (api.struct_size < KD_PLUGIN_API_STRUCT_SIZE_1_0) {
    fail(ErrorCode::plugin_abi_mismatch,
         fmt::format("plugin library {}: kd_plugin_api struct_size {} is smaller than ABI 1.0's {}", library,
                     api.struct_size, KD_PLUGIN_API_STRUCT_SIZE_1_0));
  }
  if (api.memory != nullptr && api.memory->struct_size < KD_MEMORY_API_STRUCT_SIZE_1_0) {
    fail(ErrorCode::plugin_abi_mismatch,
         fmt::format("plugin library {}: kd_memory_api struct_size {} is smaller than ABI 1.0's {}", library,
                     api.memory->struct_size, KD_MEMORY_API_STRUCT_SIZE_1_0));
  }
  if (api.probe == nullptr || api.find_kernel == nullptr) {
    fail(ErrorCode::plugin_abi_mismatch,
         fmt::format("plugin library {}: kd_plugin_api.{} is NULL", library,
                     api.probe == nullptr ? "probe" : "find_kernel"));
  }
}

// The file manifest is what selection used; the embedded one is what the
// binary was built with. If they differ, the manifest belongs to another
// build or another plugin, and calls would reach the wrong code.
void check_manifest_agreement(const kd_plugin_api& api, const Manifest& manifest,
                              const std::string& library) {
  std::vector<std::string> differences;
  auto compare = [&](const char* what, const char* binary, const std::string& file) {
    if (binary == nullptr) {
      differences.push_back(fmt::format("the table's {} is NULL, the manifest says '{}'", what, file));
    } else if (file != binary) {
      differences.push_back(fmt::format("the table's {} is '{}', the manifest says '{}'", what, binary, file));
    }
  };
  compare("plugin_name", api.plugin_name, manifest.plugin);
  compare("backend", api.backend, manifest.backend);

  if (api.manifest_json == nullptr) {
    differences.emplace_back("the table carries no embedded manifest (manifest_json is NULL)");
  } else {
    const std::string origin = fmt::format("<embedded in {}>", library);
    const ManifestResult embedded = parse_manifest(api.manifest_json, origin);
    if (!embedded.ok()) {
      const std::string first = embedded.errors.empty() ? "invalid" : embedded.errors.front().message;
      differences.push_back(fmt::format("the embedded manifest is invalid: {}", first));
    } else {
      const std::vector<std::string> more = manifest_differences(manifest, *embedded.manifest);
      differences.insert(differences.end(), more.begin(), more.end());
    }
  }
  if (!differences.empty()) {
    fail(ErrorCode::plugin_manifest_mismatch,
         fmt::format("manifest {} and plugin library {} disagree: {}", manifest.path, library,
                     fmt::join(differences, "; ")),
         {"the manifest file belongs to another build of the plugin: reinstall both together"});
  }
}

ProbedDevice to_probed_device(DeviceType type, const kd_device_info& info) {
  ProbedDevice out;
  const std::string arch(info.arch, strnlen(info.arch, sizeof info.arch));
  if (type == DeviceType::cpu) {
    out.device = Device::host_cpu();
  } else {
    out.device.type = type;
    // An arch the core cannot parse stays empty ("arch unknown"): only
    // kernels without an arch constraint will match it.
    if (type == DeviceType::hip || CudaArch::parse(arch)) out.device.arch = arch;
  }
  out.id = info.device_id;
  out.name.assign(info.name, strnlen(info.name, sizeof info.name));
  out.driver_version.assign(info.driver_version, strnlen(info.driver_version, sizeof info.driver_version));
  out.runtime_version.assign(info.runtime_version, strnlen(info.runtime_version, sizeof info.runtime_version));
  return out;
}

std::vector<ProbedDevice> probe_devices(const kd_plugin_api& api, const std::string& library) {
  // Far more than any host has; a bigger count is asked again once.
  size_t capacity = 64;
  for (int attempt = 0; attempt < 2; ++attempt) {
    std::vector<kd_device_info> infos(capacity);
    for (kd_device_info& info : infos) {
      std::memset(&info, 0, sizeof info);
      info.struct_size = sizeof(kd_device_info);
    }
    size_t count = 0;
    char error[512] = {};
    kd_status status = KD_STATUS_INTERNAL;
    try {
      status = api.probe(infos.data(), infos.size(), &count, error, sizeof error);
    } catch (...) {
      fail(ErrorCode::plugin_probe_failed,
           fmt::format("probe of plugin library {} threw an exception", library));
    }
    error[sizeof error - 1] = '\0';
    if (status != KD_STATUS_OK) {
      fail(ErrorCode::plugin_probe_failed,
           fmt::format("probe of plugin library {} failed (status {}): {}", library,
                       static_cast<int>(status), error[0] != '\0' ? error : "no message"));
    }
    if (count > capacity && attempt == 0 && count <= 4096) {
      capacity = count;
      continue;
    }
    std::vector<ProbedDevice> devices;
    for (size_t i = 0; i < std::min(count, capacity); ++i) {
      // A device type the core has no name for (another DLPack type) cannot
      // be the device of any call, so it is left out of the list.
      if (const auto type = from_dlpack_device_type(infos[i].device_type)) {
        devices.push_back(to_probed_device(*type, infos[i]));
      }
    }
    return devices;
  }
  return {};
}

std::map<std::string, kd_kernel_fn> find_kernels(const kd_plugin_api& api, const Manifest& manifest,
                                                 const std::string& library) {
  std::map<std::string, kd_kernel_fn> kernels;
  // `symbol` through find_kernel, once: a kernel, or its supports function.
  const auto find = [&](const std::string& symbol, std::string_view what, const KernelSpec& k) {
    if (symbol.empty() || kernels.contains(symbol)) return;
    kd_kernel_fn fn = nullptr;
    try {
      fn = api.find_kernel(symbol.c_str());
    } catch (...) {
      fail(ErrorCode::plugin_manifest_mismatch,
           fmt::format("find_kernel('{}') of plugin library {} threw an exception", symbol, library));
    }
    if (fn == nullptr) {
      fail(ErrorCode::plugin_manifest_mismatch,
           fmt::format("plugin library {} does not provide {} '{}' declared for op '{}' by {}", library, what, symbol,
                       k.op, manifest.path));
    }
    kernels.emplace(symbol, fn);
  };
  for (const KernelSpec& k : manifest.kernels) {
    find(k.symbol, "kernel symbol", k);
    find(k.supports_symbol, "the supports function", k);
  }
  return kernels;
}

}  // namespace

std::unique_ptr<PluginBinary> load_plugin_binary(const Manifest& manifest) {
  // The library is opened once: the checks, the checksum and the load all
  // go through that one descriptor.
  CheckedFile checked;
  if (auto problem = LocationChecks().library(manifest, &checked)) fail(problem->code, problem->message);
  if (auto problem = verify_library_checksum(manifest, checked)) fail(problem->code, problem->message);

  const std::string library = std::filesystem::absolute(manifest.library_path()).string();
  dll::shared_library* lib = open_library(checked, library);
  const kd_plugin_api* api = call_entry(*lib, library);
  check_abi(*api, library);
  check_manifest_agreement(*api, manifest, library);

  auto binary = std::make_unique<PluginBinary>();
  binary->plugin = manifest.plugin;
  binary->backend = manifest.backend;
  binary->version = api->plugin_version != nullptr ? api->plugin_version : "";
  binary->library_path = library;
  binary->abi_major = api->abi_major;
  binary->abi_minor = api->abi_minor;
  binary->api = api;
  binary->devices = probe_devices(*api, library);
  binary->kernels = find_kernels(*api, manifest, library);
  return binary;
}

}  // namespace kdispatch
