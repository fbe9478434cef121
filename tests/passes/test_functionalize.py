"""functionalize: in-place writes and aliases (the mutation catalogue).

Each pattern is a tiny model that writes a tensor in place and reads it, or an alias of it,
afterwards, from LOW (linear, conv) and FP32 (softmax, exp) ops. Property: the transformed graph
matches the fp32 model within rounding of what torch.autocast reaches on the same computation,
has no in-place node left (but the copy back into a written input, or a write into a private
clone), and writes the caller's inputs as the model does. On the code before the functionalize
pass, 28 of the 108 (pattern, capture, dtype) cases returned wrong results (errors up to 0.85:
casts hoisted above the write, writes into cast copies) and every writing case failed the
structural check.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import amprewrite
from amprewrite import ModelError
from amprewrite.graph import meta as M
from amprewrite.passes import run_pass
from amprewrite.passes.functionalize import Functionalize
from amprewrite.precision.ops import writes_in_place
from amprewrite.show.numerics import rel_err

from ..helpers import LOW_DTYPES, graph_signature, prepared, transform_via

# Unit roundoff of each dtype: the slack on top of autocast's error.
UNIT = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


class Base(nn.Module):
    symbolic = True  # False: symbolic tracing cannot follow it (``x[i] = v`` on a proxy)
    twin: type[nn.Module] | None = None  # the same computation written out of place

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def inputs(self):
        return (torch.randn(4, 8),)


# --- writes into tensors made in forward, then read by LOW and FP32 ops ---------------------
class SetitemDiagonal(nn.Module):
    """The issue's example: a conv kernel built by writing its diagonal."""

    symbolic, twin = False, None

    def forward(self, x):
        w = x.new_zeros(4, 4, 3)
        i = torch.arange(4)
        w[i, i] = torch.tensor([0.25, 0.5, 0.25])
        return F.conv1d(x, w, padding=1)

    def inputs(self):
        return (torch.randn(2, 4, 16),)


class SetitemSlice(Base):
    symbolic = False

    def forward(self, x):
        buf = torch.zeros(x.shape[0], 8)
        buf[:, :4] = self.l1(x)[:, :4]
        return self.l2(buf)


class SetitemThenSoftmax(Base):
    symbolic = False

    def forward(self, x):
        s = self.l1(x)
        s[:, 0] = 3.0
        return torch.softmax(s, -1)


class IndexPut(Base):
    def forward(self, x):
        w = x.new_zeros(4, 8)
        w.index_put_((torch.tensor([0, 2]),), self.l1(x)[:2])
        return self.l2(w)


class MaskedFillScores(Base):
    def forward(self, x):
        s = self.l1(x) @ self.l2(x).t()
        s.masked_fill_(torch.ones(4, 4).triu(1).bool(), float("-inf"))
        return torch.softmax(s, -1)


class CopyInto(Base):
    symbolic = False  # torch.empty(x.shape[0], 8) does not trace

    def forward(self, x):
        buf = torch.empty(x.shape[0], 8)
        buf.copy_(self.l1(x))
        return self.l2(buf) + buf


class FillThenWrite(Base):
    symbolic = False

    def forward(self, x):
        buf = torch.empty(x.shape[0], 8)
        buf.fill_(0.5)
        buf[:, 0] = self.l1(x)[:, 0]
        return self.l2(buf)


class ZeroThenAdd(Base):
    def forward(self, x):
        h = self.l1(x)
        a = self.l2(h)
        h.zero_()
        return a + self.l2(h + x)


class ScatterInto(Base):
    def forward(self, x):
        buf = torch.zeros(4, 8)
        idx = torch.arange(8).flip(0).expand(4, 8)
        buf.scatter_(1, idx, self.l1(x))
        return self.l2(buf)


class IndexAdd(Base):
    def forward(self, x):
        buf = torch.zeros(2, 8)
        buf.index_add_(0, torch.tensor([0, 1, 0, 1]), self.l1(x))
        return self.l2(buf)


class OutArgument(Base):
    def forward(self, x):
        buf = torch.empty(4, 8)
        torch.add(x, 1, out=buf)  # out= is refused under autograd: inputs without grad
        return self.l2(buf) + buf


# --- writes through views -------------------------------------------------------------------
class WriteThroughSlice(Base):
    def forward(self, x):
        h = self.l1(x)
        h[:, :4].mul_(2)
        return self.l2(h)


class WriteThroughTranspose(Base):
    def forward(self, x):
        h = self.l1(x)
        h.t()[0].add_(1)
        return self.l2(h)


class WriteThroughUnsqueeze(Base):
    def forward(self, x):
        h = self.l1(x)
        h.unsqueeze(0).mul_(3)
        return self.l2(h)


class WriteThroughChunk(Base):
    def forward(self, x):
        h = x * 2  # autograd refuses writes into chunks of a tensor that needs grad
        a, _ = h.chunk(2, -1)
        a.mul_(2)
        return self.l2(h)


class WriteThroughView(Base):
    def forward(self, x):
        h = self.l1(x)
        h.view(2, 16)[1].sub_(1)
        return self.l2(h)


class AugmentedAssignOnView(Base):
    symbolic = False

    def forward(self, x):
        h = self.l1(x)
        t = h.t()
        t[1] += 1
        return self.l2(h)


class OldViewReadAfterWrite(Base):
    """A view made before the write sees the write."""

    def forward(self, x):
        h = self.l1(x)
        v = h[:, :2]
        h.mul_(2)
        return self.l2(h) + v.sum(-1, keepdim=True)


class TwoViewsOneWrite(Base):
    def forward(self, x):
        h = self.l1(x)
        a, b = h[0], h.t()
        a.add_(5)
        return self.l2(b.t())


# --- in-place activations and += with several readers --------------------------------------
class ReluInplaceMethod(Base):
    def forward(self, x):
        h = self.l1(x)
        h.relu_()
        return self.l2(h) + h


class ReluInplaceModule(Base):
    def __init__(self):
        super().__init__()
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        h = self.l1(x)
        r = self.act(h)
        return self.l2(h) - r


class SiluInplaceFunctional(Base):
    def forward(self, x):
        h = self.l1(x)
        F.silu(h, inplace=True)
        return self.l2(h)


class PlusEqualsSeveralReaders(Base):
    def forward(self, x):
        h = self.l1(x)
        a = self.l2(h)
        h += 1
        b = self.l2(h)
        h *= 2
        return a + b + torch.softmax(h, -1)


class ChainedInplace(Base):
    def forward(self, x):
        h = self.l1(x)
        h.mul_(2).add_(1).sigmoid_()
        return self.l2(h)


# --- in-place FP32 ops: their out-of-place class ---------------------------------------------
class ExpTwin(Base):
    def forward(self, x):
        return self.l2(torch.log(self.l1(x).exp() + 1))

    def inputs(self):
        return (torch.randn(4, 8) * 6,)


class ExpInplace(ExpTwin):
    twin = ExpTwin

    def forward(self, x):
        h = self.l1(x)
        h.exp_()
        return self.l2(torch.log(h + 1))


class PowTwin(Base):
    def forward(self, x):
        return self.l2(self.l1(x).pow(8) ** 0.125)

    def inputs(self):
        return (torch.randn(4, 8) * 6,)


class PowInplace(PowTwin):
    twin = PowTwin

    def forward(self, x):
        h = self.l1(x)
        h.pow_(8)
        return self.l2(h ** 0.125)


class ClampLogTwin(Base):
    def forward(self, x):
        return self.l2(self.l1(x).clamp(min=1e-3).log())


class ClampLogInplace(ClampLogTwin):
    twin = ClampLogTwin

    def forward(self, x):
        h = self.l1(x)
        h.clamp_(min=1e-3)
        return self.l2(h.log_())


class FloatAliasWrite(Base):
    """``h.float()`` of a float ``h`` is ``h`` itself: writing it writes ``h``."""

    def forward(self, x):
        h = self.l1(x)
        h.float().mul_(2)
        return self.l2(h)


# --- writes into the caller's inputs ---------------------------------------------------------
class InputAddInplace(Base):
    def forward(self, x):
        x.add_(1)
        return self.l1(x)


class InputWriteThroughView(Base):
    def forward(self, x):
        x[:, 0].div_(2)
        return self.l1(x) + x


PATTERNS = [SetitemDiagonal, SetitemSlice, SetitemThenSoftmax, IndexPut, MaskedFillScores,
            CopyInto, FillThenWrite, ZeroThenAdd, ScatterInto, IndexAdd, OutArgument,
            WriteThroughSlice, WriteThroughTranspose, WriteThroughUnsqueeze, WriteThroughChunk,
            WriteThroughView, AugmentedAssignOnView, OldViewReadAfterWrite, TwoViewsOneWrite,
            ReluInplaceMethod, ReluInplaceModule, SiluInplaceFunctional,
            PlusEqualsSeveralReaders, ChainedInplace, ExpInplace, PowInplace, ClampLogInplace,
            FloatAliasWrite, InputAddInplace, InputWriteThroughView]
CASES = [pytest.param(p, c, id=f"{p.__name__}-{c}") for p in PATTERNS
         for c in ("dynamo", "symbolic") if c == "dynamo" or p.symbolic]


def _clone(inputs):
    return tuple(t.clone() for t in inputs)


def _autocast_err(model, inputs, ref, dtype) -> float:
    """autocast's error; inf where autocast crashes (index_put_ of a bf16 source into an fp32
    tensor) or overflows."""
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
            out = model(*_clone(inputs))
    except RuntimeError:
        return float("inf")
    return rel_err(out.float(), ref)


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("pattern,capture", CASES)
def test_mutation_pattern_matches_fp32(pattern, capture, dtype):
    model = pattern()
    inputs = model.inputs()
    gm = transform_via(capture, model, *_clone(inputs), dtype=dtype)

    with torch.no_grad():
        ref_in, out_in = _clone(inputs), _clone(inputs)
        ref = model(*ref_in)
        out = gm(*out_in)
    err = rel_err(out, ref)
    auto = _autocast_err(model, inputs, ref, dtype)
    if pattern.twin is not None:  # autocast runs an in-place op in its tensor's dtype
        auto = min(auto, _autocast_err(pattern.twin(), inputs, ref, dtype))
    assert torch.isfinite(out).all()
    # Where autocast has no finite answer, a few roundings of the dtype against fp32.
    bound = 1.5 * auto + 2 * UNIT[dtype] if auto < float("inf") else 8 * UNIT[dtype]
    assert err <= bound, (err, auto, gm.code)
    # The caller's inputs are written exactly as the model writes them.
    for a, b in zip(ref_in, out_in):
        assert torch.allclose(a, b, rtol=2 * UNIT[dtype], atol=2 * UNIT[dtype])
    # No write is left for a later pass to read around: only the copy back into an input, or a
    # write into a private clone that nothing else reads.
    _assert_only_private_or_copy_back_writes(gm)


@pytest.mark.parametrize("pattern", [ExpInplace, PowInplace, ClampLogInplace])
def test_inplace_fp32_op_takes_its_out_of_place_class(pattern):
    gm = amprewrite.transform(pattern(), torch.float16)
    decisions = {d.family: d.precision for d in amprewrite.report(gm).decisions if d.family}
    family = {ExpInplace: "exp", PowInplace: "pow", ClampLogInplace: "log"}[pattern]
    assert decisions[family] == "fp32"


def test_input_write_is_copied_back_bit_exact():
    model = InputWriteThroughView()
    x = torch.randn(4, 8)
    gm = amprewrite.transform(model, torch.bfloat16, example_inputs=(x.clone(),))
    a, b = x.clone(), x.clone()
    model(a)
    gm(b)
    assert torch.equal(a, b)


def _graph(build) -> fx.GraphModule:
    """A GraphModule from a hand-built graph (``build(graph, x)`` returns the output node)."""
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta[M.ORIG] = M.ValueInfo("tensor", torch.float32, 32, shape=(4, 8))
    g.output(build(g, x))
    gm = fx.GraphModule(nn.Module(), g)
    for n in g.nodes:
        n.meta.setdefault(M.ORIG, M.ValueInfo("tensor", torch.float32, 32, shape=(4, 8)))
    return gm


def test_pass_alone_rewrites_write_through_view():
    def build(g, x):
        h = g.call_method("clone", (x,))
        v = g.call_function(operator.getitem, (h, (slice(None), 0)))
        g.call_method("mul_", (v, 2))
        return g.call_method("exp", (h,))

    gm = _graph(build)
    assert Functionalize(None).run(gm)
    gm.graph.lint()
    gm.recompile()
    targets = [n.target for n in gm.graph.nodes]
    assert "mul_" not in targets and "mul" in targets
    assert any(getattr(t, "__name__", "") == "write_view" for t in targets)
    x = torch.randn(4, 8)
    h = x.clone()
    h[:, 0].mul_(2)
    assert torch.equal(gm(x), h.exp())


def test_pass_alone_leaves_pure_graph_unchanged():
    gm = _graph(lambda g, x: g.call_method("exp", (g.call_method("t", (x,)),)))
    before = [n.format_node() for n in gm.graph.nodes]
    assert not Functionalize(None).run(gm)
    assert [n.format_node() for n in gm.graph.nodes] == before


class ReshapeWriteSymbolic(nn.Module):
    """Whether ``reshape`` shares memory depends on strides symbolic tracing cannot see."""

    def forward(self, x):
        y = x.reshape(-1)
        y.mul_(2)
        return x + 1


def test_unknowable_alias_is_refused_not_guessed():
    model = ReshapeWriteSymbolic()
    with pytest.raises(ModelError, match="may or may not share memory") as err:
        amprewrite.transform(model, torch.bfloat16)
    assert "example_inputs" in str(err.value) and "\n" not in str(err.value)
    # With example inputs dynamo knows the answer, and the result is exact.
    x = torch.randn(4, 8)
    gm = amprewrite.transform(model, torch.bfloat16, example_inputs=(x.clone(),))
    a, b = x.clone(), x.clone()
    assert torch.equal(model(a), gm(b)) and torch.equal(a, b)


class ParamWrite(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            self.l.weight[0].mul_(0.5)
        return self.l(x)


@pytest.mark.parametrize("capture", ["dynamo", "symbolic"])
def test_write_to_float_parameter_through_view_refused(capture):
    with pytest.raises(ModelError, match=r"updates floating-point parameter 'l\.weight'"):
        transform_via(capture, ParamWrite(), torch.randn(2, 4), dtype=torch.bfloat16)


class RunningMean(nn.Module):
    """A float buffer updated in forward and read after the update by a LOW op (a stale read
    would use zeros on the first call: far off)."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 4)
        self.register_buffer("acc", torch.zeros(4))
        self.register_buffer("calls", torch.ones(()))

    def forward(self, x):
        self.calls += 1
        self.acc.mul_(0.5).add_(x.mean(0) * 3)
        return self.l(x + self.acc) * self.calls


@pytest.mark.parametrize("params", ["fp32", "low"])
def test_float_buffer_update_reads_the_new_value_and_reaches_the_buffer(params):
    torch.manual_seed(0)
    model = RunningMean()
    ref = RunningMean()
    ref.load_state_dict(model.state_dict())
    x = torch.randn(3, 4)
    gm = amprewrite.transform(model, dtype=torch.bfloat16, example_inputs=(x,), params=params)
    # params='fp32' shares the model's buffers; params='low' in train mode trains its own
    # copies of everything (the model is never modified), buffers included
    owner = model if params == "fp32" else gm
    for step in range(3):
        xs = torch.randn(3, 4)
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
            want = ref(xs)
        got = gm(xs)
        # The update is fp32 arithmetic in both: the buffers agree exactly.
        assert torch.equal(owner.acc, ref.acc) and torch.equal(owner.calls, ref.calls), step
        assert float(owner.calls) == step + 2
        if params == "low":
            assert float(model.calls) == 1 and not model.acc.any()
        # bf16 linear in both, same inputs: a few bf16 roundoffs apart; a stale read of acc
        # (zeros, then the previous value) is off by far more than this.
        assert rel_err(got, want.float()) < 2e-2, step
    copies = [n for n in gm.graph.nodes if n.target == "copy_"]
    assert sorted(str(n.args[0].target) for n in copies) == ["acc", "calls"]


ALONE = [p for p in PATTERNS if p.symbolic]


@pytest.mark.parametrize("pattern", ALONE, ids=lambda p: p.__name__)
def test_pass_alone_is_exact_and_the_same_for_both_dtypes(pattern):
    """Before any cast, the functionalized graph computes the model's fp32 values bit for bit
    and writes the caller's inputs as the model does; only a copy back into an input or a
    write into a private clone stays in place. The rewrite does not depend on the dtype."""
    model = pattern()
    inputs = model.inputs()
    graphs = []
    for dtype in LOW_DTYPES:
        gm, p = prepared(model, "functionalize", dtype=dtype)
        run_pass(gm, p)
        graphs.append(graph_signature(gm))
        with torch.no_grad():
            ref_in, out_in = _clone(inputs), _clone(inputs)
            assert torch.equal(gm(*out_in), model(*ref_in))
        assert all(torch.equal(a, b) for a, b in zip(out_in, ref_in))
        _assert_only_private_or_copy_back_writes(gm)
    assert graphs[0] == graphs[1]


def _assert_only_private_or_copy_back_writes(gm) -> None:
    """No write is left for a later pass to read around: only the copy back into an input, or
    a write into a private clone that nothing else reads."""
    for node in gm.graph.nodes:
        if writes_in_place(node):
            base = node.args[0]
            private = base.target == "clone" and list(base.users) == [node]
            copy_back = node.target == "copy_" and base.op == "placeholder"
            assert private or copy_back, node.format_node()


class _MaskAndReuse(nn.Module):
    """``mask & cond`` and ``mask | cond`` are Python's ``operator.and_`` / ``or_``: out of
    place, so ``mask`` keeps its value for the next reader (Dots3Note's attention mask)."""

    def forward(self, x):
        mask = torch.ones(x.shape, dtype=torch.bool).tril()
        first = mask & (x > 0)
        second = mask | (x > 1)
        return x.masked_fill(~first, 0.0) + x.masked_fill(~mask, 0.0) * x.masked_fill(~second, 1)


@pytest.mark.parametrize("with_inputs", [False, True])
def test_python_and_or_are_not_in_place(with_inputs):
    x = torch.randn(4, 4)
    options = {"example_inputs": (x,)} if with_inputs else {}
    gm = amprewrite.transform(_MaskAndReuse(), torch.bfloat16, verify=False, **options)
    assert torch.equal(gm(x), _MaskAndReuse()(x))  # booleans and selections: exact
    assert not [n for n in gm.graph.nodes if n.target in (operator.and_, operator.or_)
                and writes_in_place(n)]
