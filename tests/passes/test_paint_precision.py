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


class _ContinuousPositionBias(nn.Module):
    """SwinV2's continuous position bias: an MLP on a log-spaced coordinate table (a buffer),
    gathered per (query, key) pair, 16 * sigmoid, added to cosine attention logits."""

    def __init__(self, w: int = 8, heads: int = 4, dim: int = 32):
        super().__init__()
        torch.manual_seed(0)
        r = torch.arange(-(w - 1), w, dtype=torch.float32)
        t = torch.stack(torch.meshgrid(r, r, indexing="ij"), -1) / (w - 1) * 8
        self.register_buffer("table", torch.sign(t) * torch.log2(t.abs() + 1) / 3)
        c = torch.stack(torch.meshgrid(torch.arange(w), torch.arange(w), indexing="ij"))
        rel = (c.flatten(1)[:, :, None] - c.flatten(1)[:, None, :]).permute(1, 2, 0) + (w - 1)
        self.register_buffer("index", rel[..., 0] * (2 * w - 1) + rel[..., 1])
        self.mlp = nn.Sequential(nn.Linear(2, 512), nn.ReLU(), nn.Linear(512, heads, bias=False))
        with torch.no_grad():  # a spread of biases, as after training (HF's init is flat)
            self.mlp[2].weight.mul_(20)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.heads = heads

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        att = (torch.nn.functional.normalize(q, dim=-1)
               @ torch.nn.functional.normalize(k, dim=-1).transpose(-2, -1) * 10)
        bias = self.mlp(self.table).view(-1, self.heads)[self.index.view(-1)]
        att = att + 16 * torch.sigmoid(bias.view(n, n, -1).permute(2, 0, 1))
        return (att.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_ops_on_parameters_only_run_fp32(dtype):
    """The position-bias MLP reads only a buffer and parameters: fp32 (its cost does not grow
    with the batch); the qkv projection and attention matmuls read the input: low. Measured:
    with the MLP low, amprewrite's error is 0.94-1.05x autocast's (both round the bias the same
    way); with it fp32, 0.51-0.59x."""
    model = _ContinuousPositionBias().eval()
    x = torch.randn(2, 64, 32)
    gm = amprewrite.transform(model, dtype=dtype, example_inputs=(x,))
    by_path = {}
    for n in gm.graph.nodes:
        if n.meta.get(M.FAMILY) in ("linear", "matmul"):
            by_path.setdefault(n.meta.get(M.MODULE_PATH) or n.name, set()).add(n.meta[M.CLASS])
    assert by_path.pop("mlp.0") == by_path.pop("mlp.2") == {Precision.FP32}, by_path
    assert by_path and all(c == {Precision.LOW} for c in by_path.values()), by_path
    from amprewrite.numerics import rel_err

    ratios = []
    for seed in range(3):
        x = torch.randn(2, 64, 32, generator=torch.Generator().manual_seed(seed))
        ref = copy.deepcopy(model).double()(x.double())
        with torch.autocast("cpu", dtype=dtype):
            theirs = rel_err(model(x), ref)
        ratios.append(rel_err(gm(x), ref) / theirs)
    assert max(ratios) <= 0.8, ratios
