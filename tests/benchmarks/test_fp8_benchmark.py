"""python -m benchmarks fp8 --tiny: the float8 benchmark runs here and writes the rows it says.

The GPU figures (issue 38's goals) come from the same code at --size large on a GPU; this runs
its tiny CPU setting, eager and one round (compiling twelve variants takes minutes on this CPU),
into a temporary directory, and checks every row: all variants of both tasks, finite errors,
linears in float8 where asked for, and amprewrite's count of them equal to its report's.
"""

from __future__ import annotations

import csv
import json
import math
import warnings

import pytest

pytest.importorskip("torchao")
pytest.importorskip("transformers")

VARIANTS = {"bf16 amprewrite", "bf16 autocast", "torchao tensorwise", "torchao rowwise",
            "amprewrite fp8 tensorwise", "amprewrite fp8 rowwise"}
ERRORS = {"infer": ("out_err",), "train": ("loss_err", "loss_after_err", "grad_err")}


# Both recipes: ~40 s on a 2-core CPU (its tensorwise _scaled_mm is slow), behind -m slow;
# rowwise alone in the default run.
@pytest.mark.parametrize("recipes", [["rowwise"], pytest.param(["tensorwise", "rowwise"],
                                                               marks=pytest.mark.slow)])
def test_the_tiny_fp8_benchmark_writes_every_variant_with_finite_errors(tmp_path, recipes):
    # `python -m benchmarks fp8 ...`'s own entry point, in this process: a fresh one spent ~15 s
    # of CPU importing torch, transformers and torchao before the benchmark's ~10 s.
    from benchmarks.__main__ import main

    with warnings.catch_warnings():  # the benchmark's own filters stay in the benchmark
        assert main(["fp8", "--tiny", "--eager", "--repeats", "1", "--warmup", "0",
                     "--out", str(tmp_path), "--recipes", *recipes]) == 0
    doc = json.loads((tmp_path / "fp8_cpu.json").read_text())
    with open(tmp_path / "fp8_cpu.csv", newline="") as f:
        assert len(list(csv.DictReader(f))) == len(doc["rows"])
    assert {"date", "device", "torch", "torchao"} <= set(doc["machine"])
    assert doc["size"] == "tiny" and doc["sizes"]["hidden"] == 64 and not doc["compiled"]
    rows = {(r["task"], r["variant"]): r for r in doc["rows"]}
    variants = {v for v in VARIANTS if "bf16" in v or v.split()[-1] in recipes}
    assert set(rows) == {(t, v) for t in ("infer", "train") for v in variants}
    for (task, variant), row in rows.items():
        assert "error" not in row, row
        assert row["median_ms"] > 0 and row["speedup"] > 0 and "peak_mib" not in row  # CPU
        for col in ERRORS[task]:
            assert math.isfinite(row[col]) and row[col] >= 0, (task, variant, col, row[col])
        if "fp8" in variant or "torchao" in variant:
            assert row["fp8_linears"] > 0, row
        else:
            assert row["fp8_linears"] == 0, row
        if variant.startswith("amprewrite fp8"):
            # The report's float8 verdicts, the graph's float8 calls and the saved verdicts agree.
            verdicts = doc["verdicts"][f"{task}/{variant}"]
            assert row["fp8_linears"] == row["fp8_calls"] == sum(
                v.startswith("fp8") for v in verdicts.values())
            assert row["linears"] == len(verdicts) == 7
            assert "cost model off" in row["filter"]
            recipe = variant.split()[-1]
            assert row["fp8_linears"] == rows[(task, f"torchao {recipe}")]["fp8_linears"]
    for recipe in recipes:  # float8's error: above bf16's, still small
        bf16 = rows[("infer", "bf16 amprewrite")]["out_err"]
        for variant in (f"torchao {recipe}", f"amprewrite fp8 {recipe}"):
            assert bf16 < rows[("infer", variant)]["out_err"] < 0.05
