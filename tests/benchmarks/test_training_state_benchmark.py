"""``python -m benchmarks state`` in small: every part writes its rows, the counts are the
recipes' (fp32 and autocast 16 bytes a parameter, naive bf16 8), naive bf16's norm weights
never move where amprewrite's do, and inductor's count covers a train step's graphs."""

import json

import pytest

pytest.importorskip("transformers")


def test_the_state_benchmark_writes_every_part(tmp_path):
    from benchmarks.training import state

    out = state.main(["--parts", "bytes", "loss", "--steps", "12", "--seeds", "1",
                      "--warmup", "3", "--batch", "4", "--seq", "32", "--out", str(tmp_path)])
    by = {(r["model"], r["lr"], r["recipe"]): r for r in out["bytes"]}
    for model in ("llama", "gpt2"):
        assert by[model, 1e-3, "fp32"]["bytes_per_param"] == 16
        assert by[model, 1e-3, "autocast"]["bytes_per_param"] == 16
        assert by[model, 1e-3, "naive bf16"]["bytes_per_param"] == 8
        assert 8 <= by[model, 1e-3, "amprewrite"]["bytes_per_param"] < 12
    loss = {r["recipe"]: r for r in out["loss"]}
    assert set(loss) == set(state.RECIPES)
    assert loss["naive bf16"]["norm_unmoved_share"] == 1.0  # 1e-3 steps below half a bf16 ulp
    assert loss["amprewrite"]["norm_unmoved_share"] == 0.0
    saved = json.loads((tmp_path / "training_state_loss.json").read_text())
    assert set(saved["curves"]) == set(state.RECIPES)
    assert all(len(c) == 12 for c in saved["curves"].values())


def test_inductors_count_covers_forward_and_backward():
    """The count of a compiled train step is larger than the forward's alone: the backward
    graph is compiled and counted too, extern matmuls included."""
    import torch

    from benchmarks.compile.step_bytes import count

    lin = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    x = torch.randn(16, 64)
    forward = count(lambda: torch.compile(lin)(x))
    step = count(lambda: torch.compile(lin)(x).sum().backward())
    assert forward["extern"] >= 2 and step["extern"] > forward["extern"]
    assert step["bytes"] > forward["bytes"] > 2 * 64 * 64 * 4  # the weights read, at least
