"""A DLPack producer written with ctypes, for testing the consumer side of
the capsule protocol: it counts its exports and its deleter's calls, and
makes versioned ("dltensor_versioned") or unversioned ("dltensor")
capsules around a NumPy array's memory. The structs are the DLPack ones;
the capsule's destructor frees the tensor only if no consumer took it (the
capsule still has its original name), as the protocol asks."""
import ctypes

import numpy as np


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32), ("dtype", DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    pass


DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", DELETER)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    pass


DELETER_VERSIONED = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensorVersioned))
DLManagedTensorVersioned._fields_ = [("version", DLPackVersion), ("manager_ctx", ctypes.c_void_p),
                                     ("deleter", DELETER_VERSIONED), ("flags", ctypes.c_uint64),
                                     ("dl_tensor", DLTensor)]
FLAG_READ_ONLY = 1

CAPSULE_DESTRUCTOR = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_new = ctypes.pythonapi.PyCapsule_New
_new.restype = ctypes.py_object
_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, CAPSULE_DESTRUCTOR]
_is_valid = ctypes.pythonapi.PyCapsule_IsValid
_is_valid.restype = ctypes.c_int
_is_valid.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype = ctypes.c_void_p
_get_pointer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]

_DTYPES = {np.dtype(np.float32): (2, 32), np.dtype(np.float16): (2, 16), np.dtype(np.float64): (2, 64),
           np.dtype(np.int32): (0, 32), np.dtype(np.int64): (0, 64)}


class Producer:
    """Wraps a C-contiguous NumPy array. Its __dlpack__ accepts max_version
    and makes a versioned capsule when asked for major >= 1 (of version
    `major`), else an unversioned one."""

    versioned = True

    def __init__(self, array, read_only=False, major=1, dtype=None):
        """`dtype`, a DLPack (code, bits), labels the array's bytes as
        another dtype (e.g. (10, 8): float8_e4m3fn over uint8)."""
        assert array.flags.c_contiguous
        self.array = array
        self.dtype = dtype
        self.read_only = read_only
        self.major = major
        self.exports = 0
        self.versioned_exports = 0
        self.deleted = 0
        self._keep = []

    def __dlpack_device__(self):
        return (1, 0)  # kDLCPU

    def _fill(self, t):
        code, bits = self.dtype or _DTYPES[self.array.dtype]
        shape = (ctypes.c_int64 * self.array.ndim)(*self.array.shape)
        strides = (ctypes.c_int64 * self.array.ndim)(*[s // self.array.itemsize for s in self.array.strides])
        self._keep += [shape, strides]
        t.data = self.array.ctypes.data
        t.device = DLDevice(1, 0)
        t.ndim = self.array.ndim
        t.dtype = DLDataType(code, bits, 1)
        t.shape = shape
        t.strides = strides
        t.byte_offset = 0

    def capsule(self, versioned):
        self.exports += 1
        self.versioned_exports += versioned
        if versioned:
            managed = DLManagedTensorVersioned()
            managed.version = DLPackVersion(self.major, 0)
            managed.flags = FLAG_READ_ONLY if self.read_only else 0
            deleter = DELETER_VERSIONED(self._on_delete)
            name = b"dltensor_versioned"
        else:
            managed = DLManagedTensor()
            deleter = DELETER(self._on_delete)
            name = b"dltensor"
        self._fill(managed.dl_tensor)
        managed.deleter = deleter

        def destructor(capsule):
            # Still named as made: no consumer took it, so the producer frees it.
            if _is_valid(capsule, name):
                self._on_delete(None)

        destructor = CAPSULE_DESTRUCTOR(destructor)
        self._keep += [managed, deleter, destructor]
        return _new(ctypes.addressof(managed), name, destructor)

    def _on_delete(self, _managed):
        self.deleted += 1

    def __dlpack__(self, stream=None, **kwargs):
        max_version = kwargs.pop("max_version", None)
        if kwargs or (max_version is not None and not self.versioned):
            raise TypeError(f"__dlpack__() got an unexpected keyword argument {next(iter(kwargs or {'max_version': 0}))!r}")
        return self.capsule(versioned=max_version is not None and max_version[0] >= 1)


class OldProducer(Producer):
    """A producer from before DLPack 1.0: its __dlpack__ takes no max_version."""
    versioned = False
