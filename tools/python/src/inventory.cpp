#include "inventory.hpp"

#include <fmt/format.h>

#include <algorithm>

#include <kdispatch/doctor.hpp>
#include <kdispatch/error_catalogue.hpp>
#include <kdispatch/platform.hpp>

#include "errors.hpp"
#include "runtime.hpp"

namespace py = pybind11;

namespace kdispatch::python {

namespace {

// `text`, or the detected platform's device when absent. A GPU named
// without its arch ("cuda") is device 0 of that kind, with the arch its
// driver reports.
Device device_or_platform(const std::optional<std::string>& text) {
  if (!text) return detect_platform().device;
  Device device = Device::parse(*text);  // std::invalid_argument -> ValueError
  if (device.type != DeviceType::cpu && device.arch.empty()) {
    Device probed = device_of(device.type, 0);
    if (!probed.arch.empty()) return probed;
  }
  return device;
}

py::list target_list(const std::vector<Target>& targets) {
  py::list out;
  for (const auto& t : targets) out.append(t.str());
  return out;
}

py::list dtype_list(const std::vector<Dtype>& dtypes) {
  py::list out;
  for (Dtype d : dtypes) out.append(std::string(dtype_name(d)));
  return out;
}

py::dict spec_dict(const KernelSpec& spec) {
  py::dict d;
  d["op"] = text(spec.op);
  d["backend"] = text(spec.backend);
  d["plugin"] = text(spec.plugin);
  d["symbol"] = text(spec.symbol);
  d["targets"] = target_list(spec.targets);
  d["dtypes"] = dtype_list(spec.dtypes);
  d["manifest"] = text(spec.manifest);
  d["priority"] = spec.priority;
  return d;
}

py::object attr_to_python(const AttrValue& v) {
  if (auto* d = std::get_if<double>(&v)) return py::float_(*d);
  if (auto* i = std::get_if<int64_t>(&v)) return py::int_(*i);
  if (auto* b = std::get_if<bool>(&v)) return py::bool_(*b);
  return text(std::get<std::string>(v));
}

// {dtype name: {"ulps", "atol", "mean_ulps"}} for each float dtype an output
// of the op can have: the schema's tolerance for it, or the default one
// (OpSchema::tolerance), so that Python checks use the bounds the C++ checks
// use.
py::dict tolerance_dict(const OpSchema& s) {
  py::dict out;
  std::vector<Dtype> dtypes;
  for (const auto& t : s.tensors) {
    if (!t.written && !t.inplace) continue;
    for (Dtype call : s.call_dtypes()) {
      for (Dtype d : s.tensor_dtypes(t, call)) {
        if (std::find(dtypes.begin(), dtypes.end(), d) == dtypes.end()) dtypes.push_back(d);
      }
    }
  }
  {
    for (Dtype d : dtypes) {
      if (!is_floating(d)) continue;
      const Tolerance tol = s.tolerance(d);
      py::dict td;
      td["ulps"] = tol.ulps;
      td["atol"] = tol.atol;
      td["mean_ulps"] = tol.mean_ulps;
      out[py::str(std::string(dtype_name(d)))] = td;
    }
  }
  return out;
}

py::dict schema_dict(const OpSchema& s) {
  py::dict d;
  d["op"] = text(s.op);
  d["doc"] = text(s.doc);
  py::list tensors;
  for (const auto& t : s.tensors) {
    py::dict td;
    td["name"] = text(t.name);
    py::list shape;
    for (const auto& tok : t.shape) shape.append(tok.str());
    td["shape"] = shape;
    td["dtype"] = text(t.dtype);
    td["written"] = t.written || t.inplace;
    td["inplace"] = t.inplace;
    td["strided"] = t.layout == Layout::any;
    td["layout"] = std::string(layout_name(t.layout));
    td["optional"] = t.optional;
    td["flattened"] = t.flattened.empty() ? py::object(py::none()) : py::object(py::str(t.flattened));
    py::list alternatives;
    for (const std::string& a : t.dtype_alternatives) alternatives.append(a);
    td["dtype_alternatives"] = alternatives;
    if (t.range_max) {
      td["range"] = py::make_tuple(t.range_min.value_or(0), t.range_max->str());
    } else {
      td["range"] = py::none();
    }
    tensors.append(td);
  }
  d["tensors"] = tensors;
  py::list attrs;
  for (const auto& a : s.attrs) {
    py::dict ad;
    ad["name"] = text(a.name);
    ad["type"] = std::string(attr_type_name(a.type));
    ad["default"] = a.default_value ? attr_to_python(*a.default_value) : py::none();
    ad["required"] = !a.default_value.has_value();
    ad["doc"] = text(a.doc);
    attrs.append(ad);
  }
  d["attrs"] = attrs;
  py::dict vars;
  for (const auto& [name, dtypes] : s.dtype_vars) vars[text(name)] = dtype_list(dtypes);
  d["dtypes"] = vars;
  py::list requirements;
  for (const std::string& r : s.requirements) requirements.append(text(r));
  d["requires"] = requirements;
  if (!s.out_of_place.empty()) d["out_of_place"] = s.out_of_place;
  d["tolerance"] = tolerance_dict(s);
  d["source"] = text(s.source);
  return d;
}

py::dict problem_dict(const Problem& p) {
  py::dict d;
  d["code"] = code_string(p.code);
  d["file"] = text(p.file);
  d["message"] = text(p.message);
  d["severity"] = p.warning ? "warning" : "error";
  return d;
}

}  // namespace

py::list ops() {
  py::list out;
  for (const auto& op : runtime()->context.registry().ops()) out.append(text(op));
  return out;
}

py::list backends(const std::string& op, const std::optional<std::string>& device) {
  Context& ctx = runtime()->context;
  if (!ctx.registry().has(op)) {
    // Worded by the selector: KD-E001 with did-you-mean.
    ctx.selector().select({op, {}, Device::host_cpu(), std::nullopt});
  }
  const Device dev = device_or_platform(device);
  py::list out;
  for (const auto& e : ctx.selector().eligibility(op, dev, std::nullopt)) {
    py::dict d = spec_dict(*e.spec);
    d["device"] = dev.str();
    d["eligible"] = e.eligible;
    d["reason"] = e.eligible ? py::none() : py::object(text(e.reason));
    out.append(d);
  }
  return out;
}

py::dict select(const std::string& op, const std::optional<std::string>& backend,
                const std::optional<std::string>& device, const std::optional<std::string>& dtype) {
  std::optional<Dtype> parsed;
  if (dtype) {
    parsed = parse_dtype(*dtype);
    if (!parsed) {
      throw py::value_error(
          fmt::format("unknown dtype '{}' (float32, float16, bfloat16, float64, int32, int64, uint8, "
                      "bool, float8_e4m3fn, float8_e5m2)",
                      *dtype));
    }
  }
  const Device dev = device_or_platform(device);
  const std::string backend_name = backend.value_or("");
  const Selection selection = runtime()->context.choose({op, backend_name, dev, parsed});
  py::dict d = spec_dict(*selection.spec);
  d["device"] = dev.str();
  d["rule"] = std::string(rule_name(selection.rule));
  py::list ranked;
  for (const KernelSpec* s : selection.ranked) ranked.append(text(s->backend));
  d["ranked"] = ranked;
  py::list conditional;
  for (const ConditionalChoice& c : selection.conditional) {
    py::dict entry;
    entry["dtype"] = std::string(dtype_name(c.dtype));
    entry["when"] = text(c.when);
    entry["backend"] = text(c.backend);
    conditional.append(entry);
  }
  d["conditional"] = conditional;
  return d;
}

py::list schemas() {
  py::list out;
  for (const OpSchema* s : runtime()->context.registry().schemas()) out.append(schema_dict(*s));
  return out;
}

py::dict schema(const std::string& op) {
  Context& ctx = runtime()->context;
  const OpSchema* s = ctx.registry().schema(op);
  if (s == nullptr) {
    if (!ctx.registry().has(op)) ctx.selector().select({op, {}, Device::host_cpu(), std::nullopt});
    throw CallError(ErrorCode::bad_arguments, fmt::format("op '{}' has kernels but no schema", op));
  }
  return schema_dict(*s);
}

py::dict doctor() {
  const DoctorReport report = doctor_report(runtime()->context);
  py::list search;
  for (const auto& d : report.search_path) search.append(text(d.path.string()));
  py::list plugins;
  for (const PluginReport& r : report.plugins) {
    py::dict p;
    p["name"] = text(r.name);
    p["backend"] = text(r.backend);
    p["manifest"] = text(r.manifest);
    p["library"] = text(r.library);
    p["status"] = r.ok ? "ok" : "error";
    p["state"] = std::string(plugin_state_name(r.state));
    if (!r.note.empty()) p["note"] = text(r.note);
    py::list problems;
    for (const auto& q : r.problems) problems.append(problem_dict(q));
    p["problems"] = problems;
    p["loaded"] = r.loaded;
    if (r.loaded) {
      p["version"] = text(r.version);
      p["abi"] = r.abi;
      py::list devices;
      for (const auto& dev : r.devices) {
        py::dict dd;
        dd["device"] = dev.device.str();
        dd["id"] = dev.id;
        dd["name"] = text(dev.name);
        devices.append(dd);
      }
      p["devices"] = devices;
    }
    plugins.append(p);
  }
  py::list problems;
  for (const auto& q : report.problems) problems.append(problem_dict(q));
  py::list without_reference;
  for (const auto& op : report.ops_without_reference) without_reference.append(text(op));
  py::dict out;
  out["search_path"] = search;
  out["plugins"] = plugins;
  out["problems"] = problems;
  out["ops_without_reference"] = without_reference;
  py::list demotions;
  for (const kdispatch::Demotion& d : report.demotions) {
    py::dict item;
    item["op"] = text(d.op);
    item["backend"] = text(d.backend);
    item["device"] = text(d.device());
    item["error"] = text(d.error);
    demotions.append(item);
  }
  out["demotions"] = demotions;
  py::list failed;
  for (const kdispatch::Verdict& v : report.failed_verdicts) {
    py::dict item;
    item["op"] = text(v.op);
    item["backend"] = text(v.backend);
    item["device"] = text(v.device);
    item["library"] = text(v.library);
    item["time"] = v.time;
    item["date"] = v.date();
    item["source"] = text(v.source);
    item["detail"] = text(v.detail);
    failed.append(item);
  }
  out["failed_verdicts"] = failed;
  return out;
}

std::string explain(const std::string& code) {
  ErrorCode parsed{};
  if (!parse_code(code, &parsed)) {
    throw py::value_error(fmt::format("unknown error code '{}'; kdispatch.error_codes() lists them all", code));
  }
  const CatalogueEntry& e = *find_catalogue_entry(parsed);
  return fmt::format("{}: {}\n\n{}\n\nCommon causes:\n{}\n\nFix:\n{}\n", code_string(e.code), e.title, e.meaning,
                     e.causes, e.fix);
}

}  // namespace kdispatch::python
