"""store_params alone: with params='low', weights only LOW ops read become low copies."""

import torch
from torch import nn

import amprewrite
from amprewrite import meta as M
from amprewrite.passes import run_pass

from ..helpers import prepared, rewrites


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2)).eval()


def test_low_copies_for_weights_of_low_ops_only():
    model = _model()
    gm, p = prepared(model, "store_params", params="low")
    casts_before = sum(M.CAST in n.meta for n in gm.graph.nodes)
    assert run_pass(gm, p)
    assert gm.get_parameter("0.weight").dtype == torch.bfloat16
    assert gm.get_parameter("2.bias").dtype == torch.bfloat16
    assert gm.get_parameter("1.weight").dtype == torch.float32  # LayerNorm: fp32 and shared
    assert gm.get_parameter("1.weight") is model[1].weight
    assert model[0].weight.dtype == torch.float32  # the caller's model is untouched
    assert sum(M.CAST in n.meta for n in gm.graph.nodes) == casts_before - 4
    assert {r.action for r in rewrites(gm, "store_params")} == {
        f"store {t} as torch.bfloat16" for t in ("0.weight", "0.bias", "2.weight", "2.bias")}
    x = torch.randn(3, 8)
    ref = amprewrite.transform(model, torch.bfloat16)
    assert torch.equal(gm(x), ref(x))  # the same numbers, cast once instead of every call


def test_params_fp32_changes_nothing():
    gm, p = prepared(_model(), "store_params")
    assert not run_pass(gm, p)
    assert all(t.dtype == torch.float32 for t in gm.parameters())
