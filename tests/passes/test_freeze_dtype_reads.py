"""freeze_dtype_reads alone: ``x.dtype`` reads become the dtype the fp32 model had.

Property: every ``getattr(x, "dtype")`` whose value infer_dtypes knows is replaced by that
dtype (a constant), so the model's ``h.to(x.dtype)`` is a visible conversion to float32 that
painting sees and that stays float32 however the plan stores ``x``; other attribute reads and
dtypes nobody knows stay live reads. The constants are the fp32 model's, whatever the target.
"""

import builtins

import pytest
import torch
from torch import nn

import amprewrite
from amprewrite.graph import meta as M
from amprewrite.passes import run_pass
from amprewrite.precision.ops import conversion_target, is_conversion

from ..helpers import LOW_DTYPES, graph_signature, prepared, rewrites, runtime_dtypes


class Back(nn.Module):
    """The RMSNorm idiom: compute in fp32, then convert back to the input's dtype."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        return h.float().pow(2).to(h.dtype), x.to(self.lin.weight.dtype)


def test_dtype_reads_become_constants():
    gm, p = prepared(Back(), "freeze_dtype_reads")
    reads = [n for n in gm.graph.nodes if n.target is builtins.getattr and n.args[1] == "dtype"]
    assert len(reads) == 2
    assert run_pass(gm, p)
    assert not [n for n in gm.graph.nodes if n.target is builtins.getattr
                and n.args[1:] == ("dtype",)]
    tos = [n for n in gm.graph.nodes if n.target == "to"]
    assert [n.args[1] for n in tos] == [torch.float32, torch.float32]
    assert [r.action for r in rewrites(gm, "freeze_dtype_reads")] == [
        "x.dtype -> torch.float32"] * 2
    x = torch.randn(3, 4)
    model = Back()
    model.load_state_dict(gm.state_dict())
    for got, want in zip(gm(x), model(x)):
        assert torch.equal(got, want)


def test_unknown_dtype_is_left_as_a_live_read():
    """A graph input's dtype is unknown without example inputs: nothing to freeze."""

    class ReadInput(nn.Module):
        def forward(self, x):
            return torch.ones(3).to(x.dtype)

    gm, p = prepared(ReadInput(), "freeze_dtype_reads")
    assert not run_pass(gm, p)
    assert any(n.target is builtins.getattr for n in gm.graph.nodes)


def _dtype_reads(gm) -> list:
    return [n for n in gm.graph.nodes if n.target is builtins.getattr and n.args[1:] == ("dtype",)]


def _model_conversions(gm) -> list:
    """The model's own ``.to(...)`` nodes (not the casts amprewrite inserted)."""
    return [n for n in gm.graph.nodes if n.target == "to" and M.CAST not in n.meta]


def test_frozen_graph_is_the_same_for_both_dtypes():
    graphs = []
    for dtype in LOW_DTYPES:
        gm, p = prepared(Back(), "freeze_dtype_reads", dtype=dtype)
        # Before: the registry cannot name what the model converts to (a run-time value).
        assert [conversion_target(n) for n in _model_conversions(gm)] == [None, None]
        assert run_pass(gm, p)
        assert not _dtype_reads(gm)
        assert [conversion_target(n) for n in _model_conversions(gm)] == [torch.float32] * 2
        graphs.append(graph_signature(gm))
    assert graphs[0] == graphs[1]


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=["bf16", "fp16"])
def test_conversion_back_to_the_input_dtype_becomes_visible(dtype):
    """After the pass, painting sees ``h.to(h.dtype)`` as a conversion to float32: fp32 by
    nature (before it, the registry could not name the conversion's target)."""
    gm, p = prepared(Back(), "paint_precision", dtype=dtype)
    run_pass(gm, p)
    back = _model_conversions(gm)
    assert len(back) == 2
    for n in back:
        assert is_conversion(n) and conversion_target(n) == torch.float32, n.format_node()
        assert n.meta[M.NATURAL] == M.HIGH, n.format_node()


@pytest.mark.parametrize("params", ["fp32", "low"])
@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=["bf16", "fp16"])
def test_model_conversions_keep_float32_at_run_time(dtype, params):
    """In the transformed graph the linear runs low and ``params="low"`` stores its weight
    low, yet the model's ``.to(h.dtype)`` and ``.to(lin.weight.dtype)`` still produce float32:
    live reads would have returned the low dtype there."""
    model = Back().eval()
    gm = amprewrite.transform(model, dtype=dtype, params=params, verify=False)
    x = torch.randn(3, 4)
    seen = runtime_dtypes(gm, x)
    back = _model_conversions(gm)
    assert len(back) == 2
    assert [seen[n.name][1] for n in back] == [torch.float32, torch.float32]
    (lin,) = [n for n in gm.graph.nodes if n.meta.get(M.FAMILY) == "linear"]
    assert seen[lin.name][1] == dtype  # h itself is low: a live h.dtype would say so
    if params == "low":
        assert gm.get_parameter("lin.weight").dtype == dtype


class OtherReads(nn.Module):
    """A factory that reads a dtype, next to shape and device reads."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        z = torch.zeros(h.shape, dtype=h.dtype, device=h.device)
        return h + z


def test_only_dtype_reads_are_frozen():
    gm, p = prepared(OtherReads(), "freeze_dtype_reads")
    assert run_pass(gm, p)
    assert not _dtype_reads(gm)
    left = sorted(n.args[1] for n in gm.graph.nodes if n.target is builtins.getattr)
    assert left == ["device", "shape"]
    (zeros,) = [n for n in gm.graph.nodes if n.target is torch.zeros]
    assert zeros.kwargs["dtype"] == torch.float32
    model = OtherReads()
    model.load_state_dict(gm.state_dict())
    x = torch.randn(2, 4)
    assert torch.equal(gm(x), model(x))
