#include "reference_ops.hpp"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <numeric>
#include <stdexcept>
#include <string>

namespace kdispatch::reference {
namespace {

double inverse_rms(std::span<const double> row, double eps) {
  double sum = 0.0;
  for (double v : row) sum += v * v;
  return 1.0 / std::sqrt(sum / static_cast<double>(row.size()) + eps);
}

template <class Act>
std::vector<double> gated(std::span<const double> x, int64_t rows, int64_t d, Act act) {
  std::vector<double> out(static_cast<size_t>(rows * d));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < d; ++j) {
      out[r * d + j] = act(x[r * 2 * d + j]) * x[r * 2 * d + d + j];
    }
  }
  return out;
}

// Rotates one head of width 2 * half in place.
void rotate(double* head, const double* cos, const double* sin, int64_t half, bool is_neox) {
  for (int64_t i = 0; i < half; ++i) {
    const int64_t ia = is_neox ? i : 2 * i;
    const int64_t ib = is_neox ? i + half : 2 * i + 1;
    const double a = head[ia];
    const double b = head[ib];
    head[ia] = a * cos[i] - b * sin[i];
    head[ib] = b * cos[i] + a * sin[i];
  }
}

}  // namespace

std::vector<double> rmsnorm(std::span<const double> x, std::span<const double> weight,
                            int64_t rows, int64_t h, double eps) {
  std::vector<double> out(static_cast<size_t>(rows * h));
  for (int64_t r = 0; r < rows; ++r) {
    const double inv = inverse_rms(x.subspan(r * h, h), eps);
    for (int64_t j = 0; j < h; ++j) out[r * h + j] = x[r * h + j] * inv * weight[j];
  }
  return out;
}

FusedAddRmsnormResult fused_add_rmsnorm(std::span<const double> x,
                                        std::span<const double> residual,
                                        std::span<const double> weight, int64_t rows, int64_t h,
                                        double eps, Dtype dtype) {
  FusedAddRmsnormResult result;
  result.residual.resize(static_cast<size_t>(rows * h));
  for (size_t i = 0; i < result.residual.size(); ++i) {
    result.residual[i] = round_to(dtype, x[i] + residual[i]);
  }
  result.x = rmsnorm(result.residual, weight, rows, h, eps);
  return result;
}

std::vector<double> silu_and_mul(std::span<const double> x, int64_t rows, int64_t d) {
  return gated(x, rows, d, [](double a) { return a / (1.0 + std::exp(-a)); });
}

std::vector<double> gelu_and_mul(std::span<const double> x, int64_t rows, int64_t d) {
  return gated(x, rows, d,
               [](double a) { return 0.5 * a * (1.0 + std::erf(a / std::numbers::sqrt2)); });
}

std::vector<double> gelu_tanh_and_mul(std::span<const double> x, int64_t rows, int64_t d) {
  return gated(x, rows, d, [](double a) {
    const double k = std::sqrt(2.0 / std::numbers::pi);
    return 0.5 * a * (1.0 + std::tanh(k * (a + 0.044715 * a * a * a)));
  });
}

RotaryResult rotary_embedding(std::span<const int64_t> positions, std::span<const double> query,
                              std::span<const double> key,
                              std::span<const double> cos_sin_cache, int64_t tokens,
                              int64_t heads_q, int64_t heads_k, int64_t half, bool is_neox) {
  const int64_t width = 2 * half;
  const int64_t cache_positions = static_cast<int64_t>(cos_sin_cache.size()) / width;
  RotaryResult result{std::vector<double>(query.begin(), query.end()),
                      std::vector<double>(key.begin(), key.end())};
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t p = positions[t];
    if (p < 0 || p >= cache_positions) {
      throw std::out_of_range("token " + std::to_string(t) + ": position " + std::to_string(p) +
                              " outside the cache");
    }
    const double* cos = cos_sin_cache.data() + p * width;
    const double* sin = cos + half;
    for (int64_t h = 0; h < heads_q; ++h) {
      rotate(result.query.data() + (t * heads_q + h) * width, cos, sin, half, is_neox);
    }
    for (int64_t h = 0; h < heads_k; ++h) {
      rotate(result.key.data() + (t * heads_k + h) * width, cos, sin, half, is_neox);
    }
  }
  return result;
}

TopkSoftmaxResult topk_softmax(std::span<const double> gating, int64_t rows, int64_t e,
                               int64_t k, bool renormalize) {
  if (k > e) throw std::invalid_argument("topk_softmax: k > e");
  TopkSoftmaxResult result;
  result.weights.resize(static_cast<size_t>(rows * k));
  result.ids.resize(static_cast<size_t>(rows * k));
  result.probabilities.resize(static_cast<size_t>(rows * e));
  std::vector<int32_t> order(static_cast<size_t>(e));
  for (int64_t r = 0; r < rows; ++r) {
    const std::span<const double> g = gating.subspan(r * e, e);
    double* p = result.probabilities.data() + r * e;
    if (e == 0) continue;
    const double max = *std::max_element(g.begin(), g.end());
    double sum = 0.0;
    for (int64_t j = 0; j < e; ++j) sum += p[j] = std::exp(g[j] - max);
    for (int64_t j = 0; j < e; ++j) p[j] /= sum;
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return p[a] > p[b]; });
    double selected = 0.0;
    for (int64_t i = 0; i < k; ++i) {
      result.ids[r * k + i] = order[i];
      result.weights[r * k + i] = p[order[i]];
      selected += p[order[i]];
    }
    if (renormalize && selected > 0.0) {
      for (int64_t i = 0; i < k; ++i) result.weights[r * k + i] /= selected;
    }
  }
  return result;
}

}  // namespace kdispatch::reference
