"""The exceptions of kdispatch, one class per C++ error class.

Every error carries a stable code ("KD-E030") that ``kdispatch.explain(code)``
documents, the message (naming the op, backend, file or argument involved)
and hints (did-you-mean, why a plugin did not load).
"""


class Error(Exception):
    """Base of every kdispatch error: ``.code``, ``.message``, ``.hints``."""

    def __init__(self, code, message, hints=()):
        super().__init__(code, message, list(hints))
        self.code = code
        self.message = message
        self.hints = list(hints)

    def __str__(self):
        lines = [f"[{self.code}] {self.message}"]
        lines += [f"  hint: {hint}" for hint in self.hints]
        return "\n".join(lines)


class SelectionError(Error):
    """KD-E001..E006: no kernel could be chosen for a call."""


class RegistrationError(Error):
    """KD-E005: a conflicting registration."""


class ManifestError(Error):
    """KD-E010..E013: a manifest or op schema is invalid."""


class PluginError(Error):
    """KD-E020..E026: a plugin binary could not be used."""


class CallError(Error, ValueError):
    """KD-E030..E031: the arguments of a call do not fit the op."""


class KernelError(Error):
    """KD-E040..E041: the kernel or the device runtime failed."""


def call_error(message):
    """A KD-E030 error raised by the Python layer (fake implementations)."""
    return CallError("KD-E030", message)


class Unsupported(Exception):
    """Raised by a kernel registered with ``kdispatch.register_kernel`` that
    does not handle a call: the call passes to the next ranked backend, and
    the message says why in warnings and errors."""
