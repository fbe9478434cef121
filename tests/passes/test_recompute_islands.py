"""recompute_islands: in train mode, fp32 pointwise regions that read low values are recomputed
in backward.

Property: a connected group of fp32 pointwise nodes entered through casts up of low values
(GPT-2's ``gelu_new`` between two bf16 matmuls) becomes one ``runtime.recompute`` call of an
outlined body. The output and every gradient are bit-equal to the graph without the rewrite;
autograd keeps fewer bytes (the low inputs, not the fp32 intermediates), no more than autocast.
Regions where the checkpoint would keep more than autograd did (a residual add, which keeps
nothing) stay as they are, and so does every graph transformed in eval mode.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import amprewrite
from amprewrite.graph import meta as M
from amprewrite.graph import runtime
from amprewrite.passes import recompute_islands
from amprewrite.passes.recompute_islands import RecomputeIslands, region_bodies

from ..helpers import LOW_DTYPES, graph_signature, saved_bytes

NAMES = ["bf16", "fp16"]


class GeluNewMLP(nn.Module):
    """GPT-2's MLP: ``gelu_new`` (``pow`` is an FP32 op) between two Linears."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x):
        h = self.a(x)
        c = math.sqrt(2.0 / math.pi)
        h = 0.5 * h * (1.0 + torch.tanh(c * (h + 0.044715 * torch.pow(h, 3.0))))
        return self.b(h)


class Residual(nn.Module):
    """A low Linear's output added to the fp32 stream, then a LayerNorm: the add keeps nothing."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.ln = nn.Linear(16, 16), nn.LayerNorm(16)

    def forward(self, x):
        return self.ln(x + self.fc(x))


def _without_pass(monkeypatch, model, dtype, x):
    with monkeypatch.context() as mp:
        mp.setattr(RecomputeIslands, "run", lambda self, gm: False)
        return amprewrite.transform(model, dtype=dtype, example_inputs=(x,))


def _step(gm, model, x):
    xi = x.clone().requires_grad_()
    out = gm(xi)
    out.pow(2).mean().backward()
    grads = [out, xi.grad, *[p.grad.clone() for p in model.parameters()]]
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("capture", ["dynamo", "symbolic"])
@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=NAMES)
def test_gelu_new_region_is_recomputed_bit_for_bit(dtype, capture, monkeypatch):
    model = GeluNewMLP().train()
    x = torch.randn(32, 16)
    kw = {"example_inputs": (x,)} if capture == "dynamo" else {"verify": False}
    gm = amprewrite.transform(model, dtype=dtype, **kw)
    (call, body), = region_bodies(gm).items()
    ops = {str(n.meta.get(M.FAMILY)) for n in body.graph.nodes if n.op == "call_function"}
    assert {"pow", "tanh"} <= ops
    # The body reads low values and writes a low one: casts up first, a cast down last.
    assert all(p.meta[M.LABEL] == M.LOW for p in body.graph.nodes if p.op == "placeholder")
    (out,) = (n for n in body.graph.nodes if n.op == "output")
    assert out.args[0].meta[M.CAST] == dtype
    # Between the two Linears, no fp32 value is left in the outer graph.
    assert not [n for n in gm.graph.nodes if n.meta.get(M.LABEL) == M.HIGH
                and n.op == "call_function" and n is not call and n.meta.get(M.CAST) is None
                and n.meta.get(M.FAMILY) not in (None, "linear")], gm.code
    # The report lists the body's ops after the call.
    decided = [d.node for d in amprewrite.report(gm).decisions]
    assert decided.index(call.name) < decided.index("tanh")
    if capture == "symbolic":
        return
    plain = _without_pass(monkeypatch, model, dtype, x)
    assert not region_bodies(plain)
    for got, want in zip(_step(gm, model, x), _step(plain, model, x)):
        assert torch.equal(got, want)

    def autocast(x):
        with torch.autocast("cpu", dtype=dtype):
            return model(x)

    ours, before = saved_bytes(gm, model, x), saved_bytes(plain, model, x)
    assert ours < before and ours <= saved_bytes(autocast, model, x), (ours, before)


def test_eval_mode_and_a_residual_add_keep_their_graph(monkeypatch):
    x = torch.randn(8, 16)
    assert not region_bodies(amprewrite.transform(GeluNewMLP().eval(), torch.bfloat16,
                                                  example_inputs=(x,)))
    model = Residual().train()
    gm = amprewrite.transform(model, torch.bfloat16, example_inputs=(x,))
    # x.float() + h, read by the LayerNorm: a checkpoint would keep both inputs, autograd keeps
    # nothing for the add.
    assert not region_bodies(gm)
    assert any(n.meta.get(M.CAST) == torch.float32 for n in gm.graph.nodes)


def test_the_estimate_decides(monkeypatch):
    """With the estimate forced to say the region keeps more, nothing is outlined."""
    model = GeluNewMLP().train()
    x = torch.randn(32, 16)
    monkeypatch.setattr(recompute_islands, "kept_for_backward", lambda n: 0)
    assert not region_bodies(amprewrite.transform(model, torch.bfloat16, example_inputs=(x,)))


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=NAMES)
def test_recompute_compiles_with_fullgraph(dtype):
    model = GeluNewMLP().train()
    x = torch.randn(32, 16)
    gm = amprewrite.transform(model, dtype=dtype, example_inputs=(x,))
    assert region_bodies(gm)
    eager = _step(gm, model, x)
    compiled = _step(torch.compile(gm, fullgraph=True, backend="aot_eager"), model, x)
    for got, want in zip(compiled, eager):
        # The same ops; aot_eager may order the backward's sums differently.
        torch.testing.assert_close(got, want, rtol=2 * torch.finfo(dtype).eps, atol=1e-6)


def test_recompute_without_grad_is_a_plain_call():
    body = lambda x: (x.float().exp() * 2).to(x.dtype)  # noqa: E731
    x = torch.randn(4).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(runtime.recompute(body, x), body(x))


def test_transforming_again_inlines_the_regions():
    """A transformed train-mode graph transformed again gives the same graph: the regions are
    put back in place (their casts then dropped as every cast is) before the passes run."""
    model = GeluNewMLP().train()
    x = torch.randn(32, 16)
    gm = amprewrite.transform(model, torch.bfloat16, example_inputs=(x,))
    again = amprewrite.transform(gm, torch.bfloat16, example_inputs=(x,))
    assert len(region_bodies(again)) == len(region_bodies(gm)) == 1
    assert graph_signature(again) == graph_signature(gm)  # the same, up to node names
    (body,), (body_again,) = region_bodies(gm).values(), region_bodies(again).values()
    assert graph_signature(body_again) == graph_signature(body)
    with torch.no_grad():
        assert torch.equal(again(x), gm(x))
