"""What starting qat4 imports, in a fresh interpreter: every command builds its parser from all the
commands' modules, so a heavy import at the top of any of them would slow `qat4 --help`, `qat4
status` and `qat4 stop` (0.3-0.5 s without FastAPI and torch); the server imports xgrammar, which
imports transformers, with its first constrained request rather than at every start."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module, heavy", [
    ("qat4.cli", ("fastapi", "torch", "xgrammar", "transformers")),
    ("qat4.server.app", ("xgrammar", "transformers")),
])
def test_starting_imports_none_of_the_heavy_packages(module, heavy):
    code = f"import sys, {module}; print(' '.join(name for name in {heavy!r} if name in sys.modules))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert loaded == [], f"importing {module} imports {', '.join(loaded)}"
