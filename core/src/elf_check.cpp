#include "elf_check.hpp"

#include <elf.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

#include "file_check.hpp"

namespace kdispatch {
namespace {

#if defined(__x86_64__)
constexpr uint16_t kHostMachine = EM_X86_64;
#elif defined(__aarch64__)
constexpr uint16_t kHostMachine = EM_AARCH64;
#else
constexpr uint16_t kHostMachine = EM_NONE;  // no machine check
#endif

// Far more than any real plugin has; larger counts are corrupt, and
// bounding them keeps the check itself fast on any input.
constexpr uint64_t kMaxProgramHeaders = 256;

// The relocations a shared library of this machine carries.
#if defined(__x86_64__)
constexpr uint32_t kRelative = R_X86_64_RELATIVE;
bool known_relocation(uint32_t type) {
  switch (type) {
    case R_X86_64_64:
    case R_X86_64_PC32:
    case R_X86_64_GLOB_DAT:
    case R_X86_64_JUMP_SLOT:
    case R_X86_64_RELATIVE:
    case R_X86_64_DTPMOD64:
    case R_X86_64_DTPOFF64:
    case R_X86_64_TPOFF64:
    case R_X86_64_IRELATIVE:
    case R_X86_64_TLSDESC:
    case R_X86_64_32:
    case R_X86_64_PC64:
    case R_X86_64_COPY:
      return true;
    default:
      return false;
  }
}
#elif defined(__aarch64__)
constexpr uint32_t kRelative = R_AARCH64_RELATIVE;
bool known_relocation(uint32_t type) {
  switch (type) {
    case R_AARCH64_ABS64:
    case R_AARCH64_GLOB_DAT:
    case R_AARCH64_JUMP_SLOT:
    case R_AARCH64_RELATIVE:
    case R_AARCH64_TLS_DTPMOD:
    case R_AARCH64_TLS_DTPREL:
    case R_AARCH64_TLS_TPREL:
    case R_AARCH64_TLSDESC:
    case R_AARCH64_IRELATIVE:
    case R_AARCH64_COPY:
      return true;
    default:
      return false;
  }
}
#else
constexpr uint32_t kRelative = 0xffffffff;
bool known_relocation(uint32_t) { return true; }
#endif
constexpr uint64_t kMaxSymbols = uint64_t{1} << 24;
constexpr uint64_t kMaxSpan = uint64_t{1} << 40;  // bytes of address space a library may span

class Image {
 public:
  explicit Image(std::span<const unsigned char> bytes) : bytes_(bytes) {}

  uint64_t size() const { return bytes_.size(); }
  bool contains(uint64_t offset, uint64_t length) const {
    return offset <= bytes_.size() && length <= bytes_.size() - offset;
  }
  // A copy of the T at `offset`; the caller checked contains().
  template <class T>
  T read(uint64_t offset) const {
    T value;
    std::memcpy(&value, bytes_.data() + offset, sizeof value);
    return value;
  }
  // Whether a NUL ends the string at `offset` before `limit`.
  bool terminated(uint64_t offset, uint64_t limit) const {
    if (offset >= limit || limit > bytes_.size()) return false;
    return std::memchr(bytes_.data() + offset, 0, limit - offset) != nullptr;
  }

 private:
  std::span<const unsigned char> bytes_;
};

struct Segment {
  uint64_t vaddr, memsz, offset, filesz;
  uint32_t flags;
};

// The checks, in the order the loader reads the structures. Each returns
// false after setting `why`.
class Checker {
 public:
  explicit Checker(std::span<const unsigned char> bytes) : image_(bytes) {}

  std::string run() {
    if (header() && program_headers() && dynamic_entries() && sections() && tables() && relocations() && versions())
      return {};
    return why_;
  }

 private:
  bool fail(std::string text) {
    why_ = std::move(text);
    return false;
  }

  // The file offset of the `length` bytes at address `vaddr`, when they lie
  // in the file-backed part of one PT_LOAD segment.
  std::optional<uint64_t> file_offset(uint64_t vaddr, uint64_t length) const {
    for (const Segment& s : loads_) {
      if (vaddr < s.vaddr) continue;
      const uint64_t at = vaddr - s.vaddr;
      if (at > s.filesz || length > s.filesz - at) continue;
      return s.offset + at;
    }
    return std::nullopt;
  }
  // Whether the `length` bytes at `vaddr` lie in the memory of one segment
  // (its file-backed part or its zero-filled tail), and are writable if asked.
  bool mapped(uint64_t vaddr, uint64_t length, bool writable = false) const {
    for (const Segment& s : loads_) {
      if (vaddr < s.vaddr) continue;
      const uint64_t at = vaddr - s.vaddr;
      if (at > s.memsz || length > s.memsz - at) continue;
      return !writable || (s.flags & PF_W) != 0;
    }
    return false;
  }

  bool header() {
    if (!image_.contains(0, sizeof(Elf64_Ehdr))) return fail("shorter than an ELF header");
    ehdr_ = image_.read<Elf64_Ehdr>(0);
    const unsigned char* id = ehdr_.e_ident;
    if (std::memcmp(id, ELFMAG, SELFMAG) != 0) return fail("not an ELF file (no ELF magic)");
    if (id[EI_CLASS] != ELFCLASS64) return fail(fmt::format("ELF class {} is not ELF64", id[EI_CLASS]));
    if (id[EI_DATA] != ELFDATA2LSB) return fail(fmt::format("ELF data encoding {} is not little-endian", id[EI_DATA]));
    if (id[EI_VERSION] != EV_CURRENT || ehdr_.e_version != EV_CURRENT) {
      return fail(fmt::format("ELF version {}/{} is not {}", id[EI_VERSION], ehdr_.e_version, EV_CURRENT));
    }
    if (id[EI_OSABI] != ELFOSABI_SYSV && id[EI_OSABI] != ELFOSABI_GNU) {
      return fail(fmt::format("ELF OS ABI {} is neither System V nor GNU", id[EI_OSABI]));
    }
    if (ehdr_.e_type != ET_DYN) return fail(fmt::format("ELF type {} is not a shared library", ehdr_.e_type));
    if (kHostMachine != EM_NONE && ehdr_.e_machine != kHostMachine) {
      return fail(fmt::format("built for ELF machine {}, this process is machine {}", ehdr_.e_machine, kHostMachine));
    }
    if (ehdr_.e_ehsize != sizeof(Elf64_Ehdr)) return fail(fmt::format("ELF header size {} is not 64", ehdr_.e_ehsize));
    if (ehdr_.e_phentsize != sizeof(Elf64_Phdr)) {
      return fail(fmt::format("program header size {} is not {}", ehdr_.e_phentsize, sizeof(Elf64_Phdr)));
    }
    if (ehdr_.e_phnum == 0 || ehdr_.e_phnum > kMaxProgramHeaders) {
      return fail(fmt::format("{} program headers (expected 1 to {})", ehdr_.e_phnum, kMaxProgramHeaders));
    }
    if (ehdr_.e_phoff % alignof(Elf64_Phdr) != 0 ||
        !image_.contains(ehdr_.e_phoff, uint64_t{ehdr_.e_phnum} * sizeof(Elf64_Phdr))) {
      return fail(fmt::format("the program header table at offset {} lies outside the file of {} bytes", ehdr_.e_phoff,
                              image_.size()));
    }
    return true;
  }

  bool program_headers() {
    const auto page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
    std::vector<Elf64_Phdr> others;
    for (uint64_t i = 0; i < ehdr_.e_phnum; ++i) {
      const auto p = image_.read<Elf64_Phdr>(ehdr_.e_phoff + i * sizeof(Elf64_Phdr));
      const std::string what = fmt::format("program header {} (type {:#x})", i, p.p_type);
      if (p.p_type == PT_NULL) continue;
      if (p.p_align > 1 && (p.p_align & (p.p_align - 1)) != 0) {
        return fail(fmt::format("{}: alignment {} is not a power of two", what, p.p_align));
      }
      if (p.p_filesz > p.p_memsz)
        return fail(fmt::format("{}: file size {} > memory size {}", what, p.p_filesz, p.p_memsz));
      if (p.p_memsz > kMaxSpan || p.p_vaddr > kMaxSpan) {
        return fail(fmt::format("{}: address {:#x} + {} bytes is past any library's span", what, p.p_vaddr, p.p_memsz));
      }
      const bool in_file = p.p_type == PT_LOAD || p.p_type == PT_DYNAMIC || p.p_type == PT_NOTE ||
                           p.p_type == PT_INTERP || p.p_type == PT_GNU_PROPERTY || p.p_type == PT_TLS ||
                           p.p_type == PT_GNU_EH_FRAME;
      if (in_file && !image_.contains(p.p_offset, p.p_filesz)) {
        return fail(fmt::format("{}: bytes {}..{} lie outside the file of {} bytes", what, p.p_offset,
                                p.p_offset + p.p_filesz, image_.size()));
      }
      if (p.p_type == PT_LOAD) {
        if (p.p_align < page)
          return fail(fmt::format("{}: alignment {} is below the page size {}", what, p.p_align, page));
        if ((p.p_vaddr - p.p_offset) % p.p_align != 0) {
          return fail(fmt::format("{}: address {:#x} and offset {:#x} disagree modulo the alignment {}", what,
                                  p.p_vaddr, p.p_offset, p.p_align));
        }
        // Only a writable segment has a zero-filled tail (.bss): code or
        // read-only data cut short would run or be read as zeros.
        if (p.p_memsz > p.p_filesz && (p.p_flags & PF_W) == 0) {
          return fail(fmt::format("{}: a read-only segment of {} bytes holds only {} from the file", what, p.p_memsz,
                                  p.p_filesz));
        }
        if (!loads_.empty() && p.p_vaddr < loads_.back().vaddr + loads_.back().memsz) {
          return fail(fmt::format("{}: address {:#x} overlaps or precedes the previous segment", what, p.p_vaddr));
        }
        loads_.push_back({p.p_vaddr, p.p_memsz, p.p_offset, p.p_filesz, p.p_flags});
      } else if (p.p_type == PT_DYNAMIC) {
        if (dynamic_) return fail(what + ": a second dynamic segment");
        dynamic_ = p;
      } else {
        others.push_back(p);
      }
    }
    if (loads_.empty()) return fail("no loadable segment");
    if (!dynamic_) return fail("no dynamic segment");
    for (const Elf64_Phdr& p : others) {
      // Segments inside the image must lie in its memory; notes and
      // properties are also parsed from the file.
      const bool must_map = p.p_type == PT_NOTE || p.p_type == PT_GNU_PROPERTY || p.p_type == PT_GNU_RELRO ||
                            p.p_type == PT_TLS || p.p_type == PT_GNU_EH_FRAME;
      if (must_map && p.p_memsz != 0 && !mapped(p.p_vaddr, p.p_memsz)) {
        return fail(fmt::format("segment of type {:#x} at {:#x} ({} bytes) lies outside the loadable segments",
                                p.p_type, p.p_vaddr, p.p_memsz));
      }
      if ((p.p_type == PT_NOTE || p.p_type == PT_GNU_PROPERTY) && !notes(p)) return false;
    }
    const Elf64_Phdr& d = *dynamic_;
    if (d.p_filesz < sizeof(Elf64_Dyn) || d.p_offset % alignof(Elf64_Dyn) != 0) {
      return fail(fmt::format("the dynamic segment ({} bytes at offset {}) holds no entry", d.p_filesz, d.p_offset));
    }
    const std::optional<uint64_t> at = file_offset(d.p_vaddr, d.p_filesz);
    if (!at || *at != d.p_offset) {
      return fail(fmt::format("the dynamic segment at {:#x} is not where a loadable segment maps offset {:#x}",
                              d.p_vaddr, d.p_offset));
    }
    if (!mapped(d.p_vaddr, d.p_memsz, /*writable=*/false)) return fail("the dynamic segment lies outside memory");
    return true;
  }

  // Note entries: 4-byte name and descriptor sizes, padded to the segment's
  // alignment (4 or 8); each must end inside the segment.
  bool notes(const Elf64_Phdr& p) {
    const uint64_t align = p.p_align == 8 ? 8 : 4;
    uint64_t at = 0;
    while (at + sizeof(Elf64_Nhdr) <= p.p_filesz) {
      const auto n = image_.read<Elf64_Nhdr>(p.p_offset + at);
      const auto up = [&](uint64_t x) { return (x + align - 1) / align * align; };
      const uint64_t next = at + up(up(sizeof(Elf64_Nhdr) + n.n_namesz) + n.n_descsz);
      if (next > p.p_filesz) {
        return fail(fmt::format("a note at offset {} runs past its segment of {} bytes", p.p_offset + at, p.p_filesz));
      }
      at = next;
    }
    return true;
  }

  bool dynamic_entries() {
    const Elf64_Phdr& d = *dynamic_;
    const uint64_t count = d.p_filesz / sizeof(Elf64_Dyn);
    bool ended = false;
    for (uint64_t i = 0; i < count && !ended; ++i) {
      const auto e = image_.read<Elf64_Dyn>(d.p_offset + i * sizeof(Elf64_Dyn));
      const uint64_t v = e.d_un.d_val;
      switch (e.d_tag) {
        case DT_NULL:
          ended = true;
          break;
        case DT_NEEDED:
          strings_.push_back({"DT_NEEDED", v});
          break;
        case DT_SONAME:
          strings_.push_back({"DT_SONAME", v});
          break;
        case DT_RPATH:
          strings_.push_back({"DT_RPATH", v});
          break;
        case DT_RUNPATH:
          strings_.push_back({"DT_RUNPATH", v});
          break;
        case DT_STRTAB:
          strtab_ = v;
          break;
        case DT_STRSZ:
          strsz_ = v;
          break;
        case DT_SYMTAB:
          symtab_ = v;
          break;
        case DT_SYMENT:
          syment_ = v;
          break;
        case DT_HASH:
          hash_ = v;
          break;
        case DT_GNU_HASH:
          gnu_hash_ = v;
          break;
        case DT_RELA:
          rela_ = v;
          break;
        case DT_RELASZ:
          relasz_ = v;
          break;
        case DT_RELAENT:
          relaent_ = v;
          break;
        case DT_REL:
          return fail("DT_REL relocations on a 64-bit library (RELA expected)");
        case DT_JMPREL:
          jmprel_ = v;
          break;
        case DT_PLTRELSZ:
          pltrelsz_ = v;
          break;
        case DT_PLTREL:
          pltrel_ = v;
          break;
        case DT_RELR:
          relr_ = v;
          break;
        case DT_RELRSZ:
          relrsz_ = v;
          break;
        case DT_RELRENT:
          relrent_ = v;
          break;
        case DT_INIT:
          code_.push_back({"DT_INIT", v});
          break;
        case DT_FINI:
          code_.push_back({"DT_FINI", v});
          break;
        case DT_INIT_ARRAY:
          init_array_ = v;
          break;
        case DT_INIT_ARRAYSZ:
          init_arraysz_ = v;
          break;
        case DT_FINI_ARRAY:
          fini_array_ = v;
          break;
        case DT_FINI_ARRAYSZ:
          fini_arraysz_ = v;
          break;
        case DT_PREINIT_ARRAY:
          return fail("DT_PREINIT_ARRAY in a shared library");
        case DT_VERSYM:
          versym_ = v;
          break;
        case DT_VERNEED:
          verneed_ = v;
          break;
        case DT_VERNEEDNUM:
          verneednum_ = v;
          break;
        case DT_VERDEF:
          verdef_ = v;
          break;
        case DT_VERDEFNUM:
          verdefnum_ = v;
          break;
        case DT_TEXTREL:
          return fail("DT_TEXTREL: relocations in read-only code are not loaded");
        case DT_PLTGOT:
        case DT_SYMBOLIC:
        case DT_DEBUG:
        case DT_BIND_NOW:
        case DT_FLAGS:
        case DT_FLAGS_1:
        case DT_RELACOUNT:
        case DT_RELCOUNT:
        case DT_GNU_PRELINKED:
        case DT_GNU_CONFLICTSZ:
        case DT_GNU_LIBLISTSZ:
        case DT_CHECKSUM:
        case DT_PLTPADSZ:
        case DT_MOVEENT:
        case DT_MOVESZ:
        case DT_POSFLAG_1:
        case DT_SYMINSZ:
        case DT_SYMINENT:
        case DT_GNU_CONFLICT:
        case DT_GNU_LIBLIST:
        case DT_CONFIG:
        case DT_DEPAUDIT:
        case DT_AUDIT:
        case DT_PLTPAD:
        case DT_MOVETAB:
        case DT_SYMINFO:
        case DT_AUXILIARY:
        case DT_FILTER:
        case DT_PREINIT_ARRAYSZ:
        case DT_TLSDESC_PLT:
        case DT_TLSDESC_GOT:
          break;
        default:
          // A tag the loader does not know is a corrupted one (a size or
          // address then goes missing); processor-specific tags pass.
          if (e.d_tag >= DT_LOPROC && e.d_tag <= DT_HIPROC) break;
          return fail(fmt::format("dynamic entry {} has the unknown tag {:#x}", i, static_cast<uint64_t>(e.d_tag)));
      }
    }
    if (!ended) return fail("the dynamic section has no DT_NULL entry");
    // A table without its size (or a size without its table) is half of a
    // pair whose other half was corrupted.
    for (const auto& [what, table, size] :
         {std::tuple{"DT_JMPREL/DT_PLTRELSZ", jmprel_.has_value(), pltrelsz_ != 0},
          std::tuple{"DT_RELA/DT_RELASZ", rela_.has_value(), relasz_ != 0},
          std::tuple{"DT_INIT_ARRAY/DT_INIT_ARRAYSZ", init_array_.has_value(), init_arraysz_ != 0},
          std::tuple{"DT_FINI_ARRAY/DT_FINI_ARRAYSZ", fini_array_.has_value(), fini_arraysz_ != 0},
          std::tuple{"DT_RELR/DT_RELRSZ", relr_.has_value(), relrsz_ != 0},
          std::tuple{"DT_STRTAB/DT_STRSZ", strtab_.has_value(), strsz_ != 0},
          std::tuple{"DT_VERNEED/DT_VERNEEDNUM", verneed_.has_value(), verneednum_.has_value()},
          std::tuple{"DT_VERDEF/DT_VERDEFNUM", verdef_.has_value(), verdefnum_.has_value()},
          std::tuple{"DT_VERSYM/DT_VERNEED or DT_VERDEF", versym_.has_value(),
                     verneed_.has_value() || verdef_.has_value()}}) {
      if (table != size) return fail(fmt::format("{}: one is missing", what));
    }
    return true;
  }

  // When the file has section headers (every linker writes them), the
  // tables and arrays the dynamic section points at must be where their
  // sections are (DT_INIT and DT_FINI may name any function, so they are
  // only required to be code):
  // a pointer changed in one place and not the other is corruption the
  // loader cannot see, and following it runs or reads the wrong bytes.
  bool sections() {
    if (ehdr_.e_shnum == 0 || ehdr_.e_shoff == 0) return true;
    if (ehdr_.e_shentsize != sizeof(Elf64_Shdr) ||
        !image_.contains(ehdr_.e_shoff, uint64_t{ehdr_.e_shnum} * sizeof(Elf64_Shdr)) ||
        ehdr_.e_shstrndx >= ehdr_.e_shnum) {
      return fail(fmt::format("the section header table ({} entries at offset {}) lies outside the file", ehdr_.e_shnum,
                              ehdr_.e_shoff));
    }
    const auto section = [&](uint64_t i) { return image_.read<Elf64_Shdr>(ehdr_.e_shoff + i * sizeof(Elf64_Shdr)); };
    const Elf64_Shdr names = section(ehdr_.e_shstrndx);
    if (!image_.contains(names.sh_offset, names.sh_size)) return fail("the section name table lies outside the file");
    const auto agrees = [&](const char* what, std::optional<uint64_t> value, uint64_t address) {
      if (value && *value != address) {
        return fail(fmt::format("{} is {:#x}, but its section starts at {:#x}", what, *value, address));
      }
      return true;
    };
    for (uint64_t i = 0; i < ehdr_.e_shnum; ++i) {
      const Elf64_Shdr sh = section(i);
      bool ok = true;
      switch (sh.sh_type) {
        case SHT_DYNSYM:
          ok = agrees("DT_SYMTAB", symtab_, sh.sh_addr);
          break;
        case SHT_GNU_HASH:
          ok = agrees("DT_GNU_HASH", gnu_hash_, sh.sh_addr);
          break;
        case SHT_HASH:
          ok = agrees("DT_HASH", hash_, sh.sh_addr);
          break;
        case SHT_GNU_versym:
          ok = agrees("DT_VERSYM", versym_, sh.sh_addr);
          break;
        case SHT_GNU_verneed:
          ok = agrees("DT_VERNEED", verneed_, sh.sh_addr);
          break;
        case SHT_GNU_verdef:
          ok = agrees("DT_VERDEF", verdef_, sh.sh_addr);
          break;
        case SHT_DYNAMIC:
          ok = agrees("the dynamic segment", dynamic_->p_vaddr, sh.sh_addr);
          break;
        case SHT_INIT_ARRAY:
          ok = agrees("DT_INIT_ARRAY", init_array_, sh.sh_addr) &&
               (!init_array_ || sh.sh_size == init_arraysz_ || fail("DT_INIT_ARRAYSZ differs from its section"));
          break;
        case SHT_FINI_ARRAY:
          ok = agrees("DT_FINI_ARRAY", fini_array_, sh.sh_addr) &&
               (!fini_array_ || sh.sh_size == fini_arraysz_ || fail("DT_FINI_ARRAYSZ differs from its section"));
          break;
        default:
          break;
      }
      if (!ok) return false;
    }
    return true;
  }

  // An array of `size` bytes at address `vaddr` named `what`, in the file.
  bool in_file(const char* what, std::optional<uint64_t> vaddr, uint64_t size, uint64_t* offset = nullptr) {
    if (!vaddr) return true;
    const std::optional<uint64_t> at = file_offset(*vaddr, size);
    if (!at)
      return fail(fmt::format("{} at {:#x} ({} bytes) lies outside the file-backed segments", what, *vaddr, size));
    if (offset != nullptr) *offset = *at;
    return true;
  }

  bool tables() {
    if (!strtab_ || !symtab_) return fail("the dynamic section lacks DT_STRTAB or DT_SYMTAB");
    if (syment_ && *syment_ != sizeof(Elf64_Sym)) return fail(fmt::format("DT_SYMENT {} is not 24", *syment_));
    if (!in_file("the string table (DT_STRTAB)", strtab_, strsz_, &strtab_offset_)) return false;
    for (const auto& [what, offset] : strings_) {
      if (!image_.terminated(strtab_offset_ + offset, strtab_offset_ + strsz_)) {
        return fail(fmt::format("{} string at {} is not a string inside DT_STRSZ {}", what, offset, strsz_));
      }
    }
    for (const auto& [what, vaddr] : code_) {
      bool executable = false;
      for (const Segment& s : loads_)
        executable = executable || ((s.flags & PF_X) != 0 && vaddr >= s.vaddr && vaddr - s.vaddr < s.memsz);
      if (!executable) return fail(fmt::format("{} {:#x} is not in an executable segment", what, vaddr));
    }
    for (const auto& [what, vaddr, size] : {std::tuple{"DT_INIT_ARRAY", init_array_, init_arraysz_},
                                            std::tuple{"DT_FINI_ARRAY", fini_array_, fini_arraysz_}}) {
      if (vaddr && (size % 8 != 0 || !mapped(*vaddr, size))) {
        return fail(fmt::format("{} at {:#x} ({} bytes) lies outside the loadable segments", what, *vaddr, size));
      }
    }
    if (!symbol_count()) return false;
    if (!in_file("the symbol table (DT_SYMTAB)", symtab_, symbols_ * sizeof(Elf64_Sym), &symtab_offset_)) return false;
    for (uint64_t i = 0; i < symbols_; ++i) {
      const auto sym = image_.read<Elf64_Sym>(symtab_offset_ + i * sizeof(Elf64_Sym));
      if (sym.st_name != 0 && !image_.terminated(strtab_offset_ + sym.st_name, strtab_offset_ + strsz_)) {
        return fail(fmt::format("dynamic symbol {} names string {} outside DT_STRSZ {}", i, sym.st_name, strsz_));
      }
      const int type = ELF64_ST_TYPE(sym.st_info);
      const int bind = ELF64_ST_BIND(sym.st_info);
      if (type > STT_TLS && type != STT_GNU_IFUNC) {
        return fail(fmt::format("dynamic symbol {} has the unknown type {}", i, type));
      }
      if (bind > STB_WEAK && bind != STB_GNU_UNIQUE) {
        return fail(fmt::format("dynamic symbol {} has the unknown binding {}", i, bind));
      }
      // A defined function or object is in the image (a function, and an
      // indirect function's resolver, in code): the loader hands its address
      // to whoever binds to it, and calls a resolver itself.
      if (type == STT_GNU_IFUNC && sym.st_shndx != SHN_UNDEF) {
        bool code = false;
        for (const Segment& seg : loads_) {
          code = code || ((seg.flags & PF_X) != 0 && sym.st_value >= seg.vaddr && sym.st_value - seg.vaddr < seg.memsz);
        }
        if (!code)
          return fail(fmt::format("dynamic symbol {} resolves through {:#x}, outside the code", i, sym.st_value));
      }
      if (sym.st_shndx != SHN_UNDEF && sym.st_shndx != SHN_ABS && (type == STT_FUNC || type == STT_OBJECT)) {
        bool inside = false;
        for (const Segment& seg : loads_) {
          inside =
              inside || (sym.st_value >= seg.vaddr && sym.st_value - seg.vaddr < std::max<uint64_t>(seg.memsz, 1) &&
                         (type != STT_FUNC || (seg.flags & PF_X) != 0));
        }
        if (!inside) {
          return fail(fmt::format("dynamic symbol {} ({}) at {:#x} lies outside the {}", i,
                                  type == STT_FUNC ? "a function" : "an object", sym.st_value,
                                  type == STT_FUNC ? "code segments" : "loadable segments"));
        }
      }
    }
    return true;
  }

  // The number of dynamic symbols, from DT_HASH (nchain) or DT_GNU_HASH
  // (the end of the longest chain); the loader walks both tables.
  bool symbol_count() {
    if (hash_) {
      uint64_t at = 0;
      if (!in_file("DT_HASH", hash_, 8, &at)) return false;
      const auto nbucket = image_.read<uint32_t>(at);
      const auto nchain = image_.read<uint32_t>(at + 4);
      if (!in_file("DT_HASH", hash_, 8 + 4 * (uint64_t{nbucket} + nchain))) return false;
      for (uint64_t i = 0; i < uint64_t{nbucket} + nchain; ++i) {
        if (image_.read<uint32_t>(at + 8 + 4 * i) >= nchain) return fail("DT_HASH has an index past its chains");
      }
      symbols_ = nchain;
    }
    if (gnu_hash_) {
      uint64_t at = 0;
      if (!in_file("DT_GNU_HASH", gnu_hash_, 16, &at)) return false;
      const auto nbuckets = image_.read<uint32_t>(at);
      const auto symoffset = image_.read<uint32_t>(at + 4);
      const auto bloom_size = image_.read<uint32_t>(at + 8);
      const auto bloom_shift = image_.read<uint32_t>(at + 12);
      if (nbuckets == 0 || bloom_size == 0 || (bloom_size & (bloom_size - 1)) != 0 || bloom_shift >= 64) {
        return fail(fmt::format("DT_GNU_HASH header is corrupt ({} buckets, bloom {} words, shift {})", nbuckets,
                                bloom_size, bloom_shift));
      }
      const uint64_t buckets = at + 16 + 8 * uint64_t{bloom_size};
      if (!in_file("DT_GNU_HASH", gnu_hash_, 16 + 8 * uint64_t{bloom_size} + 4 * uint64_t{nbuckets})) return false;
      uint64_t last = 0;
      for (uint64_t i = 0; i < nbuckets; ++i) {
        const auto b = image_.read<uint32_t>(buckets + 4 * i);
        if (b != 0 && b < symoffset) return fail("DT_GNU_HASH has a bucket below its first hashed symbol");
        last = std::max<uint64_t>(last, b);
      }
      uint64_t count = symoffset;
      if (last >= symoffset) {
        // Walk the last chain to its end (the entry with the low bit set).
        const uint64_t chains = buckets + 4 * uint64_t{nbuckets};
        uint64_t i = last;
        for (;; ++i) {
          if (i - symoffset > kMaxSymbols) return fail("DT_GNU_HASH has a chain without end");
          const uint64_t entry = chains + 4 * (i - symoffset);
          if (!image_.contains(entry, 4)) return fail("DT_GNU_HASH chains run past the end of the file");
          if ((image_.read<uint32_t>(entry) & 1) != 0) break;
        }
        count = i + 1;
      }
      if (hash_ && count > symbols_) return fail("DT_GNU_HASH and DT_HASH disagree on the number of symbols");
      if (!hash_) symbols_ = count;
    }
    if (!hash_ && !gnu_hash_) return fail("the dynamic section has neither DT_HASH nor DT_GNU_HASH");
    if (symbols_ > kMaxSymbols) return fail(fmt::format("{} dynamic symbols", symbols_));
    return true;
  }

  bool symbol_ok(uint64_t index) const {
    if (index > kMaxSymbols) return false;
    const std::optional<uint64_t> at = file_offset(*symtab_ + index * sizeof(Elf64_Sym), sizeof(Elf64_Sym));
    if (!at) return false;
    const auto s = image_.read<Elf64_Sym>(*at);
    return s.st_name == 0 || image_.terminated(strtab_offset_ + s.st_name, strtab_offset_ + strsz_);
  }

  bool rela_table(const char* what, std::optional<uint64_t> vaddr, uint64_t size) {
    if (!vaddr) return true;
    if (size % sizeof(Elf64_Rela) != 0) return fail(fmt::format("{} size {} is not a multiple of 24", what, size));
    uint64_t at = 0;
    if (!in_file(what, vaddr, size, &at)) return false;
    for (uint64_t i = 0; i < size / sizeof(Elf64_Rela); ++i) {
      const auto r = image_.read<Elf64_Rela>(at + i * sizeof(Elf64_Rela));
      const uint32_t type = ELF64_R_TYPE(r.r_info);
      if (type == 0) continue;  // R_*_NONE
      if (!known_relocation(type)) return fail(fmt::format("{} entry {} has the unknown type {}", what, i, type));
      // A relative relocation stores base + addend: a pointer into the image.
      if (type == kRelative && !mapped(static_cast<uint64_t>(r.r_addend), 0)) {
        return fail(fmt::format("{} entry {} points {:#x}, outside the loadable segments", what, i,
                                static_cast<uint64_t>(r.r_addend)));
      }
      // Imports are not in the hash tables, so a symbol past their count is
      // checked where it lies.
      const uint64_t sym = ELF64_R_SYM(r.r_info);
      if (sym >= symbols_ && !symbol_ok(sym)) {
        return fail(
            fmt::format("{} entry {} names symbol {}, which lies outside the file or names no string", what, i, sym));
      }
      if (!mapped(r.r_offset, 8, /*writable=*/true)) {
        return fail(fmt::format("{} entry {} writes {:#x}, outside the writable segments", what, i, r.r_offset));
      }
    }
    return true;
  }

  bool relocations() {
    if (relaent_ && *relaent_ != sizeof(Elf64_Rela)) return fail(fmt::format("DT_RELAENT {} is not 24", *relaent_));
    if (jmprel_ && pltrel_ != DT_RELA) return fail("DT_JMPREL without DT_PLTREL = DT_RELA");
    if (!rela_table("DT_RELA", rela_, relasz_) || !rela_table("DT_JMPREL", jmprel_, pltrelsz_)) return false;
    if (relr_) {
      if (relrent_ && *relrent_ != 8) return fail(fmt::format("DT_RELRENT {} is not 8", *relrent_));
      uint64_t at = 0;
      if (relrsz_ % 8 != 0 || !in_file("DT_RELR", relr_, relrsz_, &at)) {
        return why_.empty() ? fail("DT_RELRSZ is not a multiple of 8") : false;
      }
      // Addresses and bitmaps: every word an address makes or a bitmap
      // covers must be writable.
      uint64_t base = 0;
      for (uint64_t i = 0; i < relrsz_ / 8; ++i) {
        const auto word = image_.read<uint64_t>(at + 8 * i);
        if ((word & 1) == 0) {
          if (!mapped(word, 8, true)) return fail(fmt::format("DT_RELR entry {} writes {:#x} outside memory", i, word));
          base = word + 8;
        } else {
          for (uint64_t bit = 1; bit < 64; ++bit) {
            if (((word >> bit) & 1) != 0 && !mapped(base + 8 * (bit - 1), 8, true)) {
              return fail(fmt::format("DT_RELR bitmap {} writes outside memory", i));
            }
          }
          base += 63 * 8;
        }
      }
    }
    return true;
  }

  bool versions() {
    if (verneed_ && !version_records(true, *verneed_, verneednum_.value_or(0))) return false;
    if (verdef_ && !version_records(false, *verdef_, verdefnum_.value_or(0))) return false;
    uint64_t at = 0;
    if (versym_ && !in_file("DT_VERSYM", versym_, 2 * symbols_, &at)) return false;
    // Each symbol's version index is local (0), global (1) or one that a
    // record defines; the loader indexes its version table with it.
    for (uint64_t i = 0; versym_ && i < symbols_; ++i) {
      const auto index = static_cast<uint16_t>(image_.read<uint16_t>(at + 2 * i) & 0x7fff);
      if (index > 1 && std::find(version_indices_.begin(), version_indices_.end(), index) == version_indices_.end()) {
        return fail(fmt::format("DT_VERSYM gives symbol {} version {}, which no version record defines", i, index));
      }
    }
    return true;
  }

  // DT_VERNEED / DT_VERDEF: `count` records linked by byte offsets, each
  // with auxiliary entries linked the same way; names in the string table.
  bool version_records(bool need, uint64_t vaddr, uint64_t count) {
    const char* what = need ? "DT_VERNEED" : "DT_VERDEF";
    if (count > 4096) return fail(fmt::format("{} has {} records", what, count));
    uint64_t at = 0;
    if (!in_file(what, vaddr, need ? sizeof(Elf64_Verneed) : sizeof(Elf64_Verdef), &at)) return false;
    for (uint64_t i = 0; i < count; ++i) {
      if (!image_.contains(at, need ? sizeof(Elf64_Verneed) : sizeof(Elf64_Verdef))) {
        return fail(fmt::format("{} record {} lies outside the file", what, i));
      }
      uint64_t aux_count = 0, aux = 0, next = 0;
      if (need) {
        const auto v = image_.read<Elf64_Verneed>(at);
        if (!image_.terminated(strtab_offset_ + v.vn_file, strtab_offset_ + strsz_)) {
          return fail(fmt::format("{} record {} names a file outside the string table", what, i));
        }
        aux_count = v.vn_cnt, aux = v.vn_aux, next = v.vn_next;
      } else {
        const auto v = image_.read<Elf64_Verdef>(at);
        aux_count = v.vd_cnt, aux = v.vd_aux, next = v.vd_next;
        version_indices_.push_back(v.vd_ndx & 0x7fff);
      }
      uint64_t a = at + aux;
      for (uint64_t k = 0; k < aux_count; ++k) {
        const uint64_t size = need ? sizeof(Elf64_Vernaux) : sizeof(Elf64_Verdaux);
        if (a < at || !image_.contains(a, size))
          return fail(fmt::format("{} record {} entry {} lies outside the file", what, i, k));
        uint64_t name = 0, link = 0;
        if (need) {
          const auto x = image_.read<Elf64_Vernaux>(a);
          name = x.vna_name, link = x.vna_next;
          version_indices_.push_back(x.vna_other & 0x7fff);
        } else {
          const auto x = image_.read<Elf64_Verdaux>(a);
          name = x.vda_name, link = x.vda_next;
        }
        if (!image_.terminated(strtab_offset_ + name, strtab_offset_ + strsz_)) {
          return fail(fmt::format("{} record {} entry {} names a string outside the string table", what, i, k));
        }
        if (link == 0) break;
        a += link;
      }
      if (next == 0) break;
      at += next;
    }
    return true;
  }

  Image image_;
  std::string why_;
  Elf64_Ehdr ehdr_{};
  std::vector<Segment> loads_;
  std::optional<Elf64_Phdr> dynamic_;
  std::vector<std::pair<const char*, uint64_t>> strings_, code_;
  std::optional<uint64_t> strtab_, symtab_, syment_, hash_, gnu_hash_, rela_, relaent_, jmprel_, pltrel_, relr_,
      relrent_, init_array_, fini_array_, versym_, verneed_, verneednum_, verdef_, verdefnum_;
  uint64_t strsz_ = 0, relasz_ = 0, pltrelsz_ = 0, relrsz_ = 0, init_arraysz_ = 0, fini_arraysz_ = 0;
  uint64_t strtab_offset_ = 0, symtab_offset_ = 0, symbols_ = 0;
  std::vector<uint64_t> version_indices_;
};

}  // namespace

std::string elf_load_problem(std::span<const unsigned char> image) { return Checker(image).run(); }

std::string elf_file_load_problem(const std::filesystem::path& path) {
  std::string why;
  const int fd = open_regular_file(path, O_RDONLY, why);
  if (fd < 0) return why;
  struct stat st {};
  if (::fstat(fd, &st) != 0 || st.st_size <= 0) {
    ::close(fd);
    return "empty or unreadable";
  }
  const auto size = static_cast<size_t>(st.st_size);
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int error = errno;
  ::close(fd);
  if (map == MAP_FAILED) return fmt::format("cannot map it: {}", std::strerror(error));
  std::string problem = elf_load_problem({static_cast<const unsigned char*>(map), size});
  ::munmap(map, size);
  return problem;
}

}  // namespace kdispatch
