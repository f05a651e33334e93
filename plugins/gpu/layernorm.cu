// layernorm.layernorm: out = T((x - mean) * rsqrt(var + eps) * weight + bias)
// over each row, mean and (biased) variance accumulated in float32.
//
// One block per row and three passes over it: the sum, the sum of squared
// deviations from the mean (exact where a one-pass E[x^2] - mean^2 would
// cancel), then the output. The row is read three times, mostly from L2.
#include "device_utils.cuh"
#include "launch_utils.hpp"
#include "ops.hpp"

namespace kd_gpu {
namespace {

constexpr int kThreads = 256;

template <class T>
__global__ void __launch_bounds__(kThreads)
    layernorm_rows(T* out, const T* x, const T* weight, const T* bias, int64_t rows, int hidden, float eps) {
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

}  // namespace

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
      layernorm_rows<T><<<row_grid(rows), kThreads, 0, launch.stream>>>(
          data_as<T>(out), data_as<T>(x), data_as<T>(weight), data_as<T>(bias), rows,
          static_cast<int>(hidden), eps);
    });
  });
}

}  // namespace kd_gpu
