"""Every test starts from the same global torch random state, so what a test draws without its own
generator does not depend on which tests ran before it; and with Python's own thread switch
interval, which `qat4 serve` shortens when a test runs it in the test process."""

import sys

import pytest
import torch


@pytest.fixture(autouse=True)
def _same_global_random_state():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _same_switch_interval():
    interval = sys.getswitchinterval()
    yield
    sys.setswitchinterval(interval)
