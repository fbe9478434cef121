"""Docs generated from code must match the code; the CLI demo must run."""

import subprocess
import sys
from pathlib import Path

import pytest

from amprewrite.ops import FAMILIES, families_markdown

ROOT = Path(__file__).resolve().parent.parent


def test_families_doc_matches_the_table():
    text = (ROOT / "docs" / "families.md").read_text()
    expected = families_markdown().strip()
    assert text.strip() == expected, "regenerate: amprewrite families > docs/families.md"
    assert all(f"`{name}`" in text for name in FAMILIES)


def test_demo_command_runs_and_reports():
    out = subprocess.run([sys.executable, "-m", "amprewrite.cli", "demo"], capture_output=True,
                         text=True, timeout=300, check=True).stdout
    assert "amprewrite report: dtype=bfloat16" in out
    for family in ("batch_norm", "softmax", "interpolate", "binary_cross_entropy", "trig"):
        assert family in out
    assert "position cone" in out
    assert "re-rolled 2 iterations -> batch_index" in out  # vectorize_loops
    assert "interpolate -> expand/reshape subgraph" in out  # replace_upsample, inlined
    assert "relative error against fp32" in out and "autocast" in out


def test_errors_doc_covers_every_error_type():
    import amprewrite.errors as errors

    text = (ROOT / "docs" / "errors.md").read_text()
    for name in errors.__all__:
        assert f"`{name}`" in text, name


@pytest.mark.parametrize("section", ["## Adding a pass", "## Adding a rewrite rule"])
def test_guide_worked_examples_run(section):
    """The guide's examples for extending the pipeline are code that runs and asserts."""
    text = (ROOT / "docs" / "guide.md").read_text()
    body = text[text.index(section):]
    body = body[:body.index("\n## ", 1)]
    code = body[body.index("```python\n") + 10:body.index("```", body.index("```python\n") + 10)]
    exec(compile(code, f"guide.md {section}", "exec"), {"__name__": "guide_example"})
