#include "kdispatch/selector.hpp"

#include <fmt/format.h>

#include <algorithm>

#include "kdispatch/environment.hpp"
#include "kdispatch/log.hpp"
#include "constraint.hpp"

namespace kdispatch {

namespace {

std::string backend_list(const std::vector<const KernelSpec*>& specs) {
  std::vector<std::string_view> names;
  for (const auto* s : specs) names.push_back(s->backend);
  return fmt::format("[{}]", fmt::join(names, ", "));
}

std::string dtype_list(const std::vector<Dtype>& dtypes) {
  std::vector<std::string_view> names;
  for (Dtype d : dtypes) names.push_back(dtype_name(d));
  return fmt::format("[{}]", fmt::join(names, ", "));
}

bool declares(const PluginFailure& f, std::string_view op) {
  return std::find(f.ops.begin(), f.ops.end(), op) != f.ops.end();
}

// Why `f` gives no kernel for `op`, in one line. A plugin whose invalid
// manifest declares the op says so, with the manifest's first problem.
std::string failure_text(const PluginFailure& f, std::string_view op) {
  const std::string more =
      f.more_problems == 0
          ? std::string()
          : fmt::format(" (and {} more problem{})", f.more_problems, f.more_problems == 1 ? "" : "s");
  if (f.manifest_invalid && !f.backend.empty() && declares(f, op)) {
    // Problem messages start with the file, which this line names already.
    std::string_view problem = f.problem.message;
    if (problem.starts_with(f.manifest) && problem.substr(f.manifest.size()).starts_with(": ")) {
      problem.remove_prefix(f.manifest.size() + 2);
    }
    return fmt::format("plugin '{}' declares backend '{}' for this op but its manifest {} is invalid: [{}] {}{}",
                       f.plugin.empty() ? "?" : f.plugin, f.backend, f.manifest, code_string(f.problem.code),
                       problem, more);
  }
  return fmt::format("plugin '{}'{} was not loaded: [{}] {}{}", f.plugin.empty() ? "?" : f.plugin,
                     f.manifest.empty() ? "" : fmt::format(" ({})", f.manifest), code_string(f.problem.code),
                     f.problem.message, more);
}

size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

}  // namespace

const char* const kReferenceOnlyWhenAsked =
    "a reference kernel, which runs only when named (backend=...) or forced (KDISPATCH_FORCE_BACKEND)";
const char* const kOptInOnlyWhenAsked =
    "opt-in: runs only when named (backend=...), forced (KDISPATCH_FORCE_BACKEND) or listed in "
    "KDISPATCH_BACKEND_ORDER";

namespace {

// Whether `spec` answers to the backend name `name`: its own, or "reference"
// for the op's reference kernel whatever its plugin calls its backend.
bool answers_to(const KernelSpec& spec, std::string_view name) {
  return spec.backend == name || (name == kReferenceBackend && spec.is_reference());
}

}  // namespace

SelectorOptions SelectorOptions::from_environment() {
  SelectorOptions options;
  if (auto force = get_env("KDISPATCH_FORCE_BACKEND")) options.force_backend = *force;
  if (auto order = get_env("KDISPATCH_BACKEND_ORDER")) options.backend_order = split_list(*order, ',');
  return options;
}

std::vector<std::string> closest_ops(std::string_view op, const std::vector<std::string>& candidates,
                                     size_t max_results) {
  // Suggestions are for typos. The distance is quadratic in the lengths, so
  // an id longer than any real op id gets none, and a pair whose lengths
  // differ by more than the limit (a lower bound of their distance) is not
  // compared at all.
  constexpr size_t kMaxSuggestedLength = 256;
  if (op.size() > kMaxSuggestedLength) return {};
  std::vector<std::pair<size_t, std::string>> scored;
  const size_t limit = std::max<size_t>(2, op.size() / 3);
  const auto within = [&](std::string_view c, size_t extra) {
    const size_t gap = op.size() > c.size() ? op.size() - c.size() : c.size() - op.size();
    return gap + extra <= limit;
  };
  for (const auto& c : candidates) {
    size_t d = within(c, 0) ? edit_distance(op, c) : limit + 1;
    // "rmsnorm" should suggest "layernorm.rmsnorm": a match on the name part.
    const auto dot = c.find('.');
    if (dot != std::string::npos && within(std::string_view(c).substr(dot + 1), 1)) {
      d = std::min(d, edit_distance(op, std::string_view(c).substr(dot + 1)) + 1);
    }
    if (d <= limit) scored.emplace_back(d, c);
  }
  std::sort(scored.begin(), scored.end());
  std::vector<std::string> out;
  for (size_t i = 0; i < scored.size() && i < max_results; ++i) out.push_back(scored[i].second);
  return out;
}

Selector::Selector(const KernelRegistry& registry, SelectorOptions options)
    : registry_(registry), options_(std::move(options)) {}

Selector::~Selector() = default;

std::vector<Eligibility> Selector::eligibility(std::string_view op, const Device& device, std::optional<Dtype> dtype,
                                               const ConstraintCall* call) const {
  std::vector<Eligibility> out;
  for (const KernelSpec* spec : registry_.get(op)) {
    Eligibility e{spec, true, {}};
    std::string why;
    if (!targets_match(spec->targets, device, &why)) {
      e.eligible = false;
      e.reason = std::move(why);
    } else if (dtype && !spec->supports(*dtype)) {
      e.eligible = false;
      e.reason = fmt::format("does not support dtype {} (supports {})", dtype_name(*dtype), dtype_list(spec->dtypes));
    } else if (call != nullptr && !spec->constraints.empty()) {
      const ConstraintSet set = compile_constraints(*spec, call->names);
      Constraint::Result result{};
      if (const Constraint* failed = set.first_failing(call->input, &result)) {
        e.eligible = false;
        e.reason = failed->explain(result, call->input);
      }
    }
    out.push_back(std::move(e));
  }
  return out;
}

const KernelSpec& Selector::select(const SelectRequest& request) const {
  const std::string device = request.device.str();
  const std::vector<const KernelSpec*> specs = registry_.get(request.op);
  const std::vector<PluginFailure> failures = registry_.failures();
  const auto failures_for = [&](auto&& pred) {
    std::vector<std::string> lines;
    for (const auto& f : failures) {
      if (pred(f)) lines.push_back(failure_text(f, request.op));
    }
    return lines;
  };
  const auto declares_op = [&](const PluginFailure& f) { return declares(f, request.op); };

  // Rule 1: the op is unknown. Plugins that declare it but failed say why
  // in the message; every other failure is a hint.
  if (specs.empty()) {
    std::string message = fmt::format("No kernels registered for op '{}'", request.op);
    std::vector<std::string> hints = failures_for(declares_op);
    if (!hints.empty()) message += fmt::format(": {}", fmt::join(hints, "; "));
    for (const auto& s : closest_ops(request.op, registry_.ops())) hints.push_back(fmt::format("did you mean '{}'?", s));
    for (auto& line : failures_for([&](const PluginFailure& f) { return !declares_op(f); })) {
      hints.push_back(std::move(line));
    }
    throw SelectionError(ErrorCode::unknown_op, std::move(message), std::move(hints));
  }

  // Rule 2: a backend is named. "reference" names the op's reference
  // kernel, whatever backend name its plugin gives it.
  if (!request.backend.empty()) {
    auto it = std::find_if(specs.begin(), specs.end(), [&](const KernelSpec* s) { return s->backend == request.backend; });
    if (it == specs.end() && request.backend == kReferenceBackend) {
      const KernelSpec* reference = registry_.reference(request.op);
      it = std::find(specs.begin(), specs.end(), reference);
    }
    if (it == specs.end()) {
      std::string message = fmt::format("No '{}' backend registered for op '{}' (registered: {})", request.backend,
                                        request.op, backend_list(specs));
      const auto why = failures_for([&](const PluginFailure& f) { return f.backend == request.backend; });
      if (!why.empty()) message += fmt::format(": {}", fmt::join(why, "; "));
      throw SelectionError(ErrorCode::backend_not_registered, std::move(message), why);
    }
    const KernelSpec& spec = **it;
    std::string why;
    if (!targets_match(spec.targets, request.device, &why)) {
      throw SelectionError(ErrorCode::backend_not_usable,
                           fmt::format("Backend '{}' is registered for op '{}' but not usable on device '{}': {}",
                                       request.backend, request.op, device, why));
    }
    if (request.dtype && !spec.supports(*request.dtype)) {
      throw CallError(ErrorCode::dtype_not_supported,
                      fmt::format("Backend '{}' for op '{}' does not support dtype {} (supports {})", request.backend,
                                  request.op, dtype_name(*request.dtype), dtype_list(spec.dtypes)));
    }
    if (request.call != nullptr && !spec.constraints.empty()) {
      const ConstraintSet set = compile_constraints(spec, request.call->names);
      Constraint::Result result{};
      if (const Constraint* failed = set.first_failing(request.call->input, &result)) {
        throw SelectionError(ErrorCode::no_usable_backend,
                             fmt::format("op '{}' has no backend usable for this call on device '{}': {}: {}",
                                         request.op, device, spec.backend, failed->explain(result, request.call->input)));
      }
    }
    return spec;
  }

  // Rule 3: filter by device and dtype, then choose. A reference kernel
  // can only be forced: it makes no call ambiguous and is never the one
  // usable backend. An opt-in kernel takes part only when its backend is
  // in the preference order.
  const std::vector<Eligibility> checked = eligibility(request.op, request.device, request.dtype, request.call);
  std::vector<const KernelSpec*> usable;  // references and opt-ins included: what force may pick
  std::vector<const KernelSpec*> eligible;
  const auto ordered = [&](const KernelSpec* s) {
    return std::find(options_.backend_order.begin(), options_.backend_order.end(), s->backend) !=
           options_.backend_order.end();
  };
  for (const auto& e : checked) {
    if (!e.eligible) continue;
    usable.push_back(e.spec);
    if (!e.spec->is_reference() && (!e.spec->opt_in || ordered(e.spec))) eligible.push_back(e.spec);
  }

  if (!options_.force_backend.empty()) {
    for (const KernelSpec* s : usable) {
      if (answers_to(*s, options_.force_backend)) return *s;
    }
    bool first_time;
    {
      std::lock_guard lock(warned_mutex_);
      first_time = warned_ops_.emplace(request.op).second;
    }
    if (first_time) {
      log(LogLevel::warn, "KDISPATCH_FORCE_BACKEND={} is not usable for op '{}' on device '{}'; selecting normally",
          options_.force_backend, request.op, device);
    }
  }

  if (eligible.size() == 1) return *eligible.front();

  if (eligible.empty()) {
    std::vector<std::string> reasons;
    for (const auto& e : checked) {
      const std::string_view why = !e.eligible              ? std::string_view(e.reason)
                                   : e.spec->is_reference() ? std::string_view(kReferenceOnlyWhenAsked)
                                                            : std::string_view(kOptInOnlyWhenAsked);
      reasons.push_back(fmt::format("{}: {}", e.spec->backend, why));
    }
    for (auto& line : failures_for(declares_op)) reasons.push_back(std::move(line));
    throw SelectionError(ErrorCode::no_usable_backend,
                         fmt::format("op '{}' has no backend usable on device '{}' (registered: {}): {}", request.op,
                                     device, backend_list(specs), fmt::join(reasons, "; ")),
                         reasons);
  }

  for (const auto& preferred : options_.backend_order) {
    for (const KernelSpec* s : eligible) {
      if (s->backend == preferred) return *s;
    }
  }
  throw SelectionError(ErrorCode::ambiguous_backend,
                       fmt::format("op '{}' has multiple backends usable on device '{}' ({}); pass backend=... to "
                                   "choose one",
                                   request.op, device, backend_list(eligible)),
                       {"or set a preference order, e.g. KDISPATCH_BACKEND_ORDER=" +
                        fmt::format("{}", fmt::join([&] {
                                      std::vector<std::string_view> n;
                                      for (const auto* s : eligible) n.push_back(s->backend);
                                      return n;
                                    }(),
                                                    ","))});
}

}  // namespace kdispatch
