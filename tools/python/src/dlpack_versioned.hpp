// DLManagedTensorVersioned, the struct inside a "dltensor_versioned"
// capsule (DLPack 1.0). Older dlpack.h headers (Debian 12 ships 0.6) lack it;
// then the layout the DLPack 1.0 specification gives is declared here.
#pragma once

#include <dlpack/dlpack.h>

#include <cstdint>

namespace kdispatch::python {

#if defined(DLPACK_MAJOR_VERSION) && DLPACK_MAJOR_VERSION >= 1
using ManagedTensorVersioned = DLManagedTensorVersioned;
#else
struct PackVersion {
  uint32_t major;
  uint32_t minor;
};
struct ManagedTensorVersioned {
  PackVersion version;
  void* manager_ctx;
  void (*deleter)(ManagedTensorVersioned* self);
  uint64_t flags;
  DLTensor dl_tensor;
};
#endif

// The major version of versioned capsules this consumer understands.
inline constexpr uint32_t kDlpackMajor = 1;
// flags: the producer does not allow the data to be written.
inline constexpr uint64_t kDlpackFlagReadOnly = uint64_t{1} << 0;

}  // namespace kdispatch::python
