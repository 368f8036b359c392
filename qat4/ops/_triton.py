"""Triton for the kernel modules, and stand-ins where it is not installed.

Triton is needed only to launch kernels (CUDA tensors, or the interpreter); a CPU-only install
runs the torch reference ops and need not have it. The kernel modules import `triton` and `tl`
from here: with Triton installed they are the real modules; without it they are stand-ins, so the
modules still import and define their kernels, and launching one raises a Qat4Error saying so.
"""

from __future__ import annotations

from qat4.errors import Qat4Error

try:
    import triton
    import triton.language as tl

    TRITON_VERSION: str | None = triton.__version__
except ImportError:
    TRITON_VERSION = None


# What the kernel modules call as they import, to declare kernels, their tilings and constants.
_DECLARATIONS = ("triton.jit", "triton.autotune", "triton.heuristics", "triton.Config", "triton.language.constexpr")


class _Absent:
    """Stands in for Triton or one of its names. Attributes are stand-ins; the declaring calls
    give stand-ins too (a decorated kernel's names it); any other use of Triton, such as
    launching a kernel (`kernel[grid](...)`) or `triton.cdiv(...)`, raises."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str) -> _Absent:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Absent(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs) -> _Absent:
        if self._name not in _DECLARATIONS:
            raise self._missing()
        if len(args) == 1 and not kwargs and callable(args[0]):
            kernel = args[0]
            return kernel if isinstance(kernel, _Absent) else _Absent(f"kernel {kernel.__module__}.{kernel.__qualname__}")
        return self

    def __getitem__(self, grid):
        raise self._missing()

    def _missing(self) -> Qat4Error:
        return Qat4Error(f"{self._name} needs Triton, which is not installed; install it (pip install triton) "
                         "or run the reference ops (QAT4_OPS=reference)")


if TRITON_VERSION is None:
    triton = _Absent("triton")
    tl = _Absent("triton.language")
