"""Op schemas on the Python side: the check of shapes and dtypes that a
torch fake implementation runs (the same rules as the C++ check, without
data), and the output shapes of functional variants.

A schema is the dict of ``kdispatch.schema(op)``. Shape tokens: "*" (any
leading dims, shared by every tensor that has it), a symbol ("H"), an
integer, or "k*NAME" (a multiple of a symbol).
"""
from ._errors import call_error


def parse_token(token):
    """("lead",) | ("const", n) | ("sym", name, factor)."""
    if token == "*":
        return ("lead",)
    if token.lstrip("-").isdigit():
        return ("const", int(token))
    if "*" in token:
        factor, name = token.split("*", 1)
        return ("sym", name, int(factor))
    return ("sym", token, 1)


class Plan:
    """A schema prepared for checks from Python: parsed tokens per tensor."""

    def __init__(self, schema):
        self.op = schema["op"]
        self.schema = schema
        self.tensors = schema["tensors"]
        self.tokens = [[parse_token(t) for t in arg["shape"]] for arg in self.tensors]
        self.dtype_vars = schema["dtypes"]

    def fmt_pattern(self, index):
        return "[" + ", ".join(self.tensors[index]["shape"]) + "]"

    def bind(self, tensors, dtype_name, check_device=True):
        """Checks `tensors` (schema order) against the schema, in the order
        and words of the C++ check, and returns (leading dims, symbol
        values). Raises CallError KD-E030 naming the argument. `dtype_name(t)`
        gives a tensor's kdispatch dtype name."""
        op = self.op
        if len(tensors) != len(self.tensors):
            names = ", ".join(a["name"] for a in self.tensors)
            raise call_error(f"op '{op}' takes {len(self.tensors)} tensors ({names}), got {len(tensors)}")
        leading = leading_from = leading_shape = None
        symbols = {}
        bound_from = {}
        var_dtypes = {}
        for i, (arg, tokens, t) in enumerate(zip(self.tensors, self.tokens, tensors)):
            def fail(what):
                return call_error(f"op '{op}', argument {i} '{arg['name']}': {what}")
            shape = list(t.shape)
            if check_device and t.device != tensors[0].device:
                raise fail(f"is on {t.device}, but '{self.tensors[0]['name']}' is on {tensors[0].device}: "
                           "all tensors of a call must be on one device")
            dtype = dtype_name(t)
            spec = arg["dtype"]
            if spec in self.dtype_vars:
                if spec not in var_dtypes:
                    if dtype not in self.dtype_vars[spec]:
                        raise fail(f"expected dtype {spec} in [{', '.join(self.dtype_vars[spec])}], got {dtype}")
                    var_dtypes[spec] = (dtype, arg["name"])
                elif var_dtypes[spec][0] != dtype:
                    first, owner = var_dtypes[spec]
                    raise fail(f"expected dtype {spec} = {first} (as '{owner}'), got {dtype}")
            elif dtype != spec:
                raise fail(f"expected dtype {spec}, got {dtype}")
            has_lead = bool(tokens) and tokens[0] == ("lead",)
            dims = tokens[1:] if has_lead else tokens
            if (len(shape) < len(dims)) if has_lead else (len(shape) != len(dims)):
                raise fail(f"expected shape {self.fmt_pattern(i)} ({'at least ' if has_lead else ''}{len(dims)} "
                           f"dims), got {shape}")
            lead = len(shape) - len(dims)
            if has_lead:
                if leading is None:
                    leading, leading_from, leading_shape = shape[:lead], arg["name"], shape
                elif shape[:lead] != leading:
                    raise fail(f"leading dims of {shape} differ from those of '{leading_from}' {leading_shape}")
            for k, tok in enumerate(dims):
                size = shape[lead + k]
                if tok[0] == "const":
                    if size != tok[1]:
                        raise fail(f"dim {lead + k} must be {tok[1]}, got {size} (shape {shape})")
                    continue
                _, name, factor = tok
                if name not in symbols:
                    if size % factor != 0:
                        raise fail(f"dim {lead + k} must be a multiple of {factor} ({factor}*{name}), got {size}")
                    symbols[name] = size // factor
                    bound_from[name] = arg["name"]
                elif size != factor * symbols[name]:
                    token = name if factor == 1 else f"{factor}*{name}"
                    raise fail(f"dim {lead + k} is {token} = {factor * symbols[name]} (from '{bound_from[name]}'), "
                               f"got {size} (shape {shape})")
        return leading, symbols


class Functional:
    """How a functional variant makes its outputs: which tensors it takes
    (the ones the op does not only write), which it allocates (shape from
    the inputs' dims, dtype from an input's dtype variable or the schema's
    dtype) and which it clones (read and written), and which symbols only
    outputs have (keyword arguments, e.g. K of moe.topk_softmax)."""

    def __init__(self, schema):
        self.plan = Plan(schema)
        tensors = schema["tensors"]
        self.inputs = [i for i, a in enumerate(tensors) if not a["written"] or a["inplace"]]
        self.outputs = [i for i, a in enumerate(tensors) if a["written"]]
        self.attrs = schema["attrs"]
        tokens = self.plan.tokens
        # Where each symbol and the leading dims can be read from an input:
        # (input position, dim from the end, factor).
        sources = {}
        lead_source = None
        for pos, i in enumerate(self.inputs):
            toks = tokens[i]
            has_lead = bool(toks) and toks[0] == ("lead",)
            dims = toks[1:] if has_lead else toks
            if has_lead and lead_source is None:
                lead_source = (pos, len(dims))
            for k, tok in enumerate(dims):
                if tok[0] == "sym" and tok[1] not in sources:
                    sources[tok[1]] = (pos, len(dims) - k, tok[2])
        self.lead_source = lead_source
        self.sources = sources
        self.keyword_symbols = []
        self.recipes = []
        for i in self.outputs:
            arg = tensors[i]
            if arg["inplace"]:
                self.recipes.append(("clone", self.inputs.index(i), arg["strided"]))
                continue
            toks = tokens[i]
            lead = bool(toks) and toks[0] == ("lead",)
            dims = []
            for tok in (toks[1:] if lead else toks):
                if tok[0] == "const":
                    dims.append(("const", tok[1]))
                elif tok[1] in sources:
                    pos, from_end, factor = sources[tok[1]]
                    dims.append(("dim", pos, from_end, factor, tok[2]))
                else:
                    if tok[1] not in self.keyword_symbols:
                        self.keyword_symbols.append(tok[1])
                    dims.append(("kw", tok[1], tok[2]))
            dtype = arg["dtype"]
            if dtype in schema["dtypes"]:
                like = next((pos for pos, j in enumerate(self.inputs) if tensors[j]["dtype"] == dtype), None)
                if like is None:
                    raise ValueError(f"{schema['op']}: dtype variable {dtype} of output '{arg['name']}' is not "
                                     "given by any input")
                dtype = ("like", like)
            else:
                dtype = ("name", dtype)
            if lead and lead_source is None:
                raise ValueError(f"{schema['op']}: output '{arg['name']}' has leading dims no input gives")
            self.recipes.append(("new", lead, dims, dtype))
