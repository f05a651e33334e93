#!/usr/bin/env python3
"""kdispatch.torch with the layouts and choices real model code passes, for
every op whose schema offers them (nothing here names an op):

--strided       row-strided views (a column slice of a wider tensor; for a
                tensor of three or more dims, a head dim with its own
                stride too) for every tensor of layout "rows" or "any",
                through torch.ops.kdispatch.* and the functional variants:
                the outputs land in the views themselves (no copy), equal
                the reference's within the schema's tolerances, and the
                columns between the rows stay untouched;
--optional      None for each optional tensor (and every combination),
                through torch.ops, the functional variants and meta tensors;
--alternatives  each dtype a tensor's "dtype" list allows beside the
                primary one (a float32 weight with bfloat16 activations),
                in every call dtype.

Each mode exits 77 (skipped) when no op schema offers what it tests."""
import argparse
import sys

try:
    import torch
except ImportError as e:
    print(f"SKIPPED: {e} (Debian: python3-torch)")
    sys.exit(77)

import kdispatch
import kdispatch.torch as kdt
import kdispatch.testing as kt

MAX_ELEMENTS = 1 << 16
_TORCH_DTYPES = {name: dtype for dtype, name in kdt._torch_tensors._DTYPES}


def small_cases(op):
    """The plain cases of at most MAX_ELEMENTS elements, largest first (the
    most leading dims), at most three."""
    cases = [c for c in kt.cases(op) if not c.special and c.elements <= MAX_ELEMENTS]
    cases.sort(key=lambda c: -c.elements)
    return cases[:3]


def attrs_of(schema, case):
    return [case.attrs.get(a["name"], a["default"]) for a in schema["attrs"]]


def padded_view(t, fill):
    """A view of a new tensor holding `t`'s values: its last dim contiguous,
    each dim before it with a stride larger than the elements it spans (an
    odd pad), the rest of the storage `fill`. Returns (view, base)."""
    if t.dim() < 2:
        return t.clone(), None
    pads = [0] * t.dim()
    pads[-1] = 3
    if t.dim() >= 3:
        pads[-2] = 1
    base = torch.full([n + p for n, p in zip(t.shape, pads)], fill, dtype=t.dtype)
    view = base[tuple(slice(0, n) for n in t.shape)]
    view.copy_(t)
    assert view.data_ptr() == base.data_ptr()
    return view, base


def pads_untouched(view, base, fill):
    """Whether the elements of `base` outside `view` still hold `fill`."""
    if base is None:
        return True
    mask = torch.ones(base.shape, dtype=torch.bool)
    mask[tuple(slice(0, n) for n in view.shape)] = False
    rest = base[mask]
    if rest.is_floating_point() and fill != fill:
        return bool(torch.isnan(rest).all())
    return bool((rest == fill).all())


def lacks_float8(tensor):
    """Whether a tensor is always a float8 that this torch (before 2.1) has not: its op is left out."""
    dtypes = [tensor["dtype"], *tensor["dtype_alternatives"]]
    return all(d.startswith("float8") for d in dtypes) and not hasattr(torch, dtypes[0])


def ops_with(predicate, what):
    """The registered ops with a tensor for which `predicate` holds; says
    that the check is skipped where there is none."""
    ops = [s["op"] for s in kdispatch.schemas() if s["op"] in kdt.registered and any(map(predicate, s["tensors"]))
           and not any(lacks_float8(t) for t in s["tensors"])]
    if not ops:
        print(f"SKIPPED: no op schema has {what}")
    return ops


def functional_of(op):
    group, short = op.split(".", 1)
    return getattr(getattr(kdt, group), short)


def opfn_of(op):
    return getattr(torch.ops.kdispatch, kdt.registered[op])


def run_functional(op, schema, got, case):
    """Calls the functional variant on `got`'s inputs and puts its outputs
    into `got` (optional outputs are given by keyword, as the tensors of
    `got`)."""
    tensors = schema["tensors"]
    spec = kdt._schema.Functional(schema)
    keywords = {s: case.sizes[s] for s in spec.keyword_symbols}
    keywords.update(case.attrs)
    optional_outputs = [i for i in spec.outputs if tensors[i].get("optional") and not tensors[i]["inplace"]]
    for i in optional_outputs:
        keywords[tensors[i]["name"]] = got[i]
    out_dtypes = {tensors[i]["name"]: got[i].dtype for i in spec.outputs
                  if got[i] is not None and i not in optional_outputs and not tensors[i]["inplace"]}
    result = functional_of(op)(*[got[i] for i in spec.inputs], out_dtypes=out_dtypes, **keywords)
    result = result if isinstance(result, tuple) else (result,)
    returned = [i for i in spec.outputs if i not in optional_outputs]
    for i, r in zip(returned, result):
        got[i] = r
    return got


def check_strided(op, schema):
    checked = failed = 0
    tensors = schema["tensors"]
    rows = [i for i, t in enumerate(tensors) if t.get("layout", "contiguous") != "contiguous"]
    for dtype in kt.dtypes(op):
        for case in small_cases(op):
            inputs = kt.inputs(op, dtype, case, seed=case.index)
            want = kt.reference(op, inputs, case)
            for path in ("torch.ops", "functional"):
                got = [t.clone() for t in inputs]
                bases = {}
                for i in rows:
                    fill = float("nan") if got[i].is_floating_point() else -3
                    got[i], base = padded_view(got[i], fill)
                    bases[i] = (base, fill)
                views = list(got)
                if path == "torch.ops":
                    opfn_of(op)(*got, *attrs_of(schema, case))
                else:
                    got = run_functional(op, schema, got, case)
                # Through torch.ops the outputs compared are the views given:
                # results written anywhere else (a copy) fail here.
                verdict = kt.compare(op, got, want, case)
                problems = [] if verdict.ok else [verdict.first_mismatch]
                for i, (base, fill) in bases.items():
                    if base is not None and not pads_untouched(views[i], base, fill):
                        problems.append(f"'{tensors[i]['name']}': the columns between its rows changed")
                checked += 1
                if problems:
                    failed += 1
                    print(f"FAIL {op} {dtype} {case} strided via {path}: {'; '.join(problems)}")
    print(f"{'ok  ' if failed == 0 else 'FAIL'} {op}: row-strided {', '.join(tensors[i]['name'] for i in rows)}, "
          f"{checked - failed} of {checked} checks pass")
    return checked, failed


def check_optional(op, schema):
    checked = failed = 0
    tensors = schema["tensors"]
    for dtype in kt.dtypes(op):
        primary = {t["name"]: kdt._schema.tensor_dtypes(schema, t, dtype)[0] for t in tensors}
        for variant in kt.variants(op, dtype):
            # Those leaving a tensor out, in primary dtypes (--alternatives checks the others).
            if not variant["absent"] or any(d != primary[n] for n, d in variant["dtypes"].items()):
                continue
            for case in small_cases(op)[:1]:
                inputs = kt.inputs(op, dtype, case, seed=case.index, absent=variant["absent"])
                want = kt.reference(op, inputs, case)
                for path in ("torch.ops", "functional", "meta"):
                    got = [None if t is None else t.clone() for t in inputs]
                    if path == "torch.ops":
                        opfn_of(op)(*got, *attrs_of(schema, case))
                    elif path == "functional":
                        got = run_functional(op, schema, got, case)
                    else:
                        opfn_of(op)(*[None if t is None else t.to("meta") for t in got],
                                    *attrs_of(schema, case))
                        checked += 1
                        continue
                    verdict = kt.compare(op, got, want, case)
                    checked += 1
                    if not verdict.ok:
                        failed += 1
                        print(f"FAIL {op} {dtype} {case} without {', '.join(variant['absent'])} via {path}: "
                              f"{verdict.first_mismatch}")
                print(f"ran  {op} {dtype}: None for {', '.join(variant['absent'])}")
    # None for a tensor that is not optional: refused, naming the argument.
    required = next((i for i, t in enumerate(schema["tensors"]) if not t.get("optional")), None)
    if required is not None:
        case = kt.cases(op)[0]
        args = kt.inputs(op, kt.dtypes(op)[0], case)
        args[required] = None
        try:
            opfn_of(op)(*args, *attrs_of(schema, case))
            print(f"FAIL {op}: None for '{schema['tensors'][required]['name']}' (not optional) was accepted")
            failed += 1
        except (kdispatch.Error, RuntimeError) as e:
            if schema["tensors"][required]["name"] not in str(e):
                print(f"FAIL {op}: the refusal of None does not name the argument: {e}")
                failed += 1
        checked += 1
    return checked, failed


def check_alternatives(op, schema):
    checked = failed = 0
    for dtype in kt.dtypes(op):
        for variant in kt.variants(op, dtype)[1:]:
            if variant["absent"]:
                continue
            for case in small_cases(op)[:1]:
                inputs = kt.inputs(op, dtype, case, seed=case.index, dtypes=variant["dtypes"])
                for name, want_dtype in variant["dtypes"].items():
                    i = next(k for k, t in enumerate(schema["tensors"]) if t["name"] == name)
                    assert inputs[i].dtype == _TORCH_DTYPES[want_dtype], (name, inputs[i].dtype, want_dtype)
                want = kt.reference(op, inputs, case)
                for path in ("torch.ops", "functional"):
                    got = [t.clone() for t in inputs]
                    if path == "torch.ops":
                        opfn_of(op)(*got, *attrs_of(schema, case))
                    else:
                        got = run_functional(op, schema, got, case)
                    verdict = kt.compare(op, got, want, case)
                    checked += 1
                    if not verdict.ok:
                        failed += 1
                        print(f"FAIL {op} {dtype} {variant['dtypes']} via {path}: {verdict.first_mismatch}")
            described = ", ".join(f"{k} {v}" for k, v in variant["dtypes"].items())
            print(f"ran  {op} {dtype}: {described}")
    return checked, failed


MODES = {
    "strided": (lambda t: t.get("layout", "contiguous") != "contiguous", "a tensor of layout 'rows' or 'any'",
                check_strided),
    "optional": (lambda t: t.get("optional", False), "an optional tensor", check_optional),
    "alternatives": (lambda t: bool(t.get("dtype_alternatives")), "a tensor with a list of dtypes",
                     check_alternatives),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    modes = parser.add_mutually_exclusive_group(required=True)
    for mode in ("strided", "optional", "alternatives"):
        modes.add_argument(f"--{mode}", dest="mode", action="store_const", const=mode)
    args = parser.parse_args()
    offers, what, check = MODES[args.mode]
    # Ops whose tensors this torch cannot make (8-bit floats before torch 2.1) are left out.
    ops = [op for op in ops_with(offers, what) if not kt.unavailable_dtypes(op, alternatives=True)]
    if not ops:
        return 77
    checked = failed = 0
    for op in ops:
        c, f = check(op, kdispatch.schema(op))
        checked += c
        failed += f
    print(f"{checked - failed} of {checked} checks pass")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
