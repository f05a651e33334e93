// libFuzzer target: op schemas and shape patterns, then the call checker
// on tensors made from the input. The input is an op-schema list (JSON),
// a NUL byte, and bytes that become the dims, dtypes and offsets of the
// call's tensors. Parsing must not fail internally (internal_error), a
// schema that parses must compile, and the three tiers of the check must
// agree: accepted or refused with KD-E030, never a crash.
#include <dlpack/dlpack.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>
#include <vector>

#include "kdispatch/error.hpp"
#include "kdispatch/manifest.hpp"
#include "schema_check.hpp"

namespace {

struct Reader {
  const uint8_t* data;
  size_t size;
  template <class T>
  T next() {
    T value{};
    const size_t n = size < sizeof value ? size : sizeof value;
    std::memcpy(&value, data, n);
    data += n;
    size -= n;
    return value;
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto* end = static_cast<const uint8_t*>(std::memchr(data, 0, size));
  const size_t text_size = end == nullptr ? size : static_cast<size_t>(end - data);
  const std::string_view text(reinterpret_cast<const char*>(data), text_size);
  const kdispatch::SchemaFileResult parsed = kdispatch::parse_op_schemas(text, "fuzz-ops.json");
  // The parser catches its own exceptions; one it caught is a bug.
  if (parsed.internal_error) __builtin_trap();
  Reader in{data + text_size, size - text_size};
  static float storage[4096];
  for (const kdispatch::OpSchema& schema : parsed.schemas) {
    // Parsing compiles every schema it accepts: this must not throw.
    const kdispatch::CompiledSchema compiled(schema);
    const size_t count = schema.tensors.size();
    std::vector<std::array<int64_t, 8>> shapes(count);
    std::vector<DLTensor> tensors(count);
    for (size_t i = 0; i < count; ++i) {
      DLTensor& t = tensors[i];
      t.ndim = static_cast<int32_t>(in.next<uint8_t>() % 9);
      for (int k = 0; k < t.ndim; ++k)
        shapes[i][static_cast<size_t>(k)] = in.next<int8_t>() % 9 == 0 ? in.next<int64_t>() : in.next<uint8_t>() % 9;
      t.shape = shapes[i].data();
      const uint8_t dtype = in.next<uint8_t>();
      t.dtype = DLDataType{static_cast<uint8_t>(dtype % 6), static_cast<uint8_t>(8u << (dtype / 6 % 4)), 1};
      t.device = DLDevice{kDLCPU, 0};
      t.data = in.next<uint8_t>() % 7 == 0 ? nullptr : storage;
      t.byte_offset = in.next<uint8_t>() % 5 == 0 ? in.next<uint64_t>() : 0;
    }
    for (int round = 0; round < 2; ++round) {  // the second round meets the remembered call
      try {
        (void)compiled.check(tensors);
      } catch (const kdispatch::CallError& e) {
        if (e.code() != kdispatch::ErrorCode::bad_arguments) __builtin_trap();
      }
    }
  }
  return 0;
}
