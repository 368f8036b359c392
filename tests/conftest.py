"""Every test starts from the same global torch random state, so what a test draws without its own
generator does not depend on which tests ran before it; and with Python's own thread switch
interval, which `qat4 serve` shortens when a test runs it in the test process; and with no
`gc.freeze()` (which `qat4 serve` runs before it listens) reaching the test process's heap.

Run in parallel (``pytest -n N``, pytest-xdist), each worker's torch takes its share of the
cores, not all of them: N workers with thread pools of every core oversubscribe the machine and
run slower than one process."""

import gc
import os
import sys

import pytest
import torch


def pytest_configure(config):
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        torch.set_num_threads(max(1, torch.get_num_threads() // workers))


@pytest.fixture(autouse=True)
def _same_global_random_state():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _same_switch_interval():
    interval = sys.getswitchinterval()
    yield
    sys.setswitchinterval(interval)


@pytest.fixture(autouse=True)
def _no_heap_freeze(monkeypatch):
    monkeypatch.setattr(gc, "freeze", lambda: None)
