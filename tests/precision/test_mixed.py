"""Compute dtype is not storage dtype: FP32 ops that read a low input without an fp32 copy.

DESIGN.md, "Compute dtype is not storage dtype": a norm given a low input with its fp32 weights
and statistics computes in fp32 and writes the input's dtype (``Mixed.LOW_IO``); softmax, sum,
mean and cumsum take ``dtype=torch.float32`` (``Mixed.DTYPE_ARG``). Where the kernel refuses
(CPU layer_norm), group and layer norm run ``runtime.*_norm_fp32`` (``Mixed.FP32_HELPER``): the
fp32 kernels on a copy that is not kept. The kernel probe confirms a signature per device
before the plan uses it; a "no" falls back to the fp32 island (an fp32 copy of the input).
These tests check the structure (no cast between a conv and its BatchNorm, none around a
LayerNorm or GroupNorm between two low ops), the fallback, the numerics against float64 (the
same as the island's), the probe's verdicts, and the bytes autograd keeps.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import amprewrite
from amprewrite.graph import meta as M
from amprewrite.graph import runtime
from amprewrite.passes import paint_precision
from amprewrite.precision.kernels import mixed_problem
from amprewrite.precision.ops import FAMILIES, Mixed, Precision
from amprewrite.show.numerics import rel_err
from tests.helpers import assert_classes_respected, by_family, casts, saved_bytes

LOW_DTYPES = [torch.bfloat16, torch.float16]
# What the kernel probe finds on CPU (torch 2.13), bf16 and fp16, measured: these signatures
# compute exactly as an fp32 copy would, forward and backward ...
CPU_CONFIRMED = {"batch_norm", "group_norm", "softmax", "log_softmax", "sum", "mean"}
# ... and this one does not: layer_norm's backward sums its weight and bias gradients in the low
# dtype (bias gradient error 0.87 against 0 for the island, bf16, 1024 rows): the runtime helper.
CPU_REFUSED = {"layer_norm": "backward"}
NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
CPU = torch.device("cpu")


class ConvBNConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        return self.conv2(torch.relu(self.bn(self.conv1(x))))


class LinearNormLinear(nn.Module):
    """A LayerNorm (or GroupNorm) between two low ops, on a low value."""

    def __init__(self, norm: str):
        super().__init__()
        self.norm_kind = norm
        self.a = nn.Conv1d(16, 16, 1) if norm == "group" else nn.Linear(16, 16)
        self.norm = nn.GroupNorm(4, 16) if norm == "group" else nn.LayerNorm(16)
        self.b = nn.Conv1d(16, 16, 1) if norm == "group" else nn.Linear(16, 16)

    def forward(self, x):
        return self.b(self.norm(self.a(x)))


def _trained_bn(model: nn.Module) -> nn.Module:
    with torch.no_grad():  # non-trivial running statistics
        model.train()
        for _ in range(3):
            model(torch.randn(8, 3, 8, 8) * 2 + 0.5)
    return model.eval()


def _transform(model, dtype, capture, x, **kw):
    if capture == "dynamo":
        return amprewrite.transform(model, dtype=dtype, example_inputs=(x,), **kw)
    return amprewrite.transform(model, dtype=dtype, verify=False, **kw)


def _no_mixed(monkeypatch):
    """A probe that says no to every mixed signature (a device whose kernels refuse them)."""
    monkeypatch.setattr(paint_precision, "mixed_problem",
                        lambda *a, **k: "mixed signature refused (test)")


def _no_low_io(monkeypatch):
    """A probe that refuses the kernels' own mixed signatures but not the runtime helpers."""
    real = paint_precision.mixed_problem

    def probe(node, sig, *a, **k):
        return "low_io refused (test)" if sig is not Mixed.FP32_HELPER else real(node, sig, *a,
                                                                                  **k)
    monkeypatch.setattr(paint_precision, "mixed_problem", probe)


def _helper_graph(norm: str, model: nn.Module, x: torch.Tensor, monkeypatch,
                  dtype: torch.dtype = torch.bfloat16) -> fx.GraphModule:
    """``model`` transformed with its norm on the runtime helper (the kernel's own LOW_IO
    refused by a fake probe); asserts the norm took the helper."""
    _no_low_io(monkeypatch)
    gm = amprewrite.transform(model, dtype=dtype, example_inputs=(x,))
    (n,) = by_family(gm, f"{norm}_norm")
    assert n.meta[M.MIXED] is Mixed.FP32_HELPER
    return gm


# --- structure --------------------------------------------------------------------------------


@pytest.mark.parametrize("capture", ["symbolic", "dynamo"])
@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=NAMES.get)
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_no_cast_between_conv_and_its_batchnorm(dtype, capture, train):
    model = _trained_bn(ConvBNConv()).train(train)
    x = torch.randn(2, 3, 8, 8)
    gm = _transform(model, dtype, capture, x)
    (bn,) = by_family(gm, "batch_norm")
    (conv1, _) = by_family(gm, "conv")
    data = bn.args[0]
    assert data is conv1, f"a cast sits between the conv and its BatchNorm: {data.format_node()}"
    assert bn.meta[M.CLASS] == Precision.FP32 and bn.meta[M.MIXED] is Mixed.LOW_IO
    # BN reads fp32 parameters and statistics: the module's own, or get_attr nodes never cast.
    if bn.op == "call_module":
        module = gm.get_submodule(str(bn.target))
        assert all(t.dtype == torch.float32 for t in (*module.parameters(), *module.buffers())
                   if t.is_floating_point())
    else:
        for a in bn.all_input_nodes[1:]:
            assert a.op == "get_attr" and M.CAST not in a.meta, a.format_node()
    # The casts left: the input and the convs' weights and biases down, the output back up.
    ups = [c for c in casts(gm) if c.meta[M.CAST] == torch.float32]
    assert len(ups) == 1 and [u.op for u in ups[0].users] == ["output"], ups
    downs = [c for c in casts(gm) if c.meta[M.CAST] == dtype]
    assert {c.args[0].op for c in downs} <= {"placeholder", "get_attr"}, downs
    assert_classes_respected(gm, x, low=dtype)
    d = {d.node: d for d in amprewrite.report(gm).decisions}[bn.name]
    assert (d.precision, d.dtype, d.storage) == ("fp32", "torch.float32", str(dtype))


@pytest.mark.parametrize("norm", ["layer", "group"])
@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=NAMES.get)
def test_norm_between_two_low_ops_costs_no_cast(norm, dtype, monkeypatch):
    model = LinearNormLinear(norm)
    x = torch.randn(2, 16, 5) if norm == "group" else torch.randn(2, 5, 16)
    gm = amprewrite.transform(model, dtype=dtype, example_inputs=(x,))
    (n,) = by_family(gm, f"{norm}_norm")
    helper = getattr(runtime, f"{norm}_norm_fp32")
    if f"{norm}_norm" in CPU_REFUSED:  # the kernel's "no" on CPU, with its reason: the helper
        assert n.meta[M.MIXED] is Mixed.FP32_HELPER and n.target is helper
        assert CPU_REFUSED[f"{norm}_norm"] in n.meta[M.REASON]
    else:
        assert n.meta[M.MIXED] is Mixed.LOW_IO and n.target is not helper
    # Where the probe says yes to the kernel itself (a device whose kernel computes its
    # gradients in fp32), the kernel reads the low input; where it says no, the helper does.
    for fake, sig in ((lambda mp: mp.setattr(paint_precision, "mixed_problem",
                                             lambda *a, **k: None), Mixed.LOW_IO),
                      (_no_low_io, Mixed.FP32_HELPER), (None, n.meta[M.MIXED])):
        with monkeypatch.context() as mp:
            if fake is not None:
                fake(mp)
            gm = amprewrite.transform(model, dtype=dtype, example_inputs=(x,))
        (n,) = by_family(gm, f"{norm}_norm")
        assert n.meta.get(M.MIXED) is sig and (n.target is helper) == (sig is Mixed.FP32_HELPER)
        assert M.CAST not in n.args[0].meta
        assert all(M.CAST not in u.meta for u in n.users)
        # Only the graph input, the four weights and biases down, and the output up.
        assert len(casts(gm)) == 6, [c.format_node() for c in casts(gm)]
        assert_classes_respected(gm, x, low=dtype)
        d = {d.node: d for d in amprewrite.report(gm).decisions}[n.name]
        assert (d.precision, d.dtype, d.storage) == ("fp32", "torch.float32", str(dtype))


def test_a_norm_on_the_fp32_residual_stream_stays_an_fp32_op():
    """Pre-norm transformer: the LayerNorm reads the fp32 residual: no rounding of its input."""

    class PreNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(16)
            self.fc = nn.Linear(16, 16)

        def forward(self, x):
            return x + self.fc(self.ln(x))

    x = torch.randn(2, 5, 16)
    gm = amprewrite.transform(PreNorm(), dtype=torch.bfloat16, example_inputs=(x,))
    (ln,) = by_family(gm, "layer_norm")
    assert ln.meta[M.LABEL] == M.HIGH
    assert ln.args[0].op == "placeholder"  # the fp32 input itself, not a rounded copy


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=NAMES.get)
def test_a_probe_that_says_no_gives_the_fp32_island(monkeypatch, dtype):
    model = _trained_bn(ConvBNConv())
    x = torch.randn(2, 3, 8, 8)
    _no_mixed(monkeypatch)
    gm = amprewrite.transform(model, dtype=dtype, example_inputs=(x,))
    (bn,) = by_family(gm, "batch_norm")
    assert M.MIXED not in bn.meta
    up = bn.args[0]
    assert M.CAST in up.meta and up.meta[M.CAST] == torch.float32  # today's island
    assert "mixed signature refused (test)" in bn.meta[M.REASON]
    assert_classes_respected(gm, x, low=dtype)
    for norm in ("layer", "group"):  # the helper too is used only where its probe said yes
        model = LinearNormLinear(norm)
        x = torch.randn(2, 16, 5) if norm == "group" else torch.randn(2, 5, 16)
        gm = amprewrite.transform(model, dtype=dtype, example_inputs=(x,))
        (n,) = by_family(gm, f"{norm}_norm")
        assert M.MIXED not in n.meta and n.target is not getattr(runtime, f"{norm}_norm_fp32")
        assert n.args[0].meta.get(M.CAST) == torch.float32, n.args[0].format_node()


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=NAMES.get)
def test_softmax_and_reductions_read_low_with_dtype_float32(dtype):
    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 16)

        def forward(self, x):
            h = self.fc(x)
            return torch.softmax(h, -1), h.sum(-1), h.mean(-1)

    x = torch.randn(4, 16)
    gm = amprewrite.transform(Head(), dtype=dtype, example_inputs=(x,))
    for family in ("softmax", "sum", "mean"):
        (n,) = by_family(gm, family)
        assert n.kwargs.get("dtype") == torch.float32, n.format_node()
        assert M.CAST not in n.args[0].meta, n.format_node()  # no fp32 copy of the input
    # One cast down of x and two of the weights; nothing up (the reductions write fp32).
    assert [c.meta[M.CAST] for c in casts(gm)] == [dtype] * 3
    assert_classes_respected(gm, x, low=dtype)


# --- numerics against float64 -----------------------------------------------------------------


class LowThen(nn.Module):
    """``op`` of a LOW op's output (a Linear), then another Linear when ``after``."""

    def __init__(self, op, after: bool):
        super().__init__()
        torch.manual_seed(0)
        self.op, self.after = op, after
        self.a = nn.Linear(32, 32)
        self.b = nn.Linear(32, 32)
        self.ln = nn.LayerNorm(32)
        self.gn = nn.GroupNorm(4, 32)
        self.bn = nn.BatchNorm1d(32)

    def forward(self, x):
        h = self.op(self, self.a(x) * 4 + 3)
        return self.b(h) if self.after else h


OPS = {
    "batch_norm": lambda m, h: m.bn(h.transpose(1, 2)).transpose(1, 2),
    "layer_norm": lambda m, h: m.ln(h),
    "group_norm": lambda m, h: m.gn(h.transpose(1, 2)).transpose(1, 2),
    "softmax": lambda m, h: torch.softmax(h, -1),
    "log_softmax": lambda m, h: F.log_softmax(h, -1),
    "sum": lambda m, h: h.sum(-1, keepdim=True).expand(-1, -1, 32),
    "mean": lambda m, h: h.mean(-1, keepdim=True).expand(-1, -1, 32),
}


@pytest.mark.parametrize("after", [False, True], ids=["output", "then-linear"])
@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=NAMES.get)
@pytest.mark.parametrize("family", sorted(OPS))
def test_mixed_numerics_equal_the_fp32_islands(monkeypatch, family, dtype, after):
    """Against float64, reading the low input directly is as accurate as an fp32 copy (within
    1% of the island's error plus 1e-6: kernels may sum in another order), and within the
    bound amprewrite keeps against autocast."""
    model = LowThen(OPS[family], after)
    with torch.no_grad():
        model.bn.running_mean.normal_(3, 1)
        model.bn.running_var.uniform_(10, 20)
    model.eval()
    x = torch.randn(4, 6, 32)
    ref = copy.deepcopy(model).double()(x.double())
    gm = amprewrite.transform(model, dtype=dtype, example_inputs=(x,))
    (n,) = by_family(gm, family)
    if Mixed.LOW_IO in FAMILIES[family].mixed and not after:
        # The model's output: storing it fp32 costs no more bytes, so the norm reads an fp32
        # copy and writes fp32, as before (no rounding of the output).
        assert M.MIXED not in n.meta and n.meta[M.LABEL] == M.HIGH, n.meta[M.REASON]
    else:
        assert n.meta.get(M.MIXED) is not None, n.meta[M.REASON]
    err = rel_err(gm(x), ref)
    with monkeypatch.context() as mp:
        _no_mixed(mp)
        island = amprewrite.transform(model, dtype=dtype, example_inputs=(x,))
    (n,) = by_family(island, family)
    assert M.MIXED not in n.meta
    err_island = rel_err(island(x), ref)
    assert err <= 1.01 * err_island + 1e-6, (err, err_island)
    if family in CPU_REFUSED and after:  # the helper computes exactly what the island does
        (n,) = by_family(gm, family)
        assert n.meta[M.MIXED] is Mixed.FP32_HELPER
        assert torch.equal(gm(x), island(x))


# --- the probe --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=NAMES.get)
def test_probe_confirms_norms_with_fp32_weights_only(dtype):
    m = nn.BatchNorm2d(8)
    g = fx.Graph()
    node = g.call_module("bn", (g.placeholder("x"),))
    m.train()  # a probe on the module itself would update its running statistics
    before = m.running_mean.clone()
    assert mixed_problem(node, Mixed.LOW_IO, dtype, CPU, m) is None
    assert torch.equal(m.running_mean, before)  # probed on a copy
    # Without fp32 weights or statistics the CPU kernel computes in the low dtype (measured:
    # 1.5 eps on values with mean 8): the probe refuses the signature.
    bare = nn.BatchNorm2d(8, affine=False, track_running_stats=False)
    node = g.call_module("bare", (g.placeholder("y"),))
    assert "does not compute as an fp32 copy would" in mixed_problem(
        node, Mixed.LOW_IO, dtype, CPU, bare)


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=NAMES.get)
def test_probe_refuses_a_kernel_that_computes_low(dtype):
    def low_layer_norm(x, w, b):  # rounds its weights to the input's dtype: low arithmetic
        return F.layer_norm(x, x.shape[-1:], w.to(x.dtype), b.to(x.dtype))

    g = fx.Graph()
    x, w, b = g.placeholder("x"), g.placeholder("w"), g.placeholder("b")
    node = g.call_function(low_layer_norm, (x, w, b))
    for n, shape in ((x, (4, 8)), (w, (8,)), (b, (8,))):
        n.meta[M.ORIG] = M.ValueInfo("tensor", torch.float32, shape=shape)
    problem = mixed_problem(node, Mixed.LOW_IO, dtype, CPU)
    assert problem is not None and "does not compute as an fp32 copy would" in problem, problem
    node = g.call_function(F.group_norm, (x, 2, w, b))
    assert mixed_problem(node, Mixed.LOW_IO, dtype, CPU) is None


def test_probe_refuses_dtype_arg_where_the_op_has_none():
    g = fx.Graph()
    node = g.call_function(torch.exp, (g.placeholder("x"),))
    assert "not taken" in mixed_problem(node, Mixed.DTYPE_ARG, torch.bfloat16, CPU)


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=NAMES.get)
def test_cpu_probe_verdicts(dtype):
    """Each family's signature on a node with fp32 weights (norms) on CPU: the facts above."""
    for family in sorted(CPU_CONFIRMED | set(CPU_REFUSED)):
        model = LowThen(OPS[family], True).eval()
        gm = amprewrite.transform(model, dtype=dtype, example_inputs=(torch.randn(4, 6, 32),))
        (n,) = by_family(gm, family)
        want = (Mixed.DTYPE_ARG if Mixed.DTYPE_ARG in FAMILIES[family].mixed
                else Mixed.LOW_IO if family in CPU_CONFIRMED else Mixed.FP32_HELPER)
        assert n.meta.get(M.MIXED) is want, (family, n.meta[M.REASON])


class ConvGroupNormConv(nn.Module):
    """A diffusers resnet block's shapes: 64 channels in 32 groups on a 16x16 map."""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(64, 64, 3, padding=1)
        self.norm = nn.GroupNorm(32, 64)
        self.b = nn.Conv2d(64, 64, 3, padding=1)

    def forward(self, x):
        return self.b(F.silu(self.norm(self.a(x))))


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=NAMES.get)
def test_group_norm_reads_low_at_diffusers_shapes(dtype):
    """GroupNorm(32, 64) on a low 2x64x16x16 map: the probe confirms the kernel's own LOW_IO
    (the probe once weighted each output 1/numel, which put fp16's input gradient in the
    subnormal range, where roundings differ by more than a unit, and refused it), and its input
    gradient is as close to float64's as the fp32 island's, within 1%."""
    torch.manual_seed(0)
    model = ConvGroupNormConv().train()
    x = torch.randn(2, 64, 16, 16)
    gm = amprewrite.transform(model, dtype=dtype, example_inputs=(x,))
    (n,) = by_family(gm, "group_norm")
    assert n.meta.get(M.MIXED) is Mixed.LOW_IO, n.meta[M.REASON]
    assert n.target is not runtime.group_norm_fp32

    norm = model.norm
    h = (torch.randn(2, 64, 16, 16) * 3 + 1).to(dtype)
    g = torch.randn(2, 64, 16, 16).to(dtype)  # an upstream gradient in the normal range
    grads = {}
    for name, inp, up in [("f64", h.double(), g.double()), ("island", h.float(), g.float()),
                          ("low_io", h, g)]:
        inp = inp.clone().requires_grad_()
        w, b = norm.weight.to(inp.dtype if name == "f64" else torch.float32), \
            norm.bias.to(inp.dtype if name == "f64" else torch.float32)
        out = F.group_norm(inp, 32, w, b, norm.eps)
        if name == "island":
            out = out.to(dtype)
        assert out.dtype == inp.dtype if name != "island" else out.dtype == dtype
        out.backward(up if name != "island" else up.to(dtype))
        grads[name] = inp.grad if name == "f64" else inp.grad.to(dtype)
    island = rel_err(grads["island"], grads["f64"])
    assert rel_err(grads["low_io"], grads["f64"]) <= island * 1.01, (island,)


def test_registry_lists_the_signatures():
    with_low_io = {n for n, f in FAMILIES.items() if Mixed.LOW_IO in f.mixed}
    with_dtype = {n for n, f in FAMILIES.items() if Mixed.DTYPE_ARG in f.mixed}
    with_helper = {n: f.fp32_helper for n, f in FAMILIES.items() if Mixed.FP32_HELPER in f.mixed}
    assert with_low_io == {"batch_norm", "instance_norm", "group_norm", "layer_norm"}
    assert with_helper == {"group_norm": runtime.group_norm_fp32,
                           "layer_norm": runtime.layer_norm_fp32}
    assert with_dtype == {"softmax", "log_softmax", "sum", "mean"}
    assert all(FAMILIES[n].accumulate == torch.float32 for n in with_low_io | with_dtype)
    assert all(FAMILIES[n].precision == Precision.FP32 for n in with_low_io | with_dtype)


# --- bytes autograd keeps ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=NAMES.get)
def test_conv_bn_training_keeps_no_more_bytes_than_autocast(dtype):
    model = _trained_bn(ConvBNConv()).train()
    x = torch.randn(4, 3, 16, 16)
    gm = amprewrite.transform(model, dtype=dtype, example_inputs=(x,))

    def autocast(x):
        with torch.autocast("cpu", dtype=dtype):
            return model(x)

    ours, theirs = saved_bytes(gm, model, x), saved_bytes(autocast, model, x)
    fp32 = saved_bytes(model, model, x)
    # Casts of weights to the low dtype are kept by both; the activations are all low.
    assert ours <= theirs, (ours, theirs, fp32)
    assert ours <= 0.6 * fp32, (ours, theirs, fp32)


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=NAMES.get)
def test_training_plan_counts_the_bytes_autograd_keeps(dtype, monkeypatch):
    """An fp32 BatchNorm island (the probe says no) then relu then conv: the bytes cast are the
    same whether the cast down goes before or after the relu, but in training the relu keeps
    its output for backward, so the plan casts before it (the relu keeps a low output).
    Outputs and gradients are bit-equal to the plan that ignores the kept bytes, which keeps
    more; in eval the relu stays fp32 as before."""
    from amprewrite.passes import plan_casts
    from amprewrite.precision import cast_plan as plan

    _no_mixed(monkeypatch)
    model = _trained_bn(ConvBNConv()).train()
    x = torch.randn(4, 3, 16, 16)

    def relu_input_is_cast(gm):
        (relu,) = [n for n in gm.graph.nodes if n.target is torch.relu]
        return relu.args[0].meta.get(M.CAST) == dtype

    gm = amprewrite.transform(model, dtype=dtype, example_inputs=(x,))
    assert relu_input_is_cast(gm)
    real = plan.plan_labels
    monkeypatch.setattr(plan_casts, "plan_labels",
                        lambda gm, keep, low, training=False: real(gm, keep, low))
    moved_only = amprewrite.transform(model, dtype=dtype, example_inputs=(x,))
    assert not relu_input_is_cast(moved_only)
    assert len(casts(gm)) == len(casts(moved_only))
    assert saved_bytes(gm, model, x) < saved_bytes(moved_only, model, x)

    results = []
    for g in (gm, moved_only):
        xx = x.clone().requires_grad_()
        out = g(xx)
        out.float().square().sum().backward()
        results.append((out, xx.grad, *[p.grad.clone() for p in model.parameters()]))
        model.zero_grad(set_to_none=True)
    assert all(torch.equal(a, b) for a, b in zip(*results))
    monkeypatch.setattr(plan_casts, "plan_labels", real)
    assert not relu_input_is_cast(amprewrite.transform(model.eval(), dtype=dtype,
                                                       example_inputs=(x,)))


@pytest.mark.parametrize("norm", ["layer", "group"])
@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=NAMES.get)
def test_fp32_helper_trains_as_the_island_does_and_keeps_half_the_bytes(norm, dtype,
                                                                         monkeypatch):
    """``Mixed.FP32_HELPER`` in training: the forward, the input's gradient and every weight's
    gradient are bit-equal to the fp32 island's; autograd keeps the low input, not an fp32 copy
    (fewer bytes than the island, no more than autocast)."""
    torch.manual_seed(0)
    model = LinearNormLinear(norm).train()
    x = torch.randn(8, 16, 64) if norm == "group" else torch.randn(8, 64, 16)
    graphs = {}
    with monkeypatch.context() as mp:
        graphs["helper"] = _helper_graph(norm, model, x, mp, dtype)
    with monkeypatch.context() as mp:
        _no_mixed(mp)
        graphs["island"] = amprewrite.transform(model, dtype=dtype, example_inputs=(x,))
    results = {}
    for name, gm in graphs.items():
        xi = x.clone().requires_grad_()
        out = gm(xi)
        out.pow(2).mean().backward()
        results[name] = [out, xi.grad, *[p.grad.clone() for p in model.parameters()]]
        model.zero_grad(set_to_none=True)
    for got, want in zip(results["helper"], results["island"]):
        assert torch.equal(got, want)

    def autocast(x):
        with torch.autocast("cpu", dtype=dtype):
            return model(x)

    helper, island = (saved_bytes(graphs[k], model, x) for k in ("helper", "island"))
    theirs = saved_bytes(autocast, model, x)
    # The island keeps an fp32 copy of the norm's input (4 bytes a value) where the helper
    # keeps the low input (2 bytes), which the first Linear's output already is.
    assert helper <= island - 2 * x.numel(), (helper, island)
    assert helper <= theirs, (helper, theirs)


@pytest.mark.parametrize("norm", ["layer", "group"])
def test_fp32_helper_compiles_with_fullgraph(norm, monkeypatch):
    """Under torch.compile the helper is a checkpointed island (its low input kept, the norm
    recomputed in backward): the same values as the eager Function within rounding order."""
    torch.manual_seed(0)
    model = LinearNormLinear(norm).train()
    x = torch.randn(8, 16, 64) if norm == "group" else torch.randn(8, 64, 16)
    gm = _helper_graph(norm, model, x, monkeypatch)
    results = []
    for fn in (gm, torch.compile(gm, fullgraph=True, backend="aot_eager")):
        xi = x.clone().requires_grad_()
        out = fn(xi)
        out.pow(2).mean().backward()
        results.append([out, xi.grad, *[p.grad.clone() for p in model.parameters()]])
        model.zero_grad(set_to_none=True)
    for got, want in zip(*results):
        # Gradients summed in another order: a few bf16 units at most.
        torch.testing.assert_close(got, want, rtol=4 * 2.0**-8, atol=1e-5)


class _SqueezeExcite(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.f1, self.f2 = nn.Conv2d(c, c // 4, 1), nn.Conv2d(c // 4, c, 1)

    def forward(self, x):
        w = F.hardsigmoid(self.f2(F.relu(self.f1(F.adaptive_avg_pool2d(x, 1)))))
        return x * w


class _MobileBlock(nn.Module):
    """MobileNetV3's block: expand conv, BN, hardswish, depthwise conv, BN, squeeze-excite,
    project conv, BN, residual."""

    def __init__(self, c: int, hidden: int):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(c, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.Hardswish(),
            nn.Conv2d(hidden, hidden, 3, padding=1, groups=hidden, bias=False),
            nn.BatchNorm2d(hidden), nn.Hardswish(), _SqueezeExcite(hidden),
            nn.Conv2d(hidden, c, 1, bias=False), nn.BatchNorm2d(c))

    def forward(self, x):
        return x + self.body(x)


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=NAMES.get)
def test_squeeze_excite_hardswish_net_within_autocasts_error(dtype):
    """Issue 23's held-out class (MobileNetV3/EfficientNet-like: hardswish, squeeze-excite,
    BatchNorm with trained statistics): the error against float64 is autocast's (measured
    1.000x over 4 seeds in both dtypes: the BatchNorms read the convs' low outputs with fp32
    statistics and write low, as CPU autocast's do)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1), nn.BatchNorm2d(16), nn.Hardswish(),
                          _MobileBlock(16, 64), _MobileBlock(16, 96),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            with torch.no_grad():
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2)
                m.weight.uniform_(0.5, 1.5)
    model.eval()
    x = torch.randn(4, 3, 32, 32)
    gm = amprewrite.transform(model, dtype=dtype, example_inputs=(x,))
    assert len([n for n in by_family(gm, "batch_norm") if n.meta.get(M.MIXED)]) == 7
    with torch.no_grad():
        ref = copy.deepcopy(model).double()(x.double())
        with torch.autocast("cpu", dtype=dtype):
            auto = model(x)
        assert rel_err(gm(x), ref) <= 1.1 * rel_err(auto, ref), (rel_err(gm(x), ref),
                                                                   rel_err(auto, ref))


@pytest.mark.parametrize("norm", ["layer", "group"])
def test_fp32_helper_exports(norm, monkeypatch):
    """A graph whose norm runs the helper exports with ``torch.export`` (the Function traced
    through its forward) and the program gives the graph's outputs bit for bit."""
    model = LinearNormLinear(norm).eval()
    x = torch.randn(2, 16, 5) if norm == "group" else torch.randn(2, 5, 16)
    gm = _helper_graph(norm, model, x, monkeypatch)
    program = torch.export.export(gm, (x,)).module()
    with torch.no_grad():
        assert torch.equal(program(x), gm(x))
