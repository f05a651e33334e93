// kdispatch._kdispatch: the extension module under the `kdispatch` package.
// The package's __init__.py re-exports what users call; kdispatch.torch
// registers the torch custom ops on top of it.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <pybind11/stl/filesystem.h>

#include <kdispatch/error_catalogue.hpp>
#include <kdispatch/tuning.hpp>

#include <fstream>
#include <set>

#include "errors.hpp"
#include "inventory.hpp"
#include "op_call.hpp"
#include "runtime.hpp"
#include "runtime_kernels.hpp"
#include "tensor_args.hpp"
#include "testing.hpp"

namespace py = pybind11;
using namespace kdispatch::python;

namespace {

kdispatch::DeviceType tuning_device(const std::string& device) {
  const auto type = kdispatch::parse_device_type(device);
  if (!type) throw py::value_error("device '" + device + "': expected 'cpu', 'cuda' or 'hip'");
  return *type;
}

// The non-reference backends with a kernel for devices of `type`.
std::vector<std::string> backends_on(const kdispatch::Context& ctx, kdispatch::DeviceType type) {
  std::set<std::string> names;
  for (const std::string& op : ctx.registry().ops()) {
    for (const kdispatch::KernelSpec* s : ctx.registry().get(op)) {
      if (s->is_reference()) continue;
      bool on = s->targets.empty();
      for (const auto& t : s->targets) on = on || t.device == type;
      if (on) names.insert(s->backend);
    }
  }
  return {names.begin(), names.end()};
}

}  // namespace

PYBIND11_MODULE(_kdispatch, m) {
  m.doc() = "kdispatch: kernel dispatcher with plugin backends (C++ core bindings)";
  m.attr("version") = KDISPATCH_PYTHON_VERSION;
  register_error_translator();
  bind_runtime_kernels(m);

  m.def("ops", &ops, "Every op with a usable kernel, sorted (as `kdispatch list`).");
  m.def("backends", &backends, py::arg("op"), py::arg("device") = py::none(),
        "The registered backends of an op, each checked against a device (default: the detected platform).");
  m.def("select", &kdispatch::python::select, py::arg("op"), py::arg("backend") = py::none(),
        py::arg("device") = py::none(), py::arg("dtype") = py::none(),
        "The kernel a call would run: backend, plugin, symbol, targets, the rule that chose it ('only', 'named', "
        "'forced', 'preference', 'tuned', 'order', 'priority'), the ranked candidates and the tuning file's choices that "
        "depend on a call's sizes ('conditional'; metadata only; no plugin is opened).");
  m.def(
      "set_preference",
      [](const std::string& op, const std::optional<std::vector<std::string>>& backends) {
        set_preference(op, backends.value_or(std::vector<std::string>{}));
      },
      py::arg("op"), py::arg("backends"),
      "Ranks backends for an op ahead of every other eligible one, the first preferred (the 'preference' rule); "
      "None or [] removes the preference. Raises SelectionError (KD-E001, KD-E002) for an unknown op or a "
      "backend not registered for it, and then changes nothing.");
  m.def(
      "preference",
      [](const std::string& op) { return runtime()->context.selector().preference(op); }, py::arg("op"),
      "The op's preference: its backends, the first preferred ([] when none).");
  m.def("set_fallback", &set_fallback, py::arg("on"),
        "Fallback on device and internal errors: with it on, a kernel that fails with one is demoted for its op on "
        "that device for the rest of the process and the call goes to the next ranked backend (never the "
        "reference); off (the default, unless KDISPATCH_FALLBACK=1), the failure is the call's error. A kernel that "
        "returns 'unsupported' passes the call on either way.");
  m.def("fallback", &fallback, "Whether fallback on device and internal errors is on (set_fallback).");
  m.def(
      "tuning_key",
      [](const std::string& device) {
        const kdispatch::DeviceType type = tuning_device(device);
        const auto rt = runtime();
        const kdispatch::TuningKey key = kdispatch::tuning_key(rt->context, type, backends_on(rt->context, type));
        py::dict out;
        out["kdispatch"] = key.kdispatch;
        out["device"] = std::string(kdispatch::device_type_name(key.device));
        out["name"] = key.name;
        out["arch"] = key.arch;
        out["driver"] = key.driver;
        out["runtime"] = key.runtime;
        out["threads"] = key.threads;
        out["backends"] = key.backends;
        return out;
      },
      py::arg("device") = "cpu",
      "The key a tuning file made here carries for devices of this type ('cpu', 'cuda', 'hip'): kdispatch "
      "version, device name, arch, driver, runtime, thread count and the sha256 of each backend's plugin library "
      "(docs/tuning.md).");
  m.def(
      "write_tuning",
      [](const std::filesystem::path& path, const std::string& device, const py::list& measurements) {
        const kdispatch::DeviceType type = tuning_device(device);
        std::vector<kdispatch::TuningMeasurement> ms;
        for (const py::handle& item : measurements) {
          const py::dict d = py::cast<py::dict>(item);
          kdispatch::TuningMeasurement entry;
          entry.op = py::cast<std::string>(d["op"]);
          const std::string dtype = py::cast<std::string>(d["dtype"]);
          const auto parsed = kdispatch::parse_dtype(dtype);
          if (!parsed) throw py::value_error("write_tuning: unknown dtype '" + dtype + "'");
          entry.dtype = *parsed;
          entry.sizes = py::cast<std::map<std::string, int64_t>>(d["sizes"]);
          entry.us = py::cast<std::map<std::string, double>>(d["us"]);
          ms.push_back(std::move(entry));
        }
        kdispatch::TuningFile file;
        file.path = path.string();
        file.choices = kdispatch::build_tuning_choices(ms);
        std::set<std::string> named;
        for (const auto& c : file.choices) named.insert(c.backend);
        file.key = kdispatch::tuning_key(runtime()->context, type, std::vector<std::string>(named.begin(), named.end()));
        std::ofstream out(path, std::ios::binary | std::ios::trunc);
        out << kdispatch::tuning_file_text(file);
        out.close();
        if (!out) throw py::value_error("write_tuning: cannot write " + path.string());
        return file.choices.size();
      },
      py::arg("path"), py::arg("device"), py::arg("measurements"),
      "Writes a tuning file from measurements ([{'op', 'dtype', 'sizes': {symbol: value}, 'us': {backend: us}}]): "
      "the core builds the choices (the least time per shape, boundaries at geometric means) and this machine's "
      "key. Returns the number of choices.");
  m.def(
      "set_tuning_file",
      [](const std::optional<std::filesystem::path>& path) { set_tuning_file(path.value_or(std::filesystem::path())); },
      py::arg("path"),
      "Follows a tuning file (the 'tuned' rule) in the current runtime and those after configure(); None removes "
      "it. Raises kdispatch.Error (KD-E010, KD-E011) for a bad file, which then changes nothing; a file made for "
      "another machine warns once and applies nothing.");
  m.def("schemas", &schemas, "Every op schema, as dicts.");
  m.def("schema", &schema, py::arg("op"), "The schema of one op, as a dict.");
  m.def("doctor", &doctor, "The plugin report of `kdispatch doctor --json` (opens every plugin found).");
  m.def("explain", &explain, py::arg("code"),
        "The catalogue entry of an error code, as `kdispatch explain` prints it.");
  m.def(
      "error_codes",
      [] {
        py::dict out;
        for (const auto& e : kdispatch::error_catalogue())
          out[py::str(kdispatch::code_string(e.code))] = std::string(e.title);
        return out;
      },
      "Every error code with its title.");
  m.def("configure", &configure, py::kw_only(), py::arg("plugin_path") = std::vector<std::filesystem::path>{},
        py::arg("add_plugin_path") = std::vector<std::filesystem::path>{},
        "Sets the plugin search path for the calls that follow (as --plugin-path / --add-plugin-path; an "
        "empty plugin_path keeps the default path). Ops resolved before (kdispatch.op handles, the kernels "
        "of kdispatch.torch) keep the plugins they were resolved with: configure before importing "
        "kdispatch.torch.");

  py::class_<Op>(m, "Op", "An op resolved by name once: op(*tensors, stream=None, **attrs).")
      .def("__call__", &Op::call)
      .def("_torch_call", &Op::call_positional)
      .def("_check_layout", &Op::check_layout)
      .def_property_readonly("name", [](const Op& op) { return std::string(op.handle().op()); })
      .def_property_readonly("backend",
                             [](const Op& op) -> py::object {
                               if (op.handle().backend().empty()) return py::none();
                               return py::str(std::string(op.handle().backend()));
                             })
      .def("__repr__", [](const Op& op) {
        std::string text = "<kdispatch.Op " + std::string(op.handle().op());
        if (!op.handle().backend().empty()) text += " backend=" + std::string(op.handle().backend());
        return text + ">";
      });
  m.def(
      "op",
      [](const std::string& name, const std::optional<std::string>& backend) {
        std::shared_ptr<Runtime> current = runtime();
        const kdispatch::OpHandle handle = current->dispatcher.op(name, backend.value_or(""));
        return Op(handle, std::move(current));
      },
      py::arg("op"), py::arg("backend") = py::none(), "Resolves an op once, for calls in a loop.");
  m.def("call", &call, "call(op, *tensors, backend=None, stream=None, **attrs)");

  // kdispatch.testing's calls into the harness.
  m.def("_test_cases", &test_cases, py::arg("op"));
  m.def("_make_inputs", &make_inputs, py::arg("op"), py::arg("dtype"), py::arg("case"), py::arg("seed"),
        py::arg("dtypes") = py::dict(), py::arg("absent") = py::list());
  m.def("_make_sized_inputs", &make_sized_inputs, py::arg("op"), py::arg("dtype"), py::arg("sizes"),
        py::arg("seed") = 0);
  m.def("_reference_backend", &reference_backend, py::arg("op"));
  m.def("_call_dtypes", &call_dtypes, py::arg("op"), py::arg("backend") = py::none());
  m.def("_compare", &kdispatch::python::compare, py::arg("op"), py::arg("got"), py::arg("want"),
        py::arg("unchecked") = py::list());

  m.def(
      "_record_verdict",
      [](const std::string& op, const std::string& backend, const std::string& device, bool passed,
         const std::string& source, const std::string& detail) {
        kdispatch::Context& ctx = runtime()->context;
        const kdispatch::KernelSpec* spec = ctx.registry().get_backend(op, backend);
        if (spec == nullptr) return;
        // "cuda", "cuda:1": the device kind of that device (its arch included).
        const size_t colon = device.find(':');
        const auto type = kdispatch::parse_device_type(device.substr(0, colon));
        if (!type) throw py::value_error("device '" + device + "': expected 'cpu', 'cuda[:N]' or 'hip[:N]'");
        int32_t id = 0;
        if (colon != std::string::npos) {
          try {
            id = static_cast<int32_t>(std::stoi(device.substr(colon + 1)));
          } catch (const std::exception&) {
            throw py::value_error("device '" + device + "': expected 'cpu', 'cuda[:N]' or 'hip[:N]'");
          }
        }
        ctx.record_verdict(*spec, ctx.device(*type, id), passed, source, detail);
      },
      py::arg("op"), py::arg("backend"), py::arg("device"), py::arg("passed"), py::arg("source"),
      py::arg("detail") = "");

  m.def("_live_runtimes", &live_runtimes, "How many runtimes are alive (one per configure() still in use).");

  m.def("_set_torch", [](py::object tensor_type, py::list dtypes, py::object raw_stream, py::object grad_enabled,
                         py::object version_bump, bool bump_takes_sequence, bool rocm, py::object native) {
    set_torch_support(tensor_type.ptr(), dtypes.ptr(), raw_stream.ptr(), grad_enabled.ptr(), version_bump.ptr(),
                      bump_takes_sequence, rocm, native.ptr());
  });
}
