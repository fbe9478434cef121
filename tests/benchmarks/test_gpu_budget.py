"""python -m benchmarks gpu --budget: the planner keeps to its budget, and the command runs here.

The GPU command is run on the CPU with tiny sizes so that it cannot rot between the rare calls
on a GPU machine: the same planner, rows and JSON, only the device and the sizes differ.
"""

from __future__ import annotations

import contextlib
import json
import math
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from benchmarks.gpu_budget import (
    COST_S,
    OverBudget,
    Row,
    _deadline,
    _dynamo_counts,
    _dynamo_delta,
    measure,
    plan_rows,
)

ROOT = Path(__file__).resolve().parents[2]


def _busy(seconds: float) -> list[dict]:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass
    return [{"busy_s": seconds}]


class _Clock:
    """Seconds that pass only where a row says so, and the deadline on them: the plan the
    planner makes is the same on a quiet machine and a loaded one."""

    def __init__(self) -> None:
        self.now, self.limit = 0.0, math.inf

    def __call__(self) -> float:
        return self.now

    def spend(self, seconds: float, results: list[dict] | None = None) -> list[dict]:
        self.now += seconds
        if self.now > self.limit:
            self.now = self.limit
            raise OverBudget("stopped at the budget")
        return results if results is not None else [{"spent_s": seconds}]

    @contextlib.contextmanager
    def deadline(self, seconds: float) -> Iterator[None]:
        self.limit = self.now + seconds
        try:
            yield
        finally:
            self.limit = math.inf


def test_planner_skips_what_does_not_fit_stops_at_the_budget_and_writes_after_each_row(
        tmp_path):
    out = tmp_path / "gpu.json"
    clock = _Clock()

    def saw_earlier_rows() -> list[dict]:
        return clock.spend(1, [{"saw": [r["row"] for r in json.loads(out.read_text())["rows"]]}])

    def fails() -> list[dict]:
        clock.spend(0.5)
        raise ValueError("no kernel")

    rows = [Row("first", 0, 1, lambda: clock.spend(0.5)),
            Row("too big", 0, 100, lambda: clock.spend(100)),
            Row("reads the file", 1, 1, saw_earlier_rows),
            Row("fails", 1, 1, fails),
            Row("does not fit what is left", 1, 9, lambda: clock.spend(9)),
            Row("slower than estimated", 1, 1, lambda: clock.spend(3)),
            # 4.6 s would fit in the 5 s left; the rows so far took 1.25x their estimates.
            Row("fits only as estimated", 2, 4.6, lambda: clock.spend(4.6)),
            Row("lies about its cost", 2, 1, lambda: clock.spend(30)),
            Row("after the budget", 3, 0.01, lambda: clock.spend(0)),
            Row("too big after the budget", 3, 100, lambda: clock.spend(100))]
    doc = measure(rows, 10, out, clock=clock, deadline=clock.deadline)
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))
    ran = {r["row"]: r for r in doc["rows"]}
    assert list(ran) == ["first", "reads the file", "fails", "slower than estimated",
                         "lies about its cost"]
    assert ran["first"]["status"] == "ok" and ran["first"]["results"] == [{"spent_s": 0.5}]
    assert ran["reads the file"]["results"] == [{"saw": ["first"]}]
    assert ran["fails"]["status"] == "error" and "no kernel" in ran["fails"]["error"]
    assert ran["lies about its cost"]["status"] == "stopped"
    assert ran["lies about its cost"]["estimate_s"] == 1.25
    skipped = {s["row"]: s["reason"] for s in doc["skipped"]}
    assert skipped == {
        "too big": "needs ~100 s, more than the budget of 10 s",
        "does not fit what is left": "needs ~9 s, 8 s left",
        "fits only as estimated": "needs ~6 s, 5 s left",
        "after the budget": "the budget is spent",
        "too big after the budget": "needs ~200 s, more than the budget of 10 s"}
    assert doc["finished"] and doc["elapsed_s"] == 10


def test_the_deadline_stops_a_row_that_runs_past_it():
    with pytest.raises(OverBudget, match="stopped at the budget"), _deadline(0.05):
        _busy(60)


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


def _gpu_command(tmp_path: Path, rows: list[str]) -> tuple[dict, str]:
    """``python -m benchmarks gpu`` on the CPU, tiny, bf16, with ``rows`` and a budget of 150 s:
    far above what the rows that fit need (~13 s estimated at most), below the one that does
    not (the compiled UNet, ~190 s). Which rows run and which are skipped follows from the
    estimates, not from how loaded the machine is."""
    out = tmp_path / "gpu_cpu.json"
    cmd = [sys.executable, "-m", "benchmarks", "gpu", "--device", "cpu", "--tiny",
           "--budget", "150", "--dtypes", "bf16", "--out", str(out), "--rows", *rows]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["finished"] and doc["device"] == "cpu" and doc["sizes"] == "tiny"
    ran = {r["row"]: r for r in doc["rows"]}
    skipped = {s["row"]: s["reason"] for s in doc["skipped"]}
    assert set(ran) | set(skipped) == {p["row"] for p in doc["plan"]}
    assert not set(ran) & set(skipped)
    assert ran["kernel_probe"]["status"] == "ok" and ran["kernel_probe"]["seconds"] > 0
    assert {r["op"] for r in ran["kernel_probe"]["results"]} >= {"layer_norm(low x, fp32 w)"}
    # Compiling the UNet's five variants takes longer than the whole budget: planned,
    # skipped, and said.
    reason = skipped["runtime/unet/bf16/infer/compiled"]
    assert reason.startswith("needs ~") and reason.endswith("more than the budget of 150 s")
    assert "runtime/unet/bf16/infer/compiled" in proc.stdout
    return ran, proc.stdout


def test_the_gpu_command_on_the_cpu_writes_the_rows_it_runs_and_skips(tmp_path):
    ran, _ = _gpu_command(tmp_path, ["kernel_probe", "runtime/unet/bf16/infer/compiled"])
    assert set(ran) == {"kernel_probe"}


@pytest.mark.slow  # ~40 s on a 2-core CPU: pytest -m cuda, a runtime row, a memory row
def test_the_gpu_command_on_the_cpu_writes_each_row_and_the_skipped_ones(tmp_path):
    ran, _ = _gpu_command(tmp_path, ["kernel_probe", "cuda_tests", "runtime/cnn/bf16/infer/eager",
                                     "runtime/unet/bf16/infer/compiled", "memory/vit/*"])
    for name in ("cuda_tests", "runtime/cnn/bf16/infer/eager"):
        assert ran[name]["status"] == "ok" and ran[name]["seconds"] > 0, ran[name]
    assert "skipped" in ran["cuda_tests"]["results"][0]["summary"]  # no CUDA here
    timed = {r["variant"]: r for r in ran["runtime/cnn/bf16/infer/eager"]["results"]}
    for variant in ("fp32", "autocast", "amprewrite transform"):
        assert timed[variant]["median_ms"] > 0 and "rel_err_vs_fp64" in timed[variant]
    assert timed["amprewrite transform"]["vs_autocast"] > 0
    if "memory/vit/bf16" in ran:  # fits unless the rows before ran ~10x their estimates
        assert ran["memory/vit/bf16"]["results"][0]["step_amprewrite_ms"] > 0


def test_a_compiled_row_logs_its_graph_breaks_and_compiles():
    """The compiled rows carry what dynamo did on their first call (issue 63: the UNet's 1.39x
    on the H100 needs its graph-break and recompile log): graph breaks with the first reason,
    graphs compiled, frames traced."""
    def broken(x):
        y = x.sin()
        torch._dynamo.graph_break()
        return y.cos()

    torch._dynamo.reset()
    fn = torch.compile(broken, backend="eager")
    before = _dynamo_counts()
    fn(torch.randn(3))
    first = _dynamo_delta(before)
    assert first["graph_breaks"] == 1 and first["graph_break_reason"]
    assert first["graphs"] == 2 and first["frames"] >= 2
    before = _dynamo_counts()
    fn(torch.randn(3))
    assert _dynamo_delta(before) == {"graph_breaks": 0, "graph_break_reason": "", "graphs": 0,
                                     "frames": 0}
