// activation.{silu,gelu,gelu_tanh}_and_mul: out = act(x[..., :D]) * x[..., D:],
// computed in float32 and rounded once.
//
// Elementwise and memory bound: 16-byte vectors, two of them per thread and
// half (four loads in flight), blocks of 256 threads tiled over (columns,
// rows) so that short rows still fill whole blocks, and a grid of a few waves
// that loops over the remaining rows.
#include "device_utils.cuh"
#include "launch_utils.hpp"
#include "ops.hpp"

namespace kd_gpu {
namespace {

constexpr int kThreads = 256;
constexpr int kItems = 2;  // vectors per thread and half

// a / (1 + exp(-a)) with the fast exponential and division: two special
// function instructions per value, which keeps these kernels memory bound.
__device__ __forceinline__ float sigmoid_times(float a, float z) {
  return __fdividef(a, 1.f + __expf(-z));
}

struct Silu {
  __device__ float operator()(float a) const { return sigmoid_times(a, a); }
};

struct GeluErf {
  __device__ float operator()(float a) const {
    return 0.5f * a * (1.f + erff(a * 0.70710678118654752f));
  }
};

// 0.5 * a * (1 + tanh(u)) == a * sigmoid(2u), u = sqrt(2/pi) * (a + 0.044715 a^3).
struct GeluTanh {
  __device__ float operator()(float a) const {
    constexpr float kTwoSqrt2OverPi = 1.5957691216057308f;
    return sigmoid_times(a, kTwoSqrt2OverPi * (a + 0.044715f * a * a * a));
  }
};

template <class T, int N, class Act>
__global__ void __launch_bounds__(kThreads)
    act_and_mul(T* out, const T* x, int64_t rows, int d) {
  const int nvec = d / N;
  const int first = blockIdx.x * blockDim.x * kItems + threadIdx.x;
  for (int64_t row = int64_t{blockIdx.y} * blockDim.y + threadIdx.y; row < rows;
       row += int64_t{gridDim.y} * blockDim.y) {
    const T* gate = x + row * 2 * d;
    const T* up = gate + d;
    T* o = out + row * d;
    Vec<T, N> a[kItems];
    Vec<T, N> b[kItems];
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      const int i = first + k * blockDim.x;
      if (i < nvec) {
        a[k] = load_vec<T, N>(gate + static_cast<size_t>(i) * N);
        b[k] = load_vec<T, N>(up + static_cast<size_t>(i) * N);
      }
    }
#pragma unroll
    for (int k = 0; k < kItems; ++k) {
      const int i = first + k * blockDim.x;
      if (i < nvec) {
        Vec<T, N> r;
#pragma unroll
        for (int e = 0; e < N; ++e) {
          r.v[e] = from_float<T>(Act{}(to_float(a[k].v[e])) * to_float(b[k].v[e]));
        }
        store_vec<T, N>(o + static_cast<size_t>(i) * N, r);
      }
    }
  }
}

// Blocks of kThreads tile (columns, rows): tx threads along a row (enough for
// its vectors, kItems each), kThreads / tx rows. The grid covers the columns
// and as many row tiles as run at once; blocks loop over the other rows.
template <class T, int N, class Act>
void launch_act(const Launch& launch, T* out, const T* x, int64_t rows, int d) {
  const int64_t nvec = d / N;
  int tx = 1;
  while (tx < kThreads && tx * kItems < nvec) tx *= 2;
  const int ty = kThreads / tx;
  const int64_t grid_x = ceil_div(nvec, int64_t{tx} * kItems);
  const int64_t resident = resident_grid<act_and_mul<T, N, Act>, kThreads>(launch);
  const int64_t grid_y = std::min({ceil_div(rows, ty), int64_t{65535},
                                   std::max<int64_t>(1, resident / grid_x)});
  const dim3 grid(static_cast<unsigned>(grid_x), static_cast<unsigned>(grid_y));
  const dim3 block(static_cast<unsigned>(tx), static_cast<unsigned>(ty));
  act_and_mul<T, N, Act><<<grid, block, 0, launch.stream>>>(out, x, rows, d);
}

// Tensors: out [*, D], x [*, 2*D].
template <class Act>
kd_status run_act(const kd_call_args* args, const char* op) {
  if (kd_status s = check_call(args, op, 2, 0); s != KD_STATUS_OK) return s;
  const DLTensor& out = args->tensors[0];
  const DLTensor& x = args->tensors[1];
  if (out.ndim < 1 || x.ndim != out.ndim) return invalid_shapes(args, op);
  const int64_t d = last_dim(out);
  const int64_t rows = leading_count(out, 1);
  if (last_dim(x) != 2 * d || leading_count(x, 1) != rows) return invalid_shapes(args, op);
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
    T* o = data_of<T>(out);
    const T* in = data_of<T>(x);
    if (d % kVec == 0 && all_aligned(16, {o, in})) {
      launch_act<T, kVec, Act>(launch, o, in, rows, static_cast<int>(d));
    } else {
      launch_act<T, 1, Act>(launch, o, in, rows, static_cast<int>(d));
    }
  });
}

}  // namespace

kd_status silu_and_mul(const kd_call_args* args) noexcept {
  return kd_plugin::guarded(args, [&] { return run_act<Silu>(args, "silu_and_mul"); });
}

kd_status gelu_and_mul(const kd_call_args* args) noexcept {
  return kd_plugin::guarded(args, [&] { return run_act<GeluErf>(args, "gelu_and_mul"); });
}

kd_status gelu_tanh_and_mul(const kd_call_args* args) noexcept {
  return kd_plugin::guarded(args,
                            [&] { return run_act<GeluTanh>(args, "gelu_tanh_and_mul"); });
}

}  // namespace kd_gpu
