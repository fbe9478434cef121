"""Position cones start where floats are born from integers, not where integers are auxiliary."""

import copy

import pytest
import torch
from torch import nn

import amprewrite
from amprewrite import meta as M
from amprewrite.ops import Precision


class MaskedMLP(nn.Module):
    """An integer tensor used as a mask/offset next to float data (like an MoE's expert offsets
    in a grouped matmul): the product is not 'integer values as floats'."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x, mask):
        return self.b(self.a(x) * mask.unsqueeze(-1))


class Positions(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x, pos):
        return self.a(x + pos.float().unsqueeze(-1) * 0.01)


@pytest.mark.parametrize("capture", ["symbolic", "dynamo"])
def test_bool_mask_next_to_float_data_does_not_start_a_cone(capture):
    model = MaskedMLP()
    inputs = (torch.randn(2, 8), torch.tensor([True, False]))
    gm = amprewrite.transform(model, example_inputs=inputs if capture == "dynamo" else None)
    linears = [n for n in gm.graph.nodes if n.meta.get(M.FAMILY) == "linear"]
    assert len(linears) == 2
    assert all(n.meta[M.CLASS] == Precision.LOW for n in linears), [
        (n.name, n.meta.get(M.REASON)) for n in linears]
    assert not any("position cone" in n.meta.get(M.REASON, "") for n in gm.graph.nodes)


def test_integer_tensor_multiplied_into_float_data_starts_a_cone():
    """``h * ids`` converts ``ids`` to floats like ``ids.float()`` does: by its dtype an int64
    0/1 mask cannot be told from positions (``ids * inv_freq``), so both start a cone."""
    model = MaskedMLP()
    inputs = (torch.randn(2, 8), torch.tensor([4000, 1]))
    gm = amprewrite.transform(model, example_inputs=inputs)
    mul = [n for n in gm.graph.nodes if n.meta.get(M.FAMILY) == "arith"]
    assert mul and all(n.meta[M.CLASS] == Precision.FP32 for n in mul)
    assert all("position cone" in n.meta[M.REASON] for n in mul)
    out = gm(*inputs)
    ref = copy.deepcopy(model).double()(inputs[0].double(), inputs[1])
    # The first linear runs in bf16 (relative rounding ~4e-3); the cone adds no more.
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2


def test_integer_converted_to_float_starts_a_cone():
    model = Positions()
    inputs = (torch.randn(2, 8), torch.tensor([3, 4000]))
    gm = amprewrite.transform(model, example_inputs=inputs)
    cone = [n for n in gm.graph.nodes if "position cone" in n.meta.get(M.REASON, "")]
    assert cone and all(n.meta[M.CLASS] == Precision.FP32 for n in cone)
