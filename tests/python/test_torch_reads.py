#!/usr/bin/env python3
"""torch tensors are read from torch's C++ tensor, never from attributes a
subclass can override, and every argument's memory stays where it was read
until the kernel returns:

  - a torch.Tensor subclass whose shape, stride(), data_ptr(), size(),
    dim(), is_contiguous() and __torch_function__ lie (claiming a larger
    shape than its storage), or a torch-function mode that lies, is run on
    the true layout, or refused with KD-E030, never read or written out of
    bounds;
  - a DLPack object passed after a torch tensor whose __dlpack__ resizes
    the tensor or its storage, swaps its storage (set_()) or drops the
    caller's last reference leaves no pointer to freed memory: the result is right, or
    the call is refused with KD-E030;
  - plain tensors, nn.Parameter (under no_grad), strided views and
    zero-size tensors keep working.

The hostile calls run in a subprocess each, so that a crash is a failed
test that names the signal."""
import os
import signal
import subprocess
import sys
import textwrap
import unittest

try:
    import numpy  # noqa: F401
    import torch
except ImportError as e:
    print(f"SKIPPED: {e} (Debian: python3-numpy, python3-torch)")
    sys.exit(77)

import kdispatch

RMS = "layernorm.rmsnorm"

# The prelude of every subprocess: the reference formula, the lying
# subclass and a DLPack object with a hostile __dlpack__.
PRELUDE = textwrap.dedent('''
    import sys
    import numpy as np
    import torch
    import kdispatch

    RMS = "layernorm.rmsnorm"

    def rms(x, w, eps=1e-6):
        x64 = x.double()
        return (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w.double()).to(x.dtype)

    BIG = (1 << 20, 64)  # what the liar claims: 256 MiB of float32

    class Liar(torch.Tensor):
        """Claims BIG and an unmapped pointer (fake_ptr), through its Python
        attributes and through __torch_function__ (which torch's own
        methods and getters call for a subclass)."""
        fake_ptr = 1 << 40
        def data_ptr(self):
            return self.fake_ptr
        @property
        def shape(self):
            return torch.Size(BIG)
        def size(self, dim=None):
            return torch.Size(BIG) if dim is None else BIG[dim]
        def stride(self, dim=None):
            return (BIG[1], 1) if dim is None else (BIG[1], 1)[dim]
        def dim(self):
            return 2
        def is_contiguous(self, *args, **kwargs):
            return True
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            if name in ("data_ptr",):
                return args[0].fake_ptr
            if name in ("stride",):
                return (BIG[1], 1)
            if name in ("size",):
                return torch.Size(BIG)
            with torch._C.DisableTorchFunction():
                result = func(*args, **(kwargs or {}))
            if isinstance(result, torch.Size):
                return torch.Size(BIG)
            return result

    class Hostile:
        """A DLPack object around a NumPy array whose __dlpack__ runs
        `action` first."""
        def __init__(self, array, action):
            self.array, self.action = array, action
        def __dlpack_device__(self):
            return self.array.__dlpack_device__()
        def __dlpack__(self, stream=None, **kwargs):
            self.action()
            return self.array.__dlpack__()

    def refused_or(fn, check):
        try:
            fn()
        except kdispatch.CallError as e:
            assert e.code == "KD-E030", (e.code, e.message)
            print("refused:", e.message)
            return
        check()
        print("ran")
''')


def run_child(body):
    """Runs PRELUDE + body in a fresh interpreter; its stdout, or a failure
    naming the signal that ended it."""
    proc = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ))
    if proc.returncode < 0:
        raise AssertionError(f"the call crashed: {signal.Signals(-proc.returncode).name}\n{proc.stderr[-2000:]}")
    if proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return proc.stdout


class LyingSubclass(unittest.TestCase):
    def test_lying_input(self):
        out = run_child('''
            torch.manual_seed(0)
            x = torch.rand(4, 64) + 0.5
            w = torch.rand(64) + 0.5
            liar = x.clone().as_subclass(Liar)
            assert liar.shape == BIG and liar.data_ptr() == 1 << 40
            got = torch.full_like(x, float("nan"))
            refused_or(lambda: kdispatch.call(RMS, got, liar, w, backend="reference"),
                       lambda: torch.testing.assert_close(got, rms(x, w)))
        ''')
        self.assertIn("ran", out, "the true layout [4, 64] matches out and w")

    def test_lying_input_and_output(self):
        # Both claim BIG, so that the shapes they claim agree: the call runs
        # on their true layout, or is refused.
        out = run_child('''
            torch.manual_seed(0)
            x = torch.rand(4, 64) + 0.5
            w = torch.rand(64) + 0.5
            liar = x.clone().as_subclass(Liar)
            got = torch.full((4, 64), float("nan")).as_subclass(Liar)
            got.fake_ptr = 1 << 41  # no overlap with liar's claim
            def check():
                with torch._C.DisableTorchFunction():
                    real = torch.Tensor(got)
                    torch.testing.assert_close(real, rms(x, w))
            refused_or(lambda: kdispatch.call(RMS, got, liar, w, backend="reference"), check)
            refused_or(lambda: kdispatch.op(RMS, "cpu")(got, liar, w), check)
        ''')
        self.assertEqual(out.splitlines(), ["ran", "ran"], "their true layouts agree")

    def test_lying_torch_function_mode(self):
        # An active torch-function mode sees torch's methods and getters on
        # plain tensors too.
        out = run_child('''
            from torch.overrides import TorchFunctionMode
            class Lying(TorchFunctionMode):
                def __torch_function__(self, func, types, args=(), kwargs=None):
                    result = func(*args, **(kwargs or {}))
                    if getattr(func, "__name__", "") == "data_ptr":
                        return 1 << 40
                    return torch.Size(BIG) if isinstance(result, torch.Size) else result
            torch.manual_seed(0)
            x = torch.rand(4, 64) + 0.5
            w = torch.rand(64) + 0.5
            got = torch.full((4, 64), float("nan"))
            out2 = torch.full((4, 64), float("nan"))
            with Lying():
                assert x.shape == BIG
                refused_or(lambda: kdispatch.call(RMS, got, x, w, backend="reference"), lambda: None)
                refused_or(lambda: kdispatch.op(RMS, "cpu")(out2, x, w), lambda: None)
            torch.testing.assert_close(got, rms(x, w))
            torch.testing.assert_close(out2, rms(x, w))
        ''')
        self.assertEqual(out.splitlines(), ["ran", "ran"])

    def test_lying_layout_check(self):
        # A layout check (torch.ops.kdispatch's fake implementation path)
        # reads no data; its verdict is on the tensors as torch sees them.
        run_child('''
            import kdispatch.torch
            x = (torch.rand(4, 64) + 0.5).as_subclass(Liar)
            w = torch.rand(64) + 0.5
            got = torch.empty(4, 64).as_subclass(Liar)
            got.fake_ptr = 1 << 41
            try:
                torch.ops.kdispatch.layernorm_rmsnorm(got, x, w, 1e-6, "reference")
                print("ran")
            except Exception as e:
                print("refused:", type(e).__name__)
        ''')


class ReleasedByALaterArgument(unittest.TestCase):
    """x is a torch tensor; w, after it, a DLPack object whose __dlpack__
    changes x. x is large, so that its freed memory is returned to the
    system (a read of it is a SIGSEGV)."""

    def hostile(self, action):
        return run_child(f'''
            torch.manual_seed(0)
            rows = 1 << 14
            x = torch.rand(rows, 256) + 0.5
            want = rms(x, torch.ones(256))
            w = np.ones(256, dtype=np.float32)
            holder = [x]
            def action():
                {action}
            got = torch.full((rows, 256), float("nan"))
            hostile = Hostile(w, action)
            del x
            refused_or(lambda: kdispatch.call(RMS, got, holder[0] if holder else None, hostile,
                                              backend="reference"),
                       lambda: torch.testing.assert_close(got, want))
        ''')

    def test_set_frees_the_storage(self):
        # x.set_() drops x's storage, its last owner: freed before the kernel.
        out = self.hostile("holder[0].set_()")
        self.assertIn("refused", out)

    def test_resize_to_larger_moves_the_storage(self):
        out = self.hostile("holder[0].resize_(1 << 15, 256)")
        self.assertIn("refused", out)

    def test_storage_resized_to_zero(self):
        # The storage itself is freed; x keeps its shape, over no data.
        out = self.hostile("holder[0].storage().resize_(0)")
        self.assertIn("has no data", out)

    def test_storage_shrunk(self):
        # The storage is reallocated smaller; x keeps its shape over it.
        out = self.hostile("holder[0].storage().resize_(16)")
        self.assertIn("past the end of its storage", out)

    def test_resize_to_zero(self):
        out = self.hostile("holder[0].resize_(0)")
        self.assertIn("refused", out)

    def test_last_reference_dropped(self):
        # The call's argument tuple still holds x: it runs, on x's values.
        out = self.hostile("holder.clear()")
        self.assertIn("ran", out)

    def test_torch_op_path(self):
        out = run_child('''
            rows = 1 << 14
            x = torch.rand(rows, 256) + 0.5
            w = np.ones(256, dtype=np.float32)
            got = torch.full((rows, 256), float("nan"))
            op = kdispatch.op(RMS, "cpu")
            refused_or(lambda: op(got, x, Hostile(w, lambda: x.set_())), lambda: None)
        ''')
        self.assertIn("refused", out)


class OrdinaryTensors(unittest.TestCase):
    def setUp(self):
        torch.manual_seed(1)
        self.x = torch.rand(6, 64) + 0.5
        self.w = torch.rand(64) + 0.5

    def rms(self, x, w, eps=1e-6):
        x64 = x.double()
        return (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w.double()).to(x.dtype)

    def test_plain(self):
        for backend in ("reference", "cpu"):
            out = torch.full_like(self.x, float("nan"))
            kdispatch.call(RMS, out, self.x, self.w, backend=backend)
            torch.testing.assert_close(out, self.rms(self.x, self.w))

    def test_parameter(self):
        w = torch.nn.Parameter(self.w.clone())
        out = torch.full_like(self.x, float("nan"))
        with torch.no_grad():
            kdispatch.op(RMS, "reference")(out, self.x, w)
        torch.testing.assert_close(out, self.rms(self.x, self.w))
        with self.assertRaises(kdispatch.CallError) as caught:
            kdispatch.call(RMS, out, self.x, w)
        self.assertEqual(caught.exception.code, "KD-E030")
        self.assertIn("argument 2 'weight'", caught.exception.message)

    def test_views(self):
        wide = torch.rand(6, 160) + 0.5
        x = wide[:, 32:96]  # row-strided, with a storage offset
        self.assertFalse(x.is_contiguous())
        out_wide = torch.full((6, 128), float("nan"))
        out = out_wide[:, 64:]
        kdispatch.call(RMS, out, x, self.w, backend="reference")
        torch.testing.assert_close(out, self.rms(x, self.w))
        self.assertTrue(torch.isnan(out_wide[:, :64]).all(), "nothing written outside the view")

    def test_zero_rows(self):
        x = torch.empty(0, 64)
        out = torch.empty(0, 64)
        kdispatch.call(RMS, out, x, self.w, backend="reference")

    def test_plain_subclass(self):
        # A subclass that lies about nothing, with torch's default
        # __torch_function__: read from torch's DLPack capsule of it.
        class Tagged(torch.Tensor):
            pass
        x = self.x.clone().as_subclass(Tagged)
        out = torch.full_like(self.x, float("nan")).as_subclass(Tagged)
        kdispatch.call(RMS, out, x, self.w, backend="reference")
        torch.testing.assert_close(torch.Tensor(out), self.rms(self.x, self.w))

    def test_errors_name_the_argument(self):
        out = torch.full_like(self.x, float("nan"))
        with self.assertRaises(kdispatch.CallError) as caught:
            kdispatch.call(RMS, out, self.x.to(torch.complex64), self.w)
        self.assertIn("argument 1 'x'", caught.exception.message)


if __name__ == "__main__":
    unittest.main(verbosity=2)
