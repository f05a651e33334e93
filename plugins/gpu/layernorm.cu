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
// three times (mostly from L2). Rows are addressed through
// kd_plugin::RowLayout (any stride before the last dim); the 16-byte path
// needs every row start 16-byte aligned. The weight and bias are each float32
// or T (templates W and B); the register kernel serves a weight and a bias
// of one dtype, the three-pass kernel any pair.
#include "device_utils.cuh"
#include "launch_utils.hpp"
#include "ops.hpp"

namespace kd_gpu {
namespace {

using kd_plugin::RowLayout;

constexpr int kThreads = 256;  // threads per block of the three-pass kernel

// The arguments of one call, passed to the kernels by value.
template <class T, class W, class B>
struct LayernormArgs {
  T* out;
  const T* x;
  const W* weight;
  const B* bias;
  RowLayout out_rows;
  RowLayout x_rows;
  int64_t rows;
  int hidden;
  float eps;
};

template <class T, class W, int N, int VPT>
__global__ void __launch_bounds__(kRowMaxThreads) layernorm_in_registers(const LayernormArgs<T, W, W> a) {
  start_after_previous_kernel();
  const int hidden = a.hidden;
  const int nvec = hidden / N;
  const int64_t row = block_row();
  if (row >= a.rows) return;
  const T* xr = a.x + a.x_rows.offset(row);
  T* outr = a.out + a.out_rows.offset(row);
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
  const float inv_std = rsqrtf(block_sum(squares) / static_cast<float>(hidden) + a.eps);
#pragma unroll
  for (int k = 0; k < VPT; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    if (i < nvec) {
      const Vec<W, N> w = load_vec<W, N>(a.weight + static_cast<size_t>(i) * N);
      const Vec<W, N> b = load_vec<W, N>(a.bias + static_cast<size_t>(i) * N);
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

template <class T, class W, class B>
__global__ void __launch_bounds__(kThreads) layernorm_three_pass(const LayernormArgs<T, W, B> a) {
  start_after_previous_kernel();
  const int hidden = a.hidden;
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const T* xr = a.x + a.x_rows.offset(row);
    T* outr = a.out + a.out_rows.offset(row);
    float sum = 0.f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) sum += to_float(xr[i]);
    const float mean = block_sum(sum) / static_cast<float>(hidden);
    float squares = 0.f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
      const float d = to_float(xr[i]) - mean;
      squares += d * d;
    }
    const float inv_std = rsqrtf(block_sum(squares) / static_cast<float>(hidden) + a.eps);
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
      outr[i] = from_float<T>((to_float(xr[i]) - mean) * inv_std * to_float(a.weight[i]) + to_float(a.bias[i]));
    }
  }
}

template <class T, class W, class B>
void launch_layernorm(const Launch& launch, const LayernormArgs<T, W, B>& a) {
  constexpr int kVec = 16 / sizeof(T);
  const int nvec = a.hidden / kVec;
  if constexpr (std::is_same_v<W, B>) {
    if (a.hidden % kVec == 0 && nvec <= kRowMaxThreads * kRowMaxVecPerThread &&
        all_aligned(16, {a.weight, a.bias}) && rows_aligned(16, a.out, a.out_rows, sizeof(T)) &&
        rows_aligned(16, a.x, a.x_rows, sizeof(T))) {
      const int threads = row_block_threads(nvec, launch.warp_size);
      with_vectors_per_thread<kRowMaxVecPerThread>(ceil_div(nvec, threads), [&](auto vpt) {
        launch_kernel(launch, layernorm_in_registers<T, W, kVec, decltype(vpt)::value>,
                      one_block_per_row(a.rows), threads, a);
      });
      return;
    }
  }
  launch_kernel(launch, layernorm_three_pass<T, W, B>, row_grid(a.rows), kThreads, a);
}

}  // namespace

// kd_cuda_layernorm, kd_hip_layernorm
// Tensors (out, x, weight, bias), attribute eps; the weight and the bias
// each float32 or of x's dtype.
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
    const bool float_weight = is_dtype<float>(weight);
    const bool float_bias = is_dtype<float>(bias);
    if (!same_dtype(out, x) || !(same_dtype(out, weight) || float_weight) || !(same_dtype(out, bias) || float_bias)) {
      return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT, "%s: tensors differ in dtype", kOp);
    }
    if (hidden > INT32_MAX) return kd_plugin::fail(args, KD_STATUS_UNSUPPORTED, "%s: rows longer than 2^31-1", kOp);
    float eps = 0.f;
    if (kd_status s = attr_float(args, kOp, 0, &eps); s != KD_STATUS_OK) return s;
    if (rows == 0 || hidden == 0) return KD_STATUS_OK;
    const RowLayout out_rows = kd_plugin::row_layout(out, 1);
    const RowLayout x_rows = kd_plugin::row_layout(x, 1);
    return launch_for_dtype(args, kOp, out, [&](auto tag, const Launch& launch) {
      using T = typename decltype(tag)::type;
      const auto launch_with = [&](auto weight_tag, auto bias_tag) {
        using W = typename decltype(weight_tag)::type;
        using B = typename decltype(bias_tag)::type;
        const LayernormArgs<T, W, B> call{data_as<T>(out), data_as<T>(x), data_as<W>(weight), data_as<B>(bias),
                                          out_rows, x_rows, rows, static_cast<int>(hidden), eps};
        launch_layernorm<T, W, B>(launch, call);
      };
      using kd_plugin::TypeTag;
      if (float_weight && float_bias) {
        launch_with(TypeTag<float>{}, TypeTag<float>{});
      } else if (float_weight) {
        launch_with(TypeTag<float>{}, TypeTag<T>{});
      } else if (float_bias) {
        launch_with(TypeTag<T>{}, TypeTag<float>{});
      } else {
        launch_with(TypeTag<T>{}, TypeTag<T>{});
      }
    });
  });
}

}  // namespace kd_gpu
