#include "kdispatch/coverage.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <set>

#include "kdispatch/context.hpp"
#include "kdispatch/selector.hpp"

namespace kdispatch {

namespace fs = std::filesystem;

void CoverageView::add_schema(const OpSchema& schema) { schemas_.emplace(schema.op, &schema); }

void CoverageView::add_manifest(const Manifest& manifest) {
  manifests_.push_back(&manifest);
  for (const OpSchema& s : manifest.ops) add_schema(s);
}

const OpSchema* CoverageView::schema(std::string_view op) const {
  const auto it = schemas_.find(op);
  return it == schemas_.end() ? nullptr : it->second;
}

std::vector<std::string> CoverageView::schema_ops() const {
  std::vector<std::string> out;
  for (const auto& [op, schema] : schemas_) out.push_back(op);
  return out;
}

namespace {

// A kernel of the op other than `self`, of the given role (the kernel's
// own, else its manifest's): in `manifest`, which holds `self`, and in the
// view's other plugins. One manifest may hold both the backend kernel and
// the reference kernel of an op.
struct OtherKernel {
  const KernelSpec* spec;
  const Manifest* manifest;
};

std::vector<OtherKernel> other_kernels(const CoverageView& view, const Manifest& manifest, const KernelSpec* self,
                                       std::string_view op, KernelRole role) {
  std::vector<OtherKernel> out;
  const auto take = [&](const Manifest& m) {
    for (const KernelSpec& k : m.kernels) {
      if (&k != self && k.op == op && k.role == role) out.push_back({&k, &m});
    }
  };
  take(manifest);
  for (const Manifest* m : view.manifests()) {
    if (m->plugin != manifest.plugin) take(*m);
  }
  return out;
}

std::string dtype_names(const std::vector<Dtype>& dtypes) {
  std::vector<std::string_view> names;
  for (Dtype d : dtypes) names.push_back(dtype_name(d));
  return fmt::format("{}", fmt::join(names, ", "));
}

bool contains(const std::vector<Dtype>& dtypes, Dtype d) { return std::find(dtypes.begin(), dtypes.end(), d) != dtypes.end(); }

constexpr std::string_view kNoOutput =
    "no tensor is \"written\" or \"inplace\": nothing a kernel computes can be compared with the reference, so no "
    "check of the op checks anything";

// A plugin named like a reference (a '_'-separated part of its plugin or
// backend name is "ref" or "reference"): one that implements an op that has
// no reference may have lost its "role".
bool named_like_reference(const Manifest& m) {
  for (const std::string* name : {&m.plugin, &m.backend}) {
    size_t start = 0;
    while (start <= name->size()) {
      size_t end = name->find('_', start);
      if (end == std::string::npos) end = name->size();
      const std::string_view part = std::string_view(*name).substr(start, end - start);
      if (part == "ref" || part == "reference") return true;
      start = end + 1;
    }
  }
  return false;
}

// Why nothing checks op `op` of a kernel of `self`, beyond its missing
// reference: a reference declared for a similar op id, or a plugin named
// like a reference that lacks "role": "reference".
std::string missing_reference_hint(const CoverageView& view, const Manifest& self, const std::string& op) {
  std::vector<std::string> reference_ops;
  for (const Manifest* m : view.manifests()) {
    for (const KernelSpec& k : m->kernels) {
      if (k.is_reference() && k.op != op) reference_ops.push_back(k.op);
    }
  }
  for (const std::string& near : closest_ops(op, reference_ops, 1)) {
    return fmt::format("; a reference is declared for op '{}': a typo?", near);
  }
  for (const OtherKernel& k : other_kernels(view, self, nullptr, op, KernelRole::backend)) {
    if (k.manifest != &self && named_like_reference(*k.manifest)) {
      return fmt::format("; plugin '{}' ({}) implements it too, and its manifest lacks \"role\": \"reference\"",
                         k.manifest->plugin, k.manifest->path);
    }
  }
  return "";
}

}  // namespace

std::vector<Problem> check_schema_outputs(const OpSchema& schema, const std::string& file) {
  if (schema.has_output()) return {};
  return {Problem{ErrorCode::op_unchecked, file, fmt::format("{}: op '{}': {}", file, schema.op, kNoOutput), true}};
}

std::vector<Problem> check_manifest_coverage(const Manifest& m, const CoverageView& view) {
  std::vector<Problem> out;
  const auto warn = [&](std::string pointer, std::string what) {
    out.push_back({ErrorCode::op_unchecked, m.path, fmt::format("{}: {}: {}", m.path, pointer, what), true});
  };
  std::vector<std::string> own_ops;
  for (const OpSchema& s : m.ops) own_ops.push_back(s.op);

  for (size_t i = 0; i < m.kernels.size(); ++i) {
    const KernelSpec& k = m.kernels[i];
    const std::string at = fmt::format("/kernels/{}", i);
    const bool reference = k.is_reference();
    const OpSchema* schema = view.schema(k.op);
    for (const OpSchema& s : m.ops) {
      if (schema == nullptr && s.op == k.op) schema = &s;
    }
    if (schema == nullptr) {
      std::vector<std::string> near = closest_ops(k.op, own_ops, 1);
      if (near.empty()) near = closest_ops(k.op, view.schema_ops(), 1);
      warn(at + "/op",
           fmt::format("op '{}' has no op schema (none built in, in this manifest's \"ops\" or in another manifest "
                       "seen){}: `kdispatch run` cannot make its inputs, a checked call of it fails with KD-E030{}",
                       k.op, near.empty() ? "" : fmt::format("; did you mean '{}'?", near.front()),
                       reference ? ", and as a reference it checks nothing" : ""));
      continue;
    }

    const std::vector<Dtype> takes = schema->call_dtypes();
    std::vector<Dtype> outside;
    for (Dtype d : k.dtypes) {
      if (!contains(takes, d)) outside.push_back(d);
    }
    if (!outside.empty()) {
      warn(at + "/dtypes", fmt::format("{} {} not among the dtypes op '{}' takes ({}): no call selects the kernel in {}",
                                       dtype_names(outside), outside.size() == 1 ? "is" : "are", k.op,
                                       dtype_names(takes), outside.size() == 1 ? "it" : "them"));
    }

    const std::vector<OtherKernel> backends = other_kernels(view, m, &k, k.op, KernelRole::backend);
    if (reference) {
      if (backends.empty()) {
        // An op of similar id that backends implement and no reference checks.
        std::vector<std::string> unreferenced;
        for (const Manifest* other : view.manifests()) {
          for (const KernelSpec& ok : other->kernels) {
            if (!ok.is_reference() && ok.op != k.op &&
                other_kernels(view, *other, &ok, ok.op, KernelRole::reference).empty()) {
              unreferenced.push_back(ok.op);
            }
          }
        }
        const std::vector<std::string> near = closest_ops(k.op, unreferenced, 1);
        warn(at + "/op",
             fmt::format("reference kernel of op '{}', which no other kernel implements: it checks nothing{}", k.op,
                         near.empty() ? "" : fmt::format("; did you mean '{}', which has kernels and no reference?",
                                                         near.front())));
        continue;
      }
      // Dtypes backends serve that the reference does not: their results
      // cannot be checked.
      for (Dtype d : takes) {
        if (k.supports(d)) continue;
        for (const OtherKernel& b : backends) {
          if (!b.spec->supports(d)) continue;
          warn(at + "/dtypes", fmt::format("the reference kernel of op '{}' does not serve {}, which backend '{}' "
                                           "serves: its results in {} cannot be checked",
                                           k.op, dtype_name(d), b.spec->backend, dtype_name(d)));
          break;
        }
      }
      continue;
    }

    // A schema dtype that no backend kernel of the view serves is never run.
    std::vector<Dtype> unserved;
    for (Dtype d : takes) {
      if (k.supports(d)) continue;
      const bool served = std::any_of(backends.begin(), backends.end(),
                                      [&](const OtherKernel& b) { return b.spec->supports(d); });
      if (!served) unserved.push_back(d);
    }
    if (!unserved.empty()) {
      warn(at + "/dtypes",
           fmt::format("op '{}' takes {} (its schema: {}), which no backend's kernel serves (this one lists {}): run, "
                       "bench and the conformance suite never call it in {}",
                       k.op, dtype_names(unserved), dtype_names(takes), dtype_names(k.dtypes),
                       unserved.size() == 1 ? "that dtype" : "those dtypes"));
    }
    if (other_kernels(view, m, &k, k.op, KernelRole::reference).empty()) {
      warn(at + "/op", fmt::format("op '{}' has no reference kernel (no plugin with \"role\": \"reference\" implements "
                                   "it): run and bench report its results unchecked{}",
                                   k.op, missing_reference_hint(view, m, k.op)));
    }
  }
  for (const OpSchema& s : m.ops) {
    if (!s.has_output()) warn("/ops", fmt::format("op '{}': {}", s.op, kNoOutput));
  }
  return out;
}

std::vector<Problem> find_orphan_libraries(const fs::path& dir, const std::vector<std::string>& named) {
  std::vector<Problem> out;
  std::error_code ec;
  fs::directory_iterator it(dir, ec);
  if (ec) return out;  // discovery reports a directory it cannot list
  std::vector<fs::path> libraries;
  for (; it != fs::directory_iterator(); it.increment(ec)) {
    if (ec) break;
    const std::string name = it->path().filename().string();
    const size_t so = name.find(".so");
    const bool library = so != std::string::npos && so > 0 &&
                         (so + 3 == name.size() || name[so + 3] == '.');
    if (library && it->is_regular_file(ec)) libraries.push_back(it->path());
  }
  std::sort(libraries.begin(), libraries.end());
  for (const fs::path& library : libraries) {
    const std::string name = library.filename().string();
    if (std::find(named.begin(), named.end(), name) != named.end()) continue;
    // A manifest that names a file that is not there is the likely owner.
    std::string hint;
    for (const std::string& n : named) {
      if (!fs::exists(dir / n, ec)) {
        hint = fmt::format("; a manifest here names '{}', which does not exist", n);
        break;
      }
    }
    out.push_back({ErrorCode::plugin_orphan_library, library.string(),
                   fmt::format("{}: a library that no manifest in {} names (\"library\"): kdispatch never loads it{}",
                               library.string(), dir.string(), hint),
                   /*warning=*/true});
  }
  return out;
}

std::vector<Problem> check_plugins(const Context& context) {
  CoverageView view;
  for (const OpSchema* s : context.registry().schemas()) view.add_schema(*s);
  std::vector<const Manifest*> found;
  for (const PluginRecord& rec : context.discovery().plugins) {
    if (rec.state != PluginState::found || !rec.manifest) continue;
    view.add_manifest(*rec.manifest);
    found.push_back(&*rec.manifest);
  }
  std::vector<Problem> out;
  for (const Manifest* m : found) {
    for (Problem& p : check_manifest_coverage(*m, view)) out.push_back(std::move(p));
  }
  for (const SearchDir& dir : context.discovery().search_path) {
    std::vector<std::string> named;
    for (const PluginRecord& rec : context.discovery().plugins) {
      if (rec.library_path.empty()) continue;
      const fs::path library(rec.library_path);
      std::error_code ec;
      if (fs::equivalent(library.parent_path(), dir.path, ec)) named.push_back(library.filename().string());
    }
    for (Problem& p : find_orphan_libraries(dir.path, named)) out.push_back(std::move(p));
  }
  return out;
}

}  // namespace kdispatch
