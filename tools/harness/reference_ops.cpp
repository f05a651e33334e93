#include "reference_ops.hpp"

#include <dlfcn.h>
#include <kdispatch/plugin_api.h>

#include <cstring>
#include <stdexcept>

#include "raw_call.hpp"

namespace kdispatch::reference {
namespace {

const kd_plugin_api* g_plugin = nullptr;

kd_kernel_fn kernel(const char* symbol) {
  if (g_plugin == nullptr) throw std::runtime_error("the reference plugin is not open (open_reference_plugin)");
  kd_kernel_fn fn = g_plugin->find_kernel(symbol);
  if (fn == nullptr) throw std::runtime_error(std::string("the reference plugin has no kernel ") + symbol);
  return fn;
}

// A tensor over caller-owned data; `shape` must outlive the call.
DLTensor tensor(void* data, DLDataType dtype, std::vector<int64_t>& shape) {
  DLTensor t{};
  t.data = data;
  t.device = {kDLCPU, 0};
  t.ndim = static_cast<int32_t>(shape.size());
  t.dtype = dtype;
  t.shape = shape.data();
  return t;
}

constexpr DLDataType kF64{kDLFloat, 64, 1};
constexpr DLDataType kI32{kDLInt, 32, 1};
constexpr DLDataType kI64{kDLInt, 64, 1};

DLDataType dl_dtype(Dtype dtype) {
  switch (dtype) {
    case Dtype::kFloat32: return {kDLFloat, 32, 1};
    case Dtype::kFloat16: return {kDLFloat, 16, 1};
    case Dtype::kBFloat16: return {kDLBfloat, 16, 1};
  }
  return kF64;
}

// Runs `call`; a refusal becomes std::invalid_argument (std::out_of_range
// with `out_of_range`), any other failure std::runtime_error.
void run(harness::RawCall& call, bool out_of_range = false) {
  const kd_status status = call.run();
  if (status == KD_STATUS_OK) return;
  if (status == KD_STATUS_INVALID_ARGUMENT) {
    if (out_of_range) throw std::out_of_range(call.error);
    throw std::invalid_argument(call.error);
  }
  throw std::runtime_error(call.error);
}

std::vector<double> copy(std::span<const double> v) { return {v.begin(), v.end()}; }

// out [rows, d] = act(x[:, :d]) * x[:, d:] by the reference kernel `symbol`.
std::vector<double> gated(const char* symbol, std::span<const double> x, int64_t rows, int64_t d) {
  std::vector<double> in = copy(x);
  std::vector<double> out(static_cast<size_t>(rows * d));
  std::vector<int64_t> out_shape{rows, d}, in_shape{rows, 2 * d};
  harness::RawCall call;
  call.fn = kernel(symbol);
  call.tensors = {tensor(out.data(), kF64, out_shape), tensor(in.data(), kF64, in_shape)};
  run(call);
  return out;
}

}  // namespace

void open_reference_plugin(const std::string& plugin_dir) {
  if (g_plugin != nullptr) return;
  const std::string path = plugin_dir + "/libkdispatch-reference.so";
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) throw std::runtime_error("dlopen " + path + ": " + dlerror());
  auto entry = reinterpret_cast<kd_plugin_entry_fn>(dlsym(handle, KDISPATCH_PLUGIN_ENTRY_SYMBOL));
  if (entry == nullptr || entry() == nullptr) throw std::runtime_error("no plugin entry in " + path);
  g_plugin = entry();
}

std::vector<double> rmsnorm(std::span<const double> x, std::span<const double> weight, int64_t rows, int64_t h,
                            double eps) {
  std::vector<double> in = copy(x), w = copy(weight);
  std::vector<double> out(static_cast<size_t>(rows * h));
  std::vector<int64_t> shape{rows, h}, w_shape{h};
  harness::RawCall call;
  call.fn = kernel("kd_ref_rmsnorm");
  call.tensors = {tensor(out.data(), kF64, shape), tensor(in.data(), kF64, shape), tensor(w.data(), kF64, w_shape)};
  call.attrs = {harness::float_attr("eps", eps)};
  run(call);
  return out;
}

FusedAddRmsnormResult fused_add_rmsnorm(std::span<const double> x, std::span<const double> residual,
                                        std::span<const double> weight, int64_t rows, int64_t h, double eps,
                                        Dtype dtype) {
  const size_t width = static_cast<size_t>(dtype_size(dtype));
  const auto encoded = [&](std::span<const double> v) {
    std::vector<unsigned char> bytes(v.size() * width);
    for (size_t i = 0; i < v.size(); ++i) {
      const uint32_t bits = encode(dtype, v[i]);
      std::memcpy(bytes.data() + i * width, &bits, width);
    }
    return bytes;
  };
  const auto decoded = [&](const std::vector<unsigned char>& bytes) {
    std::vector<double> v(bytes.size() / width);
    for (size_t i = 0; i < v.size(); ++i) {
      uint32_t bits = 0;
      std::memcpy(&bits, bytes.data() + i * width, width);
      v[i] = decode(dtype, bits);
    }
    return v;
  };
  std::vector<unsigned char> xb = encoded(x), rb = encoded(residual), wb = encoded(weight);
  std::vector<int64_t> shape{rows, h}, w_shape{h};
  harness::RawCall call;
  call.fn = kernel("kd_ref_fused_add_rmsnorm");
  call.tensors = {tensor(xb.data(), dl_dtype(dtype), shape), tensor(rb.data(), dl_dtype(dtype), shape),
                  tensor(wb.data(), dl_dtype(dtype), w_shape)};
  call.attrs = {harness::float_attr("eps", eps)};
  run(call);
  return {decoded(xb), decoded(rb)};
}

std::vector<double> silu_and_mul(std::span<const double> x, int64_t rows, int64_t d) {
  return gated("kd_ref_silu_and_mul", x, rows, d);
}

std::vector<double> gelu_and_mul(std::span<const double> x, int64_t rows, int64_t d) {
  return gated("kd_ref_gelu_and_mul", x, rows, d);
}

std::vector<double> gelu_tanh_and_mul(std::span<const double> x, int64_t rows, int64_t d) {
  return gated("kd_ref_gelu_tanh_and_mul", x, rows, d);
}

RotaryResult rotary_embedding(std::span<const int64_t> positions, std::span<const double> query,
                              std::span<const double> key, std::span<const double> cos_sin_cache, int64_t tokens,
                              int64_t heads_q, int64_t heads_k, int64_t half, bool is_neox) {
  std::vector<int64_t> pos(positions.begin(), positions.end());
  RotaryResult result{copy(query), copy(key)};
  std::vector<double> cache = copy(cos_sin_cache);
  std::vector<int64_t> pos_shape{tokens}, q_shape{tokens, heads_q, 2 * half}, k_shape{tokens, heads_k, 2 * half},
      cache_shape{static_cast<int64_t>(cache.size()) / (2 * half), 2 * half};
  harness::RawCall call;
  call.fn = kernel("kd_ref_rotary_embedding");
  call.tensors = {tensor(pos.data(), kI64, pos_shape), tensor(result.query.data(), kF64, q_shape),
                  tensor(result.key.data(), kF64, k_shape), tensor(cache.data(), kF64, cache_shape)};
  call.attrs = {harness::bool_attr("is_neox", is_neox)};
  run(call, /*out_of_range=*/true);
  return result;
}

TopkSoftmaxResult topk_softmax(std::span<const double> gating, int64_t rows, int64_t e, int64_t k, bool renormalize) {
  std::vector<double> in = copy(gating);
  std::vector<int64_t> in_shape{rows, e};
  const auto call_with = [&](int64_t kk, bool renorm, std::vector<double>& weights, std::vector<int32_t>& ids) {
    weights.assign(static_cast<size_t>(rows * kk), 0.0);
    ids.assign(static_cast<size_t>(rows * kk), 0);
    std::vector<int64_t> out_shape{rows, kk};
    harness::RawCall call;
    call.fn = kernel("kd_ref_topk_softmax");
    call.tensors = {tensor(weights.data(), kF64, out_shape), tensor(ids.data(), kI32, out_shape),
                    tensor(in.data(), kF64, in_shape)};
    call.attrs = {harness::bool_attr("renormalize", renorm)};
    run(call);
  };
  TopkSoftmaxResult result;
  call_with(k, renormalize, result.weights, result.ids);
  // Every expert, unnormalised: the whole softmax, in expert order.
  std::vector<double> sorted;
  std::vector<int32_t> order;
  call_with(e, false, sorted, order);
  result.probabilities.assign(static_cast<size_t>(rows * e), 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < e; ++i) result.probabilities[r * e + order[r * e + i]] = sorted[r * e + i];
  }
  return result;
}

}  // namespace kdispatch::reference
