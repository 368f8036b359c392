"""tools/test_tally.sh: what a `pytest -v -s` log says so far, with or without pytest's summary."""

from __future__ import annotations

import subprocess
from pathlib import Path

TALLY = Path(__file__).parent.parent / "tools" / "test_tally.sh"

CUT_LOG = """\
============================= test session starts ==============================
tests/gpu/test_a.py::test_one batched vs alone over 170 positions: mean KL 1.21e-05
PASSED
tests/gpu/test_a.py::test_two PASSED
tests/gpu/test_a.py::test_three SKIPPED (needs two GPUs)
tests/gpu/test_b.py::test_four FAILED
tests/gpu/test_b.py::test_five ERROR
tests/gpu/test_c.py::test_six allocated before 12,528.0 MiB, after 12,528.0 MiB
"""


def tally(tmp_path: Path, text: str) -> list[str]:
    log = tmp_path / "gpu_tests.log"
    log.write_text(text)
    done = subprocess.run(["bash", str(TALLY), str(log)], capture_output=True, text=True, check=True)
    return done.stdout.splitlines()


def test_a_log_cut_by_a_timeout_is_counted_test_by_test(tmp_path):
    lines = tally(tmp_path, CUT_LOG)
    assert lines == ["tests: 2 passed, 1 skipped, 2 failed or errors",
                     "files reached: test_a.py test_b.py test_c.py "]


def test_a_finished_log_adds_its_failures_and_pytests_summary(tmp_path):
    summary = ("=========================== short test summary info ============================\n"
               "FAILED tests/gpu/test_b.py::test_four - AssertionError: KL 0.3\n"
               "ERROR tests/gpu/test_b.py::test_five - RuntimeError: CUDA error\n"
               "============== 2 passed, 1 skipped, 1 failed, 1 error in 12.00s ===============\n")
    lines = tally(tmp_path, CUT_LOG + summary)
    assert lines[0] == "tests: 2 passed, 1 skipped, 2 failed or errors"
    assert lines[2:] == ["FAILED tests/gpu/test_b.py::test_four - AssertionError: KL 0.3",
                         "ERROR tests/gpu/test_b.py::test_five - RuntimeError: CUDA error",
                         "============== 2 passed, 1 skipped, 1 failed, 1 error in 12.00s ==============="]


def test_a_missing_log_is_one_sentence_and_exit_2(tmp_path):
    done = subprocess.run(["bash", str(TALLY), str(tmp_path / "none.log")], capture_output=True, text=True)
    assert done.returncode == 2 and done.stdout.strip() == f"test_tally: no log at {tmp_path / 'none.log'}"
