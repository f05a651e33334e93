// moe.align_block_size: the N pairs of topk_ids, flat index i, grouped by
// expert in order of i (a stable counting sort), each group padded with N to
// a multiple of block_size; ids outside [0, num_experts) skipped; the rest
// of sorted_token_ids N, of expert_ids -1. One pass counts, one places, on
// one thread: the order of the pairs is the result, and the op moves a few
// bytes per pair.
#include <cstdint>
#include <vector>

#include <kdispatch/plugin_helpers.hpp>

#include "kd_plugin_kernels.hpp"
#include "tensor_access.hpp"

namespace kdispatch::cpu {
namespace {

constexpr const char* kOp = "moe.align_block_size";

template <class Id>
void align(const Id* ids, int64_t n, int64_t num_experts, int64_t block, int32_t* sorted, int64_t sorted_size,
           int32_t* experts, int64_t experts_size, int32_t* post_pad) {
  std::vector<int64_t> next(static_cast<size_t>(num_experts), 0);
  for (int64_t i = 0; i < n; ++i) {
    const Id id = ids[i];
    if (id >= 0 && static_cast<int64_t>(id) < num_experts) ++next[static_cast<size_t>(id)];
  }
  // next[e]: the count of expert e, then the position of its next pair.
  int64_t total = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t padded = (next[e] + block - 1) / block * block;
    for (int64_t j = total / block; j < (total + padded) / block; ++j) experts[j] = static_cast<int32_t>(e);
    next[e] = total;
    total += padded;
  }
  for (int64_t j = total / block; j < experts_size; ++j) experts[j] = -1;
  for (int64_t p = 0; p < sorted_size; ++p) sorted[p] = static_cast<int32_t>(n);
  for (int64_t i = 0; i < n; ++i) {
    const Id id = ids[i];
    if (id >= 0 && static_cast<int64_t>(id) < num_experts) sorted[next[static_cast<size_t>(id)]++] = static_cast<int32_t>(i);
  }
  *post_pad = static_cast<int32_t>(total);
}

}  // namespace

kd_status moe_align_block_size(const kd_call_args* args) noexcept {
  return kd_plugin::guarded(args, [&]() -> kd_status {
    constexpr int kMinNdim[] = {1, 1, 1, 1};
    if (kd_status s = check_arguments(args, kOp, 2, kMinNdim); s != KD_STATUS_OK) return s;
    const DLTensor& ids = args->tensors[0];
    const DLTensor& sorted = args->tensors[1];
    const DLTensor& experts = args->tensors[2];
    const DLTensor& post_pad = args->tensors[3];
    const int64_t num_experts = kd_plugin::int_attr(args, "num_experts");
    const int64_t block = kd_plugin::int_attr(args, "block_size");
    const bool ids64 = is_dtype(ids, kDLInt, 64);
    if (!(ids64 || is_dtype(ids, kDLInt, 32)) || !is_dtype(sorted, kDLInt, 32) || !is_dtype(experts, kDLInt, 32) ||
        !is_dtype(post_pad, kDLInt, 32) || sorted.ndim != 1 || experts.ndim != 1 || post_pad.ndim != 1 ||
        dim(post_pad, 0) != 1) {
      return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT,
                             "%s: expected topk_ids [*, K] int32 or int64, sorted_token_ids [P], expert_ids [M] "
                             "and num_tokens_post_pad [1] int32",
                             kOp);
    }
    if (num_experts < 1 || block < 1 || num_experts > INT32_MAX || block > INT32_MAX) {
      return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT,
                             "%s: num_experts = %lld and block_size = %lld must be in [1, 2^31)", kOp,
                             static_cast<long long>(num_experts), static_cast<long long>(block));
    }
    const int64_t n = leading_rows(ids, 0);
    const int64_t worst = n + num_experts * (block - 1);
    const int64_t p = dim(sorted, 0);
    const int64_t m = dim(experts, 0);
    if (worst > INT32_MAX || p < worst || m < worst / block) {
      return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT,
                             "%s: sorted_token_ids has %lld elements and expert_ids %lld; N + num_experts * "
                             "(block_size - 1) = %lld needs at least that many and %lld (and at most 2^31 - 1)",
                             kOp, static_cast<long long>(p), static_cast<long long>(m),
                             static_cast<long long>(worst), static_cast<long long>(worst / block));
    }
    auto* sorted_data = data_as<int32_t>(sorted);
    auto* experts_data = data_as<int32_t>(experts);
    auto* post_pad_data = data_as<int32_t>(post_pad);
    if (ids64) {
      align(data_as<const int64_t>(ids), n, num_experts, block, sorted_data, p, experts_data, m, post_pad_data);
    } else {
      align(data_as<const int32_t>(ids), n, num_experts, block, sorted_data, p, experts_data, m, post_pad_data);
    }
    return KD_STATUS_OK;
  });
}

}  // namespace kdispatch::cpu
