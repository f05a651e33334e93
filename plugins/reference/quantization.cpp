// The fp8 quantisers: output_q = fp8(x * inv) with s a float32 scale and
// inv its float32 reciprocal, per tensor, per row or per group of a row, in
// float64 from the stored inputs. A computed scale is absmax / fp8_max
// rounded once to float32 (the value output_s stores); inv is 1 / s rounded
// once to float32 (the float64 quotient rounded again to float32: a double
// rounding of a quotient from 53 to 24 bits gives the correctly rounded
// one), or 0 for s == 0. The product x * inv is exact in float64 (two
// values of at most 24 significant bits) and rounded once to the fp8 format
// (Tensor::set: nearest even, saturating at the largest finite value,
// infinities included, NaN kept). So s == 0 gives 0 for finite x, and NaN
// for NaN or infinite x, as does x * 0.
#include <algorithm>
#include <cmath>

#include <kdispatch/plugin_helpers.hpp>

#include "kd_plugin_kernels.hpp"
#include "tensor.hpp"

namespace kdispatch::reference {
namespace {

// The largest finite value of output_q's fp8 format.
double fp8_max_of(const DLTensor& q) {
  return kd_plugin::is_dtype(q, KD_DLPACK_FLOAT8_E4M3FN, 8) ? 448.0 : 57344.0;
}

// The scale of a block whose largest magnitude is `absmax`, as float32.
double scale_of(double absmax, double fp8_max) { return static_cast<float>(absmax / fp8_max); }

// The float32 reciprocal of the scale s, 0 for s == 0.
double reciprocal_of(double s) { return s == 0.0 ? 0.0 : static_cast<float>(1.0 / s); }

// Writes fp8(x[i] * inv) for i in [begin, end) of the flat index, with inv
// the float32 reciprocal of s.
void quantise(const Tensor& q, const Tensor& x, int64_t begin, int64_t end, double s) {
  const double inv = reciprocal_of(s);
  for (int64_t i = begin; i < end; ++i) q.set(i, x.get(i) * inv);
}

double absmax(const Tensor& x, int64_t begin, int64_t end) {
  double m = 0.0;
  for (int64_t i = begin; i < end; ++i) m = std::max(m, std::fabs(x.get(i)));
  return m;
}

}  // namespace

// kd_ref_per_tensor_quant_fp8. Tensors (input, output_q, output_s), attribute is_static.
kd_status per_tensor_quant_fp8(const kd_call_args* args) noexcept {
  return kd_plugin::guarded(args, [&] {
    expect_arity(args, 3, 1, "quantization.per_tensor_quant_fp8");
    const Tensor x(args->tensors[0]), q(args->tensors[1]), s(args->tensors[2]);
    double scale = s.get(0);
    if (!kd_plugin::bool_attr(args, "is_static")) {
      scale = scale_of(absmax(x, 0, x.numel()), fp8_max_of(args->tensors[1]));
      s.set(0, scale);
    }
    quantise(q, x, 0, x.numel(), scale);
  });
}

// kd_ref_per_token_quant_fp8. Tensors (input, output_q, output_s).
kd_status per_token_quant_fp8(const kd_call_args* args) noexcept {
  return kd_plugin::guarded(args, [&] {
    expect_arity(args, 3, 0, "quantization.per_token_quant_fp8");
    const Tensor x(args->tensors[0]), q(args->tensors[1]), s(args->tensors[2]);
    const int64_t n = x.dim(-1);
    const double fp8_max = fp8_max_of(args->tensors[1]);
    for (int64_t r = 0; r < x.rows(1); ++r) {
      const double scale = scale_of(absmax(x, r * n, (r + 1) * n), fp8_max);
      s.set(r, scale);
      quantise(q, x, r * n, (r + 1) * n, scale);
    }
  });
}

// kd_ref_per_token_group_quant_fp8. Tensors (input, output_q, output_s),
// attributes group_size, eps, scale_ue8m0.
kd_status per_token_group_quant_fp8(const kd_call_args* args) noexcept {
  return kd_plugin::guarded(args, [&] {
    constexpr const char* kOp = "quantization.per_token_group_quant_fp8";
    expect_arity(args, 3, 3, kOp);
    const Tensor x(args->tensors[0]), q(args->tensors[1]), s(args->tensors[2]);
    const int64_t n = x.dim(-1);
    const int64_t groups = s.dim(-1);
    const int64_t group_size = kd_plugin::int_attr(args, "group_size");
    if (groups <= 0 || n % groups != 0 || (group_size != 0 && group_size * groups != n)) {
      throw std::invalid_argument(std::string(kOp) + ": group_size " + std::to_string(group_size) + " with N " +
                                  std::to_string(n) + " and " + std::to_string(groups) + " groups");
    }
    const int64_t size = n / groups;
    const double eps = static_cast<float>(kd_plugin::float_attr(args, "eps"));
    const bool ue8m0 = kd_plugin::bool_attr(args, "scale_ue8m0");
    const double fp8_max = fp8_max_of(args->tensors[1]);
    for (int64_t r = 0; r < x.rows(1); ++r) {
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t begin = r * n + g * size;
        double scale = scale_of(std::max(absmax(x, begin, begin + size), eps), fp8_max);
        if (ue8m0 && scale > 0.0) {
          int e = 0;
          const double m = std::frexp(scale, &e);  // scale = m * 2^e, m in [0.5, 1)
          scale = std::ldexp(1.0, m == 0.5 ? e - 1 : e);
        }
        s.set(r * groups + g, scale);
        quantise(q, x, begin, begin + size, scale);
      }
    }
  });
}

}  // namespace kdispatch::reference
