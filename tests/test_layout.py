"""The package's folders are stages and its imports run one way, down (docs/architecture.md,
the rule in tools/architecture.py); every public name the docs show resolves where they say."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from tools import architecture as A

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "amprewrite"


def test_imports_run_down_the_layers():
    assert A.upward(A.imports(A.modules())) == []


def test_no_import_cycles():
    assert A.cycles(A.imports(A.modules())) == []


def test_every_folder_says_what_lives_there_and_what_it_may_import():
    for init in PACKAGE.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        where = init.relative_to(ROOT)
        assert "import" in doc.lower(), f"{where}: its docstring says what it may import"


def test_no_two_modules_differ_only_by_a_plural():
    stems = {p.stem for p in PACKAGE.rglob("*.py")}
    assert sorted(s for s in stems if f"{s}s" in stems) == []


def test_the_checks_catch_an_upward_import_and_a_cycle():
    """The checks themselves: a graph module importing the API, and two modules in a loop."""
    edges = [("amprewrite.graph.meta", "amprewrite.api", 3),
             ("amprewrite.compile.backend", "amprewrite.show.views", 4),
             ("amprewrite.passes.base", "amprewrite.precision.ops", 5)]
    assert [line.split(" (")[0] for line in A.upward(edges)] == [
        "amprewrite.graph.meta", "amprewrite.compile.backend"]
    loop = [("amprewrite.graph.a", "amprewrite.graph.b", 1),
            ("amprewrite.graph.b", "amprewrite.graph.a", 1)]
    assert A.cycles(loop) == [["amprewrite.graph.a", "amprewrite.graph.b"]]


# `amprewrite.x.y` in prose or code of the docs; the CLI's `amprewrite export ...` has a space.
_DOTTED = re.compile(r"\bamprewrite(?:\.[A-Za-z_]\w*)+")
_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _documented_names() -> list[str]:
    names = set()
    for page in _PAGES:
        names.update(_DOTTED.findall(page.read_text()))
    return sorted(names)


@pytest.mark.parametrize("dotted", _documented_names())
def test_every_name_the_docs_use_resolves(dotted):
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):  # the longest importable module, then attributes
        try:
            value = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            value = getattr(value, attr)
        return
    raise AssertionError(f"{dotted} does not import")


def test_the_architecture_page_shows_the_code_as_it_is():
    assert A.main(["--check"]) == 0, "run python -m tools.architecture and commit the page"
