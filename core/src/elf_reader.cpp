#include "kdispatch/elf_reader.hpp"

#include <kdispatch/plugin_api.h>

#include <fcntl.h>
#include <gelf.h>
#include <libelf.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>

#include "file_check.hpp"
#include "kdispatch/error.hpp"
#include "unique_fd.hpp"

namespace kdispatch {
namespace {

[[noreturn]] void fail(const std::filesystem::path& path, const std::string& what) {
  throw PluginError(ErrorCode::plugin_open_failed,
                    fmt::format("cannot read plugin file {}: {}", path.string(), what));
}

std::string libelf_error() {
  const char* message = elf_errmsg(-1);
  return message != nullptr ? message : "unknown libelf error";
}

struct ElfEnd {
  void operator()(Elf* elf) const noexcept { elf_end(elf); }
};
using ElfPtr = std::unique_ptr<Elf, ElfEnd>;

std::string machine_name(unsigned machine) {
  switch (machine) {
    case EM_X86_64: return "x86-64";
    case EM_AARCH64: return "AArch64";
    case EM_386: return "Intel 80386";
    case EM_ARM: return "ARM";
    case EM_PPC64: return "PowerPC64";
    case EM_RISCV: return "RISC-V";
    default: return fmt::format("machine {}", machine);
  }
}

// libelf checks bounds of what it reads, but says little about a file that
// was cut short. Checking every table and loadable segment against the file
// size up front gives a message that says "truncated", and it is also what
// protects the dynamic loader later: glibc maps segments without checking
// the file size, and touching a page past the end of the file is SIGBUS.
void check_extents(const std::filesystem::path& path, Elf* elf, const GElf_Ehdr& ehdr,
                   uint64_t file_size) {
  auto check = [&](uint64_t offset, uint64_t size, const std::string& what) {
    if (offset > file_size || size > file_size - offset) {
      fail(path, fmt::format("truncated or corrupt ELF file: {} ends at byte {}, the file has {} bytes",
                             what, offset + size, file_size));
    }
  };
  size_t shnum = 0;
  if (elf_getshdrnum(elf, &shnum) != 0) fail(path, "corrupt ELF section table: " + libelf_error());
  check(ehdr.e_shoff, static_cast<uint64_t>(shnum) * ehdr.e_shentsize, "the section header table");
  size_t phnum = 0;
  if (elf_getphdrnum(elf, &phnum) != 0) fail(path, "corrupt ELF program headers: " + libelf_error());
  check(ehdr.e_phoff, static_cast<uint64_t>(phnum) * ehdr.e_phentsize, "the program header table");
  for (size_t i = 0; i < phnum; ++i) {
    GElf_Phdr phdr;
    if (gelf_getphdr(elf, static_cast<int>(i), &phdr) == nullptr) {
      fail(path, fmt::format("corrupt program header {}: {}", i, libelf_error()));
    }
    if (phdr.p_type == PT_LOAD || phdr.p_type == PT_DYNAMIC) {
      check(phdr.p_offset, phdr.p_filesz, fmt::format("segment {}", i));
    }
  }
  Elf_Scn* scn = nullptr;
  while ((scn = elf_nextscn(elf, scn)) != nullptr) {
    GElf_Shdr shdr;
    if (gelf_getshdr(scn, &shdr) == nullptr) fail(path, "corrupt section header: " + libelf_error());
    if (shdr.sh_type != SHT_NOBITS) {
      check(shdr.sh_offset, shdr.sh_size, fmt::format("section {}", elf_ndxscn(scn)));
    }
  }
}

// Defined GLOBAL/WEAK symbols of a .dynsym section: what dlsym can find.
void collect_exported(const std::filesystem::path& path, Elf* elf, Elf_Scn* scn,
                      const GElf_Shdr& shdr, std::vector<std::string>* out) {
  Elf_Data* data = elf_getdata(scn, nullptr);
  if (data == nullptr || shdr.sh_entsize == 0) return;
  const size_t count = shdr.sh_size / shdr.sh_entsize;
  for (size_t i = 0; i < count; ++i) {
    GElf_Sym sym;
    if (gelf_getsym(data, static_cast<int>(i), &sym) == nullptr) {
      fail(path, fmt::format("corrupt dynamic symbol {}: {}", i, libelf_error()));
    }
    const int bind = GELF_ST_BIND(sym.st_info);
    if (sym.st_shndx == SHN_UNDEF || (bind != STB_GLOBAL && bind != STB_WEAK)) continue;
    if (GELF_ST_VISIBILITY(sym.st_other) == STV_HIDDEN) continue;
    const char* name = elf_strptr(elf, shdr.sh_link, sym.st_name);
    if (name != nullptr && *name != '\0') out->emplace_back(name);
  }
}

void collect_needed(const std::filesystem::path& path, Elf* elf, Elf_Scn* scn,
                    const GElf_Shdr& shdr, std::vector<std::string>* out) {
  Elf_Data* data = elf_getdata(scn, nullptr);
  if (data == nullptr || shdr.sh_entsize == 0) return;
  const size_t count = shdr.sh_size / shdr.sh_entsize;
  for (size_t i = 0; i < count; ++i) {
    GElf_Dyn dyn;
    if (gelf_getdyn(data, static_cast<int>(i), &dyn) == nullptr) {
      fail(path, fmt::format("corrupt dynamic entry {}: {}", i, libelf_error()));
    }
    if (dyn.d_tag == DT_NULL) break;
    if (dyn.d_tag != DT_NEEDED) continue;
    const char* name = elf_strptr(elf, shdr.sh_link, dyn.d_un.d_val);
    if (name == nullptr) fail(path, fmt::format("DT_NEEDED entry {} points outside its string table", i));
    out->emplace_back(name);
  }
}

std::string section_text(Elf_Scn* scn, const GElf_Shdr& shdr) {
  if (shdr.sh_type == SHT_NOBITS) return {};
  std::string text;
  Elf_Data* data = nullptr;
  while ((data = elf_rawdata(scn, data)) != nullptr) {
    if (data->d_buf != nullptr) text.append(static_cast<const char*>(data->d_buf), data->d_size);
  }
  // The helper stores the manifest NUL-terminated (a C string).
  while (!text.empty() && text.back() == '\0') text.pop_back();
  return text;
}

}  // namespace

ElfInfo read_elf(const std::filesystem::path& path) {
  std::string why;
  UniqueFd file{open_regular_file(path, O_RDONLY, why)};
  if (file.fd < 0) fail(path, why);
  struct stat st{};
  if (::fstat(file.fd, &st) != 0) fail(path, std::strerror(errno));
  const auto file_size = static_cast<uint64_t>(st.st_size);

  // Once per process: elf_version() writes libelf's globals, and plugins
  // may load on several threads at once.
  static const bool libelf_usable = elf_version(EV_CURRENT) != EV_NONE;
  if (!libelf_usable) fail(path, "libelf is unusable: " + libelf_error());
  ElfPtr elf(elf_begin(file.fd, ELF_C_READ, nullptr));
  if (!elf) fail(path, "libelf cannot open it: " + libelf_error());
  if (elf_kind(elf.get()) != ELF_K_ELF) {
    fail(path, file_size < 4 ? "not an ELF file (too short)" : "not an ELF file");
  }
  GElf_Ehdr ehdr;
  if (gelf_getehdr(elf.get(), &ehdr) == nullptr) {
    fail(path, "truncated or corrupt ELF header: " + libelf_error());
  }
  if (ehdr.e_type != ET_DYN) {
    fail(path, fmt::format("an ELF file of type {}, not a shared library", ehdr.e_type));
  }
  check_extents(path, elf.get(), ehdr, file_size);

  ElfInfo info;
  info.machine = machine_name(ehdr.e_machine);
  const int elf_class = gelf_getclass(elf.get());
  info.elf_class = elf_class == ELFCLASS64 ? "ELF64" : elf_class == ELFCLASS32 ? "ELF32" : "ELF?";

  size_t shstrndx = 0;
  if (elf_getshdrstrndx(elf.get(), &shstrndx) != 0) {
    fail(path, "corrupt section name table: " + libelf_error());
  }
  Elf_Scn* scn = nullptr;
  while ((scn = elf_nextscn(elf.get(), scn)) != nullptr) {
    GElf_Shdr shdr;
    if (gelf_getshdr(scn, &shdr) == nullptr) fail(path, "corrupt section header: " + libelf_error());
    if (shdr.sh_type == SHT_DYNSYM) {
      collect_exported(path, elf.get(), scn, shdr, &info.exported_symbols);
    } else if (shdr.sh_type == SHT_DYNAMIC) {
      collect_needed(path, elf.get(), scn, shdr, &info.needed);
    }
    const char* name = elf_strptr(elf.get(), shstrndx, shdr.sh_name);
    if (name != nullptr && std::strcmp(name, KDISPATCH_MANIFEST_SECTION) == 0) {
      info.embedded_manifest = section_text(scn, shdr);
    }
  }
  std::sort(info.exported_symbols.begin(), info.exported_symbols.end());
  info.exported_symbols.erase(std::unique(info.exported_symbols.begin(), info.exported_symbols.end()),
                              info.exported_symbols.end());
  return info;
}

}  // namespace kdispatch
