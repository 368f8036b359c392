"""Where the kernel tests run: on CUDA when there is a GPU, else under the Triton interpreter.

Triton reads TRITON_INTERPRET when a kernel is defined, so under a plain `pytest` a kernel test
file runs its kernel tests in a subprocess with TRITON_INTERPRET=1 (:func:`run_interpreted`). The
kernel test files of one session share that subprocess: the first file's call runs them all (each
process start imports torch and Triton again), and each file's test then reads its own results.
Run in parallel (pytest-xdist), each worker would run that shared subprocess, all files twice over,
so there a file's call runs its own kernel tests alone.
"""

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest
import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
KERNEL_DEVICE = "cpu" if INTERPRETED else ("cuda" if torch.cuda.is_available() else None)
kernel_test = pytest.mark.skipif(KERNEL_DEVICE is None, reason="needs CUDA or TRITON_INTERPRET=1")

_RUNS: dict[tuple[tuple[Path, ...], str], tuple[int, dict[Path, list[str]], str]] = {}


def run_interpreted(test_file: str, request: pytest.FixtureRequest, keyword: str = "kernel") -> None:
    """Run the tests of `test_file` matching `keyword` under the interpreter; skip when the kernel
    tests run in this process already. One subprocess runs them for every file of the session that
    calls this from the same test function as `request`'s."""
    if KERNEL_DEVICE is not None:
        pytest.skip("the kernel tests run in this process")
    this = Path(test_file).resolve()
    files = (this,) if os.environ.get("PYTEST_XDIST_WORKER") else tuple(sorted(
        {Path(item.path).resolve() for item in request.session.items if item.originalname == request.node.originalname}
        | {this}))
    if (files, keyword) not in _RUNS:
        _RUNS[files, keyword] = _run(files, keyword)
    returncode, outcomes, output = _RUNS[files, keyword]
    assert returncode in (0, 1), output
    assert this in outcomes, f"no test of {this.name} matches -k {keyword}\n{output}"
    failed = [line for line in outcomes[this] if line != "passed" and line != "skipped"]
    assert not failed, "\n".join(failed) + "\n" + output


def _run(files: tuple[Path, ...], keyword: str) -> tuple[int, dict[Path, list[str]], str]:
    """(exit status, each file's test outcomes: "passed", "skipped" or the failure's text, the
    output's tail) of one interpreted pytest run over `files`."""
    root = files[0].parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1")
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "report.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", keyword,
               f"--junitxml={report}", *map(str, files)]
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=900)
        output = proc.stdout[-6000:] + proc.stderr[-3000:]
        by_module = {".".join(f.relative_to(root).with_suffix("").parts): f for f in files}
        outcomes: dict[Path, list[str]] = {}
        if report.exists():
            for case in ElementTree.parse(report).iter("testcase"):
                file = by_module.get(case.get("classname", ""))
                if file is None:
                    continue
                bad = [child for child in case if child.tag in ("failure", "error")]
                skipped = any(child.tag == "skipped" for child in case)
                outcome = (f"{case.get('name')}: {bad[0].get('message')}" if bad
                           else "skipped" if skipped else "passed")
                outcomes.setdefault(file, []).append(outcome)
    return proc.returncode, outcomes, output
