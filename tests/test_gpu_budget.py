"""python -m benchmarks gpu --budget: the planner keeps to its budget, and the command runs here.

The GPU command is run on the CPU with tiny sizes so that it cannot rot between the rare calls
on a GPU machine: the same planner, rows and JSON, only the device and the sizes differ.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.gpu_budget import COST_S, SLACK_S, Row, measure, plan_rows

ROOT = Path(__file__).resolve().parent.parent


def _busy(seconds: float) -> list[dict]:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass
    return [{"busy_s": seconds}]


def test_planner_skips_what_does_not_fit_stops_at_the_budget_and_writes_after_each_row(
        tmp_path):
    out = tmp_path / "gpu.json"

    def saw_earlier_rows() -> list[dict]:
        return [{"saw": [r["row"] for r in json.loads(out.read_text())["rows"]]}]

    def fails() -> list[dict]:
        raise ValueError("no kernel")

    rows = [Row("first", 0, 0.1, lambda: _busy(0.05)),
            Row("too big", 0, 100.0, lambda: _busy(100)),
            Row("reads the file", 1, 0.1, saw_earlier_rows),
            Row("fails", 1, 0.1, fails),
            Row("lies about its cost", 2, 0.1, lambda: _busy(30)),
            Row("after the budget", 3, 0.01, lambda: _busy(0))]
    start = time.perf_counter()
    doc = measure(rows, 1.5, out)
    assert time.perf_counter() - start <= 1.5 + SLACK_S
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))
    ran = {r["row"]: r for r in doc["rows"]}
    assert ran["first"]["status"] == "ok" and ran["first"]["results"] == [{"busy_s": 0.05}]
    assert ran["reads the file"]["results"] == [{"saw": ["first"]}]
    assert ran["fails"]["status"] == "error" and "no kernel" in ran["fails"]["error"]
    assert ran["lies about its cost"]["status"] == "stopped"
    skipped = {s["row"]: s["reason"] for s in doc["skipped"]}
    assert skipped["too big"].startswith("needs ~100 s")
    assert skipped["after the budget"] == "the budget is spent"
    assert doc["finished"] and doc["elapsed_s"] <= 1.5 + SLACK_S


def test_every_row_has_a_cost_estimate_and_the_plan_puts_probes_first():
    rows = plan_rows("cpu", tiny=True, dtypes=["bf16", "fp16"])
    names = [r.name for r in rows]
    fp8 = [n for n in COST_S if n.startswith("fp8/")]  # bf16 against float8: once, no dtype
    assert len(fp8) == 4 and set(fp8) <= set(names)
    assert len(names) == len(set(names)) == 2 + 2 * (len(COST_S) - 2 - len(fp8)) + len(fp8)
    assert {"/".join(p for p in n.split("/") if p not in ("bf16", "fp16")) for n in names} == set(
        COST_S)
    assert names[:2] == ["kernel_probe", "cuda_tests"]
    assert [(r.tier, r.estimate_s) for r in rows] == sorted((r.tier, r.estimate_s) for r in rows)
    assert max(r.tier for r in rows if "/bf16" in r.name) < min(
        r.tier for r in rows if "/fp16" in r.name)


def test_the_gpu_command_on_the_cpu_writes_each_row_and_the_skipped_ones(tmp_path):
    out = tmp_path / "gpu_cpu.json"
    budget = 25
    cmd = [sys.executable, "-m", "benchmarks", "gpu", "--device", "cpu", "--tiny",
           "--budget", str(budget), "--dtypes", "bf16", "--out", str(out),
           "--rows", "kernel_probe", "cuda_tests", "runtime/cnn/bf16/infer/*", "memory/vit/*"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["finished"] and doc["device"] == "cpu" and doc["sizes"] == "tiny"
    assert doc["elapsed_s"] <= budget + SLACK_S
    ran = {r["row"]: r for r in doc["rows"]}
    skipped = {s["row"]: s["reason"] for s in doc["skipped"]}
    assert set(ran) | set(skipped) == {p["row"] for p in doc["plan"]}
    assert not set(ran) & set(skipped)
    for name in ("kernel_probe", "cuda_tests", "runtime/cnn/bf16/infer/eager"):
        assert ran[name]["status"] == "ok" and ran[name]["seconds"] > 0, ran[name]
    assert {r["op"] for r in ran["kernel_probe"]["results"]} >= {"layer_norm(low x, fp32 w)"}
    assert "skipped" in ran["cuda_tests"]["results"][0]["summary"]  # no CUDA here
    timed = {r["variant"]: r for r in ran["runtime/cnn/bf16/infer/eager"]["results"]}
    for variant in ("fp32", "autocast", "amprewrite transform"):
        assert timed[variant]["median_ms"] > 0 and "rel_err_vs_fp64" in timed[variant]
    assert timed["amprewrite transform"]["vs_autocast"] > 0
    # Compiling five variants takes longer than the whole budget: planned, skipped, and said.
    assert skipped["runtime/cnn/bf16/infer/compiled"].startswith("needs ~")
    assert "runtime/cnn/bf16/infer/compiled" in proc.stdout
    if "memory/vit/bf16" in ran:  # fits unless the machine runs slower than the estimates
        assert ran["memory/vit/bf16"]["results"][0]["step_amprewrite_ms"] > 0
