"""Where the kernel tests run: on CUDA when there is a GPU, else under the Triton interpreter.

Triton reads TRITON_INTERPRET when a kernel is defined, so under a plain `pytest` a kernel test
file runs its kernel tests in a subprocess with TRITON_INTERPRET=1 (:func:`run_interpreted`).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
KERNEL_DEVICE = "cpu" if INTERPRETED else ("cuda" if torch.cuda.is_available() else None)
kernel_test = pytest.mark.skipif(KERNEL_DEVICE is None, reason="needs CUDA or TRITON_INTERPRET=1")


def run_interpreted(test_file: str, keyword: str = "kernel") -> None:
    """Run the tests of `test_file` matching `keyword` under the interpreter; skip when the kernel
    tests run in this process already."""
    if KERNEL_DEVICE is not None:
        pytest.skip("the kernel tests run in this process")
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", keyword, str(test_file)]
    proc = subprocess.run(cmd, cwd=Path(test_file).resolve().parents[1], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
