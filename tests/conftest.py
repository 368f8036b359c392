"""Every test starts from the same global torch random state, so what a test draws without its own
generator does not depend on which tests ran before it."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _same_global_random_state():
    torch.manual_seed(0)
