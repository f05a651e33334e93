// The reference plugin's kernels (plugins/reference) as plain functions on
// float64 vectors, for the tests and benchmarks that drive one plugin's
// kernels directly through the C ABI, without the core. Each call runs the
// reference kernel on float64 tensors (fused_add_rmsnorm: on tensors of the
// storage dtype, whose residual it rounds), so the formulas exist once, in
// the reference plugin. "*" leading dims are flattened into `rows` (or
// `tokens`).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "dtype_codec.hpp"

namespace kdispatch::reference {

// Opens the reference plugin (libkdispatch-reference.so) in `plugin_dir`;
// the functions below throw std::runtime_error until it has been opened.
// Throws std::runtime_error when the library cannot be opened.
void open_reference_plugin(const std::string& plugin_dir);

// How far a backend's result may be from the reference:
// |got - want| <= atol + rtol * |want|.
struct Tolerance {
  double rtol;
  double atol;
};

// out[r, j] = x[r, j] / sqrt(mean_j(x[r, :]^2) + eps) * weight[j]
std::vector<double> rmsnorm(std::span<const double> x, std::span<const double> weight,
                            int64_t rows, int64_t h, double eps);

struct FusedAddRmsnormResult {
  std::vector<double> x;         // normalised output, rounded to the dtype
  std::vector<double> residual;  // x + residual, rounded to the dtype
};

// residual = round_to(dtype, x + residual); x = rmsnorm(residual) with the
// rounded residual, as the kernels store and reuse it. `x`, `residual` and
// `weight` hold values of `dtype`.
FusedAddRmsnormResult fused_add_rmsnorm(std::span<const double> x,
                                        std::span<const double> residual,
                                        std::span<const double> weight, int64_t rows, int64_t h,
                                        double eps, Dtype dtype);

// out[r, j] = act(x[r, j]) * x[r, d + j], x of shape [rows, 2 * d].
std::vector<double> silu_and_mul(std::span<const double> x, int64_t rows, int64_t d);
std::vector<double> gelu_and_mul(std::span<const double> x, int64_t rows, int64_t d);
std::vector<double> gelu_tanh_and_mul(std::span<const double> x, int64_t rows, int64_t d);

struct RotaryResult {
  std::vector<double> query;
  std::vector<double> key;
};

// query [tokens, heads_q, 2 * half], key [tokens, heads_k, 2 * half],
// cos_sin_cache [positions_in_cache, 2 * half]. Throws std::out_of_range for
// a position outside the cache.
RotaryResult rotary_embedding(std::span<const int64_t> positions, std::span<const double> query,
                              std::span<const double> key,
                              std::span<const double> cos_sin_cache, int64_t tokens,
                              int64_t heads_q, int64_t heads_k, int64_t half, bool is_neox);

struct TopkSoftmaxResult {
  std::vector<double> weights;     // [rows, k]
  std::vector<int32_t> ids;        // [rows, k]
  std::vector<double> probabilities;  // [rows, e]: the softmax, for tie checks
};

// Softmax over each row of gating [rows, e]; the k largest probabilities in
// descending order, ties to the lower index; weights divided by their sum
// when renormalize (and the sum is positive). Throws std::invalid_argument
// when k > e.
TopkSoftmaxResult topk_softmax(std::span<const double> gating, int64_t rows, int64_t e,
                               int64_t k, bool renormalize);

}  // namespace kdispatch::reference
