// moe.topk_softmax in float64.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include <kdispatch/plugin_helpers.hpp>

#include "kd_plugin_kernels.hpp"
#include "tensor.hpp"

namespace kdispatch::reference {
namespace {

// An optional tensor the caller left out (ABI 1.1).
bool absent(const DLTensor& t) { return t.data == nullptr && t.ndim == 0; }

}  // namespace

// kd_ref_topk_softmax
// Tensors (topk_weights [*, K], topk_ids [*, K] int32 or int64,
// gating_output [*, E], correction_bias [E] optional, token_expert_indices
// [*, K] optional), attributes renormalize and moe_softcapping. Each row:
// x = gating, x = tanh(x / c) c rounded to float32 when c =
// moe_softcapping > 0, x += bias in float32; p = softmax(x); the K largest p
// in descending order, ties to the lower index; weights those p, divided by their sum when renormalize;
// token_expert_indices[t, i] = i T + t over the T rows.
kd_status topk_softmax(const kd_call_args* args) noexcept {
  return kd_plugin::guarded(args, [&] {
    expect_arity(args, 5, 2, "moe.topk_softmax");
    const Tensor weights(args->tensors[0]), ids(args->tensors[1]), gating(args->tensors[2]);
    std::optional<Tensor> bias, token_expert;
    if (!absent(args->tensors[3])) bias.emplace(args->tensors[3]);
    if (!absent(args->tensors[4])) token_expert.emplace(args->tensors[4]);
    const bool renormalize = kd_plugin::bool_attr(args, "renormalize");
    const double softcap = kd_plugin::float_attr(args, "moe_softcapping");
    const int64_t k = weights.dim(-1);
    const int64_t e = gating.dim(-1);
    const int64_t rows = gating.rows(1);
    if (k > e) {
      throw std::invalid_argument("moe.topk_softmax: K=" + std::to_string(k) +
                                  " is larger than E=" + std::to_string(e));
    }
    std::vector<double> p(static_cast<size_t>(e));
    std::vector<int64_t> order(static_cast<size_t>(e));
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t j = 0; j < e; ++j) {
        // The transformed logit is a float32 value, each step rounded once.
        float x = static_cast<float>(gating.get(r * e + j));
        if (softcap > 0) x = static_cast<float>(std::tanh(x / softcap) * softcap);
        if (bias) x += static_cast<float>(bias->get(j));
        p[j] = x;
      }
      double max = -INFINITY;
      for (int64_t j = 0; j < e; ++j) max = std::max(max, p[j]);
      double sum = 0;
      for (int64_t j = 0; j < e; ++j) sum += p[j] = std::exp(p[j] - max);
      for (int64_t j = 0; j < e; ++j) p[j] /= sum;
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return p[a] > p[b]; });
      double selected = 0;
      for (int64_t i = 0; i < k; ++i) selected += p[order[i]];
      const double scale = renormalize && selected > 0 ? 1.0 / selected : 1.0;
      for (int64_t i = 0; i < k; ++i) {
        weights.set(r * k + i, p[order[i]] * scale);
        ids.set(r * k + i, static_cast<double>(order[i]));
        if (token_expert) token_expert->set(r * k + i, static_cast<double>(i * rows + r));
      }
    }
  });
}

}  // namespace kdispatch::reference
