"""Programmatic dependent launch (PDL) for the decode step's small kernels, Hopper and later.

A decode step is some 500 kernels of a few microseconds each, so the gap between one kernel's end
and the next one's first load costs as much as the work. Launched with PDL, a kernel is scheduled
while its predecessor still runs: it may load what no earlier kernel writes (the GEMV's weights)
and then waits in :func:`wait_for_previous_kernel` until the predecessor has finished and its
writes are visible. Every kernel so launched waits before it reads or writes any activation, so
the chain stays ordered exactly as without PDL. Captured in a CUDA graph, the launches keep their
programmatic edges.

PDL is used for launches over at most MAX_ROWS token rows (a decode step of up to 128 sequences is
still a chain of short kernels; prefill's large grids would only crowd the SMs), on CUDA devices
of compute capability 9.0 or later, outside the interpreter, unless ``QAT4_PDL=0``.
"""

import functools
import os

import torch

from qat4.ops._triton import tl, triton

MAX_ROWS = 128  # token rows of the largest decode batch launched with PDL


@functools.lru_cache(maxsize=None)
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_launch(tensor: torch.Tensor, rows: int) -> dict:
    """Keyword arguments of a launch over `rows` token rows of CUDA `tensor`: the kernel's
    ``USE_PDL`` constexpr and, when on (at most MAX_ROWS rows), Triton's ``launch_pdl`` option."""
    on = (tensor.is_cuda and rows <= MAX_ROWS and os.environ.get("QAT4_PDL", "1") != "0"
          and os.environ.get("TRITON_INTERPRET", "0") != "1" and _capable(tensor.device.index or 0))
    return {"USE_PDL": True, "launch_pdl": True} if on else {"USE_PDL": False}


@triton.jit
def wait_for_previous_kernel(USE_PDL: tl.constexpr):
    """With USE_PDL: block until the previous kernel of the stream has finished and its writes are
    visible, then let the next kernel be scheduled. Without: nothing."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
