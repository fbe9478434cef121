"""vectorize_loops: unrolled per-sample loops become one batched op, exactly; near misses stay.

Property: B unrolled copies of a per-sample body stacked (or concatenated) in order become one
batched op whose forward and backward are the loop's bit for bit, for any batch size the graph
is called with; loops that are not exactly ``for i in range(B)`` over one body are left alone.
The rewrite copies values, so it is the same for both target dtypes and exact on low inputs.
"""

import pytest
import torch
from torch import nn

import amprewrite
from amprewrite.graph import meta as M
from amprewrite.graph.runtime import batch_gather, batch_index, vmap_call
from amprewrite.passes import run_pass
from amprewrite.precision.ops import Precision

from ..helpers import LOW_DTYPES, casts, graph_signature, prepared, transform

REROLLED = (batch_index, batch_gather, vmap_call)


def _loop(form: str):
    def body(t, idx, i):
        if form == "getitem":
            return t[i][idx[i]]
        if form == "tuple_index":
            return t[i, idx[i]]
        if form == "index_select_method":
            return t[i].index_select(0, idx[i])
        if form == "index_select_fn":
            return torch.index_select(t[i], 0, idx[i])
        if form == "gather":
            return torch.gather(t[i], 0, idx[i])
        raise ValueError(form)

    class Loop(nn.Module):
        def forward(self, t, idx):
            return torch.stack([body(t, idx, i) for i in range(t.size(0))])

    return Loop()


def _inputs(form: str, b: int, index: str = "1d", seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(b, 6, 3, generator=g)
    if form == "gather":
        return t, torch.randint(0, 6, (b, 4, 3), generator=g)
    shape = {"scalar": (b,), "1d": (b, 4), "nd": (b, 2, 3)}[index]
    if form.startswith("index_select"):
        shape = (b, 4)
    return t, torch.randint(0, 6, shape, generator=g)


FORMS = ["getitem", "tuple_index", "index_select_method", "index_select_fn", "gather"]


def _check_equal_fwd_bwd(model, gm, t, idx):
    t1, t2 = t.clone().requires_grad_(), t.clone().requires_grad_()
    out, ref = gm(t1, idx), model(t2, idx)
    assert torch.equal(out, ref)
    grad = torch.randint(-3, 4, ref.shape).float()  # integers: accumulation order is exact
    out.backward(grad)
    ref.backward(grad)
    assert torch.equal(t1.grad, t2.grad)


@pytest.mark.parametrize("b", [1, 2, 7, 64, pytest.param(512, marks=pytest.mark.slow)])
@pytest.mark.parametrize("form", FORMS)
def test_batch_gather_family_is_rerolled_and_exact(form, b):
    model = _loop(form)
    t, idx = _inputs(form, b)
    gm = transform(model, dtype=torch.bfloat16, example_inputs=(t, idx))
    fns = [n.target for n in gm.graph.nodes if n.target in REROLLED]
    assert fns == [batch_gather if form == "gather" else batch_index]
    assert len(gm.graph.nodes) < 10  # the B unrolled copies are gone
    _check_equal_fwd_bwd(model, gm, t, idx)
    (rw,) = [r for r in amprewrite.report(gm).rewrites if r.pass_name == "vectorize_loops"]
    assert f"re-rolled {b} iterations" in rw.action


def test_scalar_tensor_index_is_a_dynamo_limit_reported_clearly():
    """t[i][idx[i]] with a 0-d idx[i] is data-dependent for dynamo (torch 2.13): not capturable."""
    model = _loop("getitem")
    t, idx = _inputs("getitem", 7, "scalar")
    with pytest.raises(amprewrite.CaptureError, match=r"dynamo could not capture.*amprewrite\)"):
        transform(model, example_inputs=(t, idx))


@pytest.mark.parametrize("index", ["1d", "nd"])
def test_index_shapes(index):
    model = _loop("getitem")
    t, idx = _inputs("getitem", 7, index)
    gm = transform(model, example_inputs=(t, idx))
    assert any(n.target is batch_index for n in gm.graph.nodes)
    _check_equal_fwd_bwd(model, gm, t, idx)


def test_cat_of_unsqueezed_rows():
    class Cat(nn.Module):
        def forward(self, t, idx):
            return torch.cat([t[i][idx[i]].unsqueeze(0) for i in range(t.size(0))], 0)

    t, idx = _inputs("getitem", 5)
    gm = transform(Cat(), example_inputs=(t, idx))
    assert any(n.target is batch_index for n in gm.graph.nodes)
    assert torch.equal(gm(t, idx), Cat()(t, idx))


def test_rerolled_graph_runs_at_other_batch_sizes():
    model = _loop("getitem")
    gm = transform(model, example_inputs=_inputs("getitem", 8))
    for b in (1, 5, 33):
        t, idx = _inputs("getitem", b, seed=b)
        assert torch.equal(gm(t, idx), model(t, idx))


def test_any_isomorphic_body_becomes_vmap():
    class Body(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4))

        def forward(self, x, y):
            return torch.stack([torch.tanh(x[i]) * self.w + y[i].sum()
                                for i in range(x.size(0))])

    model = Body()
    x, y = torch.randn(6, 4), torch.randn(6, 3)
    gm = transform(model, example_inputs=(x, y))
    assert [n.target for n in gm.graph.nodes if n.target in REROLLED] == [vmap_call]
    torch.testing.assert_close(gm(x, y), model(x, y), rtol=1e-6, atol=1e-6)
    rw = [r for r in amprewrite.report(gm).rewrites if r.pass_name == "vectorize_loops"]
    assert "torch.vmap" in rw[0].action


class NearMiss(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def forward(self, t, idx, other):
        b = t.size(0)
        order = list(range(b))
        if self.kind == "missing":
            order = order[:-1]
        elif self.kind == "repeated":
            order[2] = 1
        elif self.kind == "out_of_order":
            order[0], order[1] = 1, 0
        rows = []
        for i in order:
            if self.kind == "other_index" and i == 2:
                rows.append(t[i][other[i]])
            elif self.kind == "different_op" and i == 3:
                rows.append(t[i][idx[i]] + 1)
            else:
                rows.append(t[i][idx[i]])
        out = torch.stack(rows)
        if self.kind == "used_elsewhere":
            return out, rows[2].sum()  # the same row value, read outside the loop too
        return out


@pytest.mark.parametrize("kind", ["missing", "repeated", "out_of_order", "other_index",
                                  "different_op", "used_elsewhere"])
def test_near_misses_are_left_alone(kind):
    model = NearMiss(kind)
    t, idx = _inputs("getitem", 6)
    other = torch.randint(0, 6, idx.shape)
    gm = transform(model, example_inputs=(t, idx, other))
    assert not any(n.target in REROLLED for n in gm.graph.nodes)
    left = [r for r in amprewrite.report(gm).rewrites if r.pass_name == "vectorize_loops"]
    assert left and left[0].action == "left alone"
    out, ref = gm(t, idx, other), model(t, idx, other)
    for a, b in zip(out if isinstance(out, tuple) else (out,),
                    ref if isinstance(ref, tuple) else (ref,)):
        assert torch.equal(a, b)


def test_through_the_compile_backend():
    torch._dynamo.reset()
    model = _loop("getitem")
    graphs = []
    backend = amprewrite.backend(inner=lambda gm, ex: graphs.append(gm) or gm.forward)
    t, idx = _inputs("getitem", 16)
    out = torch.compile(model, backend=backend, fullgraph=True)(t, idx)
    assert torch.equal(out, model(t, idx))
    assert any(n.target is batch_index for n in graphs[0].graph.nodes)


@pytest.mark.parametrize("form", ["getitem", "gather"])
def test_pass_alone_is_the_same_for_both_dtypes(form):
    model = _loop(form)
    t, idx = _inputs(form, 5)
    graphs = []
    for dtype in LOW_DTYPES:
        gm, p = prepared(model, "vectorize_loops", example_inputs=(t, idx), dtype=dtype)
        before = len(gm.graph.nodes)
        assert run_pass(gm, p)
        assert len(gm.graph.nodes) < before
        assert [n.target for n in gm.graph.nodes if n.target in REROLLED] == [
            batch_gather if form == "gather" else batch_index]
        assert torch.equal(gm(t, idx), model(t, idx))
        graphs.append(graph_signature(gm))
    assert graphs[0] == graphs[1]


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("form", ["getitem", "index_select_fn", "gather"])
def test_rerolled_loop_on_low_inputs_is_exact(form, dtype):
    """Low-precision data through the transformed graph: the batched gather copies the same
    values the loop copies, and runs in the dtype it is given (NEUTRAL: no cast around it)."""
    model = _loop(form)
    t, idx = _inputs(form, 6)
    t = t.to(dtype)
    gm = transform(model, dtype=dtype, example_inputs=(t, idx))
    (op,) = [n for n in gm.graph.nodes if n.target in REROLLED]
    assert op.meta[M.CLASS] == Precision.NEUTRAL and not casts(gm)
    out = gm(t, idx)
    assert out.dtype == dtype and torch.equal(out, model(t, idx))
