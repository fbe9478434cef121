"""paint_precision: every node gets the precision class its op family has in the registry.

Property: LOW for matmul-like ops, FP32 for norms, softmax, exp/log and reductions, PROMOTE for
arithmetic and activations, NEUTRAL for exact copies, NONFLOAT for integer values, FP32 for ops
the registry does not know; position cones (floats born from integers, up to the first bounded
or LOW op) and LOW ops on parameters only are FP32; ``keep_fp32`` and ``allow_low`` (module
path, module type, family name, node name) override all of these. The natural precision of a
value follows: LOW ops low, FP32 ops fp32, PROMOTE/NEUTRAL the widest of their float inputs.
Position cones start where floats are born from integers, not where integers are auxiliary.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import amprewrite
from amprewrite.graph import meta as M
from amprewrite.passes import run_pass
from amprewrite.precision.ops import FAMILIES, Precision

from ..helpers import LOW_DTYPES, by_family, prepared

L, H, P, N, X = (Precision.LOW, Precision.FP32, Precision.PROMOTE, Precision.NEUTRAL,
                 Precision.NONFLOAT)


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
    mul = by_family(gm, "arith")  # the region recompute_islands outlines included
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
    from amprewrite.show.numerics import rel_err

    ratios = []
    for seed in range(3):
        x = torch.randn(2, 64, 32, generator=torch.Generator().manual_seed(seed))
        ref = copy.deepcopy(model).double()(x.double())
        with torch.autocast("cpu", dtype=dtype):
            theirs = rel_err(model(x), ref)
        ratios.append(rel_err(gm(x), ref) / theirs)
    assert max(ratios) <= 0.8, ratios


@fx.wrap
def _mystery(x):
    """An op the registry does not know (kept as a call by the symbolic trace)."""
    return x * 2


class Ops(nn.Module):
    """A handful of ops of every class, on values computed from the input."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.ln = nn.LayerNorm(4)

    def forward(self, x):
        h = self.lin(x)
        a = torch.matmul(h, h.transpose(-1, -2))
        n = self.ln(h)
        return (F.gelu(n) + torch.exp(n), torch.relu(h).reshape(-1), h.argmax(-1),
                torch.softmax(a, -1).sum(), torch.special.erfcx(h), _mystery(h))


# The policy's classes (DESIGN.md, "Precision classes"), written out rather than read from the
# registry, so that a registry entry or a painting rule that disagrees is caught.
INTENT = {"linear": L, "matmul": L, "layer_norm": H, "softmax": H, "exp": H, "sum": H,
          "special": H, "activation": P, "arith": P, "relu": N, "shape": N, "indices": X}


def _painted(dtype=torch.bfloat16, **options) -> fx.GraphModule:
    gm, p = prepared(Ops(), "paint_precision", dtype=dtype, **options)
    assert not run_pass(gm, p)  # meta only: the graph's code is unchanged
    return gm


def _classes(gm) -> dict[str, set[Precision]]:
    out: dict[str, set[Precision]] = {}
    for n in gm.graph.nodes:
        if n.meta.get(M.FAMILY) is not None:
            out.setdefault(n.meta[M.FAMILY], set()).add(n.meta[M.CLASS])
    return out


def _node(gm, name: str) -> fx.Node:
    (node,) = [n for n in gm.graph.nodes if n.name == name]
    return node


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=["bf16", "fp16"])
def test_classes_per_family_are_the_registrys(dtype):
    gm = _painted(dtype)
    assert _classes(gm) == {f: {c} for f, c in INTENT.items()}
    assert all(FAMILIES[f].precision == c for f, c in INTENT.items() if c != X)
    unknown = _node(gm, "_mystery")
    assert unknown.meta[M.FAMILY] is None and unknown.meta[M.CLASS] == H
    assert unknown.meta[M.REASON].startswith("unknown op")


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=["bf16", "fp16"])
def test_natural_precision_follows_the_classes(dtype):
    """LOW ops are low and what only copies them stays low; FP32 ops are fp32, and an add
    that reads an fp32 value is fp32 (the widest input); integer values have none."""
    gm = _painted(dtype)
    natural = {n.name: n.meta[M.NATURAL] for n in gm.graph.nodes}
    assert natural["linear"] == natural["matmul"] == M.LOW
    assert natural["relu"] == natural["reshape"] == natural["transpose"] == M.LOW
    assert natural["softmax"] == natural["exp"] == natural["add"] == M.HIGH
    assert natural["argmax"] is None


@pytest.mark.parametrize("selector", ["lin", nn.Linear, "linear", "node:linear"],
                         ids=["path", "type", "family", "node"])
@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=["bf16", "fp16"])
def test_keep_fp32_selects_the_linear_only(dtype, selector):
    gm = _painted(dtype, keep_fp32=[selector])
    linear = _node(gm, "linear")
    assert linear.meta[M.CLASS] == H and linear.meta[M.REASON].startswith("keep_fp32=")
    assert linear.meta[M.NATURAL] == M.HIGH
    # Nothing else changes class: the matmul still runs low.
    assert _classes(gm) == {f: {c} for f, c in INTENT.items()} | {"linear": {H}}


@pytest.mark.parametrize("selector, name", [("ln", "layer_norm"), (nn.LayerNorm, "layer_norm"),
                                            ("softmax", "softmax"), ("node:_mystery", "_mystery")],
                         ids=["path", "type", "family", "node"])
@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=["bf16", "fp16"])
def test_allow_low_lets_an_fp32_op_follow_its_inputs(dtype, selector, name):
    gm = _painted(dtype, allow_low=[selector])
    node = _node(gm, name)
    assert node.meta[M.CLASS] == P and node.meta[M.REASON].startswith("allow_low=")
    others = {f: c for f, c in _classes(gm).items() if f != node.meta[M.FAMILY]}
    assert others == {f: {c} for f, c in INTENT.items() if f != node.meta[M.FAMILY]}


def test_allow_low_leaves_low_and_neutral_ops_as_they_are():
    """allow_low opts an FP32 op in; it does not change what already runs low or follows."""
    gm = _painted(allow_low=["linear", "relu", "lin"])
    assert _classes(gm) == {f: {c} for f, c in INTENT.items()}
