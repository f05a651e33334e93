// moe.topk_softmax in float64.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include <kdispatch/plugin_helpers.hpp>

#include "kd_plugin_kernels.hpp"
#include "tensor.hpp"

namespace kdispatch::reference {

// kd_ref_topk_softmax
// Tensors (topk_weights [*, K], topk_ids [*, K], gating_output [*, E]),
// attribute renormalize. Each row: p = softmax(gating); the K largest p in
// descending order, ties to the lower index; weights divided by their sum
// when renormalize.
kd_status topk_softmax(const kd_call_args* args) noexcept {
  return kd_plugin::guarded(args, [&] {
    expect_arity(args, 3, 1, "moe.topk_softmax");
    const Tensor weights(args->tensors[0]), ids(args->tensors[1]), gating(args->tensors[2]);
    const bool renormalize = kd_plugin::bool_attr(args, "renormalize");
    const int64_t k = weights.dim(-1);
    const int64_t e = gating.dim(-1);
    if (k > e) {
      throw std::invalid_argument("moe.topk_softmax: K=" + std::to_string(k) +
                                  " is larger than E=" + std::to_string(e));
    }
    std::vector<double> p(static_cast<size_t>(e));
    std::vector<int64_t> order(static_cast<size_t>(e));
    for (int64_t r = 0; r < gating.rows(1); ++r) {
      double max = -INFINITY;
      for (int64_t j = 0; j < e; ++j) max = std::max(max, gating.get(r * e + j));
      double sum = 0;
      for (int64_t j = 0; j < e; ++j) sum += p[j] = std::exp(gating.get(r * e + j) - max);
      for (int64_t j = 0; j < e; ++j) p[j] /= sum;
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return p[a] > p[b]; });
      double selected = 0;
      for (int64_t i = 0; i < k; ++i) selected += p[order[i]];
      const double scale = renormalize && selected > 0 ? 1.0 / selected : 1.0;
      for (int64_t i = 0; i < k; ++i) {
        weights.set(r * k + i, p[order[i]] * scale);
        ids.set(r * k + i, static_cast<double>(order[i]));
      }
    }
  });
}

}  // namespace kdispatch::reference
