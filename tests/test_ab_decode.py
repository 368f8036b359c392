"""tools/ab_decode.py on the CPU: the tiny synthetic model, this checkout against itself imported a
second time, each engine timed in turns."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ab_decode_times_both_trees_in_turns():
    cmd = [sys.executable, str(ROOT / "tools" / "ab_decode.py"), str(ROOT), "--model", "synthetic:tiny",
           "--device", "cpu", "--new", "2", "--rounds", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(" this") and lines[1].startswith("other") and "median" in lines[1]
    assert len(lines[0].split("µs per step")[1].split(";")[0].split()) == 2  # one time per counted round
    assert "as fast as the other" in lines[2]


def test_ab_decode_refuses_a_folder_without_qat4(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "ab_decode.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "no qat4 package" in proc.stderr
