"""kdispatch ops as torch custom ops.

Importing this module registers every op that has a schema (built-in ones
and those of the plugins found at import) as
``torch.ops.kdispatch.<group>_<name>`` through ``torch.library``:

- the torch schema comes from the op schema: tensors in schema order, the
  ones the op writes as mutated arguments (``Tensor(a!)``), optional ones as
  ``Tensor?`` (None leaves them out of the call), then the attributes typed
  with their defaults, then ``str? backend=None``; the op returns nothing;
- tensors are passed as they are, strides included: a row-strided view (a
  column slice, q and k sliced from a fused QKV output) reaches the kernel
  without a copy where the op schema's layout for it is "rows" or "any";
- the CPU and CUDA kernels are the dispatcher's checked call; CUDA tensors
  run on torch's current stream of their device, with no synchronisation and
  no allocation, so calls can be captured in a CUDA graph;
- a fake (meta) implementation runs the dispatcher's own check on the
  tensors' devices, dtypes, shapes and strides (no data, no kernel), so
  torch.compile(fullgraph=True) traces through the ops, meta tensors work,
  and a bad call is refused with the words of a real one.

The plugins are those of the plugin path at import, and the registered
kernels keep them: call ``kdispatch.configure(plugin_path=...,
add_plugin_path=...)`` before ``import kdispatch.torch``.

Functional variants allocate the outputs from the schema and return them,
e.g. ``kdispatch.torch.layernorm.rmsnorm(x, weight, eps=1e-6) -> out``:
they take the tensors the op reads (in schema order), clone the ones it
updates in place (or, for an op whose schema names an ``out_of_place`` op,
call that op into fresh outputs instead: ``kdispatch.torch.layernorm.
fused_add_rmsnorm(x, residual, weight)`` reads x and residual once and
writes the two results, with no copy first), and take the sizes that only
outputs have as keywords
(``kdispatch.torch.moe.topk_softmax(gating_output, K=8)``). An optional
input may be None, left off the end of the positional ones, or given by
name as a keyword; an optional output is not allocated: pass a tensor for
it by name (``token_expert_indices=t``) and the op fills it. An output
whose schema lists several dtypes gets its first, or the one given in
``out_dtypes={name: torch dtype}``.

Every op and functional variant takes a last argument ``backend`` (None by
default: the selection rules decide): a name runs that backend's kernel,
e.g. ``torch.ops.kdispatch.layernorm_rmsnorm(out, x, w, 1e-6, "reference")``
or ``kdispatch.torch.layernorm.rmsnorm(x, w, backend="reference")``.
"""
import difflib as _difflib
import types as _types
import warnings as _warnings

import torch as _torch

from . import _kdispatch, _schema, _torch_tensors
from ._errors import Error, call_error

_torch_tensors.enable()

NAMESPACE = "kdispatch"
_lib = _torch.library.Library(NAMESPACE, "DEF")

_TORCH_DTYPES = {name: dtype for dtype, name in _torch_tensors._DTYPES}
_ATTR_TYPES = {"float": "float", "int": "int", "bool": "bool", "string": "str"}
_TORCH_MAJOR = int(_torch.__version__.split(".")[0])

# Op id -> the name under torch.ops.kdispatch.
registered = {}


def op_name(op):
    """The torch name of an op: "layernorm.rmsnorm" -> "layernorm_rmsnorm"."""
    return op.replace(".", "_")


def _default_text(attr):
    value = attr["default"]
    if attr["type"] == "bool":
        return "True" if value else "False"
    if attr["type"] == "float":
        return repr(float(value))
    if attr["type"] == "int":
        return str(int(value))
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def torch_schema(schema):
    """The torch.library schema of an op schema, e.g.
    "layernorm_rmsnorm(Tensor(a!) out, Tensor x, Tensor weight, float eps=1e-06, str? backend=None) -> ()":
    the tensors, the attributes, then the backend to run (None: the
    selection rules decide, as for kdispatch.call)."""
    aliases = iter("abcdefghijklmnopqrstuvwxyz")
    args = []
    tensors = schema["tensors"]
    # An optional tensor defaults to None where every argument after it can
    # be left off too (later tensors optional, attributes with defaults).
    attrs_defaulted = all(not a["required"] for a in schema["attrs"])
    for i, t in enumerate(tensors):
        optional = "?" if t.get("optional") else ""
        default = ("=None" if optional and attrs_defaulted and all(u.get("optional") for u in tensors[i + 1:])
                   else "")
        if t["written"]:
            args.append(f"Tensor({next(aliases)}!){optional} {t['name']}{default}")
        else:
            args.append(f"Tensor{optional} {t['name']}{default}")
    for a in schema["attrs"]:
        text = f"{_ATTR_TYPES[a['type']]} {a['name']}"
        if not a["required"]:
            text += "=" + _default_text(a)
        args.append(text)
    args.append("str? backend=None")
    return f"{op_name(schema['op'])}({', '.join(args)}) -> ()"


def _kernel_and_fake(op):
    """The CPU/CUDA kernel (the resolved op's positional call) and the fake
    implementation (the same op's check of the tensors' layout, with the
    attributes, which may say that tensors come flattened). For an op
    with a schema but no usable kernel at import, both resolve the op (and
    report why they cannot) at every call."""
    try:
        handle = _kdispatch.op(op)
    except Error:
        def resolve_each_call(*args):
            return _kdispatch.op(op)._torch_call(*args)

        def fake_each_call(*args):
            _kdispatch.op(op)._check_layout(*args)

        return resolve_each_call, fake_each_call

    def fake(*args):
        handle._check_layout(*args)

    return handle._torch_call, fake


def _register_fake(name, fake):
    qualname = f"{NAMESPACE}::{name}"
    register = (getattr(_torch.library, "register_fake", None)      # torch >= 2.4
                or getattr(_torch.library, "impl_abstract", None))  # torch 2.1 .. 2.3
    if register is not None:
        try:
            register(qualname, fake, lib=_lib)
            return
        except Exception as e:  # noqa: BLE001 - any refusal leaves the Meta kernel below
            _warnings.warn(f"kdispatch.torch: {register.__name__} refused the fake implementation of "
                           f"{qualname} ({e}); registering it as a Meta kernel instead")
    # torch 1.13: a Meta kernel, and one for AutogradMeta, which meta tensors
    # reach first there.
    _lib.impl(name, fake, "Meta")
    if _TORCH_MAJOR < 2:
        _lib.impl(name, fake, "AutogradMeta")


def _impl(name, kernel, key):
    try:
        _lib.impl(name, kernel, key)
    except TypeError:
        # A torch that wants a Python function rather than any callable.
        _lib.impl(name, lambda *args: kernel(*args), key)


def _make_functional(schema, opfn):
    spec = _schema.Functional(schema)
    op = schema["op"]
    tensors = schema["tensors"]
    count = len(tensors)
    input_names = [tensors[i]["name"] for i in spec.inputs]
    attr_defaults = [(a["name"], a["default"], a["required"]) for a in spec.attrs]
    keyword_symbols = list(spec.keyword_symbols)
    optional_inputs = [name for pos, name in enumerate(input_names) if tensors[spec.inputs[pos]].get("optional")]
    optional_outputs = {tensors[i]["name"] for i in spec.outputs if tensors[i].get("optional")
                        and not tensors[i]["inplace"]}
    required_inputs = len(spec.inputs)
    while required_inputs > 0 and input_names[required_inputs - 1] in optional_inputs:
        required_inputs -= 1
    known_keywords = (set(keyword_symbols) | {a["name"] for a in spec.attrs} | {"backend", "out_dtypes"}
                      | set(optional_inputs) | optional_outputs)

    def functional(*inputs, **kwargs):
        if not required_inputs <= len(inputs) <= len(spec.inputs):
            takes = (f"{len(spec.inputs)}" if required_inputs == len(spec.inputs)
                     else f"{required_inputs} to {len(spec.inputs)}")
            raise TypeError(f"{op}({', '.join(input_names)}, ...): takes {takes} tensors, got {len(inputs)}")
        for key in kwargs:
            if key not in known_keywords:
                raise TypeError(f"{op}: unexpected keyword '{key}' (keywords: {sorted(known_keywords)})")
        if len(inputs) < len(spec.inputs) or any(name in kwargs for name in optional_inputs):
            given = list(inputs) + [None] * (len(spec.inputs) - len(inputs))
            for pos, name in enumerate(input_names):
                if name in kwargs:
                    if pos < len(inputs):
                        raise TypeError(f"{op}: '{name}' given by position and by keyword")
                    given[pos] = kwargs[name]
            inputs = given
        out_dtypes = kwargs.get("out_dtypes") or {}
        sizes = {}
        for name in keyword_symbols:
            if name not in kwargs:
                raise TypeError(f"{op}: the size {name} of the outputs is a required keyword ({name}=...)")
            sizes[name] = kwargs[name]
        attrs = []
        for name, default, required in attr_defaults:
            if name in kwargs:
                attrs.append(kwargs[name])
            elif required:
                raise TypeError(f"{op}: attribute '{name}' is required")
            else:
                attrs.append(default)
        args = [None] * count
        for pos, i in enumerate(spec.inputs):
            args[i] = inputs[pos]
        device = next(t for t in inputs if t is not None).device
        outputs = []
        for i, recipe in zip(spec.outputs, spec.recipes):
            name = tensors[i]["name"]
            if name in optional_outputs:
                args[i] = kwargs.get(name)  # None: left out of the call
                continue
            if recipe[0] == "clone":
                source = inputs[recipe[1]]
                if source is None:  # an optional tensor updated in place, left out
                    t = None
                elif recipe[2]:
                    t = source.clone()
                else:
                    t = source.clone(memory_format=_torch.contiguous_format)
            else:
                _, lead, dims, dtype = recipe
                shape = []
                try:
                    if lead:
                        pos, after = spec.lead_source
                        shape.extend(inputs[pos].shape[:inputs[pos].dim() - after])
                    for d in dims:
                        if d[0] == "const":
                            shape.append(d[1])
                        elif d[0] == "dim":
                            _, pos, from_end, factor, multiple = d
                            shape.append(inputs[pos].shape[-from_end] // factor * multiple)
                        else:
                            shape.append(sizes[d[1]] * d[2])
                except IndexError:
                    raise call_error(f"op '{op}': input '{input_names[pos]}' has too few dims "
                                     f"{list(inputs[pos].shape)} for its shape {tensors[spec.inputs[pos]]['shape']}")
                if name in out_dtypes:
                    torch_dtype = out_dtypes[name]
                else:
                    torch_dtype = inputs[dtype[1]].dtype if dtype[0] == "like" else _TORCH_DTYPES[dtype[1]]
                t = _torch.empty(shape, dtype=torch_dtype, device=device)
            args[i] = t
            outputs.append(t)
        opfn(*args, *attrs, kwargs.get("backend"))
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    name = op.split(".", 1)[1]
    functional.__name__ = name
    functional.__qualname__ = name
    outputs = ", ".join(tensors[i]["name"] for i in spec.outputs if tensors[i]["name"] not in optional_outputs)
    keywords = ([f"{s}" for s in keyword_symbols] + [a["name"] + ("" if a["required"] else f"={a['default']!r}")
                                                    for a in spec.attrs]
                + [f"{name}=None" for name in sorted(optional_outputs)] + ["out_dtypes=None", "backend=None"])
    functional.__doc__ = (f"{name}({', '.join(input_names + keywords)}) -> {outputs}\n\n{schema['doc']}\n\n"
                          f"Functional form of torch.ops.{NAMESPACE}.{op_name(op)}: allocates or clones its "
                          "outputs and returns them.")
    return functional


def _unknown(where, what, name, known):
    near = _difflib.get_close_matches(name, known, n=1)
    return AttributeError(
        f"{where} has no {what}" + (f"; did you mean '{near[0]}'?" if near else "") +
        f" (known: {', '.join(sorted(known)) or 'none'}). An op of a plugin is registered when kdispatch.torch "
        "is imported: call kdispatch.configure(add_plugin_path=[...]) before importing it; "
        "`kdispatch list` shows the ops a plugin path provides.")


class _Group(_types.ModuleType):
    """The functional variants of one op group, kdispatch.torch.<group>.<name>."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        group = self.__name__.rsplit(".", 1)[1]
        raise _unknown(self.__name__, f"op '{group}.{name}'", name, [k for k in vars(self) if not k.startswith("_")])


def _out_of_place_target(schema, by_op):
    """The schema of the op that `schema`'s functional variant calls instead
    of cloning (its "out_of_place" op), or None: when it names none, or one
    that is not registered or takes other inputs, attributes or outputs
    (warned)."""
    target = schema.get("out_of_place")
    if target is None:
        return None
    other = by_op.get(target)
    problem = None
    if other is None:
        problem = "is not registered"
    else:
        mine, theirs = _schema.Functional(schema), _schema.Functional(other)

        def names(s, f, which):
            return [s["tensors"][i]["name"] for i in getattr(f, which)]

        if names(schema, mine, "inputs") != names(other, theirs, "inputs"):
            problem = "takes other inputs"
        elif [a["name"] for a in mine.attrs] != [a["name"] for a in theirs.attrs]:
            problem = "takes other attributes"
        elif len(mine.outputs) != len(theirs.outputs):
            problem = "writes another number of outputs"
    if problem is not None:
        _warnings.warn(f"kdispatch.torch: '{schema['op']}' names '{target}' as its out-of-place form, which "
                       f"{problem}; its functional variant clones the tensors it updates instead")
        return None
    return other


def _register_all():
    groups = {}
    names = {}
    functionals = {}  # op -> (group module, short name, functional variant)
    by_op = {}  # op -> schema, of the registered ops
    for schema in _kdispatch.schemas():
        op = schema["op"]
        name = op_name(op)
        if name in names:
            _warnings.warn(f"kdispatch.torch: op '{op}' would be torch.ops.{NAMESPACE}.{name}, which "
                           f"'{names[name]}' is already; '{op}' is not registered")
            continue
        names[name] = op
        if any(a["name"] == "backend" for a in schema["attrs"]):
            _warnings.warn(f"kdispatch.torch: op '{op}' has an attribute named 'backend', the name of the torch "
                           "ops' backend argument; it is not registered")
            continue
        try:
            _lib.define(torch_schema(schema))
        except RuntimeError as e:  # e.g. an argument name torch's schema parser refuses
            _warnings.warn(f"kdispatch.torch: op '{op}' is not registered: torch refused the schema "
                           f"'{torch_schema(schema)}': {e}")
            continue
        kernel, fake = _kernel_and_fake(op)
        _impl(name, kernel, "CPU")
        _impl(name, kernel, "CUDA")
        _register_fake(name, fake)
        registered[op] = name
        by_op[op] = schema
        opfn = getattr(getattr(_torch.ops, NAMESPACE), name)
        group, short = op.split(".", 1)
        try:
            functional = _make_functional(schema, opfn)
        except ValueError as e:
            _warnings.warn(f"kdispatch.torch: no functional variant of '{op}': {e}")
            continue
        module = groups.get(group)
        if module is None:
            if group in globals():
                _warnings.warn(f"kdispatch.torch: group '{group}' clashes with a name of kdispatch.torch; "
                               f"its functional variants are under kdispatch.torch.groups['{group}']")
            module = groups[group] = _Group(f"{__name__}.{group}", f"Functional variants of {group}.*")
            globals().setdefault(group, module)
        setattr(module, short, functional)
        functionals[op] = (module, short, functional)
    # An in-place op's functional variant becomes that of its out-of-place
    # form, under its own name and docstring.
    for op, (module, short, own) in functionals.items():
        target = _out_of_place_target(by_op[op], by_op)
        if target is None or target["op"] not in functionals:
            continue
        setattr(module, short, _renamed(functionals[target["op"]][2], own, op, target["op"]))
    return groups


def _renamed(functional, like, op, target):
    """`functional` (the variant of `target`) under the name and docstring of
    `like` (the variant of `op`)."""
    def variant(*inputs, **kwargs):
        return functional(*inputs, **kwargs)

    variant.__name__ = like.__name__
    variant.__qualname__ = like.__qualname__
    parts = like.__doc__.split("\n\n")
    parts[-1] = (f"Functional form of torch.ops.{NAMESPACE}.{op_name(op)}: returns new tensors, computed by "
                 f"torch.ops.{NAMESPACE}.{op_name(target)} from the inputs, which are not copied first.")
    variant.__doc__ = "\n\n".join(parts)
    return variant


groups = _register_all()


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    raise _unknown(__name__, f"op group '{name}'", name, list(groups))
