"""Op schemas on the Python side: the outputs a functional variant
allocates. Calls are checked by the dispatcher, fake (meta) calls too.

A schema is the dict of ``kdispatch.schema(op)``. Shape tokens: "*" (any
leading dims, shared by every tensor that has it), a symbol ("H"), an
integer, or "k*NAME" (a multiple of a symbol).
"""


def tensor_dtypes(schema, arg, call_dtype=None):
    """The dtype names a tensor may take: its "dtype" then its
    "dtype_alternatives", a dtype variable replaced by `call_dtype` where
    given (else by each dtype it allows), without repeats; the first is the
    primary one."""
    out = []
    for name in [arg["dtype"]] + list(arg.get("dtype_alternatives", ())):
        if name in schema["dtypes"]:
            names = [call_dtype] if call_dtype is not None else schema["dtypes"][name]
        else:
            names = [name]
        for n in names:
            if n not in out:
                out.append(n)
    return out

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


class Functional:
    """How a functional variant makes its outputs: which tensors it takes
    (the ones the op does not only write), which it allocates (shape from
    the inputs' dims, dtype from an input's dtype variable or the schema's
    dtype) and which it clones (read and written), and which symbols only
    outputs have (keyword arguments, e.g. K of moe.topk_softmax)."""

    def __init__(self, schema):
        tensors = schema["tensors"]
        self.inputs = [i for i, a in enumerate(tensors) if not a["written"] or a["inplace"]]
        self.outputs = [i for i, a in enumerate(tensors) if a["written"]]
        self.attrs = schema["attrs"]
        tokens = [[parse_token(t) for t in arg["shape"]] for arg in tensors]
        # Where each symbol and the leading dims can be read from an input:
        # (input position, dim from the end, factor).
        sources = {}
        lead_source = None
        # Sizes are read from the inputs always given first, then from
        # optional ones (which a call may leave out).
        order = sorted(enumerate(self.inputs), key=lambda p: bool(tensors[p[1]].get("optional")))
        for pos, i in order:
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
                self.recipes.append(("clone", self.inputs.index(i), arg.get("layout", "contiguous") != "contiguous"))
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
                # An input of exactly that dtype variable: one that may take
                # another dtype (a "dtype" list) or be left out does not say.
                candidates = [pos for pos, j in enumerate(self.inputs) if tensors[j]["dtype"] == dtype]
                certain = [pos for pos in candidates if not tensors[self.inputs[pos]].get("dtype_alternatives")
                           and not tensors[self.inputs[pos]].get("optional")]
                like = (certain or candidates or [None])[0]
                if like is None:
                    raise ValueError(f"{schema['op']}: dtype variable {dtype} of output '{arg['name']}' is not "
                                     "given by any input")
                dtype = ("like", like)
            else:
                dtype = ("name", dtype)
            if lead and lead_source is None:
                raise ValueError(f"{schema['op']}: output '{arg['name']}' has leading dims no input gives")
            self.recipes.append(("new", lead, dims, dtype))
