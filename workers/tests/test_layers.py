"""The folder tree is the architecture: packages import only downward (import-linter's
contracts in pyproject.toml), no two modules import each other, and no product file or
class outgrows what one reader holds (docs/architecture.md)."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import grimp
import pytest

REPO = Path(__file__).resolve().parents[2]
SOURCE_ROOTS = ("workers", "kernels", "operator")  # each holds a portion of `specd`
PRODUCT_PACKAGES = ("workers/specd/workers", "kernels/specd/kernels", "operator/specd/operator")
MAX_FILE_LINES = 600
MAX_CLASS_LINES = 400

# Runs lint-imports on the trees under ``root`` only (the editable install's own source
# folders are taken off sys.path, so a copy of the tree is what gets analysed).
_LINT = textwrap.dedent(
    """
    import os, sys
    root, repo = sys.argv[1], sys.argv[2]
    own = {os.path.join(repo, d) for d in ("workers", "kernels", "operator")}
    sys.path[:] = [os.path.join(root, d) for d in ("workers", "kernels", "operator")] + [
        p for p in sys.path if os.path.abspath(p) not in own
    ]
    from importlinter.cli import lint_imports
    os.chdir(root)
    sys.exit(lint_imports(config_filename="pyproject.toml", no_cache=True, no_logo=True))
    """
)


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _LINT, str(root), str(REPO)],
        capture_output=True,
        text=True,
        timeout=300,
    )


def copy_tree(dest: Path) -> Path:
    for name in SOURCE_ROOTS:
        shutil.copytree(
            REPO / name / "specd",
            dest / name / "specd",
            ignore=shutil.ignore_patterns("__pycache__", "tests"),
        )
    shutil.copy(REPO / "pyproject.toml", dest / "pyproject.toml")
    return dest


def test_the_import_contracts_hold():
    result = lint_imports(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    ("importer", "refusal"),
    [
        pytest.param(
            "workers/specd/workers/mem_cache/allocator.py",
            "specd.workers.mem_cache is not allowed to import specd.workers.engine",
            id="a-lower-package-importing-a-higher-one-breaks-the-layers",
        ),
        pytest.param(
            "operator/specd/operator/naming.py",
            "specd.operator is not allowed to import specd.workers.engine",
            id="the-operator-importing-the-engine-breaks-its-independence",
        ),
    ],
)
def test_a_wrong_way_import_breaks_a_contract(tmp_path, importer, refusal):
    root = copy_tree(tmp_path)
    module = root / importer
    module.write_text(module.read_text() + "\nimport specd.workers.engine.engine  # noqa\n")
    result = lint_imports(root)
    assert result.returncode != 0
    assert refusal in result.stdout


def import_cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Groups of two or more modules that import each other, directly or round a loop
    (strongly connected components; lazy and TYPE_CHECKING imports count)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in graph.find_modules_directly_imported_by(module):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == module:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return cycles


def test_no_two_modules_import_each_other():
    graph = grimp.build_graph("specd", cache_dir=None)
    assert import_cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    graph = grimp.ImportGraph()
    for module in ("a", "a.x", "a.y", "a.z"):
        graph.add_module(module)
    graph.add_import(importer="a.x", imported="a.y")
    graph.add_import(importer="a.y", imported="a.z")
    graph.add_import(importer="a.z", imported="a.x")
    assert import_cycles(graph) == [["a.x", "a.y", "a.z"]]


def oversized(path: Path) -> list[str]:
    """This file's length and classes over the limits, as readable lines."""
    source = path.read_text()
    found = []
    lines = source.count("\n")
    if lines > MAX_FILE_LINES:
        found.append(f"{path.relative_to(REPO)}: {lines} lines (> {MAX_FILE_LINES})")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_CLASS_LINES:
                found.append(
                    f"{path.relative_to(REPO)}: class {node.name} {length} lines "
                    f"(> {MAX_CLASS_LINES})"
                )
    return found


def test_no_product_file_or_class_outgrows_one_reader():
    found = [
        line
        for package in PRODUCT_PACKAGES
        for path in sorted((REPO / package).rglob("*.py"))
        for line in oversized(path)
    ]
    assert found == [], "split by responsibility:\n" + "\n".join(found)


def test_the_size_check_reports_a_long_class(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_CLASS_LINES + 1))
    path = tmp_path / "big.py"
    path.write_text(f"class Big:\n{body}\n")
    assert oversized(path) == [f"big.py: class Big {MAX_CLASS_LINES + 2} lines (> 400)"]
