#include "testing.hpp"

#include <fmt/format.h>

#include <kdispatch/error.hpp>

#include <algorithm>
#include <vector>

#include "errors.hpp"
#include "harness.hpp"
#include "runtime.hpp"
#include "tensor_args.hpp"

namespace py = pybind11;

namespace kdispatch::python {

namespace {

const OpSchema& schema_of(const std::string& op) {
  Context& ctx = runtime()->context;
  const OpSchema* s = ctx.registry().schema(op);
  if (s == nullptr) {
    if (!ctx.registry().has(op)) ctx.selector().select({op, {}, Device::host_cpu(), std::nullopt});
    throw CallError(ErrorCode::bad_arguments, fmt::format("op '{}' has kernels but no schema", op));
  }
  return *s;
}

py::object attr_object(const AttrValue& v) {
  if (auto* d = std::get_if<double>(&v)) return py::float_(*d);
  if (auto* i = std::get_if<int64_t>(&v)) return py::int_(*i);
  if (auto* b = std::get_if<bool>(&v)) return py::bool_(*b);
  return py::str(std::get<std::string>(v));
}

// Each tensor of `data` as (bytes, dtype name, shape), None where absent.
py::list host_tensors(const harness::CallData& data) {
  py::list out;
  for (const harness::Buffer& b : data.tensors) {
    if (!b.present()) {
      out.append(py::none());
      continue;
    }
    py::list shape;
    for (int64_t d : b.shape()) shape.append(d);
    out.append(py::make_tuple(py::bytes(static_cast<const char*>(b.host()), b.bytes()),
                              std::string(dtype_name(b.dtype())), py::tuple(shape)));
  }
  return out;
}

}  // namespace

py::list test_cases(const std::string& op) {
  const OpSchema& schema = schema_of(op);
  py::list out;
  for (const harness::TestCase& c : harness::test_cases(schema)) {
    py::dict sizes;
    py::list leading;
    for (int64_t d : c.shapes.leading) leading.append(d);
    sizes["*"] = leading;
    for (const auto& [name, value] : c.shapes.symbols) sizes[py::str(name)] = value;
    py::dict attrs;
    for (const NamedAttr& a : c.attrs) attrs[py::str(std::string(a.name))] = attr_object(a.value);
    py::dict d;
    d["sizes"] = sizes;
    d["attrs"] = attrs;
    d["special"] = c.special != nullptr ? py::object(py::str(c.special->what)) : py::object(py::none());
    py::list unchecked;
    if (c.special != nullptr) {
      for (const std::string& name : c.special->unchecked) unchecked.append(name);
    }
    d["unchecked"] = unchecked;
    int64_t elements = 0;
    for (const TensorArg& arg : schema.tensors) {
      int64_t n = 1;
      for (int64_t dim : harness::tensor_shape(arg, c.shapes)) n *= dim;
      elements += n;
    }
    d["elements"] = elements;
    out.append(d);
  }
  return out;
}

py::list make_inputs(const std::string& op, const std::string& dtype, size_t index, uint64_t seed,
                     const py::dict& dtypes, const py::list& absent) {
  const OpSchema& schema = schema_of(op);
  const auto parsed = parse_dtype(dtype);
  if (!parsed) throw py::value_error(fmt::format("unknown dtype '{}'", dtype));
  const std::vector<harness::TestCase> cases = harness::test_cases(schema);
  if (index >= cases.size()) {
    throw py::index_error(fmt::format("op '{}' has {} test cases, not {}", op, cases.size(), index + 1));
  }
  // The dtype alternative asked for each tensor named in `dtypes`, the
  // optional tensors named in `absent` left out.
  harness::Variant variant;
  variant.absent.assign(schema.tensors.size(), false);
  const auto position = [&](const std::string& name) {
    for (size_t i = 0; i < schema.tensors.size(); ++i) {
      if (schema.tensors[i].name == name) return i;
    }
    throw py::value_error(fmt::format("op '{}' has no tensor '{}'", op, name));
  };
  for (const TensorArg& arg : schema.tensors) variant.dtypes.push_back(schema.tensor_dtypes(arg, *parsed).front());
  for (const auto& [key, value] : dtypes) {
    const size_t i = position(key.cast<std::string>());
    const std::string name = value.cast<std::string>();
    const std::vector<Dtype> allowed = schema.tensor_dtypes(schema.tensors[i], *parsed);
    const auto d = parse_dtype(name);
    if (!d || std::find(allowed.begin(), allowed.end(), *d) == allowed.end()) {
      std::vector<std::string_view> names;
      for (Dtype a : allowed) names.push_back(dtype_name(a));
      throw py::value_error(fmt::format("op '{}': tensor '{}' of a {} call takes {}, not '{}'", op,
                                        schema.tensors[i].name, dtype, fmt::join(names, ", "), name));
    }
    variant.dtypes[i] = *d;
  }
  for (py::handle item : absent) {
    const size_t i = position(item.cast<std::string>());
    if (!schema.tensors[i].optional) {
      throw py::value_error(fmt::format("op '{}': tensor '{}' is not optional", op, schema.tensors[i].name));
    }
    variant.absent[i] = true;
  }
  return host_tensors(harness::make_case(schema, *parsed, cases[index], seed, variant));
}

py::list make_sized_inputs(const std::string& op, const std::string& dtype, const std::vector<std::string>& sizes,
                           uint64_t seed) {
  const OpSchema& schema = schema_of(op);
  const auto parsed = parse_dtype(dtype);
  if (!parsed) throw py::value_error(fmt::format("unknown dtype '{}'", dtype));
  harness::Shapes shapes = harness::example_shapes(schema);
  try {
    harness::apply_overrides(shapes, sizes, schema);
  } catch (const std::invalid_argument& e) {
    throw py::value_error(fmt::format("op '{}': {}", op, e.what()));
  }
  return host_tensors(harness::make_call(schema, *parsed, shapes, seed));
}

py::list call_dtypes(const std::string& op, const std::optional<std::string>& backend) {
  const OpSchema& schema = schema_of(op);
  std::vector<Dtype> dtypes = harness::call_dtypes(schema);
  if (backend) {
    const KernelSpec* spec = runtime()->context.registry().get_backend(op, *backend);
    if (spec == nullptr) runtime()->context.select({op, *backend, Device::host_cpu(), std::nullopt});  // KD-E002
    if (spec != nullptr) dtypes = harness::kernel_dtypes(schema, *spec);
  }
  py::list out;
  for (Dtype d : dtypes) out.append(std::string(dtype_name(d)));
  return out;
}

std::string reference_backend(const std::string& op) {
  const KernelSpec* spec = runtime()->context.registry().reference(op);
  if (spec == nullptr) {
    schema_of(op);  // KD-E001 for an unknown op
    throw SelectionError(ErrorCode::backend_not_registered,
                         fmt::format("No reference backend registered for op '{}': nothing can check its results", op));
  }
  return spec->backend;
}

py::dict compare(const std::string& op, const py::sequence& got, const py::sequence& want,
                 const py::sequence& unchecked) {
  const OpSchema& schema = schema_of(op);
  TensorArgs got_args(schema, StreamRequest{});
  for (py::handle t : got) got_args.add(t.ptr());
  TensorArgs want_args(schema, StreamRequest{});
  for (py::handle t : want) want_args.add(t.ptr());
  for (const DLTensor* t : {got_args.tensors().data(), want_args.tensors().data()}) {
    for (size_t i = 0; i < got_args.count(); ++i) {
      if (t[i].device.device_type != kDLCPU) {
        throw_call_error(fmt::format("compare: op '{}', tensor {}: copy results to the host first", op, i));
      }
    }
  }
  std::vector<std::string> skip;
  for (py::handle name : unchecked) skip.push_back(name.cast<std::string>());
  harness::Comparison c;
  try {
    c = harness::compare(schema, got_args.tensors(), want_args.tensors(), skip);
  } catch (const std::invalid_argument& e) {
    throw_call_error(e.what());
  }
  py::dict d;
  d["ok"] = c.ok;
  d["max_abs_err"] = c.max_abs_err;
  d["max_rel_err"] = c.max_rel_err;
  d["max_ulps"] = c.max_ulps;
  d["mean_ulps"] = c.mean_ulps;
  d["first_mismatch"] = c.first_mismatch;
  return d;
}

}  // namespace kdispatch::python
