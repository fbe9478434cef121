"""ExportedProgram in, ExportedProgram out: ``amprewrite.transform(ep, dtype)``.

The program returned takes the sizes the input program takes (its dynamic dimensions and their
ranges), survives ``torch.export.save``/``load`` and AOTInductor, computes what the
``nn.Module`` path's GraphModule computes (within 1e-6 relative; the decisions are the same, so
in practice bit for bit), within 1.1x autocast's error against fp32 (no further slack: the
measured ratio is 0.95-1.00), and runs as many ops low as the ``nn.Module`` path on every zoo
model (``-m slow`` for most of them).
"""

from __future__ import annotations

import collections

import pytest
import sympy
import torch
from torch import nn
from torch.export import Dim, ExportedProgram

import amprewrite
from amprewrite import NotVerifiedWarning
from amprewrite.show.numerics import rel_err
from amprewrite.testing import zoo
from amprewrite.testing.zoo import first_tensor
from tests.graph.test_dynamic_shapes import CASES, _autocast_err, _batch

# The matmul-like families, and how many GEMMs one node of each is: what stays comparable when
# an ATen graph decomposes (linear -> addmm, SDPA -> bmm, softmax, bmm).
GEMMS = {"linear": 1, "conv": 1, "conv_transpose": 1, "matmul": 1, "bilinear": 1,
         "rnn_cell": 1, "scaled_dot_product_attention": 2}


def _user_inputs(ep: ExportedProgram) -> list[tuple[str, object]]:
    kinds = torch.export.graph_signature.InputKind
    vals = {n.name: n.meta.get("val") for n in ep.graph.nodes if n.op == "placeholder"}
    return [(s.arg.name, vals[s.arg.name]) for s in ep.graph_signature.input_specs
            if s.kind == kinds.USER_INPUT]


def _dynamic_dims(ep: ExportedProgram) -> list[tuple[str, int, str, int, float]]:
    """(input, dimension, size expression, min, max) for every symbolic input size, symbols
    renamed in order of appearance (so two programs' can be compared)."""
    names: dict[sympy.Symbol, sympy.Symbol] = {}
    out = []
    for name, val in _user_inputs(ep):
        for d, size in enumerate(getattr(val, "shape", ())):
            if not isinstance(size, torch.SymInt):
                continue
            expr = size.node.expr
            for sym in sorted(expr.free_symbols, key=str):
                names.setdefault(sym, sympy.Symbol(f"d{len(names)}"))
            (sym,) = expr.free_symbols
            vr = ep.range_constraints[sym]
            hi = int(vr.upper) if vr.upper.is_finite else float("inf")
            out.append((name, d, str(expr.xreplace(names)), int(vr.lower), hi))
    return out


def _low_ops(gm_or_ep) -> collections.Counter:
    return collections.Counter(d.family for d in amprewrite.report(gm_or_ep).decisions
                               if d.precision == "low")


def _gemms(gm_or_ep) -> int:
    return sum(GEMMS.get(family, 0) * n for family, n in _low_ops(gm_or_ep).items())


def _low_values(ep: ExportedProgram) -> int:
    """Nodes of the program whose value is bf16: the casts it carries, and what runs low."""
    return sum(1 for n in ep.graph.nodes
               if getattr(n.meta.get("val"), "dtype", None) == torch.bfloat16)


@pytest.mark.parametrize("case", CASES)
def test_program_in_program_out_with_its_dynamic_batch(case, tmp_path):
    model, x, name = CASES[case]()
    batch = Dim("batch", min=2, max=16)
    ep = torch.export.export(model, (x,), dynamic_shapes={name: {0: batch}})
    out = amprewrite.transform(ep, torch.bfloat16)
    assert isinstance(out, ExportedProgram)
    assert _dynamic_dims(out) == _dynamic_dims(ep) == [(name, 0, "d0", 2, 16)]
    assert _low_values(ep) == 0 and _low_values(out) > 0
    # Verified on the program's own example inputs (ep.example_inputs).
    assert any(n.startswith("verify: output error") for n in amprewrite.report(out).notes)
    gm = amprewrite.transform(model, torch.bfloat16, example_inputs=(x,),
                              dynamic_shapes={name: {0: batch}})
    assert _low_ops(out) == _low_ops(gm) and _low_ops(gm)
    path = tmp_path / "model.pt2"
    torch.export.save(out, path)
    loaded = torch.export.load(path)
    assert _dynamic_dims(loaded) == [(name, 0, "d0", 2, 16)]
    for n in (3, 7):
        xb = _batch(x, n)
        with torch.no_grad():
            got = first_tensor(loaded.module()(xb))
            want = first_tensor(gm(xb))
            ref = first_tensor(model(xb)).float()
        assert got.shape[0] == n and got.dtype == want.dtype
        assert rel_err(got, want) <= 1e-6
        assert rel_err(got, ref) <= 1.1 * _autocast_err(model, xb, ref)
    with pytest.raises((AssertionError, RuntimeError), match="<= 16"):
        loaded.module()(_batch(x, 17))


def test_a_static_program_stays_static():
    model, x, _ = CASES["cnn"]()
    out = amprewrite.transform(torch.export.export(model, (x,)), torch.bfloat16)
    assert _dynamic_dims(out) == []
    with torch.no_grad():
        assert rel_err(out.module()(x), model(x)) <= 1.1 * _autocast_err(model, x, model(x))
    with pytest.raises((AssertionError, RuntimeError)):
        out.module()(_batch(x, 5))


class Pair(nn.Module):
    """Two inputs, one by keyword, whose sizes are related: x has twice y's rows."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, y=None):
        h = self.fc(x).view(-1, 2, 8).amax(1)
        return torch.softmax(h, -1) * y


def test_keyword_inputs_and_derived_dimensions_are_kept():
    torch.manual_seed(0)
    model, x, y = Pair().eval(), torch.randn(8, 8), torch.randn(4, 8)
    rows = Dim("rows", min=2, max=64)
    ep = torch.export.export(model, (x,), {"y": y},
                             dynamic_shapes={"x": {0: 2 * rows}, "y": {0: rows}})
    out = amprewrite.transform(ep, torch.bfloat16)
    assert out.call_spec.in_spec == ep.call_spec.in_spec  # x by position, y by keyword
    assert _dynamic_dims(out) == _dynamic_dims(ep) == [("x", 0, "2*d0", 2, 64),
                                                       ("y", 0, "d0", 2, 64)]
    gm = amprewrite.transform(model, torch.bfloat16, example_inputs={"x": x, "y": y},
                              dynamic_shapes={"x": {0: 2 * rows}, "y": {0: rows}})
    xb, yb = torch.randn(10, 8), torch.randn(5, 8)
    with torch.no_grad():
        assert rel_err(out.module()(xb, y=yb), gm(xb, y=yb)) <= 1e-6


class Upcast(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.fc2(self.fc1(x).to(torch.float32))


def test_the_programs_dtype_asserts_cost_no_casts():
    """export asserts the fp32 dtype each ``.to()`` saw (``_assert_tensor_metadata``); kept, it
    would need an fp32 copy of fc1's low output. The program gets the module path's casts."""
    torch.manual_seed(0)
    model, x = Upcast().eval(), torch.randn(4, 8)
    ep = torch.export.export(model, (x,))
    assert any("assert_tensor_metadata" in str(n.target) for n in ep.graph.nodes)
    out = amprewrite.transform(ep, torch.bfloat16)
    gm = amprewrite.transform(model, torch.bfloat16, example_inputs=(x,))
    assert len(amprewrite.report(out).casts) == len(amprewrite.report(gm).casts)
    with torch.no_grad():
        assert rel_err(out.module()(x), gm(x)) <= 1e-6


def test_a_program_without_example_inputs_is_exported_but_not_verified():
    """A program that keeps no example inputs is captured and exported on zero-filled inputs of
    its example sizes; there is nothing to verify on, and the warning and the report say so."""
    model, x, name = CASES["transformer"]()
    batch = Dim("batch", min=2, max=16)
    ep = torch.export.export(model, (x,), dynamic_shapes={name: {0: batch}})
    verified = amprewrite.transform(ep, torch.bfloat16)
    ep.example_inputs = None
    with pytest.warns(NotVerifiedWarning, match="keeps no example inputs"):
        out = amprewrite.transform(ep, torch.bfloat16)
    notes = amprewrite.report(out).notes
    assert any("verify: not run" in n for n in notes)
    assert not any(n.startswith("verify: output error") for n in notes)
    assert _dynamic_dims(out) == _dynamic_dims(ep)
    xb = _batch(x, 5)
    with torch.no_grad():
        assert rel_err(out.module()(xb), verified.module()(xb)) <= 1e-6
    # Example inputs passed to transform are used (and verified on) instead.
    checked = amprewrite.transform(ep, torch.bfloat16, example_inputs=(x,))
    assert any(n.startswith("verify: output error") for n in amprewrite.report(checked).notes)


@pytest.mark.parametrize("training", [False, True])
def test_the_report_names_the_mode_the_program_was_exported_in(training):
    x = torch.randn(4, 8)
    mode = "train" if training else "eval"
    for model in (nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)),
                  nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))):
        ep = torch.export.export(model.train(training), (x,))
        notes = amprewrite.report(amprewrite.transform(ep, "bf16")).notes
        assert f"captured by dynamo in {mode} mode; the mode is fixed in the graph" in notes
    # No op that reads the mode: the program computes the same in both, and the note says so.
    ep = torch.export.export(nn.Linear(8, 8).train(training), (x,))
    (note,) = [n for n in amprewrite.report(amprewrite.transform(ep, "bf16")).notes
               if n.startswith("captured")]
    assert note == ("captured from an ExportedProgram with no mode-dependent op (dropout, "
                    "batch norm): train and eval compute the same")


def test_a_decomposed_program_keeps_every_matmul_low():
    """After ``run_decompositions()`` (core ATen: linear is addmm, SDPA is bmm-softmax-bmm) the
    program runs as many GEMMs low as the module path does."""
    model, x, _ = CASES["transformer"]()
    ep = torch.export.export(model, (x,)).run_decompositions()
    out = amprewrite.transform(ep, torch.bfloat16)
    gm = amprewrite.transform(model, torch.bfloat16, example_inputs=(x,))
    assert set(_low_ops(out)) == {"matmul"}  # no linear or SDPA node is left to count
    assert _gemms(out) == _gemms(gm) == 7  # 5 Linear, 1 SDPA
    with torch.no_grad():
        ref = model(x)
        assert rel_err(out.module()(x), ref) <= 1.1 * _autocast_err(model, x, ref)


def test_an_aten_graph_module_gives_a_graph_module():
    """``ep.module()`` is an nn.Module: transform returns a GraphModule for it, as for any."""
    model, x, _ = CASES["cnn"]()
    ep = torch.export.export(model, (x,))
    gm = amprewrite.transform(ep.module(), torch.bfloat16, example_inputs=(x,))
    assert isinstance(gm, torch.fx.GraphModule) and not isinstance(gm, ExportedProgram)
    assert _low_ops(gm) == _low_ops(amprewrite.transform(ep, torch.bfloat16))


def _zoo_program(name):
    model, inputs = zoo.MODELS[name]()
    args, kwargs = ((), inputs) if isinstance(inputs, dict) else (inputs, {})
    return model, inputs, torch.export.export(model, args, kwargs, strict=False)


FAST_ZOO = ("resnet", "vit", "bert")


def _zoo_params(names):
    return [pytest.param(n, marks=() if n in FAST_ZOO else (pytest.mark.slow,)) for n in names]


@pytest.mark.parametrize("name", _zoo_params(zoo.MODELS))
def test_zoo_program_runs_the_same_ops_low_as_the_module(name):
    model, inputs, ep = _zoo_program(name)
    out = amprewrite.transform(ep, torch.bfloat16)
    gm = amprewrite.transform(model, torch.bfloat16, example_inputs=inputs)
    assert _low_ops(out) == _low_ops(gm) and _low_ops(gm)
    assert any(n.startswith("verify: output error") for n in amprewrite.report(out).notes)


# gpt2: torch 2.13's own run_decompositions() fails on it ("Cannot view a tensor with shape
# [2, 64, 64] and strides (64, 128, 1)"), before amprewrite sees the program.
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow)
                                  for n in zoo.MODELS if n != "gpt2"])
def test_decomposed_zoo_program_runs_as_many_gemms_low_as_the_module(name):
    model, inputs, ep = _zoo_program(name)
    out = amprewrite.transform(ep.run_decompositions(), torch.bfloat16)
    gm = amprewrite.transform(model, torch.bfloat16, example_inputs=inputs)
    assert _gemms(out) == _gemms(gm) > 0


@pytest.mark.slow
def test_aotinductor_compiles_the_program(tmp_path):
    model, x, name = CASES["cnn"]()
    ep = torch.export.export(model, (x,), dynamic_shapes={name: {0: Dim("batch", min=2, max=16)}})
    out = amprewrite.transform(ep, torch.bfloat16)
    path = torch._inductor.aoti_compile_and_package(out, package_path=str(tmp_path / "m.pt2"))
    runner = torch._inductor.aoti_load_package(path)
    for n in (3, 7):
        xb = _batch(x, n)
        with torch.no_grad():
            got, want, ref = runner(xb), out.module()(xb), model(xb)
        assert got.shape == want.shape and got.dtype == want.dtype
        assert rel_err(got, want) <= 1e-2  # inductor fuses: not bit-equal in general
        assert rel_err(got, ref) <= 1.1 * _autocast_err(model, xb, ref)
