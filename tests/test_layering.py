"""The packages stand in one order, and no import runs back up: the server and the command line
over the engine, the engine over the model, the model over the kernels (qat4.ops) and the
checkpoint formats. Imports inside functions count too: a lazy import up the stack is still a
dependency up the stack."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "qat4"

# Each layer and the modules above it, which it may not import. The modules every layer shares
# (config, errors, the tokenizer, chat templates and grammars) import none of the layers' modules.
ABOVE_ENGINE = ("qat4.server", "qat4.commands", "qat4.cli", "qat4.serve_process", "qat4.server_control",
                "qat4.mcp_server", "qat4.doctor", "qat4.bench", "qat4.bench_speculative", "qat4.bench_serve",
                "qat4.eval", "qat4.api_client")
ABOVE_MODEL = ("qat4.engine", *ABOVE_ENGINE)
ABOVE_KERNELS = ("qat4.model", "qat4.assistant", "qat4.reference", *ABOVE_MODEL)
LAYERS = {
    "qat4/ops": ABOVE_KERNELS,
    "qat4/checkpoint": ABOVE_KERNELS,
    "qat4/model.py": ABOVE_MODEL,
    "qat4/assistant.py": ABOVE_MODEL,
    "qat4/engine": ABOVE_ENGINE,
    **{shared: ABOVE_KERNELS for shared in ("qat4/config.py", "qat4/errors.py", "qat4/tokenizer.py", "qat4/chat")},
}


def imported_modules(path: Path, root: Path = ROOT) -> set[str]:
    """Every module a file under package ``root`` imports, at its top or inside functions
    (relative imports resolved)."""
    package = ".".join(path.relative_to(root.parent).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def files_of(layer: str) -> list[Path]:
    path = ROOT.parent / layer
    return sorted(path.rglob("*.py")) if path.is_dir() else [path]


def reaches(module: str, above: tuple[str, ...]) -> bool:
    return any(module == name or module.startswith(name + ".") for name in above)


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_no_import_runs_back_up_the_stack(layer):
    wrong = {f"{path.relative_to(ROOT.parent)} imports {module}"
             for path in files_of(layer) for module in imported_modules(path) if reaches(module, LAYERS[layer])}
    assert not wrong, sorted(wrong)


def test_the_check_sees_an_import_up_the_stack(tmp_path):
    """A lazy import of the engine inside a kernel module is found."""
    module = tmp_path / "qat4" / "ops" / "bad.py"
    module.parent.mkdir(parents=True)
    module.write_text("def f():\n    from ..engine import Engine\n    import qat4.server.app\n")
    found = imported_modules(module, tmp_path / "qat4")
    assert {"qat4.engine", "qat4.engine.Engine", "qat4.server.app"} <= found
    assert any(reaches(m, ABOVE_KERNELS) for m in found)
