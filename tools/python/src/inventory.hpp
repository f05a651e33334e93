// What the dispatcher knows, as plain Python values: ops, backends,
// selections, op schemas, the plugin report, the error catalogue. Metadata
// only, but for doctor(), which opens every plugin as `kdispatch doctor` does.
#pragma once

#include <pybind11/pybind11.h>

#include <optional>
#include <string>

namespace kdispatch::python {

pybind11::list ops();
pybind11::list backends(const std::string& op, const std::optional<std::string>& device);
pybind11::dict select(const std::string& op, const std::optional<std::string>& backend,
                      const std::optional<std::string>& device, const std::optional<std::string>& dtype);
pybind11::list schemas();
pybind11::dict schema(const std::string& op);
pybind11::dict doctor();
std::string explain(const std::string& code);

}  // namespace kdispatch::python
