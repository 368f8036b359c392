"""examples/qat4_colab.ipynb, run end to end by nbclient on the CPU with a tiny synthetic checkpoint
in place of the real model: its parameters cell rewritten, the pip cell skipped, the server it
starts kept in a temporary state directory and stopped whatever happens."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

from qat4.checkpoint.synth import write_synthetic  # noqa: E402
from qat4.cli import main  # noqa: E402
from qat4.config import TINY  # noqa: E402
from qat4.serve_process import free_port  # noqa: E402

NOTEBOOK = Path(__file__).parent.parent / "examples" / "qat4_colab.ipynb"
CELL_TIMEOUT_S = 120


def parameters_cell(notebook):
    """The cell tagged `parameters` (papermill's convention)."""
    [cell] = [c for c in notebook.cells if "parameters" in c.metadata.get("tags", [])]
    return cell


def set_parameters(notebook, **values) -> None:
    """Rewrite the parameters cell's `NAME = ...` lines for each of `values`."""
    cell = parameters_cell(notebook)
    lines = cell.source.splitlines()
    for name, value in values.items():
        [index] = [i for i, line in enumerate(lines) if line.startswith(f"{name} = ")]
        lines[index] = f"{name} = {value!r}"
    cell.source = "\n".join(lines)


def printed(notebook) -> str:
    """Everything the code cells printed."""
    return "".join(output.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                   for output in cell.get("outputs", []))


def test_the_notebook_is_stored_without_outputs_and_names_the_real_model():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(notebook)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert all(not cell.outputs and cell.execution_count is None for cell in code)
    source = parameters_cell(notebook).source
    assert 'MODEL = "xbill9/gemma-4-E2B-it-qat-q4_0-w4a16-ct-text-emb4"' in source
    assert "MEMORY_CAP_MIB = 3732" in source


def test_the_notebook_runs_end_to_end_on_the_cpu(tmp_path, monkeypatch):
    model = write_synthetic(tmp_path / "tiny-emb4", TINY, "ct-emb4")
    state, port = tmp_path / "state", free_port()
    monkeypatch.setenv("QAT4_STATE_DIR", str(state))  # the kernel and the server it starts inherit it
    monkeypatch.delenv("QAT4_API_KEY", raising=False)
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    set_parameters(notebook, MODEL=str(model), DEVICE="cpu", PORT=port, MAX_CTX=1024, MAX_NEW_TOKENS=16,
                   INSTALL=False)
    try:
        nbclient.NotebookClient(notebook, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                resources={"metadata": {"path": str(tmp_path)}}).execute()
    finally:  # in this process, whose environment names the state directory too
        main(["stop", "--port", str(port), "--timeout", "5"])
    out = printed(notebook)
    assert "device: cpu" in out
    assert re.search(r"^⚠️ gpu: no CUDA GPU", out, re.M) and re.search(r"^✅ model: ", out, re.M)
    assert "qat4 will run here" in out
    assert "on the CPU: no GPU memory to cap" in out and "no GPU: these are the CPU's figures" in out
    assert re.search(r"^ +512 +[\d.]+ +[\d.]+ +[\d.]+x$", out, re.M)
    assert re.search(r"^loaded in [\d.]+ s: context 1,024 tokens", out, re.M)
    assert re.search(r"tokens decoded at [\d.]+ tokens/s \(finish: (length|stop)\)", out)
    assert re.search(rf"^qat4 serve: running as pid \d+ on http://127\.0\.0\.1:{port}/", out, re.M)
    assert re.search(r"^  device +cpu", out, re.M)
    assert re.search(r"^tiny-emb4: ", out, re.M)
    assert re.search(r"^usage: \d+ prompt \+ \d+ completion tokens$", out, re.M)
    assert re.search(r"^qat4 stop: stopped pid \d+ \(gracefully", out, re.M)
    assert not list(state.glob("*.pid"))
