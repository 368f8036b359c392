"""A CPU install has no Triton (it is a test extra): qat4 imports and every CPU command runs
without it, and a kernel asked for anyway is refused in one line."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

# Runs `qat4 COMMAND ...` for each argument line with `import triton` failing, as where it is not installed.
WITHOUT_TRITON = textwrap.dedent("""
    import sys
    sys.modules["triton"] = None
    from qat4.cli import main
    for line in sys.argv[1:]:
        status = main(line.split())
        print(f"status {status}: {line}", flush=True)
    assert "triton" not in [name.split(".")[0] for name, module in sys.modules.items() if module is not None]
""")


def _without_triton(*commands: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WITHOUT_TRITON, *commands], capture_output=True, text=True,
                          cwd=cwd, timeout=600, env={**os.environ, **env})


def test_cpu_commands_run_without_triton(tmp_path):
    commands = [
        "synth --preset tiny --format ct-emb4 --out tiny",
        "generate --model tiny --prompt hi --max-new 2 --device cpu",
        "repack tiny tiny.gguf --to gguf",
        "verify tiny tiny.gguf",
        "bench --model synthetic:tiny --device cpu --depths 0 --new 2 --prompt 8",
    ]
    proc = _without_triton(*commands, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert [line for line in proc.stdout.splitlines() if line.startswith("status ")] == [
        f"status {0}: {c}" for c in commands]


def test_a_kernel_without_triton_is_refused_in_one_line(tmp_path):
    proc = _without_triton("synth --preset tiny --format ct-emb4 --out tiny",
                           "generate --model tiny --prompt hi --max-new 2 --device cpu", cwd=tmp_path, QAT4_OPS="triton")
    assert proc.returncode == 0, proc.stderr
    assert "status 1: generate" in proc.stdout
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith("qat4 generate: ") and "needs Triton, which is not installed" in error and "QAT4_OPS=reference" in error
    assert "Traceback" not in proc.stderr
