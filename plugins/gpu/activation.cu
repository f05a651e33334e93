// activation.{silu,gelu,gelu_tanh}_and_mul: out = act(x[..., :D]) * x[..., D:],
// computed in float32 and rounded once.
//
// Elementwise and memory bound: each thread moves one 16-byte vector of each
// half and of the output (8 bytes at decode sizes, one element for one or
// two rows), blocks of 128 threads (256 for one or two rows) tile a row, the
// grid covers every row (looping only past 65535 rows). A grid that covers
// the data keeps more loads in flight than blocks that loop over rows, and
// the fewer bytes a thread moves at decode sizes, the more SMs share the
// loads and the sooner the last one returns. Inputs and outputs, touched
// once, take streaming cache hints. out and x have the schema's "rows"
// layout: rows at any stride; vectors are used only where every row start is
// 16-byte aligned, and dense tensors skip the row addressing.
#include <kdispatch/plugin_rows.hpp>

#include "device_utils.cuh"
#include "launch_utils.hpp"
#include "ops.hpp"

namespace kd_gpu {
namespace {

constexpr int kThreads = 128;
// Up to this many outputs (decode sizes) a thread moves 8-byte vectors.
constexpr int64_t kSmallElements = int64_t{1} << 19;
// Up to this many (a row or two) a thread moves one element, in blocks of
// kTinyThreads.
constexpr int64_t kTinyElements = int64_t{1} << 13;
constexpr int kTinyThreads = 256;

// a / (1 + exp(-a)) with the fast exponential and division: two special
// function instructions per value, which keeps these kernels memory bound.
__device__ __forceinline__ float sigmoid_times(float a, float z) {
  return __fdividef(a, 1.f + __expf(-z));
}

struct Silu {
  template <bool kLowPrecision>
  __device__ static float eval(float a) {
    return sigmoid_times(a, a);
  }
};

// For 16-bit outputs, gelu(a) = a * Phi(a) with Phi(-|a|) = erfc(|a|/sqrt 2) / 2
// from Abramowitz and Stegun 7.1.26 (absolute error of erf below 1.5e-7, far
// under their rounding), t = 1 / (1 + p |a| / sqrt 2), so that Phi never
// cancels: constants folded, one reciprocal and one exponential instruction,
// which keeps the 16-bit kernels memory bound. float32 keeps erff.
struct GeluErf {
  template <bool kLowPrecision>
  __device__ static float eval(float a) {
    if constexpr (kLowPrecision) {
      constexpr float kP = 0.3275911f * 0.70710678118654752f;
      constexpr float kMinusHalfLog2e = -0.5f * 1.4426950408889634f;  // e^(-a^2/2) = 2^(k a^2)
      const float t = fast_rcp(fmaf(kP, fabsf(a), 1.f));
      const float poly =
          t * (0.5f * 0.254829592f +
               t * (0.5f * -0.284496736f +
                    t * (0.5f * 1.421413741f + t * (0.5f * -1.453152027f + t * (0.5f * 1.061405429f)))));
      const float phi_minus_abs = poly * fast_exp2(a * a * kMinusHalfLog2e);
      return a * (a >= 0.f ? 1.f - phi_minus_abs : phi_minus_abs);
    } else {
      return 0.5f * a * (1.f + erff(a * 0.70710678118654752f));
    }
  }
};

// 0.5 * a * (1 + tanh(u)) == a * sigmoid(2u), u = sqrt(2/pi) * (a + 0.044715 a^3).
struct GeluTanh {
  template <bool kLowPrecision>
  __device__ static float eval(float a) {
    constexpr float kTwoSqrt2OverPi = 1.5957691216057308f;
    return sigmoid_times(a, kTwoSqrt2OverPi * (a + 0.044715f * a * a * a));
  }
};

// kDense: the rows of out and x lie back to back (row r at r * d and
// r * 2 * d), and the layouts are not read.
template <class T, int N, class Act, int kBlock, bool kDense>
__global__ void __launch_bounds__(kBlock)
    act_and_mul(T* out, const T* x, kd_plugin::RowLayout out_rows, kd_plugin::RowLayout x_rows,
                int64_t rows, int d) {
  start_after_previous_kernel();
  const int i = blockIdx.x * kBlock + threadIdx.x;  // the vector of the row
  if (i >= d / N) return;
  for (int64_t row = blockIdx.y; row < rows; row += gridDim.y) {
    const int64_t x_row = kDense ? row * 2 * d : x_rows.offset(row);
    const int64_t out_row = kDense ? row * d : out_rows.offset(row);
    const T* gate = x + x_row + static_cast<int64_t>(i) * N;
    const Vec<T, N> a = load_once<T, N>(gate);
    const Vec<T, N> b = load_once<T, N>(gate + d);
    Vec<T, N> r;
#pragma unroll
    for (int e = 0; e < N; ++e) {
      const float act = Act::template eval<sizeof(T) == 2>(to_float(a.v[e]));
      r.v[e] = from_float<T>(act * to_float(b.v[e]));
    }
    store_once<T, N>(out + out_row + static_cast<int64_t>(i) * N, r);
  }
}

// The rows of out and x, where each lies.
struct ActRows {
  kd_plugin::RowLayout out;
  kd_plugin::RowLayout x;
  bool dense;  // both back to back
};

template <class T, int N, class Act, int kBlock = kThreads>
void launch_act(const Launch& launch, T* out, const T* x, const ActRows& layout, int64_t rows,
                int d) {
  const dim3 grid(static_cast<unsigned>(ceil_div(d / N, kBlock)),
                  static_cast<unsigned>(std::min<int64_t>(rows, 65535)));
  if (layout.dense) {
    launch_kernel(launch, act_and_mul<T, N, Act, kBlock, true>, grid, kBlock, out, x, layout.out,
                  layout.x, rows, d);
  } else {
    launch_kernel(launch, act_and_mul<T, N, Act, kBlock, false>, grid, kBlock, out, x,
                  layout.out, layout.x, rows, d);
  }
}

// True when every row of `rows` starts `bytes`-aligned, given that row 0
// does: each stride is a multiple of `bytes`.
inline bool row_strides_aligned(const kd_plugin::RowLayout& rows, size_t element_bytes,
                                size_t bytes) {
  for (int i = 0; i < rows.ndim; ++i) {
    if ((rows.stride[i] * static_cast<int64_t>(element_bytes)) % static_cast<int64_t>(bytes) != 0) {
      return false;
    }
  }
  return true;
}

// Tensors: out [*, D], x [*, 2*D].
template <class Act>
kd_status run_act(const kd_call_args* args, const char* op) {
  if (kd_status s = check_call(args, op, 2, 0); s != KD_STATUS_OK) return s;
  const DLTensor& out = args->tensors[0];
  const DLTensor& x = args->tensors[1];
  if (out.ndim < 1 || x.ndim != out.ndim) return invalid_shapes(args, op);
  const int64_t d = dim(out, -1);
  const int64_t rows = leading_rows(out, 1);
  if (dim(x, -1) != 2 * d || leading_rows(x, 1) != rows) return invalid_shapes(args, op);
  if (!same_dtype(out, x)) {
    return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT, "%s: tensors differ in dtype", op);
  }
  if (d > INT32_MAX / 2) {
    return kd_plugin::fail(args, KD_STATUS_UNSUPPORTED, "%s: rows longer than 2^30-1", op);
  }
  if (rows == 0 || d == 0) return KD_STATUS_OK;
  return launch_for_dtype(args, op, out, [&](auto tag, const Launch& launch) {
    using T = typename decltype(tag)::type;
    constexpr int kVec = 16 / sizeof(T);
    T* o = data_as<T>(out);
    const T* in = data_as<T>(x);
    ActRows layout{kd_plugin::row_layout(out, 1), kd_plugin::row_layout(x, 1), false};
    layout.dense = layout.out.dense(d) && layout.x.dense(2 * d);
    const int di = static_cast<int>(d);
    if (rows * d <= kTinyElements) {
      launch_act<T, 1, Act, kTinyThreads>(launch, o, in, layout, rows, di);
    } else if (d % kVec == 0 && all_aligned(16, {o, in}) &&
               row_strides_aligned(layout.out, sizeof(T), 16) &&
               row_strides_aligned(layout.x, sizeof(T), 16)) {
      if (rows * d <= kSmallElements) {
        launch_act<T, kVec / 2, Act>(launch, o, in, layout, rows, di);
      } else {
        launch_act<T, kVec, Act>(launch, o, in, layout, rows, di);
      }
    } else {
      launch_act<T, 1, Act>(launch, o, in, layout, rows, di);
    }
  });
}

}  // namespace

// kd_cuda_silu_and_mul, kd_hip_silu_and_mul
kd_status silu_and_mul(const kd_call_args* args) noexcept {
  return kd_plugin::guarded(args, [&] { return run_act<Silu>(args, "silu_and_mul"); });
}

// kd_cuda_gelu_and_mul, kd_hip_gelu_and_mul
kd_status gelu_and_mul(const kd_call_args* args) noexcept {
  return kd_plugin::guarded(args, [&] { return run_act<GeluErf>(args, "gelu_and_mul"); });
}

// kd_cuda_gelu_tanh_and_mul, kd_hip_gelu_tanh_and_mul
kd_status gelu_tanh_and_mul(const kd_call_args* args) noexcept {
  return kd_plugin::guarded(args,
                            [&] { return run_act<GeluTanh>(args, "gelu_tanh_and_mul"); });
}

}  // namespace kd_gpu
