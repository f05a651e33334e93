// Checks across manifests, op schemas and plugin folders that no single file
// shows: each file is valid, yet together they leave part of an op unchecked
// (KD-E014: a kernel for an op that has no schema, dtypes the schema does not
// take or that no kernel serves, an op schema with no output, a reference
// that checks nothing, an op without a reference), or leave a library that
// nothing loads (KD-E028). `kdispatch validate` and the doctor report
// (`kdispatch doctor`, kdispatch.doctor()) both ask here. Every problem is a
// warning: nothing here stops a plugin from loading.
#pragma once

#include <kdispatch/export.h>

#include <filesystem>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "kdispatch/error.hpp"
#include "kdispatch/manifest.hpp"
#include "kdispatch/schema.hpp"

namespace kdispatch KDISPATCH_API {

class Context;

// What the checks can see: op schemas, and manifests with their kernels and
// their "ops". Holds pointers: what is added must outlive the view.
class CoverageView {
 public:
  // The first schema of an op id counts; a later one of the same id is
  // ignored (a conflicting one is KD-E005, reported where it is registered).
  void add_schema(const OpSchema& schema);
  // The manifest's kernels, and its "ops" as schemas.
  void add_manifest(const Manifest& manifest);

  const OpSchema* schema(std::string_view op) const;
  std::vector<std::string> schema_ops() const;  // sorted
  const std::vector<const Manifest*>& manifests() const { return manifests_; }

 private:
  std::map<std::string, const OpSchema*, std::less<>> schemas_;
  std::vector<const Manifest*> manifests_;
};

// KD-E014 warnings on `manifest` (which the view holds, or not), each naming
// the JSON pointer of the field: a kernel whose op has no schema (with a
// did-you-mean, the manifest's own "ops" first), kernel dtypes the op's
// schema does not take, schema dtypes that no backend kernel of the view
// serves, a reference kernel whose op no other kernel implements, an op with
// no reference kernel in the view, and an op schema of its "ops" with no
// written or in-place tensor.
std::vector<Problem> check_manifest_coverage(const Manifest& manifest, const CoverageView& view);

// KD-E014 when no tensor of `schema` is "written" or "inplace" (nothing to
// compare); `file` is where the schema was read.
std::vector<Problem> check_schema_outputs(const OpSchema& schema, const std::string& file);

// KD-E028 for each shared library (NAME.so, NAME.so.N...) in `dir` whose file
// name is not among `named`, the libraries the manifests there name: an
// orphan, which no manifest makes kdispatch load.
std::vector<Problem> find_orphan_libraries(const std::filesystem::path& dir, const std::vector<std::string>& named);

// All of the above over a context's plugins: the view holds the context's
// op schemas and the manifests of the plugins found; every such manifest is
// checked, and every directory of the search path is searched for orphans.
std::vector<Problem> check_plugins(const Context& context);

}  // namespace kdispatch
