"""Real-model conformance (issue: reliability): each model of benchmarks/zoo.py in bf16 and fp16.

The rows are those of docs/models.md (``python -m benchmarks.conformance``). CI runs FAST; the
rest is marked slow (``pytest -m slow tests/models``).
"""

import pytest

from benchmarks.conformance import DTYPES, NOISE, conform
from benchmarks.zoo import MODELS

pytest.importorskip("transformers")
pytest.importorskip("diffusers")

FAST = {"resnet", "gpt2", "vit", "mixtral"}


def _params():
    for name in MODELS:
        marks = () if name in FAST else (pytest.mark.slow,)
        for d in DTYPES:
            yield pytest.param(name, d, marks=marks, id=f"{name}-{d}")


@pytest.mark.parametrize(("name", "dtype"), list(_params()))
def test_conformance(name, dtype):
    row = conform(name, DTYPES[dtype], compile=True)
    assert "transform_error" not in row, row.get("traceback")
    assert row["model_unchanged"]
    assert not row["new_nonfinite"]
    assert row["output_dtypes_match"]
    # Pooled over several input batches; NOISE is explained in benchmarks/conformance.py.
    assert row["err_amprewrite"] <= row["err_autocast"] * (1 + NOISE), row
    assert row["err_amprewrite"] < 0.05
    assert row["casts"] > 0 and row["fp32_nodes"] > 0 and row["low_nodes"] > 0
    assert row["report"]
    assert row["compile"] == "ok", row["compile"]
    assert not row["compiled_nonfinite"]
    # Inductor fuses and reorders low-precision arithmetic, so the compiled error is not the
    # eager one; it stays within twice autocast's eager error on every model measured.
    assert row["err_compiled"] <= 2 * row["err_autocast"], row


def test_matrix_is_generated_from_results():
    """docs/models.md is exactly what the script renders from docs/benchmarks/models.json."""
    import json

    from benchmarks.common import RESULTS
    from benchmarks.conformance import DOC, markdown

    data = json.loads((RESULTS / "models.json").read_text())
    assert {r["model"] for r in data["rows"]} == set(MODELS)
    assert len(MODELS) >= 12
    assert DOC.read_text() == markdown(data)
    assert all(r.get("compile") == "ok" and not r["new_nonfinite"] for r in data["rows"])

