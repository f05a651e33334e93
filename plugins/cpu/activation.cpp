// activation.silu_and_mul, activation.gelu_and_mul and
// activation.gelu_tanh_and_mul: out[..., j] = act(x[..., j]) * x[..., D + j],
// computed in float and rounded to T once (SGLang semantics), a block of
// widened elements at a time (see convert.hpp). out and x have the schema's
// "rows" layout: each row is contiguous, the rows may lie at any stride.
//
// A 16-bit gate has only 65536 values. Their activations are computed once,
// by the same float code, into a table (256 KiB per op and type, built on the
// first call in about 0.3 ms), and a 16-bit row is then a lookup and a
// multiply: the results are bit for bit those of evaluating the activation
// per element, at a fraction of the arithmetic, which on large inputs was
// what the rows waited on.

#include <cstdint>
#include <memory>
#include <type_traits>

#include <kdispatch/plugin_helpers.hpp>
#include <kdispatch/plugin_rows.hpp>

#include "convert.hpp"
#include "fast_math.hpp"
#include "kd_plugin_kernels.hpp"
#include "multiversion.hpp"
#include "prefetch.hpp"
#include "tensor_access.hpp"

namespace kdispatch::cpu {
namespace {

// silu(a) = a / (1 + exp(-a))
struct Silu {
  static constexpr const char* kOp = "activation.silu_and_mul";
  template <Precision P>
  [[gnu::always_inline]] static float apply(float a) {
    return times_sigmoid<P>(a, a);
  }
};

// gelu(a) = 0.5 a (1 + erf(a / sqrt(2))) = a * Phi(a)
struct GeluErf {
  static constexpr const char* kOp = "activation.gelu_and_mul";
  template <Precision P>
  [[gnu::always_inline]] static float apply(float a) {
    return gelu_erf<P>(a);
  }
};

// gelu_tanh(a) = 0.5 a (1 + tanh(y)), y = sqrt(2/pi) (a + 0.044715 a^3).
// 0.5 (1 + tanh(y)) is exactly 1 / (1 + exp(-2y)), the sigmoid of 2y; that
// form needs one exp and loses nothing where tanh(y) is close to -1.
struct GeluTanh {
  static constexpr const char* kOp = "activation.gelu_tanh_and_mul";
  template <Precision P>
  [[gnu::always_inline]] static float apply(float a) {
    constexpr float kTwoSqrt2OverPi = 1.5957691216057308f;  // 2 sqrt(2/pi)
    const float two_y = kTwoSqrt2OverPi * (a + 0.044715f * a * a * a);
    return times_sigmoid<P>(a, two_y);
  }
};

// Elements per block: the widened up values and the float results of one
// block stay in L1. 16-bit up values go through the block conversions, which
// use F16C or AVX2 where the host has it (GCC does not vectorise _Float16
// conversions); 16-bit gates are only looked up. Results are narrowed a block
// at a time, so that large outputs can be written with streaming stores.
constexpr int64_t kBlock = 512;

// A block is computed in pieces of kPiece elements, each first asking for
// the cache lines of the same piece kPrefetchAhead bytes further on in both
// inputs. Asking for a whole block at once (64 lines for float32) filled the
// core's miss queue, so that the loads behind them waited: with the requests
// spread out, silu_and_mul float32 went from 1.1-1.3 to 1.1 of memcpy and
// gelu_and_mul float32 from 1.4-1.7 to 1.3-1.5.
constexpr int64_t kPiece = 64;
constexpr int64_t kPrefetchAhead = 4096;
template <class T>
inline constexpr int64_t kPieceBytes = kPiece * static_cast<int64_t>(sizeof(T));

// Where a 16-bit gate's activation comes from: the table of all 65536.
template <class T>
inline constexpr bool kTabulated = !std::is_same_v<T, float>;
constexpr int64_t kTableSize = int64_t{1} << 16;

template <class Act, class T>
KD_CPU_MULTIVERSION void fill_table(float* table) {
  alignas(64) T bits[kBlock];
  alignas(64) float block[kBlock];
  for (int64_t i0 = 0; i0 < kTableSize; i0 += kBlock) {
    for (int64_t j = 0; j < kBlock; ++j) bits[j].bits = static_cast<uint16_t>(i0 + j);
    const float* g = as_float(bits, block, kBlock);
    for (int64_t j = 0; j < kBlock; ++j) table[i0 + j] = Act::template apply<kPrecisionFor<T>>(g[j]);
  }
}

// Built on first use; a static local, so concurrent first calls build it once.
// Throws std::bad_alloc (reported by the caller's guard) and is then tried
// again on the next call. Never freed: kernels may still run on other
// threads while the process exits and runs its static destructors.
template <class Act, class T>
const float* activation_table() {
  static const float* const table = [] {
    auto t = std::make_unique_for_overwrite<float[]>(kTableSize);
    fill_table<Act, T>(t.get());
    return t.release();
  }();
  return table;
}

// Rows [begin, end) of out and x, each row where its RowLayout puts it (one
// multiply per row for a dense tensor or a slice of a matrix's columns).
template <class Act, class T>
KD_CPU_MULTIVERSION void gated_rows(T* out, const kd_plugin::RowLayout& out_rows, const T* x,
                                   const kd_plugin::RowLayout& x_rows, int64_t d,
                                   const float* table, Store store, int64_t begin, int64_t end) {
  // Cache-line aligned: no 256-bit store of the widening splits a line.
  alignas(64) float up_block[kBlock];
  alignas(64) float result[kBlock];
  for (int64_t r = begin; r < end; ++r) {
    const T* gate = x + x_rows.offset(r);
    const T* up = gate + d;
    T* o = out + out_rows.offset(r);
    for (int64_t j0 = 0; j0 < d; j0 += kBlock) {
      const int64_t n = d - j0 < kBlock ? d - j0 : kBlock;
      const T* g = gate + j0;
      const T* u = up + j0;
      const float* uf = as_float(u, up_block, n);
      for (int64_t s = 0; s < n; s += kPiece) {
        const int64_t m = n - s < kPiece ? n - s : kPiece;
        // The same piece kPrefetchAhead bytes on, in both inputs: spread
        // over the block, the requests never queue up behind each other.
        prefetch_range(g + s, kPrefetchAhead, kPieceBytes<T>);
        prefetch_range(u + s, kPrefetchAhead, kPieceBytes<T>);
        if constexpr (!kTabulated<T>) {
          for (int64_t j = s; j < s + m; ++j) {
            result[j] = Act::template apply<kPrecisionFor<T>>(g[j]) * uf[j];
          }
        } else {
          for (int64_t j = s; j < s + m; ++j) result[j] = table[g[j].bits] * uf[j];
        }
      }
      narrow(result, o + j0, n, store);
    }
  }
  if (store == Store::kStreaming) store_fence();
}

template <class Act>
kd_status gated_activation(const kd_call_args* args) noexcept {
  return kd_plugin::guarded(args, [&]() -> kd_status {
    constexpr int kMinNdim[] = {1, 1};
    if (kd_status s = check_arguments(args, Act::kOp, 0, kMinNdim); s != KD_STATUS_OK) return s;
    const DLTensor& out = args->tensors[0];
    const DLTensor& x = args->tensors[1];
    const int64_t rows = leading_rows(x, 1);
    const int64_t d = dim(out, -1);
    if (dim(x, -1) != 2 * d || leading_rows(out, 1) != rows) {
      return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT,
                             "%s: out must be [*, D] and x [*, 2*D]", Act::kOp);
    }
    if (!same_dtype(out, x)) {
      return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT, "%s: tensor dtypes differ",
                             Act::kOp);
    }
    return dispatch_float_dtype(args, Act::kOp, x, [&](auto tag) {
      using T = typename decltype(tag)::type;
      T* o = data_as<T>(out);
      const T* xd = data_as<T>(x);
      const kd_plugin::RowLayout out_rows = kd_plugin::row_layout(out, 1);
      const kd_plugin::RowLayout x_rows = kd_plugin::row_layout(x, 1);
      const Store store = store_for(rows * d * static_cast<int64_t>(sizeof(T)));
      const float* table = nullptr;
      if constexpr (kTabulated<T>) table = activation_table<Act, T>();
      kd_plugin::parallel_for(rows, 3 * d, [&](int64_t begin, int64_t end) noexcept {
        gated_rows<Act, T>(o, out_rows, xd, x_rows, d, table, store, begin, end);
      });
      return KD_STATUS_OK;
    });
  });
}

}  // namespace

// kd_cpu_silu_and_mul
kd_status silu_and_mul(const kd_call_args* args) noexcept {
  return gated_activation<Silu>(args);
}

// kd_cpu_gelu_and_mul
kd_status gelu_and_mul(const kd_call_args* args) noexcept {
  return gated_activation<GeluErf>(args);
}

// kd_cpu_gelu_tanh_and_mul
kd_status gelu_tanh_and_mul(const kd_call_args* args) noexcept {
  return gated_activation<GeluTanh>(args);
}

}  // namespace kdispatch::cpu
