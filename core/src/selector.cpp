#include "kdispatch/selector.hpp"

#include <fmt/format.h>

#include <algorithm>

#include "kdispatch/environment.hpp"
#include "kdispatch/log.hpp"
#include "constraint.hpp"
#include "preference_file.hpp"
#include "tuning_set.hpp"

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
  if (auto fallback = get_env("KDISPATCH_FALLBACK"); fallback && !fallback->empty()) {
    if (*fallback == "1") {
      options.fallback = true;
    } else if (*fallback != "0") {
      log(LogLevel::warn, "KDISPATCH_FALLBACK={}: expected 1 (on) or 0 (off); fallback stays off", *fallback);
    }
  }
  if (auto file = get_env("KDISPATCH_TUNING_FILE"); file && !file->empty()) options.tuning_file = *file;
  if (auto file = get_env("KDISPATCH_PREFERENCE_FILE"); file && !file->empty()) {
    PreferenceFileResult read = read_preference_file(*file);
    for (Problem& p : read.warnings) {
      log(LogLevel::warn, "KDISPATCH_PREFERENCE_FILE: [{}] {}", code_string(p.code), p.message);
      options.problems.push_back(std::move(p));
    }
    for (Problem& p : read.errors) {
      log(LogLevel::warn, "KDISPATCH_PREFERENCE_FILE: [{}] {}; the file is ignored", code_string(p.code), p.message);
      options.problems.push_back(std::move(p));
    }
    options.preferences = std::move(read.preferences);
  }
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
                                               const ConstraintCall* call, int32_t device_id) const {
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
    if (e.eligible) {
      if (const auto d = demotion(op, spec->backend, device.type, device_id)) {
        e.eligible = false;
        e.reason = fmt::format("demoted for this op on {} after its kernel failed: {}", d->device(), d->error);
      }
    }
    out.push_back(std::move(e));
  }
  return out;
}

Selection Selector::choose(const SelectRequest& request) const {
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
    return {&spec, SelectionRule::named, {&spec}, {}};
  }

  // Rule 3: filter by device and dtype, then choose. A reference kernel
  // can only be forced: it makes no call ambiguous and is never the one
  // usable backend. An opt-in kernel takes part only when its backend is
  // in the op's preference or the global order, or a tuned choice names it.
  const std::vector<std::string> preferred = preference(request.op);
  const auto position = [](const std::vector<std::string>& list, const KernelSpec* s) {
    return static_cast<size_t>(std::find(list.begin(), list.end(), s->backend) - list.begin());
  };
  const std::vector<Eligibility> checked =
      eligibility(request.op, request.device, request.dtype, request.call, request.device_id);
  std::vector<const KernelSpec*> usable;  // references and opt-ins included: what force may pick
  for (const auto& e : checked) {
    if (e.eligible) usable.push_back(e.spec);
  }
  const std::shared_ptr<const TuningSet> tuning = this->tuning();
  const std::string_view tuned = tuned_backend(request, usable, tuning.get());
  std::vector<const KernelSpec*> eligible;
  for (const KernelSpec* s : usable) {
    const bool listed = position(preferred, s) < preferred.size() ||
                        position(options_.backend_order, s) < options_.backend_order.size() ||
                        (!tuned.empty() && s->backend == tuned);
    if (!s->is_reference() && (!s->opt_in || listed)) eligible.push_back(s);
  }

  // The ranking: each rule's key, compared in rule order; the registry's
  // order (by backend name) is kept among equals.
  struct Ranked {
    const KernelSpec* spec;
    size_t preference;
    size_t tuned;  // 0: the tuned choice's backend
    size_t order;
    int32_t priority;
  };
  std::vector<Ranked> ranked;
  for (const KernelSpec* s : eligible) {
    ranked.push_back({s, position(preferred, s), !tuned.empty() && s->backend == tuned ? size_t{0} : size_t{1},
                      position(options_.backend_order, s), s->priority});
  }
  std::stable_sort(ranked.begin(), ranked.end(), [](const Ranked& a, const Ranked& b) {
    if (a.preference != b.preference) return a.preference < b.preference;
    if (a.tuned != b.tuned) return a.tuned < b.tuned;
    if (a.order != b.order) return a.order < b.order;
    return a.priority > b.priority;
  });
  Selection selection;
  for (const Ranked& r : ranked) selection.ranked.push_back(r.spec);
  if (request.call == nullptr) selection.conditional = conditional_choices(request, usable, tuning.get());

  if (!options_.force_backend.empty()) {
    for (const KernelSpec* s : usable) {
      if (!answers_to(*s, options_.force_backend)) continue;
      selection.ranked.erase(std::remove(selection.ranked.begin(), selection.ranked.end(), s), selection.ranked.end());
      selection.ranked.insert(selection.ranked.begin(), s);
      selection.spec = s;
      selection.rule = SelectionRule::forced;
      return selection;
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

  if (ranked.empty()) {
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

  selection.spec = ranked.front().spec;
  if (ranked.size() == 1) {
    selection.rule = SelectionRule::only;
    return selection;
  }
  const Ranked& first = ranked[0];
  const Ranked& second = ranked[1];
  if (first.preference != second.preference) {
    selection.rule = SelectionRule::preference;
  } else if (first.tuned != second.tuned) {
    selection.rule = SelectionRule::tuned;
  } else if (first.order != second.order) {
    selection.rule = SelectionRule::order;
  } else if (first.priority != second.priority) {
    selection.rule = SelectionRule::priority;
  } else {
    std::vector<const KernelSpec*> tied;
    std::vector<std::string_view> names;
    for (const Ranked& r : ranked) {
      if (r.preference != first.preference || r.tuned != first.tuned || r.order != first.order ||
          r.priority != first.priority) {
        break;
      }
      tied.push_back(r.spec);
      names.push_back(r.spec->backend);
    }
    throw SelectionError(
        ErrorCode::ambiguous_backend,
        fmt::format("op '{}' has multiple backends usable on device '{}' ({}); pass backend=... to choose one",
                    request.op, device, backend_list(tied)),
        {fmt::format("or rank them: a preference for the op (KDISPATCH_PREFERENCE_FILE, kdispatch.set_preference), "
                     "a tuning file (kdispatch tune, KDISPATCH_TUNING_FILE), "
                     "or KDISPATCH_BACKEND_ORDER={}",
                     fmt::join(names, ","))});
  }
  return selection;
}

void Selector::set_preference(std::string_view op, std::vector<std::string> backends) {
  if (backends.empty()) {
    std::lock_guard lock(preferences_mutex_);
    if (auto it = options_.preferences.find(op); it != options_.preferences.end()) options_.preferences.erase(it);
    return;
  }
  const std::vector<const KernelSpec*> specs = registry_.get(op);
  if (specs.empty()) select({op, {}, Device::host_cpu(), std::nullopt});  // words KD-E001, with did-you-mean
  for (size_t i = 0; i < backends.size(); ++i) {
    const std::string& name = backends[i];
    if (std::find(backends.begin(), backends.begin() + static_cast<std::ptrdiff_t>(i), name) !=
        backends.begin() + static_cast<std::ptrdiff_t>(i)) {
      throw SelectionError(ErrorCode::backend_not_registered,
                           fmt::format("preference for op '{}' names backend '{}' twice", op, name));
    }
    if (std::none_of(specs.begin(), specs.end(), [&](const KernelSpec* s) { return s->backend == name; })) {
      throw SelectionError(ErrorCode::backend_not_registered,
                           fmt::format("No '{}' backend registered for op '{}' (registered: {}); the preference is "
                                       "unchanged",
                                       name, op, backend_list(specs)));
    }
  }
  std::lock_guard lock(preferences_mutex_);
  options_.preferences.insert_or_assign(std::string(op), std::move(backends));
}

std::vector<std::string> Selector::preference(std::string_view op) const {
  std::lock_guard lock(preferences_mutex_);
  const auto it = options_.preferences.find(op);
  return it == options_.preferences.end() ? std::vector<std::string>{} : it->second;
}

void Selector::set_tuning_file(const std::filesystem::path& path) {
  std::shared_ptr<const TuningSet> set;
  if (!path.empty()) set = compile_tuning(read_tuning_file(path, registry_), registry_);
  std::lock_guard lock(tuning_mutex_);
  tuning_ = std::move(set);
}

std::string Selector::tuning_file() const {
  std::lock_guard lock(tuning_mutex_);
  return tuning_ ? tuning_->file.path : std::string();
}

std::shared_ptr<const TuningSet> Selector::tuning() const {
  std::lock_guard lock(tuning_mutex_);
  return tuning_;
}

void Selector::set_machine_key(MachineKey key) { machine_key_ = std::move(key); }

std::vector<Problem> Selector::tuning_problems() const {
  std::lock_guard lock(tuning_mutex_);
  return tuning_problems_;
}

std::vector<Problem> Selector::check_tuning() const {
  if (const std::shared_ptr<const TuningSet> set = tuning()) tuning_applies(*set);
  return tuning_problems();
}

void Selector::add_tuning_problem(Problem problem) {
  std::lock_guard lock(tuning_mutex_);
  tuning_problems_.push_back(std::move(problem));
}

bool Selector::tuning_applies(const TuningSet& tuning) const {
  std::call_once(tuning.checked, [&] {
    if (!machine_key_) {
      tuning.active = true;
      return;
    }
    std::vector<std::string> backends;
    for (const auto& entry : tuning.file.key.backends) backends.push_back(entry.first);
    std::string mismatch;
    try {
      mismatch = tuning_key_mismatch(tuning.file.key, machine_key_(tuning.file.key.device, backends));
    } catch (const Error& e) {
      mismatch = e.message();
    }
    tuning.active = mismatch.empty();
    if (tuning.active) return;
    tuning.mismatch = mismatch;
    const std::string message = fmt::format(
        "{}: made for another machine or build ({}); the tuning file is ignored", tuning.file.path, mismatch);
    log(LogLevel::warn, "[{}] {}", code_string(ErrorCode::manifest_bad_field), message);
    std::lock_guard lock(tuning_mutex_);
    tuning_problems_.push_back({ErrorCode::manifest_bad_field, tuning.file.path, message, /*warning=*/true});
  });
  return tuning.active;
}

std::string_view Selector::tuned_backend(const SelectRequest& request, const std::vector<const KernelSpec*>& usable,
                                         const TuningSet* tuning) const {
  if (tuning == nullptr || !request.dtype || tuning->file.key.device != request.device.type) return {};
  const std::vector<TunedChoice>* choices = tuning->choices(request.op);
  if (choices == nullptr || !tuning_applies(*tuning)) return {};
  for (const TunedChoice& c : *choices) {
    if (c.dtype != *request.dtype) continue;
    if (c.when) {
      // Without the call's values, only the choices for every call apply.
      if (request.call == nullptr || c.when->evaluate(request.call->input) != Constraint::Result::holds) continue;
    }
    for (const KernelSpec* s : usable) {
      if (s->backend == c.backend && !s->is_reference()) return c.backend;
    }
  }
  return {};
}

std::vector<ConditionalChoice> Selector::conditional_choices(const SelectRequest& request,
                                                             const std::vector<const KernelSpec*>& usable,
                                                             const TuningSet* tuning) const {
  std::vector<ConditionalChoice> out;
  if (tuning == nullptr || tuning->file.key.device != request.device.type) return out;
  const std::vector<TunedChoice>* choices = tuning->choices(request.op);
  if (choices == nullptr || !tuning_applies(*tuning)) return out;
  for (const TunedChoice& c : *choices) {
    if (!c.when || (request.dtype && c.dtype != *request.dtype)) continue;
    const bool here = std::any_of(usable.begin(), usable.end(),
                                  [&](const KernelSpec* s) { return s->backend == c.backend && !s->is_reference(); });
    if (here) out.push_back({c.dtype, c.when->text(), c.backend});
  }
  return out;
}

std::string Demotion::device() const { return fmt::format("{}:{}", device_type_name(device_type), device_id); }

bool Selector::demote(std::string_view op, std::string_view backend, DeviceType type, int32_t id, std::string error) {
  std::lock_guard lock(demoted_mutex_);
  for (const Demotion& d : demoted_) {
    if (d.op == op && d.backend == backend && d.device_type == type && d.device_id == id) return false;
  }
  demoted_.push_back({std::string(op), std::string(backend), type, id, std::move(error)});
  demoted_count_.store(demoted_.size(), std::memory_order_release);
  return true;
}

std::optional<Demotion> Selector::demotion(std::string_view op, std::string_view backend, DeviceType type,
                                           int32_t id) const {
  if (demoted_count_.load(std::memory_order_acquire) == 0) return std::nullopt;
  std::lock_guard lock(demoted_mutex_);
  for (const Demotion& d : demoted_) {
    if (d.op == op && d.backend == backend && d.device_type == type && d.device_id == id) return d;
  }
  return std::nullopt;
}

std::vector<Demotion> Selector::demotions() const {
  std::lock_guard lock(demoted_mutex_);
  return demoted_;
}

std::string_view rule_name(SelectionRule rule) {
  switch (rule) {
    case SelectionRule::only: return "only";
    case SelectionRule::named: return "named";
    case SelectionRule::forced: return "forced";
    case SelectionRule::preference: return "preference";
    case SelectionRule::tuned: return "tuned";
    case SelectionRule::order: return "order";
    case SelectionRule::priority: return "priority";
  }
  return "?";
}

}  // namespace kdispatch
