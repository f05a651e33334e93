// The float64 reference (reference_ops.hpp) applied to a call's tensors: the
// cpu backend is checked against it, every other backend against the cpu one.
#include <stdexcept>

#include "harness.hpp"
#include "reference_ops.hpp"

namespace kdispatch::harness {

namespace {

using Outputs = std::vector<std::vector<double>>;

std::vector<double> values(const Buffer& b) {
  std::vector<double> v(b.numel());
  for (size_t i = 0; i < v.size(); ++i) v[i] = b.at(i);
  return v;
}

const AttrValue& attr(const OpSchema& schema, const CallData& data, std::string_view name) {
  for (const auto& a : data.attrs) {
    if (a.name == name) return a.value;
  }
  for (const auto& a : schema.attrs) {
    if (a.name == name && a.default_value) return *a.default_value;
  }
  throw std::invalid_argument("reference: missing attribute " + std::string(name));
}

double attr_f(const OpSchema& s, const CallData& d, std::string_view n) {
  const AttrValue& v = attr(s, d, n);
  if (auto* x = std::get_if<double>(&v)) return *x;
  return static_cast<double>(std::get<int64_t>(v));
}

bool attr_b(const OpSchema& s, const CallData& d, std::string_view n) { return std::get<bool>(attr(s, d, n)); }

int64_t last_dim(const Buffer& b) { return b.shape().empty() ? 1 : b.shape().back(); }
int64_t rows_of(const Buffer& b) { return last_dim(b) == 0 ? 0 : static_cast<int64_t>(b.numel()) / last_dim(b); }

}  // namespace

std::optional<Outputs> reference_outputs(const OpSchema& schema, const CallData& data) {
  const std::string& op = schema.op;
  const auto& t = data.tensors;
  if (op == "layernorm.rmsnorm") {
    return Outputs{reference::rmsnorm(values(t[1]), values(t[2]), rows_of(t[1]), last_dim(t[1]),
                                      attr_f(schema, data, "eps"))};
  }
  if (op == "layernorm.fused_add_rmsnorm") {
    auto r = reference::fused_add_rmsnorm(values(t[0]), values(t[1]), values(t[2]), rows_of(t[0]), last_dim(t[0]),
                                          attr_f(schema, data, "eps"), to_reference(data.dtype));
    return Outputs{std::move(r.x), std::move(r.residual)};
  }
  if (op == "activation.silu_and_mul") return Outputs{reference::silu_and_mul(values(t[1]), rows_of(t[0]), last_dim(t[0]))};
  if (op == "activation.gelu_and_mul") return Outputs{reference::gelu_and_mul(values(t[1]), rows_of(t[0]), last_dim(t[0]))};
  if (op == "activation.gelu_tanh_and_mul") {
    return Outputs{reference::gelu_tanh_and_mul(values(t[1]), rows_of(t[0]), last_dim(t[0]))};
  }
  if (op == "embeddings.rotary_embedding") {
    std::vector<int64_t> positions(t[0].numel());
    for (size_t i = 0; i < positions.size(); ++i) positions[i] = static_cast<int64_t>(t[0].at(i));
    const auto& q = t[1].shape();
    const auto& k = t[2].shape();
    const int64_t two_r = q.back();
    auto r = reference::rotary_embedding(positions, values(t[1]), values(t[2]), values(t[3]),
                                         static_cast<int64_t>(positions.size()), q[q.size() - 2], k[k.size() - 2],
                                         two_r / 2, attr_b(schema, data, "is_neox"));
    return Outputs{std::move(r.query), std::move(r.key)};
  }
  if (op == "moe.topk_softmax") {
    auto r = reference::topk_softmax(values(t[2]), rows_of(t[2]), last_dim(t[2]), last_dim(t[0]),
                                     attr_b(schema, data, "renormalize"));
    return Outputs{std::move(r.weights), std::vector<double>(r.ids.begin(), r.ids.end())};
  }
  return std::nullopt;
}

}  // namespace kdispatch::harness
