// layernorm.layernorm: out = T((x - mean) * rsqrt(var + eps) * weight + bias)
// over each row, mean and (biased) variance accumulated in float32.
//
// Memory bound, so a row is read once: one block per row, each thread
// holding its share of the row in registers as stored (16-byte vectors, up
// to 8 per thread), through two block sums, the mean and then the squared
// deviations from it (exact where a one-pass E[x^2] - mean^2 would cancel);
// the weight and bias are read after them, which keeps registers few and
// blocks per SM many. The grid covers every row, and a block takes its row
// and exits (no loop over rows). Rows that are longer, or whose length or
// pointers do not allow 16-byte accesses, take a kernel that reads the row
// three times (mostly from L2).
#include "device_utils.cuh"
#include "launch_utils.hpp"
#include "ops.hpp"

namespace kd_gpu {
namespace {

constexpr int kThreads = 256;  // threads per block of the three-pass kernel

template <class T, int N, int VPT>
__global__ void __launch_bounds__(kRowMaxThreads)
    layernorm_in_registers(T* out, const T* x, const T* weight, const T* bias, int64_t rows,
                           int hidden, float eps) {
  start_after_previous_kernel();
  const int nvec = hidden / N;
  const int64_t row = block_row();
  if (row >= rows) return;
  const T* xr = x + row * hidden;
  T* outr = out + row * hidden;
  Vec<T, N> xv[VPT];
  // Every load is issued before the first sum waits on one.
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    if (i < nvec) xv[k] = load_vec<T, N>(xr + static_cast<size_t>(i) * N);
  }
  float sum = 0.f;
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    if (i < nvec) {
#pragma unroll
      for (int e = 0; e < N; ++e) sum += to_float(xv[k].v[e]);
    }
  }
  const float mean = block_sum(sum) / static_cast<float>(hidden);
  float squares = 0.f;
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    if (i < nvec) {
#pragma unroll
      for (int e = 0; e < N; ++e) {
        const float d = to_float(xv[k].v[e]) - mean;
        squares += d * d;
      }
    }
  }
  const float inv_std = rsqrtf(block_sum(squares) / static_cast<float>(hidden) + eps);
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    if (i < nvec) {
      const Vec<T, N> w = load_vec<T, N>(weight + static_cast<size_t>(i) * N);
      const Vec<T, N> b = load_vec<T, N>(bias + static_cast<size_t>(i) * N);
      Vec<T, N> o;
#pragma unroll
      for (int e = 0; e < N; ++e) {
        o.v[e] = from_float<T>((to_float(xv[k].v[e]) - mean) * inv_std * to_float(w.v[e]) +
                               to_float(b.v[e]));
      }
      store_vec<T, N>(outr + static_cast<size_t>(i) * N, o);
    }
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    layernorm_three_pass(T* out, const T* x, const T* weight, const T* bias, int64_t rows,
                         int hidden, float eps) {
  start_after_previous_kernel();
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* xr = x + row * hidden;
    T* outr = out + row * hidden;
    float sum = 0.f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) sum += to_float(xr[i]);
    const float mean = block_sum(sum) / static_cast<float>(hidden);
    float squares = 0.f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
      const float d = to_float(xr[i]) - mean;
      squares += d * d;
    }
    const float inv_std = rsqrtf(block_sum(squares) / static_cast<float>(hidden) + eps);
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
      outr[i] = from_float<T>((to_float(xr[i]) - mean) * inv_std * to_float(weight[i]) + to_float(bias[i]));
    }
  }
}

template <class T>
void launch_layernorm(const Launch& launch, T* out, const T* x, const T* weight, const T* bias,
                      int64_t rows, int hidden, float eps) {
  constexpr int kVec = 16 / sizeof(T);
  const int nvec = hidden / kVec;
  if (hidden % kVec == 0 && nvec <= kRowMaxThreads * kRowMaxVecPerThread &&
      all_aligned(16, {out, x, weight, bias})) {
    const int threads = row_block_threads(nvec, launch.warp_size);
    with_vectors_per_thread<kRowMaxVecPerThread>(ceil_div(nvec, threads), [&](auto vpt) {
      launch_kernel(launch, layernorm_in_registers<T, kVec, decltype(vpt)::value>, one_block_per_row(rows),
                    threads, out, x, weight, bias, rows, hidden, eps);
    });
    return;
  }
  launch_kernel(launch, layernorm_three_pass<T>, row_grid(rows), kThreads, out, x, weight, bias, rows, hidden,
                eps);
}

}  // namespace

// kd_cuda_layernorm, kd_hip_layernorm
// Tensors (out, x, weight, bias), attribute eps.
kd_status layernorm(const kd_call_args* args) noexcept {
  return kd_plugin::guarded(args, [&]() -> kd_status {
    constexpr const char* kOp = "layernorm";
    if (kd_status s = check_call(args, kOp, 4, 1); s != KD_STATUS_OK) return s;
    const DLTensor& out = args->tensors[0];
    const DLTensor& x = args->tensors[1];
    const DLTensor& weight = args->tensors[2];
    const DLTensor& bias = args->tensors[3];
    if (out.ndim < 1 || x.ndim != out.ndim || weight.ndim != 1 || bias.ndim != 1) return invalid_shapes(args, kOp);
    const int64_t hidden = dim(out, -1);
    const int64_t rows = leading_rows(out, 1);
    if (dim(x, -1) != hidden || weight.shape[0] != hidden || bias.shape[0] != hidden ||
        leading_rows(x, 1) != rows) {
      return invalid_shapes(args, kOp);
    }
    if (!same_dtype(out, x) || !same_dtype(out, weight) || !same_dtype(out, bias)) {
      return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT, "%s: tensors differ in dtype", kOp);
    }
    if (hidden > INT32_MAX) return kd_plugin::fail(args, KD_STATUS_UNSUPPORTED, "%s: rows longer than 2^31-1", kOp);
    float eps = 0.f;
    if (kd_status s = attr_float(args, kOp, 0, &eps); s != KD_STATUS_OK) return s;
    if (rows == 0 || hidden == 0) return KD_STATUS_OK;
    return launch_for_dtype(args, kOp, out, [&](auto tag, const Launch& launch) {
      using T = typename decltype(tag)::type;
      launch_layernorm<T>(launch, data_as<T>(out), data_as<T>(x), data_as<T>(weight),
                          data_as<T>(bias), rows, static_cast<int>(hidden), eps);
    });
  });
}

}  // namespace kd_gpu
