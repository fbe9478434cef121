"""normalize_modules alone: known leaf modules become functional calls on get_attr weights."""

import torch
import torch.nn.functional as F
from torch import nn

from amprewrite import meta as M
from amprewrite.passes import run_pass

from ..helpers import prepared, rewrites


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op in ("call_function", "call_module")]


def test_linear_and_conv_become_functional_with_their_weights():
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Flatten(), nn.Linear(4 * 25, 2))
    gm, p = prepared(model, "normalize_modules")
    assert run_pass(gm, p)
    targets = _targets(gm)
    assert torch.conv2d in targets or F.conv2d in targets
    assert F.linear in targets or torch._C._nn.linear in targets
    attrs = {str(n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    assert {"0.weight", "0.bias", "2.weight", "2.bias"} <= attrs
    # Every node made carries the module's provenance, and the get_attrs their ValueInfo.
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            assert n.meta[M.MODULE_PATH] in ("0", "2") and n.meta[M.ORIG].dtype == torch.float32
    x = torch.randn(2, 3, 5, 5)
    assert torch.equal(gm(x), model(x))
    assert [r.module_path for r in rewrites(gm, "normalize_modules")] == ["0", "1", "2"]


def test_mode_dependent_and_hooked_modules_stay_modules():
    lin = nn.Linear(4, 4)
    lin.register_forward_hook(lambda *a: None)
    model = nn.Sequential(nn.BatchNorm1d(4), nn.Dropout(0.5), lin)
    gm, p = prepared(model, "normalize_modules")
    run_pass(gm, p)
    kept = [n.target for n in gm.graph.nodes if n.op == "call_module"]
    assert kept == ["0", "1", "2"]  # BatchNorm and Dropout follow gm.train(); hooks must run
    assert not rewrites(gm, "normalize_modules")
