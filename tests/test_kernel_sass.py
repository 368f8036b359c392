"""tools/kernel_sass.py on a machine without a GPU: the decode-batch kernel compiles for sm_90a
both ways (eight dots and one dot a step), and the count finds the K loop and its tensor-core
instructions."""

import re
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parent.parent / "tools" / "kernel_sass.py"


def test_both_ways_of_a_step_compile_and_their_loops_are_counted():
    run = subprocess.run([sys.executable, str(TOOL), "--tile", "16", "128", "4", "8"], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr
    lines = [line for line in run.stdout.splitlines() if line.startswith("16x128x4x8")]
    assert [line.split(":")[0] for line in lines] == ["16x128x4x8 eight dots", "16x128x4x8 one dot"]
    for line in lines:
        found = re.search(r"(\d+) registers, (\d+) KiB shared, (\d+) L2 prefetch instructions; loop (\d+)", line)
        registers, shared, prefetches, loop = (int(v) for v in found.groups())
        assert 0 < registers <= 255 and shared > 0 and loop > 100 and prefetches == 0
        assert re.search(r"HGMMA \d+", line) and re.search(r"LOP3 \d+", line)  # tensor cores, and the unpacking


def test_l2_prefetch_compiles_to_prefetch_instructions():
    run = subprocess.run([sys.executable, str(TOOL), "--tile", "16", "64", "8", "4", "--one-dot", "--l2-prefetch"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert int(re.search(r"(\d+) L2 prefetch instructions", run.stdout).group(1)) > 0
