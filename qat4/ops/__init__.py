"""Model ops: each one a plain-torch reference and a Triton kernel with the same signature.

``QAT4_OPS`` picks the implementation for every op: ``auto`` (default: Triton for CUDA tensors,
the reference for CPU tensors), ``reference`` (the reference everywhere) or ``triton`` (the
kernels everywhere, e.g. CPU tensors under ``TRITON_INTERPRET=1``).
"""

import os

import torch

from qat4.errors import Qat4Error

_MODES = ("auto", "reference", "triton")


def use_triton(tensor) -> bool:
    """True when the op called on `tensor` should run its Triton kernel."""
    return triton_on(tensor.device)


def triton_on(device) -> bool:
    """True when ops on tensors of `device` run their Triton kernels (QAT4_OPS, module docstring)."""
    mode = os.environ.get("QAT4_OPS", "auto").strip().lower() or "auto"
    if mode not in _MODES:
        raise Qat4Error(f"QAT4_OPS is {mode!r}; use one of {', '.join(_MODES)}.")
    return mode == "triton" or (mode == "auto" and torch.device(device).type == "cuda")
