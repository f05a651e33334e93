"""The ``triton`` backend: Triton kernels for the norms and the gated
activations, on CUDA where triton imports.

    import kdispatch, kdispatch.triton
    kdispatch.triton.register()          # backend "triton" for the ops below
    kdispatch.call("layernorm.rmsnorm", out, x, w, eps=1e-6, backend="triton")

An ordinary backend registered at run time (``kdispatch.register_kernel``),
like the ``torch`` backend of kdispatch.native: its kernels go through the
dispatcher's checks, run on torch's current stream (so they are captured by
CUDA graphs and run inside torch.compile'd code as the plugins' kernels
do), and are compared with the reference backend with the op schema's
tolerances (``kdispatch.testing.conformance``). They compute in float32 and
round once to the output's dtype; weights may be float32 or the activation
dtype; rows may be any stride apart.

Opt-in by default, as the torch backend: it takes part when a call, an op's
preference, a tuned choice or ``KDISPATCH_BACKEND_ORDER`` names it, or
with ``register(opt_in=False, priority=...)``.

Calls it passes on as unsupported: leading dims that are not one stride
apart (e.g. a transposed batch), and rows longer than 32768 elements.
"""
from ._errors import PluginError, Unsupported
from ._runtime_kernels import register_backend as _register_backend, unregister_backend as _unregister_backend

BACKEND = "triton"
_MAX_ROW = 32768


def available():
    """None when the backend can be registered here, else why not."""
    try:
        import torch
    except ImportError as e:
        return f"torch does not import: {e}"
    if not torch.cuda.is_available():
        return "torch has no CUDA device"
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return f"triton does not import: {e}"
    return None


def _rows(t, name):
    """t [*, L] as a 2-D view [rows, L] (no copy), or Unsupported."""
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        raise Unsupported(f"{name}: its leading dims {tuple(t.shape[:-1])} with strides {t.stride()[:-1]} are not "
                          "one stride apart") from None


def _block(n):
    if n > _MAX_ROW:
        raise Unsupported(f"rows of {n} elements: the triton kernels hold a row of at most {_MAX_ROW} in registers")
    return max(16, 1 << (n - 1).bit_length())


def _warps(block):
    return max(1, min(16, block // 256))


def _launch(kernel, grid, tensor, *args, **meta):
    import torch
    if tensor.shape[0] == 0:
        return
    if tensor.device.index not in (None, torch.cuda.current_device()):
        with torch.cuda.device(tensor.device):
            kernel[grid](*args, **meta)
    else:
        kernel[grid](*args, **meta)


def _norm(gemma):
    def kernel(out, x, weight, eps):
        from . import _triton_kernels as k
        o, xs = _rows(out, "out"), _rows(x, "x")
        h = xs.shape[1]
        block = _block(h)
        _launch(k.rmsnorm_kernel, (xs.shape[0],), xs, o, o.stride(0), xs, xs.stride(0), weight, h, eps,
                GEMMA=gemma, BLOCK=block, num_warps=_warps(block))
    return kernel


def _fused_out(gemma):
    def kernel(out, residual_out, x, residual, weight, eps):
        from . import _triton_kernels as k
        o, ro = _rows(out, "out"), _rows(residual_out, "residual_out")
        xs, rs = _rows(x, "x"), _rows(residual, "residual")
        h = xs.shape[1]
        block = _block(h)
        _launch(k.fused_add_rmsnorm_kernel, (xs.shape[0],), xs, o, o.stride(0), ro, ro.stride(0), xs, xs.stride(0),
                rs, rs.stride(0), weight, h, eps, GEMMA=gemma, BLOCK=block, num_warps=_warps(block))
    return kernel


def _fused_inplace(gemma):
    out_of_place = _fused_out(gemma)

    def kernel(x, residual, weight, eps):
        out_of_place(x, residual, x, residual, weight, eps)
    return kernel


def _gated(act):
    def kernel(out, x):
        from . import _triton_kernels as k
        o, xs = _rows(out, "out"), _rows(x, "x")
        d = o.shape[1]
        block = min(1024, max(16, 1 << (d - 1).bit_length()))
        grid = (xs.shape[0], (d + block - 1) // block)
        _launch(k.gated_kernel, grid, xs, o, o.stride(0), xs, xs.stride(0), d, ACT=act, BLOCK=block,
                num_warps=_warps(block))
    return kernel


KERNELS = {
    "layernorm.rmsnorm": _norm(False),
    "layernorm.gemma_rmsnorm": _norm(True),
    "layernorm.fused_add_rmsnorm": _fused_inplace(False),
    "layernorm.gemma_fused_add_rmsnorm": _fused_inplace(True),
    "layernorm.fused_add_rmsnorm_out": _fused_out(False),
    "layernorm.gemma_fused_add_rmsnorm_out": _fused_out(True),
    "activation.silu_and_mul": _gated(0),
    "activation.gelu_tanh_and_mul": _gated(1),
}


def register(ops=None, *, opt_in=True, priority=0):
    """Registers backend "triton" on CUDA for `ops` (default: every op of
    KERNELS with a schema in the current registry). Returns the ops
    registered. Raises PluginError KD-E020 when triton or CUDA is missing,
    naming which."""
    why = available()
    if why is not None:
        raise PluginError("KD-E020", f"the '{BACKEND}' backend cannot be registered: {why}",
                          ["kdispatch.native.register() gives the torch backend wherever torch is"])
    from . import _triton_kernels  # noqa: F401  (compiles nothing yet: kernels compile at their first call)
    return _register_backend(BACKEND, KERNELS, ops, "kdispatch.triton", "Triton", targets=["cuda"], opt_in=opt_in,
                             priority=priority)


def unregister(ops=None):
    """Withdraws what register() registered."""
    _unregister_backend(BACKEND, KERNELS, ops)
