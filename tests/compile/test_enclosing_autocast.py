"""An enclosing ``torch.autocast`` cannot undo the plan (DESIGN.md, "Where people train").

transformers' Trainer, accelerate and Lightning run every forward inside ``torch.autocast``.
Each transformed graph turns it off while it runs (``passes/guard_autocast.py``), so the plan's
fp32 matmuls stay fp32: the results inside autocast are the results outside, bit for bit,
forward and backward, for ``transform``'s graphs, the backend's and ``torch.compile`` of a
transformed graph.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import amprewrite
from amprewrite.errors import AutocastIgnoredWarning
from amprewrite.graph import runtime
from amprewrite.testing import overflow


def _logits(model, inputs):
    out = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
    return out.logits if hasattr(out, "logits") else out


@pytest.fixture(scope="module")
def llama():
    """transformers' LLaMA whose MLP passes fp16's 65504 (amprewrite.testing.overflow)."""
    case = overflow.llama()
    return case.model.eval(), case.inputs


def test_the_overflow_llama_inside_fp16_autocast_is_the_run_outside(llama):
    model, inputs = llama
    with torch.no_grad():
        gm = amprewrite.transform(model, "fp16", example_inputs=inputs)
        alone = _logits(gm, inputs)
        with torch.autocast("cpu", dtype=torch.float16):
            plain = _logits(model, inputs)  # what autocast alone gives this model
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                inside = [_logits(gm, inputs) for _ in range(2)]
    assert not torch.isfinite(plain).all()  # the overflow is real
    assert torch.isfinite(alone).all()
    assert all(torch.equal(y, alone) for y in inside)
    told = [n for n in amprewrite.report(gm).notes if "enclosing torch.autocast" in n]
    assert len(told) == 1 and "'cpu', dtype=torch.float16" in told[0]  # once, for two calls
    assert len([w for w in caught if w.category is AutocastIgnoredWarning]) == 1


def test_the_backend_inside_fp16_autocast_is_the_run_outside(llama):
    """Compiled outside, then called inside (dynamo recompiles for the autocast state: that
    compile, its range recording included, runs as fp32's), and the other way round."""
    model, inputs = llama
    results = []
    for order in ("outside first", "inside first"):
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="amprewrite",
                                 options={"dtype": "fp16", "inner": "eager"})
        with torch.no_grad():
            runs = {}
            for where in (("outside", "inside") if order == "outside first"
                          else ("inside", "outside")):
                with torch.autocast("cpu", dtype=torch.float16, enabled=where == "inside"):
                    runs[where] = _logits(compiled, inputs)
        assert torch.isfinite(runs["outside"]).all(), order
        assert torch.equal(runs["inside"], runs["outside"]), order
        results.append(runs["outside"])
    assert torch.equal(results[0], results[1])


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 8)

    def forward(self, x):
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_forward_and_backward_inside_autocast_follow_the_plan(dtype):
    """A linear the user keeps fp32 stays fp32 inside autocast (autocast would run it low), and
    the gradients are the ones outside, bit for bit: backward replays what forward ran."""
    torch.manual_seed(0)
    model = _Net()
    x = torch.randn(4, 16)
    gm = amprewrite.transform(model, dtype, example_inputs=(x,), keep_fp32=["fc2"])
    grads = []
    for enabled in (False, True):
        gm.zero_grad()
        with torch.autocast("cpu", dtype=dtype, enabled=enabled):
            out = gm(x)
        out.square().sum().backward()
        grads.append((out.detach(), [p.grad.clone() for p in gm.parameters()]))
    (out0, g0), (out1, g1) = grads
    assert out1.dtype == torch.float32 and torch.equal(out0, out1)
    assert all(torch.equal(a, b) for a, b in zip(g0, g1))


def test_torch_compile_of_a_transformed_graph_inside_autocast():
    torch.manual_seed(0)
    model, x = _Net().eval(), torch.randn(4, 16)
    gm = amprewrite.transform(model, "fp16", example_inputs=(x,), keep_fp32=["fc2"])
    with torch.no_grad():
        alone = gm(x)
        torch._dynamo.reset()
        compiled = torch.compile(gm, fullgraph=True, backend="eager")
        with torch.autocast("cpu", dtype=torch.float16):
            inside = compiled(x)
    assert torch.equal(inside, alone)


def test_the_guard_is_the_graphs_first_and_last_call_and_exports_drop_it():
    """Structure: the guard's two calls bracket the graph; an export (made outside autocast)
    keeps nothing of them."""
    torch.manual_seed(0)
    model, x = _Net().eval(), torch.randn(4, 16)
    gm = amprewrite.transform(model, "bf16", example_inputs=(x,))
    calls = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    assert calls[0].target is runtime.autocast_off
    assert calls[-1].target is runtime.autocast_on_again and calls[-1].args == (calls[0],)
    ep = torch.export.export(gm, (x,))
    assert "autocast" not in ep.graph_module.code
    assert not [n for n in amprewrite.report(gm).notes if "enclosing" in n]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_autocast_inside_is_the_run_outside(llama):
    model, inputs = llama
    model = model.cuda()
    inputs = tuple(t.cuda() for t in inputs)
    with torch.no_grad():
        gm = amprewrite.transform(model, "fp16", example_inputs=inputs)
        alone = _logits(gm, inputs)
        with torch.autocast("cuda", dtype=torch.float16):
            inside = _logits(gm, inputs)
    assert torch.isfinite(alone).all() and torch.equal(inside, alone)
