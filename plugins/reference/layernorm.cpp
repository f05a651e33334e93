// layernorm.rmsnorm, layernorm.gemma_rmsnorm, layernorm.fused_add_rmsnorm,
// layernorm.gemma_fused_add_rmsnorm (each also _out, into separate outputs),
// layernorm.rmsnorm_quant_fp8, layernorm.fused_add_rmsnorm_quant_fp8 and
// layernorm.layernorm in float64. The weights (and bias) may be float32 or
// x's dtype: Tensor decodes either. The fp8 outputs are rounded once by
// Tensor::set (nearest even, saturating at the format's largest finite value).
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include <kdispatch/plugin_helpers.hpp>

#include "kd_plugin_kernels.hpp"
#include "tensor.hpp"

namespace kdispatch::reference {
namespace {

// out[r, j] = x[r, j] / sqrt(mean(x[r, :]^2) + eps) * (weight_offset +
// weight[j]) * multiplier, for rows of width h given as float64 values;
// weight_offset is 1 for the Gemma variants, else 0; multiplier is 1 / scale
// for the quantising ops, else 1.
void normalise(const std::vector<double>& x, const Tensor& weight, double weight_offset, int64_t rows,
               int64_t h, double eps, const Tensor& out, double multiplier = 1.0) {
  for (int64_t r = 0; r < rows; ++r) {
    double sum = 0;
    for (int64_t j = 0; j < h; ++j) sum += x[r * h + j] * x[r * h + j];
    const double inv_rms = 1.0 / std::sqrt(sum / static_cast<double>(h) + eps);
    for (int64_t j = 0; j < h; ++j) {
      out.set(r * h + j, x[r * h + j] * inv_rms * (weight_offset + weight.get(j)) * multiplier);
    }
  }
}

// Tensors (out, x, weight), attribute eps.
void rms_normalise(const kd_call_args* args, double weight_offset, const char* op) {
  expect_arity(args, 3, 1, op);
  const Tensor out(args->tensors[0]), x(args->tensors[1]), weight(args->tensors[2]);
  std::vector<double> values(static_cast<size_t>(x.numel()));
  for (int64_t i = 0; i < x.numel(); ++i) values[i] = x.get(i);
  normalise(values, weight, weight_offset, x.rows(1), x.dim(-1), kd_plugin::float_attr(args, "eps"), out);
}

// residual_out = x + residual, stored rounded to its dtype; out = the
// rmsnorm of the unrounded sum. Every input is read before any output is
// written, so the outputs may be the inputs.
void add_and_rms_normalise(const kd_call_args* args, const Tensor& out, const Tensor& residual_out,
                           const Tensor& x, const Tensor& residual, const Tensor& weight, double weight_offset,
                           double multiplier = 1.0) {
  std::vector<double> sum(static_cast<size_t>(x.numel()));
  for (int64_t i = 0; i < x.numel(); ++i) sum[i] = x.get(i) + residual.get(i);
  for (int64_t i = 0; i < x.numel(); ++i) residual_out.set(i, sum[i]);
  normalise(sum, weight, weight_offset, x.rows(1), x.dim(-1), kd_plugin::float_attr(args, "eps"), out,
            multiplier);
}

// 1 / scale[0], scale a tensor of one element: the peers multiply by this
// reciprocal.
double reciprocal_of_scale(const Tensor& scale, const char* op) {
  if (scale.numel() != 1) throw std::invalid_argument(std::string(op) + ": scale must hold one element");
  return 1.0 / scale.get(0);
}

// Tensors (x, residual, weight), both of the first updated in place.
void add_and_rms_normalise_in_place(const kd_call_args* args, double weight_offset, const char* op) {
  expect_arity(args, 3, 1, op);
  const Tensor x(args->tensors[0]), residual(args->tensors[1]), weight(args->tensors[2]);
  add_and_rms_normalise(args, x, residual, x, residual, weight, weight_offset);
}

// Tensors (out, residual_out, x, residual, weight).
void add_and_rms_normalise_out(const kd_call_args* args, double weight_offset, const char* op) {
  expect_arity(args, 5, 1, op);
  const Tensor out(args->tensors[0]), residual_out(args->tensors[1]), x(args->tensors[2]),
      residual(args->tensors[3]), weight(args->tensors[4]);
  add_and_rms_normalise(args, out, residual_out, x, residual, weight, weight_offset);
}

// Tensors (out, x, weight, scale), out in fp8.
void rms_normalise_quant(const kd_call_args* args, const char* op) {
  expect_arity(args, 4, 1, op);
  const Tensor out(args->tensors[0]), x(args->tensors[1]), weight(args->tensors[2]), scale(args->tensors[3]);
  const double multiplier = reciprocal_of_scale(scale, op);
  std::vector<double> values(static_cast<size_t>(x.numel()));
  for (int64_t i = 0; i < x.numel(); ++i) values[i] = x.get(i);
  normalise(values, weight, 0.0, x.rows(1), x.dim(-1), kd_plugin::float_attr(args, "eps"), out, multiplier);
}

// Tensors (out, x, residual, weight, scale), out in fp8, residual updated in
// place.
void add_and_rms_normalise_quant(const kd_call_args* args, const char* op) {
  expect_arity(args, 5, 1, op);
  const Tensor out(args->tensors[0]), x(args->tensors[1]), residual(args->tensors[2]), weight(args->tensors[3]),
      scale(args->tensors[4]);
  add_and_rms_normalise(args, out, residual, x, residual, weight, 0.0, reciprocal_of_scale(scale, op));
}

}  // namespace

// kd_ref_rmsnorm_quant_fp8
kd_status rmsnorm_quant_fp8(const kd_call_args* args) noexcept {
  return kd_plugin::guarded(args, [&] { rms_normalise_quant(args, "layernorm.rmsnorm_quant_fp8"); });
}

// kd_ref_fused_add_rmsnorm_quant_fp8
kd_status fused_add_rmsnorm_quant_fp8(const kd_call_args* args) noexcept {
  return kd_plugin::guarded(
      args, [&] { add_and_rms_normalise_quant(args, "layernorm.fused_add_rmsnorm_quant_fp8"); });
}

// kd_ref_rmsnorm
kd_status rmsnorm(const kd_call_args* args) noexcept {
  return kd_plugin::guarded(args, [&] { rms_normalise(args, 0.0, "layernorm.rmsnorm"); });
}

// kd_ref_gemma_rmsnorm: weight + 1.
kd_status gemma_rmsnorm(const kd_call_args* args) noexcept {
  return kd_plugin::guarded(args, [&] { rms_normalise(args, 1.0, "layernorm.gemma_rmsnorm"); });
}

// kd_ref_fused_add_rmsnorm
kd_status fused_add_rmsnorm(const kd_call_args* args) noexcept {
  return kd_plugin::guarded(args,
                            [&] { add_and_rms_normalise_in_place(args, 0.0, "layernorm.fused_add_rmsnorm"); });
}

// kd_ref_fused_add_rmsnorm_out
kd_status fused_add_rmsnorm_out(const kd_call_args* args) noexcept {
  return kd_plugin::guarded(args,
                            [&] { add_and_rms_normalise_out(args, 0.0, "layernorm.fused_add_rmsnorm_out"); });
}

// kd_ref_gemma_fused_add_rmsnorm: weight + 1.
kd_status gemma_fused_add_rmsnorm(const kd_call_args* args) noexcept {
  return kd_plugin::guarded(
      args, [&] { add_and_rms_normalise_in_place(args, 1.0, "layernorm.gemma_fused_add_rmsnorm"); });
}

// kd_ref_gemma_fused_add_rmsnorm_out: weight + 1.
kd_status gemma_fused_add_rmsnorm_out(const kd_call_args* args) noexcept {
  return kd_plugin::guarded(
      args, [&] { add_and_rms_normalise_out(args, 1.0, "layernorm.gemma_fused_add_rmsnorm_out"); });
}

// kd_ref_layernorm
// Tensors (out, x, weight, bias), attribute eps: out = (x - mean) /
// sqrt(var + eps) * weight + bias over each row, var the biased variance.
kd_status layernorm(const kd_call_args* args) noexcept {
  return kd_plugin::guarded(args, [&] {
    expect_arity(args, 4, 1, "layernorm.layernorm");
    const Tensor out(args->tensors[0]), x(args->tensors[1]), weight(args->tensors[2]), bias(args->tensors[3]);
    const double eps = kd_plugin::float_attr(args, "eps");
    const int64_t h = x.dim(-1);
    for (int64_t r = 0; r < x.rows(1); ++r) {
      double mean = 0;
      for (int64_t j = 0; j < h; ++j) mean += x.get(r * h + j);
      mean /= static_cast<double>(h);
      double var = 0;
      for (int64_t j = 0; j < h; ++j) var += (x.get(r * h + j) - mean) * (x.get(r * h + j) - mean);
      var /= static_cast<double>(h);
      const double inv_std = 1.0 / std::sqrt(var + eps);
      for (int64_t j = 0; j < h; ++j) {
        out.set(r * h + j, (x.get(r * h + j) - mean) * inv_std * weight.get(j) + bias.get(j));
      }
    }
  });
}

}  // namespace kdispatch::reference
