"""infer_dtypes alone: what the fp32 model produces at each node of a symbolic trace.

Property: ``meta[ORIG]`` of every node is what running the fp32 graph produces there (the
dtype of a tensor, the items of a sequence, "other" for Python values), for integer, float and
bool mixes, conversions, type promotion, factories and comparisons; a graph input traced
without examples has an unknown dtype (None), never a wrong one. The pass describes the fp32
model, so it does not depend on the target dtype.
"""

import pytest
import torch
from torch import fx, nn

from amprewrite.graph import meta as M
from amprewrite.passes import run_pass

from ..helpers import LOW_DTYPES, prepared


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

    def forward(self, x, ids):
        pos = torch.arange(ids.shape[-1]).float()  # int -> float
        mask = ids > 0  # bool
        h = self.lin(x) + pos[None, :, None] * 0.5
        count = self.steps + 1  # int64 stays int64
        return h.masked_fill(~mask[..., None], 0.0), count


def _dtypes(gm):
    return {n.name: M.info(n).dtype for n in gm.graph.nodes if n.op != "output"}


def test_dtypes_follow_factories_conversions_comparisons_and_promotion():
    gm, p = prepared(Mixed(), "infer_dtypes")
    assert not run_pass(gm, p)  # meta only: the graph's code is unchanged
    d = _dtypes(gm)
    assert d["x"] is None and d["ids"] is None  # graph inputs traced without examples
    assert d["arange"] == torch.int64 and d["float_1"] == torch.float32
    assert d["gt"] == torch.bool and d["invert"] == torch.bool
    assert d["_tensor_constant0"] == torch.int64  # steps + 1, which tracing computed once
    assert d["masked_fill"] == torch.float32
    lin = [n for n in gm.graph.nodes if "linear" in str(n.target) or n.target == "lin"]
    assert lin and all(M.info(n).dtype == torch.float32 for n in lin)  # fp32 weights decide


def test_existing_value_infos_are_kept():
    """Dynamo graphs carry exact fake values: the pass fills only what is missing."""
    x, ids = torch.randn(2, 3, 4), torch.randint(0, 5, (2, 3))
    gm, p = prepared(Mixed(), "infer_dtypes", example_inputs=(x, ids))
    before = {n.name: n.meta[M.ORIG] for n in gm.graph.nodes if M.ORIG in n.meta}
    run_pass(gm, p)
    for n in gm.graph.nodes:
        if n.name in before:
            assert n.meta[M.ORIG] is before[n.name]
    assert M.info(gm.graph.find_nodes(op="placeholder")[0]).shape == (2, 3, 4)


class _Values(fx.Interpreter):
    """Runs the graph and keeps the value every node produced."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.values: dict[fx.Node, object] = {}

    def run_node(self, n: fx.Node):
        self.values[n] = out = super().run_node(n)
        return out


def _assert_agrees(node: fx.Node, got: M.ValueInfo, value: object) -> None:
    """``got`` describes ``value``; a graph input may have an unknown (None) dtype."""
    where = node.format_node()
    if isinstance(value, torch.Tensor):
        assert got.kind == "tensor", where
        assert got.dtype == value.dtype or (node.op == "placeholder" and got.dtype is None), (
            where, got.dtype, value.dtype)
    elif isinstance(value, (tuple, list)) and all(isinstance(v, torch.Tensor) for v in value):
        assert got.kind == "seq", where
        if got.items:
            assert len(got.items) == len(value), where
            for item, v in zip(got.items, value):
                _assert_agrees(node, item, v)
        else:  # a homogeneous sequence of unknown length (split, chunk)
            assert {v.dtype for v in value} == {got.dtype}, (where, got.dtype)
    else:
        assert got.kind == "other", (where, got, type(value))


def _check(model: nn.Module, *inputs) -> int:
    """Infer, run, compare every node; returns how many tensors were checked."""
    gm, p = prepared(model, "infer_dtypes")
    run_pass(gm, p)
    run = _Values(gm)
    with torch.no_grad():
        run.run(*inputs)
    for node, value in run.values.items():
        if node.op != "output":
            _assert_agrees(node, M.info(node), value)
    return sum(isinstance(v, torch.Tensor) for v in run.values.values())


class IntFloatBool(nn.Module):
    """Integer positions, float data and bool masks combined."""

    def forward(self, x, ids):
        x, ids = x.float(), ids.long()
        pos = torch.arange(ids.shape[-1])  # int64
        scaled = pos * 0.5  # int tensor, float scalar: the default float
        shifted = pos + ids  # int64
        mask = (ids > 1) & (ids < 4)  # bool
        return (scaled, shifted, ids // 2, ids / 2, torch.div(ids, 2, rounding_mode="floor"),
                mask, mask.float(), torch.where(mask, x, 0.0), torch.exp(ids), ids.sqrt(),
                mask + mask, mask + ids, mask * 1.5, -ids, ids.clamp(0, 3), ids.clamp(0.5, 3),
                x.argmax(-1), ids.sum(), ids.float().mean())


class Conversions(nn.Module):
    """Every spelling of a conversion names its dtype."""

    def forward(self, x, ids):
        x = x.float()
        return (x.half(), x.bfloat16(), x.double(), x.to(torch.float16), ids.long(), ids.int(),
                ids.to(torch.int16), ids.type(torch.float16), ids.type_as(x),
                x.to(torch.float64).to(torch.bfloat16), (x > 0).to(torch.uint8), x.bool())


class Promotions(nn.Module):
    """Type promotion between float dtypes, and between floats and integers."""

    def forward(self, x, ids):
        x, ids = x.float(), ids.long()
        h, b, d = x.half(), x.bfloat16(), x.double()
        return (h + b, d + x, h * x, b + 1, h + ids, d * ids, torch.cat([ids.float(), x], -1),
                torch.cat([ids, ids], -1), torch.maximum(h, x), torch.where(ids > 0, b, h))


class Factories(nn.Module):
    """Factories, *_like/new_* and sequences: the dtype they name, their input's, or fp32."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.ones(3, dtype=torch.float64))
        self.register_buffer("steps", torch.arange(3))

    def forward(self, x, ids):
        x, ids = x.float(), ids.long()
        top = x.topk(2, -1)
        return (torch.zeros_like(ids), torch.ones(3), torch.full((2,), 1.5), torch.full((2,), 2),
                x.new_zeros(3), torch.arange(4, dtype=torch.float16), torch.arange(0.0, 2.0),
                torch.ones(2, dtype=torch.int32), self.scale * 2, self.steps + 1,
                x.split(1, -1), ids.max(-1), top[0], top[1], torch.broadcast_tensors(x, ids))


@pytest.mark.parametrize("model", [IntFloatBool(), Conversions(), Promotions(), Factories()],
                         ids=lambda m: type(m).__name__)
def test_inferred_dtypes_are_the_dtypes_the_graph_computes(model):
    x, ids = torch.randn(2, 3), torch.randint(0, 5, (2, 3))
    assert _check(model, x, ids) >= 10  # the comparison saw the model's tensors


class _BoolReductions(nn.Module):
    def forward(self, ids):
        mask = ids.long() > 0
        return mask.sum(-1), mask.cumsum(-1)


class _NarrowIntegers(nn.Module):
    def forward(self, ids):
        return ids.int() * 2, ids.to(torch.uint8) + 1, ids.short() // 2


def test_sum_of_bool_is_int64():
    _check(_BoolReductions(), torch.randint(0, 5, (2, 3)))


def test_arithmetic_keeps_narrow_integer_dtypes():
    _check(_NarrowIntegers(), torch.randint(0, 5, (2, 3)))


def test_inferred_dtypes_do_not_depend_on_the_target_dtype():
    """ORIG describes the fp32 model: the same for a bf16 and an fp16 policy."""
    infos = []
    for dtype in LOW_DTYPES:
        gm, p = prepared(IntFloatBool(), "infer_dtypes", dtype=dtype)
        run_pass(gm, p)
        infos.append([(n.name, n.meta[M.ORIG]) for n in gm.graph.nodes if n.op != "output"])
    assert infos[0] == infos[1]
    assert sum(i.dtype == torch.float32 for _, i in infos[0]) >= 5
