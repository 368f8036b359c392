"""tools/bench_sync.py's GEMV stage kernel (both hand-offs) against its torch reference, under the
Triton interpreter in a child process (see tests/test_ops_w4.py for why a child)."""

import os
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parent.parent / "tools" / "bench_sync.py"


def test_stage_kernel_matches_its_reference():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(TOOL), "--check"], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "stage kernel matches its reference" in proc.stdout
