"""Kernels registered at run time: Python callables on torch tensors,
selected and called like a plugin's kernels (docs/python.md, "Kernels
registered at run time")."""
import json as _json

from . import _kdispatch
from ._errors import Error, ManifestError, SelectionError, Unsupported


def _targets_json(targets):
    """The manifest's "targets" list (docs/manifest.md, Targets) as JSON: a
    device name stands for the target object {"device": name}, a dict is a
    target object as a manifest writes it."""
    if isinstance(targets, (str, dict)):
        targets = (targets,)
    out = []
    for target in targets:
        if isinstance(target, str):
            out.append({"device": target})
        elif isinstance(target, dict):
            out.append(target)
        else:
            raise ManifestError(
                "KD-E011", f"targets: expected a device name (\"cpu\", \"cuda\", \"hip\") or a target object "
                f"such as {{\"device\": \"cuda\", \"min_arch\": \"9.0\"}}, found {target!r}")
    try:
        return _json.dumps(out)
    except (TypeError, ValueError) as e:
        raise ManifestError("KD-E011", f"targets: not a JSON value: {e}") from None


def _names(what, values):
    if values is None:
        return []
    if isinstance(values, str):
        values = (values,)
    out = []
    for value in values:
        if not isinstance(value, str):
            raise ManifestError("KD-E011", f"{what}: expected strings, found {value!r}")
        out.append(value)
    return out


def register_kernel(op, backend, fn, *, targets=("cpu",), dtypes=None, constraints=(), priority=0, opt_in=False,
                    description=""):
    """Registers ``fn`` as the kernel of backend ``backend`` for ``op``.

    The dispatcher checks, selects, ranks and falls back over it as over a
    plugin's kernel: ``targets`` (device names or manifest target objects),
    ``dtypes`` (None: every dtype of the op's schema), ``constraints``,
    ``priority`` and ``opt_in`` mean what they mean in a manifest.

    ``fn`` gets the call's tensors as torch tensors in schema order (None for
    an absent optional tensor; no data is copied) and its attributes as
    keyword arguments; it writes the outputs in place and its return value
    is ignored. It must not keep the tensors after it returns. Raising
    ``kdispatch.Unsupported(msg)`` passes the call to the next ranked
    backend; any other exception fails the call (KernelError KD-E040, or a
    demotion when fallback is on). On CUDA it runs on torch's current
    stream.

    Applies to the current runtime and to those made after
    ``kdispatch.configure()``. Raises SelectionError KD-E001 for an op
    without a schema, ManifestError KD-E011 for a bad field,
    RegistrationError KD-E005 when the backend already has another kernel
    for the op.
    """
    if not callable(fn):
        raise ManifestError("KD-E011", f"register_kernel('{op}', '{backend}'): fn must be callable, found {fn!r}")
    if not isinstance(op, str) or not isinstance(backend, str):
        raise ManifestError("KD-E011", f"register_kernel: op and backend must be strings, found {op!r}, {backend!r}")
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ManifestError("KD-E011", f"register_kernel('{op}', '{backend}'): priority must be an integer in "
                            f"[-1000, 1000], found {priority!r}")
    try:
        from torch.utils.dlpack import from_dlpack
    except ImportError as e:
        raise ManifestError("KD-E011", f"register_kernel('{op}', '{backend}'): kernels registered from Python "
                            f"are called with torch tensors, and torch cannot be imported: {e}") from None
    _kdispatch._register_kernel(op, backend, fn, from_dlpack, Unsupported, _targets_json(targets),
                                _names("dtypes", dtypes), _names("constraints", constraints), priority,
                                bool(opt_in), str(description))


def unregister_kernel(op, backend):
    """Withdraws the kernel ``register_kernel`` registered for (op, backend),
    in the current runtime and those made after ``kdispatch.configure()``.
    Raises SelectionError KD-E002 when there is none, RegistrationError
    KD-E005 for a plugin's kernel."""
    _kdispatch._unregister_kernel(op, backend)


def register_backend(backend, kernels, ops, module, what, *, targets, opt_in, priority):
    """Registers backend `backend` for `ops` (None: every op of `kernels`, a
    dict op -> callable, that has a schema in the current registry): the
    register() of kdispatch.native and kdispatch.triton. Returns the ops
    registered."""
    chosen = list(kernels) if ops is None else list(ops)
    unknown = [op for op in chosen if op not in kernels]
    if unknown:
        raise SelectionError("KD-E002", f"No '{backend}' backend for op(s) {unknown}: {module} has no kernel for them",
                             [f"its ops: {', '.join(sorted(kernels))}"])
    known = set(_kdispatch.ops())
    done = []
    for op in chosen:
        if op not in known:
            continue
        register_kernel(op, backend, kernels[op], targets=targets, opt_in=opt_in, priority=priority,
                        description=f"{op} in {what} ({module})")
        done.append(op)
    return done


def unregister_backend(backend, kernels, ops):
    """Withdraws what register_backend registered for `ops` (None: all)."""
    for op in (list(kernels) if ops is None else ops):
        try:
            unregister_kernel(op, backend)
        except Error:
            pass
