// Float64 references of the built-in ops: the documented formulas of
// manifests/ops/*.json, computed from the (already rounded) inputs. The cpu
// backend is checked against these; every other backend against the cpu one.
#include <algorithm>
#include <cmath>
#include <numeric>

#include "harness.hpp"

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

// y = x * rsqrt(mean(x^2) + eps) * w, row by row.
std::vector<double> rmsnorm(const std::vector<double>& x, const std::vector<double>& w, double eps) {
  const size_t h = w.size();
  std::vector<double> out(x.size());
  for (size_t r = 0; h > 0 && r < x.size() / h; ++r) {
    double sum = 0;
    for (size_t i = 0; i < h; ++i) sum += x[r * h + i] * x[r * h + i];
    const double inv = 1.0 / std::sqrt(sum / static_cast<double>(h) + eps);
    for (size_t i = 0; i < h; ++i) out[r * h + i] = x[r * h + i] * inv * w[i];
  }
  return out;
}

template <class Act>
std::vector<double> act_and_mul(const std::vector<double>& x, size_t d, Act act) {
  const size_t rows = d == 0 ? 0 : x.size() / (2 * d);
  std::vector<double> out(rows * d);
  for (size_t r = 0; r < rows; ++r) {
    for (size_t i = 0; i < d; ++i) out[r * d + i] = act(x[r * 2 * d + i]) * x[r * 2 * d + d + i];
  }
  return out;
}

Outputs rotary(const OpSchema& schema, const CallData& data) {
  const std::vector<double> pos = values(data.tensors[0]);
  std::vector<double> q = values(data.tensors[1]);
  std::vector<double> k = values(data.tensors[2]);
  const std::vector<double> cache = values(data.tensors[3]);
  const bool neox = attr_b(schema, data, "is_neox");
  const auto& qshape = data.tensors[1].shape();
  const auto& kshape = data.tensors[2].shape();
  const size_t two_r = static_cast<size_t>(qshape.back());
  const size_t r = two_r / 2;
  const size_t hq = static_cast<size_t>(qshape[qshape.size() - 2]);
  const size_t hk = static_cast<size_t>(kshape[kshape.size() - 2]);
  const auto rotate = [&](std::vector<double>& t, size_t heads, size_t token, size_t p) {
    for (size_t h = 0; h < heads; ++h) {
      double* row = &t[(token * heads + h) * two_r];
      for (size_t i = 0; i < r; ++i) {
        const double c = cache[p * two_r + i];
        const double s = cache[p * two_r + r + i];
        const size_t ia = neox ? i : 2 * i;
        const size_t ib = neox ? i + r : 2 * i + 1;
        const double a = row[ia];
        const double b = row[ib];
        row[ia] = a * c - b * s;
        row[ib] = b * c + a * s;
      }
    }
  };
  for (size_t t = 0; t < pos.size(); ++t) {
    const auto p = static_cast<size_t>(pos[t]);
    rotate(q, hq, t, p);
    rotate(k, hk, t, p);
  }
  return {q, k};
}

Outputs topk_softmax(const OpSchema& schema, const CallData& data) {
  const std::vector<double> logits = values(data.tensors[2]);
  const size_t k = static_cast<size_t>(data.tensors[0].shape().back());
  const size_t e = static_cast<size_t>(data.tensors[2].shape().back());
  const bool renormalize = attr_b(schema, data, "renormalize");
  const size_t rows = e == 0 ? 0 : logits.size() / e;
  std::vector<double> weights(rows * k);
  std::vector<double> ids(rows * k);
  std::vector<size_t> order(e);
  for (size_t r = 0; r < rows; ++r) {
    const double* row = &logits[r * e];
    const double max = *std::max_element(row, row + e);
    std::vector<double> p(e);
    double sum = 0;
    for (size_t i = 0; i < e; ++i) sum += p[i] = std::exp(row[i] - max);
    for (double& v : p) v /= sum;
    std::iota(order.begin(), order.end(), size_t{0});
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return p[a] > p[b]; });
    double picked = 0;
    for (size_t j = 0; j < k; ++j) picked += p[order[j]];
    for (size_t j = 0; j < k; ++j) {
      weights[r * k + j] = renormalize ? p[order[j]] / picked : p[order[j]];
      ids[r * k + j] = static_cast<double>(order[j]);
    }
  }
  return {weights, ids};
}

}  // namespace

std::optional<Outputs> reference_outputs(const OpSchema& schema, const CallData& data) {
  const std::string& op = schema.op;
  if (op == "layernorm.rmsnorm") {
    return Outputs{rmsnorm(values(data.tensors[1]), values(data.tensors[2]), attr_f(schema, data, "eps"))};
  }
  if (op == "layernorm.fused_add_rmsnorm") {
    const std::vector<double> x = values(data.tensors[0]);
    std::vector<double> residual = values(data.tensors[1]);
    // The sum is stored in the tensor's dtype and normalised from there.
    for (size_t i = 0; i < residual.size(); ++i) residual[i] = round_to(data.dtype, x[i] + residual[i]);
    return Outputs{rmsnorm(residual, values(data.tensors[2]), attr_f(schema, data, "eps")), residual};
  }
  const auto d = [&] { return static_cast<size_t>(data.tensors[0].shape().back()); };
  if (op == "activation.silu_and_mul") {
    return Outputs{act_and_mul(values(data.tensors[1]), d(), [](double a) { return a / (1.0 + std::exp(-a)); })};
  }
  if (op == "activation.gelu_and_mul") {
    return Outputs{act_and_mul(values(data.tensors[1]), d(),
                               [](double a) { return 0.5 * a * (1.0 + std::erf(a / std::sqrt(2.0))); })};
  }
  if (op == "activation.gelu_tanh_and_mul") {
    return Outputs{act_and_mul(values(data.tensors[1]), d(), [](double a) {
      const double k = std::sqrt(2.0 / M_PI);
      return 0.5 * a * (1.0 + std::tanh(k * (a + 0.044715 * a * a * a)));
    })};
  }
  if (op == "embeddings.rotary_embedding") return rotary(schema, data);
  if (op == "moe.topk_softmax") return topk_softmax(schema, data);
  return std::nullopt;
}

}  // namespace kdispatch::harness
