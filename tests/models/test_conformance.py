"""Real-model conformance: each model of amprewrite/testing/zoo.py in bf16 and fp16.

The rows are those of docs/models.md (``python -m benchmarks.conformance``). The default run
checks FAST's models eagerly and one of them compiled too (inductor with a cold cache takes
10-200 s a model on a 2-core CPU); every model compiled is marked slow (``pytest -m slow
tests/models``).
"""

import pytest

from amprewrite.testing.conformance import DTYPES, NOISE, conform
from amprewrite.testing.zoo import MODELS

pytest.importorskip("transformers")
pytest.importorskip("diffusers")

FAST = {"resnet", "gpt2", "vit", "mixtral"}
EAGER_BF16_ONLY = {"vit", "mixtral"}  # their fp16 eager rows are slow (3-4 s each)
COMPILED_FAST: set[tuple[str, str]] = set()  # every compiled model is slow; see docs/testing.md


def _params():
    for name in MODELS:
        for d in DTYPES:
            fast = (name, d) in COMPILED_FAST
            yield pytest.param(name, d, True, marks=() if fast else (pytest.mark.slow,),
                               id=f"{name}-{d}")
            if name in FAST and not fast:
                slow = name in EAGER_BF16_ONLY and d != "bf16"
                yield pytest.param(name, d, False, id=f"{name}-{d}-eager",
                                   marks=(pytest.mark.slow,) if slow else ())


@pytest.mark.parametrize(("name", "dtype", "compile"), list(_params()))
def test_conformance(name, dtype, compile):
    row = conform(name, DTYPES[dtype], compile=compile)
    assert "transform_error" not in row, row.get("traceback")
    assert row["model_unchanged"]
    assert not row["new_nonfinite"]
    assert row["output_dtypes_match"]
    # Pooled over several input batches; NOISE is explained in benchmarks/conformance.py.
    assert row["err_amprewrite"] <= row["err_autocast"] * (1 + NOISE), row
    assert row["err_amprewrite"] < 0.05
    assert row["casts"] > 0 and row["fp32_nodes"] > 0 and row["low_nodes"] > 0
    assert row["report"]
    if not compile:
        return
    assert row["compile"] == "ok", row["compile"]
    assert not row["compiled_nonfinite"]
    # Inductor fuses and reorders low-precision arithmetic, so the compiled error is not the
    # eager one; it stays within twice autocast's eager error on every model measured.
    assert row["err_compiled"] <= 2 * row["err_autocast"], row


def test_matrix_is_generated_from_results():
    """docs/models.md is exactly what the script renders from docs/benchmarks/models.json."""
    import json
    from pathlib import Path

    from amprewrite.testing.conformance import markdown

    docs = Path(__file__).resolve().parents[2] / "docs"
    data = json.loads((docs / "benchmarks" / "models.json").read_text())
    assert {r["model"] for r in data["rows"]} == set(MODELS)
    assert len(MODELS) >= 12
    assert (docs / "models.md").read_text() == markdown(data)
    assert all(r.get("compile") == "ok" and not r["new_nonfinite"] for r in data["rows"])

