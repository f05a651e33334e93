"""The Triton kernels of the ``triton`` backend (kdispatch.triton). Imported
only by kdispatch.triton.register(), where triton imports.

One program a row for the norms (the row in registers, float32 sums); a
grid of rows x column blocks for the gated activations. Every kernel reads
its inputs as stored, computes in float32 and rounds once to the output's
dtype; rows may be any stride apart (the last dim is dense)."""
import triton
import triton.language as tl


@triton.jit
def rmsnorm_kernel(out_ptr, out_stride, x_ptr, x_stride, w_ptr, H, eps, GEMMA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if GEMMA:
        w = w + 1.0
    inv = tl.rsqrt(tl.sum(x * x, axis=0) / H + eps)
    tl.store(out_ptr + row * out_stride + cols, (x * inv * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def fused_add_rmsnorm_kernel(out_ptr, out_stride, res_out_ptr, res_out_stride, x_ptr, x_stride, res_ptr, res_stride,
                             w_ptr, H, eps, GEMMA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    s = (tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
         + tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0).to(tl.float32))
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if GEMMA:
        w = w + 1.0
    inv = tl.rsqrt(tl.sum(s * s, axis=0) / H + eps)
    tl.store(res_out_ptr + row * res_out_stride + cols, s.to(res_out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + row * out_stride + cols, (s * inv * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def gated_kernel(out_ptr, out_stride, x_ptr, x_stride, D, ACT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    a = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(x_ptr + row * x_stride + D + cols, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:  # silu: a / (1 + e^-a)
        g = a / (1.0 + tl.exp(-a))
    else:  # gelu, tanh form: 0.5 a (1 + tanh(u)) = a / (1 + e^-2u), without the cancellation of 1 + tanh
        u = 0.7978845608028654 * (a + 0.044715 * a * a * a)
        g = a / (1.0 + tl.exp(-2.0 * u))
    tl.store(out_ptr + row * out_stride + cols, (g * b).to(out_ptr.dtype.element_ty), mask=mask)
