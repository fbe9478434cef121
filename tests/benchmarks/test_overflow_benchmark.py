"""benchmarks.overflow's measurements on one small case (the script's own saving is not run:
it would overwrite docs/benchmarks/overflow.json)."""

from __future__ import annotations

import torch

from benchmarks import overflow as bench


def test_measure_reports_the_goals_of_the_default_plan():
    row = bench.measure("t5_ff", repeats=1)
    assert row["finite"] and row["by_op_type"] == "inf/nan"
    assert row["vs_hand"] <= 1.5 and row["flops_low"] >= 0.5  # issue 36's goals
    assert row["flops_low_rescale"] > row["flops_low_fp32"]
    assert 0 < row["ranges_share"] < 1


def test_spread_compares_fresh_batches_drawn_like_the_example():
    x = (torch.randn(4, 8) * 3 + 1, torch.randint(2, 9, (4, 5)), torch.ones(3, dtype=torch.bool))
    fresh = bench._fresh(x, seed=1)
    assert fresh[0].shape == x[0].shape and not torch.equal(fresh[0], x[0])
    assert fresh[1].dtype == torch.int64 and int(fresh[1].min()) >= 2 and int(fresh[1].max()) <= 8
    assert fresh[2] is x[2]
    row = bench.spread("t5_ff", batches=1)
    assert row["values"] > 0 and row["max"] >= row["p99"] > 0
