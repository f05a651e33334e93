// moe.align_block_size: a stable counting sort of the routed pairs by expert.
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include <kdispatch/plugin_helpers.hpp>

#include "kd_plugin_kernels.hpp"
#include "tensor.hpp"

namespace kdispatch::reference {

// kd_ref_moe_align_block_size
// Tensors (topk_ids [*, K] int32 or int64, sorted_token_ids [P],
// expert_ids [M], num_tokens_post_pad [1], the outputs int32), attributes
// num_experts E and block_size B. The N pairs of topk_ids, flat index i,
// grouped by expert in order of i, each group padded with N to a multiple
// of B; ids outside [0, E) skipped; the rest of sorted_token_ids N, of
// expert_ids -1.
kd_status moe_align_block_size(const kd_call_args* args) noexcept {
  return kd_plugin::guarded(args, [&] {
    expect_arity(args, 4, 2, "moe.align_block_size");
    const Tensor ids(args->tensors[0]), sorted(args->tensors[1]), experts(args->tensors[2]),
        post_pad(args->tensors[3]);
    const int64_t e = kd_plugin::int_attr(args, "num_experts");
    const int64_t b = kd_plugin::int_attr(args, "block_size");
    const int64_t n = ids.numel();
    if (e < 1 || b < 1 || e > std::numeric_limits<int32_t>::max() || b > std::numeric_limits<int32_t>::max()) {
      throw std::invalid_argument("moe.align_block_size: num_experts=" + std::to_string(e) +
                                  " and block_size=" + std::to_string(b) + " must be in [1, 2^31)");
    }
    const int64_t worst = n + e * (b - 1);
    if (worst > std::numeric_limits<int32_t>::max() || sorted.numel() < worst || experts.numel() < worst / b) {
      throw std::invalid_argument(
          "moe.align_block_size: sorted_token_ids has " + std::to_string(sorted.numel()) + " elements and expert_ids " +
          std::to_string(experts.numel()) + "; N + num_experts * (block_size - 1) = " + std::to_string(worst) +
          " needs at least that many and " + std::to_string(worst / b) + " (and at most 2^31 - 1)");
    }
    std::vector<int64_t> count(static_cast<size_t>(e), 0);
    for (int64_t i = 0; i < n; ++i) {
      const double id = ids.get(i);
      if (id >= 0 && id < static_cast<double>(e)) ++count[static_cast<size_t>(id)];
    }
    std::vector<int64_t> next(static_cast<size_t>(e));  // the next free position of each expert
    int64_t total = 0;
    for (int64_t x = 0; x < e; ++x) {
      next[x] = total;
      for (int64_t j = total / b; j < (total + (count[x] + b - 1) / b * b) / b; ++j) experts.set(j, static_cast<double>(x));
      total += (count[x] + b - 1) / b * b;
    }
    for (int64_t j = total / b; j < experts.numel(); ++j) experts.set(j, -1);
    for (int64_t p = 0; p < sorted.numel(); ++p) sorted.set(p, static_cast<double>(n));
    for (int64_t i = 0; i < n; ++i) {
      const double id = ids.get(i);
      if (id >= 0 && id < static_cast<double>(e)) sorted.set(next[static_cast<size_t>(id)]++, static_cast<double>(i));
    }
    post_pad.set(0, static_cast<double>(total));
  });
}

}  // namespace kdispatch::reference
