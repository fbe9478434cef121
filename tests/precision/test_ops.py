"""The op registry: ops outside the old table, every spelling, unknown ops, kernel probes,
coverage of torch's overridable functions."""

from __future__ import annotations

import math
import operator

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import amprewrite
from amprewrite.precision import ops
from amprewrite.precision.coverage import coverage, overridable_ops, status
from amprewrite.precision.ops import Precision, family_of
from tests.helpers import rel_err

DTYPES = [torch.bfloat16, torch.float16]


class Head(nn.Module):
    """A Linear (low) feeding ``fn``: the op sees a low-precision input, as in a real model."""

    def __init__(self, fn, width=16):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(width, width)
        self.fn = fn

    def forward(self, x):
        return self.fn(self.fc(x))


def _inverse(h):
    m = h[:8, :8] + 4 * torch.eye(8)
    return torch.inverse(m)


def _normal_log_prob(h):
    return torch.distributions.Normal(h, h.abs() + 0.5).log_prob(h * 0.9)


ROWS = {
    # op: (fn, input shape); each output is real so that errors compare.
    "fft.rfft": (lambda h: torch.fft.rfft(h).abs(), (64, 16)),
    "fft.fft": (lambda h: torch.view_as_real(torch.fft.fft(h)), (64, 16)),
    "polar": (lambda h: torch.view_as_real(torch.polar(h.abs(), h)), (64, 16)),
    "view_as_complex": (lambda h: torch.view_as_complex(h.reshape(-1, 8, 2)).abs(), (64, 16)),
    "quantile": (lambda h: torch.quantile(h, 0.3, dim=-1), (64, 16)),
    "inverse": (_inverse, (16, 16)),
    "linalg.svdvals": (lambda h: torch.linalg.svdvals(h), (64, 16)),
    "avg_pool3d": (lambda h: F.avg_pool3d(h.reshape(-1, 2, 4, 4, 4), 2), (64, 16)),
    "grid_sample": (lambda h: F.grid_sample(
        h.reshape(1, 2, 8, 8), torch.tanh(h[:4].reshape(1, 4, 8, 2)), align_corners=False),
        (8, 16)),
    "trace": (lambda h: torch.trace(h.reshape(32, 4) @ h.reshape(4, 32)).reshape(1), (8, 16)),
    "Normal.log_prob": (_normal_log_prob, (64, 16)),
    # Pre-scalings are powers of two (exact in any dtype): a rounding before the op would make
    # the comparison with autocast a coin toss (its own rounding after the op may cancel it).
    "square": (lambda h: torch.square(h * 32), (64, 16)),
    "reciprocal operator": (lambda h: 1.0 / (h.abs() + 0.01), (64, 16)),
    "torch.kl_div": (lambda h: torch.kl_div(F.log_softmax(h, -1), F.softmax(h * 2, -1))
                     .mean().reshape(1), (64, 16)),
    "torch.poisson_nll_loss": (lambda h: torch.poisson_nll_loss(
        h, h.abs(), True, False, 1e-8, 1).reshape(1), (64, 16)),
    "lgamma": (lambda h: torch.lgamma(h.abs() + 0.1), (64, 16)),
    "digamma": (lambda h: torch.digamma(h.abs() + 0.1), (64, 16)),
    "special.ndtri": (lambda h: torch.special.ndtri(torch.sigmoid(h)), (64, 16)),
    "logaddexp": (lambda h: torch.logaddexp(h * 16, -h * 16), (64, 16)),
    "logit": (lambda h: torch.logit(torch.sigmoid(h), 1e-6), (64, 16)),
    "atanh": (lambda h: torch.atanh(h / 4), (64, 16)),
    "logcumsumexp": (lambda h: torch.logcumsumexp(h * 8, -1), (64, 16)),
}


def _errors(fn, shape, dtype, example):
    model = Head(fn, shape[-1]).eval()
    torch.manual_seed(1)
    x = torch.randn(*shape)
    with torch.no_grad():
        ref = model.double()(x.double()).float()
        model.float()
        gm = amprewrite.transform(model, dtype, example_inputs=(x,) if example else None)
        out = gm(x)
        try:
            with torch.autocast("cpu", dtype=dtype):
                auto = model(x).float()
        except (RuntimeError, NotImplementedError):  # no low-precision kernel under autocast
            auto = None
    return out, ref, auto


@pytest.mark.parametrize("example", [False, True], ids=["symbolic", "dynamo"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("row", list(ROWS))
def test_issue_table_row_is_finite_and_at_most_autocasts_error(row, dtype, example):
    fn, shape = ROWS[row]
    out, ref, auto = _errors(fn, shape, dtype, example)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert torch.isfinite(out).all() or not torch.isfinite(ref).all()
    err = rel_err(out, ref)
    if auto is None:  # autocast crashes: amprewrite must run, within the low Linear's rounding
        assert err < 8 * torch.finfo(dtype).eps, (row, err)
        return
    auto_err = rel_err(auto, ref)
    # Same low Linear in both; amprewrite computes the op in fp32 where autocast may not. Where
    # autocast rounds the op's result to low precision, that rounding can happen to cancel some
    # of the Linear's error: allowance 1% of autocast's error plus 0.1 unit roundoff of dtype.
    assert err <= 1.01 * auto_err + 0.1 * torch.finfo(dtype).eps / 2, (row, err, auto_err)


@pytest.mark.parametrize("row", ["fft.rfft", "avg_pool3d", "grid_sample", "trace", "square",
                                 "reciprocal operator", "torch.kl_div", "lgamma", "logit",
                                 "atanh", "logcumsumexp", "quantile", "inverse"])
def test_issue_table_row_runs_in_fp32(row):
    fn, shape = ROWS[row]
    gm = amprewrite.transform(Head(fn, shape[-1]), torch.bfloat16)
    fc = [d for d in amprewrite.report(gm).decisions if d.family == "linear"]
    assert [d.precision for d in fc] == ["low"]
    risky = [d for d in amprewrite.report(gm).decisions
             if d.op in ("call_function", "call_method") and d.family is not None
             and d.family not in (
                 "linear", "getitem", "shape", "arith", "div", "attribute", "complex_parts",
                 "tanh", "sigmoid", "softmax", "log_softmax", "factory", "index", "metadata",
                 "matmul", "exact_scale")]
    assert risky and all(d.precision in ("fp32", "nonfloat") for d in risky), [
        (d.node, d.family, d.precision) for d in risky]


# --- every spelling of an op gets the same family ---------------------------------------------


def _node(target, *args, op="call_function", **kwargs) -> fx.Node:
    g = fx.Graph()
    x = g.placeholder("x")
    fill = [x if a == "x" else a for a in args]
    return g.create_node(op, target, tuple(fill), kwargs)


SPELLINGS = {
    # family: [(op, target, args)] — function, method, in-place, operator and alias forms
    "exp": [("call_function", torch.exp, ("x",)), ("call_method", "exp", ("x",)),
            ("call_method", "exp_", ("x",)), ("call_function", torch.exp_, ("x",)),
            ("call_function", torch.special.exp2, ("x",))],
    "pow": [("call_function", torch.pow, ("x", 2)), ("call_method", "pow", ("x", 2)),
            ("call_method", "pow_", ("x", 2)), ("call_function", operator.pow, ("x", 2)),
            ("call_function", torch.square, ("x",)), ("call_method", "square", ("x",)),
            ("call_method", "square_", ("x",)), ("call_function", operator.mul, ("x", "x")),
            ("call_method", "__pow__", ("x", 2))],
    "reciprocal": [("call_function", torch.reciprocal, ("x",)),
                   ("call_method", "reciprocal_", ("x",)),
                   ("call_function", operator.truediv, (1.0, "x")),
                   ("call_method", "__rtruediv__", ("x", 1.0))],
    "special": [("call_function", torch.lgamma, ("x",)), ("call_method", "lgamma", ("x",)),
                ("call_method", "lgamma_", ("x",)), ("call_function", torch.special.gammaln,
                                                     ("x",)),
                ("call_function", torch.logit, ("x",)), ("call_method", "logit_", ("x",)),
                ("call_function", torch.special.logit, ("x",)),
                ("call_function", torch.logaddexp, ("x", "x"))],
    "trig": [("call_function", torch.atanh, ("x",)), ("call_method", "atanh", ("x",)),
             ("call_method", "arctanh_", ("x",)), ("call_function", torch.arctanh, ("x",))],
    "logsumexp": [("call_function", torch.logcumsumexp, ("x", 0)),
                  ("call_method", "logcumsumexp", ("x", 0)),
                  ("call_function", torch.special.logsumexp, ("x", 0))],
    "kl_div": [("call_function", F.kl_div, ("x", "x")), ("call_function", torch.kl_div,
                                                          ("x", "x"))],
    "relu": [("call_function", torch.relu, ("x",)), ("call_function", F.relu, ("x",)),
             ("call_method", "relu_", ("x",)), ("call_function", torch.relu_, ("x",)),
             ("call_function", F.relu_, ("x",))],
    "linalg": [("call_function", torch.inverse, ("x",)), ("call_function", torch.linalg.inv,
                                                          ("x",)),
               ("call_method", "inverse", ("x",))],
    "arith": [("call_function", operator.add, ("x", 1)), ("call_method", "add_", ("x", 1)),
              ("call_method", "__radd__", ("x", 1)), ("call_function", torch.add, ("x", 1)),
              ("call_function", operator.mul, ("x", 2.0))],
}


@pytest.mark.parametrize("family", list(SPELLINGS))
def test_every_spelling_of_an_op_has_its_family(family):
    for op, target, args in SPELLINGS[family]:
        node = _node(target, *args, op=op)
        found = family_of(node)
        assert found is not None and found.name == family, (target, found and found.name)


def test_in_place_spellings_get_the_out_of_place_class():
    for name in ("exp_", "pow_", "log_", "clamp_", "add_", "masked_fill_", "index_put_",
                 "copy_", "lgamma_", "sqrt_", "sigmoid_"):
        fam = ops.family_for_method(name)
        base = ops.family_for_method(name[:-1])
        assert fam is not None and (base is None or fam is base), name


# --- unknown ops run in fp32 ------------------------------------------------------------------


@torch.fx.wrap
def mystery_op(x):
    return x * 2.0


class Mystery(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(mystery_op(self.fc(x)))


def test_unknown_op_runs_in_fp32_and_the_report_says_how_to_override():
    gm = amprewrite.transform(Mystery(), torch.bfloat16)
    rep = amprewrite.report(gm)
    (row,) = [d for d in rep.decisions if d.node.startswith("mystery_op")]
    assert row.precision == "fp32" and row.dtype == "torch.float32"
    assert "unknown op 'tests.precision.test_ops.mystery_op': fp32; allow_low=['node:mystery_op']" \
        in row.reason
    assert any("unknown op 'tests.precision.test_ops.mystery_op' (1 node): fp32" in n
               for n in rep.notes)
    gm_low = amprewrite.transform(Mystery(), torch.bfloat16, allow_low=["node:mystery_op"])
    (row,) = [d for d in amprewrite.report(gm_low).decisions if d.node.startswith("mystery")]
    assert row.precision == "promote" and row.dtype == "torch.bfloat16"


# --- kernel probes ----------------------------------------------------------------------------


def test_missing_low_kernel_becomes_an_fp32_island_with_the_reason():
    model = Head(lambda h: F.avg_pool3d(h.reshape(-1, 2, 4, 4, 4), 2), 16)
    x = torch.randn(8, 16)
    for example in (None, (x,)):
        gm = amprewrite.transform(model, torch.bfloat16, example_inputs=example)
        (row,) = [d for d in amprewrite.report(gm).decisions if d.family == "avg_pool"]
        assert row.precision == "fp32"
        assert "fp32 island: no bfloat16 kernel on cpu" in row.reason
        with torch.no_grad():
            assert torch.isfinite(gm(x)).all()


def broken_low_kernel(x):
    """Right in fp32, garbage in low precision: what torch's bf16 CPU grid_sample does."""
    return x * 2 if x.dtype == torch.float32 else x * 1e30


torch.fx.wrap("broken_low_kernel")  # a leaf of the symbolic trace, like a C++ op


@pytest.fixture
def broken_family():
    fam = ops.Family("broken_test_op", Precision.PROMOTE, (broken_low_kernel,))
    with ops.override_families(fam):
        yield fam


def test_wrong_low_kernel_is_caught_by_the_probe(broken_family):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return broken_low_kernel(self.fc(x))

    model, x = M(), torch.randn(4, 8)
    gm = amprewrite.transform(model, torch.bfloat16)
    (row,) = [d for d in amprewrite.report(gm).decisions if d.family == "broken_test_op"]
    assert row.precision == "fp32" and "bfloat16 kernel is wrong on cpu" in row.reason
    with torch.no_grad():
        out, ref = gm(x), model(x)
    assert rel_err(out, ref) < 0.02  # the low Linear's rounding only, not 1e30


def test_probe_keeps_working_kernels_low():
    model = Head(lambda h: F.avg_pool2d(F.gelu(h).reshape(1, 2, 8, 8), 2), 16)
    gm = amprewrite.transform(model, torch.bfloat16, example_inputs=(torch.randn(8, 16),))
    rows = {d.family: d for d in amprewrite.report(gm).decisions}
    assert rows["avg_pool"].dtype == "torch.bfloat16" and rows["activation"].dtype == \
        "torch.bfloat16"


# --- coverage ---------------------------------------------------------------------------------


def test_every_overridable_torch_function_is_classified_or_reviewed():
    unreviewed = sorted({f"{space}.{name}" for space, name, fn in overridable_ops()
                         if status(space, name, fn) == "unreviewed"})
    assert not unreviewed, ("add a family in amprewrite/precision/ops.py (or, after review, the "
                            "name to "
                            f"coverage.FP32_BY_DEFAULT): {unreviewed}")
    counts = coverage()
    assert counts["known"] > 1000 and counts["not float"] > 150
    assert counts["fp32 by default"] < 0.1 * sum(counts.values())


def _op_tables(source: str) -> list[str]:
    """Literal collections (set, list, tuple, dict keys) in ``source`` that name three or more
    ops: strings that are torch / Tensor / functional callables (dtype names aside), or
    references such as ``torch.add``, ``F.relu``, ``operator.iadd`` (classes and modules aside).
    """
    import ast
    import builtins
    import math as _math
    import operator as _operator

    import torch.nn.functional as F

    spaces = {"torch": torch, "F": F, "operator": _operator, "math": _math, "builtins": builtins}

    def op_string(value: object) -> bool:
        return (isinstance(value, str) and value.isidentifier() and not value.startswith("__")
                and not isinstance(getattr(torch, value, None), torch.dtype)
                and any(callable(getattr(ns, value, None)) for ns in (torch, torch.Tensor, F)))

    def op_ref(node: ast.AST) -> bool:
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not (isinstance(node, ast.Name) and node.id in spaces and parts):
            return False
        obj: object = spaces[node.id]
        for part in reversed(parts):
            obj = getattr(obj, part, None)
        return callable(obj) and not isinstance(obj, type)

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Set, ast.List, ast.Tuple)):
            elts = node.elts
        elif isinstance(node, ast.Dict):
            elts = [k for k in node.keys if k is not None]
        else:
            continue
        strings = [e for e in elts if isinstance(e, ast.Constant) and op_string(e.value)]
        refs = [e for e in elts if op_ref(e)]
        if len(strings) >= 3 or len(refs) >= 3:
            found.append(f"line {node.lineno}: {ast.unparse(node)[:80]}")
    return found


def test_registry_is_the_only_op_table():
    """Every op fact lives in amprewrite/precision/ops.py: no other module of the package keeps
    a table of op names or op functions (views, in-place writes, conversions, upsample modes
    ...)."""
    import pathlib

    package = pathlib.Path(amprewrite.__file__).parent
    tables = {str(path.relative_to(package)): _op_tables(path.read_text())
              for path in sorted(package.rglob("*.py"))
              if path != package / "precision" / "ops.py"}
    assert {k: v for k, v in tables.items() if v} == {}
    # The registry itself is found by the same check (it cannot pass by finding nothing).
    assert len(_op_tables((package / "precision" / "ops.py").read_text())) > 20


def test_override_families_restores_the_registry():
    """override_families changes the registry inside the block only, even when it raises."""
    before = dict(ops.FAMILIES)
    softmax_spelling = ops.family_for_function(torch.softmax)
    fam = ops.Family("override_test_op", Precision.LOW, (broken_low_kernel,))
    with pytest.raises(RuntimeError, match="inside"):
        with amprewrite.override_families(fam, softmax=Precision.LOW):
            assert ops.FAMILIES["softmax"].precision is Precision.LOW
            assert ops.family_for_function(broken_low_kernel) is fam
            raise RuntimeError("inside")
    assert dict(ops.FAMILIES) == before
    assert ops.family_for_function(broken_low_kernel) is None
    assert ops.family_for_function(torch.softmax) is softmax_spelling
    with pytest.raises(KeyError, match="no op family named 'sofmax'"):
        with amprewrite.override_families(sofmax=Precision.LOW):
            pass
    assert dict(ops.FAMILIES) == before


def test_op_table_check_finds_a_table_added_outside_the_registry():
    """The guard above fails when a module defines an op table: each spelling of one is found."""
    assert _op_tables('_VIEWS = {"view", "transpose", "permute"}')
    assert _op_tables("_INPLACE = {operator.iadd: operator.add, operator.isub: operator.sub,"
                      " operator.imul: operator.mul}")
    assert _op_tables("def f(node):\n    return node.target in (torch.add, F.relu, torch.mul)")
    # Not op tables: dtype names, classes, modes.
    assert not _op_tables('NAMES = {"float": 1, "half": 2, "bfloat16": 3, "int": 4}')
    assert not _op_tables("TYPES = (torch.SymInt, torch.SymFloat, torch.dtype, torch.device)")
    assert not _op_tables('MODES = ("nearest", "nearest-exact", "area")')


def test_distribution_log_prob_traces_symbolically():
    model = Head(_normal_log_prob, 16)
    gm = amprewrite.transform(model, torch.float16)
    x = torch.randn(8, 16)
    with torch.no_grad():
        out, ref = gm(x), model(x)
    assert torch.isfinite(out).all() and rel_err(out, ref) < 0.02
    assert math.isfinite(rel_err(out, ref))


@torch.library.custom_op("amprewrite_test::scale", mutates_args=())
def _custom_scale(x: torch.Tensor, s: float) -> torch.Tensor:
    return x * s


@_custom_scale.register_fake
def _(x, s):
    return torch.empty_like(x)


class _CustomOpModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return _custom_scale(self.fc(x), 2.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_custom_ops_are_named_and_selected_by_their_qualified_name(dtype):
    """A ``torch.library.custom_op`` runs fp32 (unknown), the report names it as the user wrote
    it ('amprewrite_test::scale', not torch._ops' internal module path) and advises the
    selector that works, and that selector opts it back in."""
    torch.manual_seed(0)
    model, x = _CustomOpModel().eval(), torch.randn(2, 8)
    gm = amprewrite.transform(model, dtype, example_inputs=(x,))
    (row,) = [d for d in amprewrite.report(gm).decisions if d.node.startswith("_custom_scale")
              or "scale" in d.node]
    assert row.precision == "fp32"
    assert row.reason == ("unknown op 'amprewrite_test::scale': fp32; "
                          "allow_low=['amprewrite_test::scale'] to override")
    low = amprewrite.transform(model, dtype, example_inputs=(x,),
                               allow_low=["amprewrite_test::scale"])
    (row,) = [d for d in amprewrite.report(low).decisions if d.node == row.node]
    assert row.precision == "promote" and row.dtype == str(dtype)
    with torch.no_grad():
        assert rel_err(low(x), model(x)) < 2e-2
    with pytest.raises(amprewrite.PolicyError, match="namespace::name"):
        amprewrite.transform(model, dtype, example_inputs=(x,), allow_low=["scale"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_c_nn_upsample_is_classified_by_its_mode_not_by_argument_positions(dtype):
    """``torch._C._nn.upsample_bilinear2d(x, size, align_corners)`` has no mode argument: it was
    read as nearest ("exact in any dtype"). Its name says the mode."""
    class Up(nn.Module):
        def forward(self, x):
            a = torch._C._nn.upsample_bilinear2d(x, (8, 8), False)
            b = torch._C._nn.upsample_nearest2d(x, (8, 8))
            return a + b

    gm = amprewrite.transform(Up(), dtype, example_inputs=(torch.randn(1, 2, 4, 4),),
                              upsample="never")
    rows = [d for d in amprewrite.report(gm).decisions if d.family == "interpolate"]
    bilinear = [d for d in rows if "bilinear" in d.target]
    nearest = [d for d in rows if "nearest" in d.target]
    assert bilinear and all(d.precision != "neutral" for d in bilinear)
    assert "exact in any dtype" not in bilinear[0].reason
    assert nearest and all(d.precision == "neutral" for d in nearest)


def test_every_core_aten_op_has_a_family():
    """ATen-level graphs (torch.export, aot_autograd) are classified by the same registry: every
    overload tagged ``torch.Tag.core`` maps to a family (by its base name through torch, F,
    torch._C._nn, torch.special/linalg/fft and Tensor, or by a family's ``op_names``), except
    backward kernels, which only joint graphs hold (amprewrite does not transform those; an
    unknown op runs fp32)."""
    core = set()
    for qualified in torch._C._dispatch_get_all_op_names():  # every registered op, loaded or not
        if not qualified.startswith("aten::"):
            continue
        name, _, overload = qualified[len("aten::"):].partition(".")
        op = getattr(getattr(torch.ops.aten, name, None), overload or "default", None)
        if op is not None and torch.Tag.core in op.tags:
            core.add(op)
    assert len(core) > 150
    missing = sorted({op.name() for op in core if ops.family_for_function(op) is None
                      and not op.name().split(".")[0].endswith("_backward")})
    assert missing == []
    # A few that used to be unknown, and what they are now.
    aten = torch.ops.aten
    expect = {aten.linear.default: "linear", aten._softmax.default: "softmax",
              aten.gelu.default: "activation", aten._to_copy.default: "convert",
              aten.upsample_bilinear2d.vec: "interpolate", aten.linalg_vector_norm.default: "norm",
              aten.scaled_dot_product_attention.default: None, aten.mse_loss.default: None,
              aten.slice.Tensor: "shape", aten.index.Tensor: "index"}
    for op, family in expect.items():
        got = ops.family_for_function(op)
        if family is None:
            assert got is not None, op  # in some family
        else:
            assert got is not None and got.name == family, (op, got)


# torch.autocast's op lists, by device and cast policy, as PyTorch's C++ declares them:
# aten/src/ATen/autocast_mode.cpp (the CPU lists; pytorch/pytorch at 008ec6b1) and the
# AT_FORALL_* lists of aten/src/ATen/autocast_mode.h that CUDA (and XPU) register, plus
# cudnn_convolution(_transpose), which the .cpp adds for CUDA. fp32 includes autocast's
# fp32_set_opt_dtype and fp32_append_dtype policies (softmax, sum, norm: run in fp32 too).
# rms_norm: CUDA fp32 in torch 2.13, newer than that source.
AUTOCAST_LISTS = {
    ("cpu", "low"): """conv1d conv1d.padding conv2d conv2d.padding conv3d conv3d.padding bmm mm
        linalg_vecdot baddbmm addmm _addmm_activation addbmm linear _convolution.deprecated matmul
        conv_tbc mkldnn_rnn_layer conv_transpose1d conv_transpose2d.input conv_transpose3d.input
        prelu scaled_dot_product_attention _native_multi_head_attention""",
    ("cpu", "fp32"): """avg_pool3d binary_cross_entropy grid_sampler polar prod prod.dim_int
        prod.dim_Dimname quantile quantile.scalar nanquantile nanquantile.scalar stft stft.center
        cdist grid_sampler_2d _grid_sampler_2d_cpu_fallback grid_sampler_3d trace view_as_complex
        cholesky cholesky_inverse cholesky_solve inverse lu_solve orgqr ormqr pinverse max_pool3d
        max_unpool2d max_unpool3d adaptive_avg_pool3d reflection_pad1d reflection_pad2d
        replication_pad1d replication_pad2d replication_pad3d mse_loss cosine_embedding_loss
        nll_loss nll_loss2d hinge_embedding_loss poisson_nll_loss smooth_l1_loss
        cross_entropy_loss l1_loss huber_loss margin_ranking_loss soft_margin_loss
        triplet_margin_loss multi_margin_loss ctc_loss.IntList ctc_loss.Tensor kl_div
        multilabel_margin_loss binary_cross_entropy_with_logits fft_fft fft_ifft fft_fft2
        fft_ifft2 fft_fftn fft_ifftn fft_rfft fft_irfft fft_rfft2 fft_irfft2 fft_rfftn fft_irfftn
        fft_hfft fft_ihfft linalg_cond linalg_cond.p_str linalg_matrix_rank
        linalg_matrix_rank.tol_tensor linalg_matrix_rank.atol_rtol_tensor
        linalg_matrix_rank.atol_rtol_float linalg_solve linalg_cholesky linalg_svdvals
        linalg_eigvals linalg_eigvalsh linalg_inv linalg_householder_product linalg_tensorinv
        linalg_tensorsolve fake_quantize_per_tensor_affine geqrf _lu_with_info qr svd
        triangular_solve fractional_max_pool2d fractional_max_pool3d adaptive_max_pool3d
        multilabel_margin_loss_forward linalg_qr linalg_cholesky_ex linalg_svd linalg_eig
        linalg_eigh linalg_lstsq linalg_inv_ex""",
    ("cpu", "promote"): "stack cat index_copy index_copy.dimname",
    ("cuda", "low"): """_convolution.deprecated _convolution conv1d conv2d conv3d conv_tbc
        conv_transpose1d conv_transpose2d.input conv_transpose3d.input convolution prelu addmm
        addmv addr matmul einsum mm mv linalg_vecdot linear addbmm baddbmm bmm chain_matmul
        linalg_multi_dot _thnn_fused_lstm_cell _thnn_fused_gru_cell lstm_cell gru_cell
        rnn_tanh_cell rnn_relu_cell _scaled_dot_product_flash_attention
        scaled_dot_product_attention cudnn_convolution cudnn_convolution_transpose""",
    ("cuda", "fp32"): """acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt
        sinh tan pow.Tensor_Scalar pow.Tensor_Tensor pow.Scalar softplus layer_norm
        native_layer_norm group_norm frobenius_norm.dim nuclear_norm nuclear_norm.dim
        cosine_similarity poisson_nll_loss cosine_embedding_loss nll_loss nll_loss2d
        hinge_embedding_loss kl_div l1_loss smooth_l1_loss huber_loss mse_loss margin_ranking_loss
        multilabel_margin_loss soft_margin_loss triplet_margin_loss multi_margin_loss
        binary_cross_entropy_with_logits dist pdist cdist renorm logsumexp upsample_nearest1d
        _upsample_nearest_exact1d upsample_nearest2d _upsample_nearest_exact2d upsample_nearest3d
        _upsample_nearest_exact3d upsample_linear1d upsample_bilinear2d _upsample_bilinear2d_aa
        upsample_trilinear3d upsample_bicubic2d _upsample_bicubic2d_aa prod prod.dim_int
        prod.dim_Dimname softmax.int softmax.Dimname log_softmax.int log_softmax.Dimname cumprod
        cumprod.dimname cumsum cumsum.dimname linalg_vector_norm linalg_matrix_norm
        linalg_matrix_norm.str_ord sum sum.dim_IntList sum.dim_DimnameList norm.Scalar
        norm.ScalarOpt_dim norm.names_ScalarOpt_dim rms_norm""",
    ("cuda", "promote"): """addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put
        tensordot scatter_add""",
    ("cuda", "banned"): "binary_cross_entropy",  # raises "unsafe to autocast"
}
AUTOCAST = {key: names.split() for key, names in AUTOCAST_LISTS.items()}
# torch 2.14 removed the ATen ops cholesky and qr (torch.cholesky and torch.qr call linalg's
# now), casts its new linalg_matrix_sqrth to fp32 on CPU and CUDA, and registers CUDA
# autocast's low _cudnn_rnn (whole recurrent networks) under AutocastCUDA.
TORCH_2_14 = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 14)
if TORCH_2_14:
    AUTOCAST[("cpu", "fp32")] = [n for n in AUTOCAST[("cpu", "fp32")]
                                 if n not in ("cholesky", "qr")]
    for device in ("cpu", "cuda"):
        AUTOCAST[(device, "fp32")].append("linalg_matrix_sqrth")
    AUTOCAST[("cuda", "low")].append("_cudnn_rnn")

# Where the registry runs an op of autocast's low or fp32 list in another class, and why. Every
# entry is deliberate; the test fails when one appears or goes away.
AUTOCAST_DISAGREEMENTS = {
    # Autocast runs these low; the registry does not.
    "prelu": "promote",  # elementwise: runs in its inputs' widest precision, like gelu
    "mkldnn_rnn_layer": "fp32 by default",  # whole recurrent layers (nn.LSTM) are unknown: fp32
    # Autocast runs these in fp32; they select or copy values, exact in any dtype.
    **dict.fromkeys(["max_pool3d", "max_unpool2d", "max_unpool3d", "adaptive_max_pool3d",
                     "fractional_max_pool2d", "fractional_max_pool3d", "reflection_pad1d",
                     "reflection_pad2d", "replication_pad1d", "replication_pad2d",
                     "replication_pad3d"], "neutral"),
    # CUDA autocast runs every upsample in fp32; nearest ones copy values (NEUTRAL per node),
    # the averaging modes follow their input (an fp32 island where no low kernel is probed).
    **dict.fromkeys(["upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d",
                     "_upsample_nearest_exact2d", "upsample_nearest3d",
                     "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
                     "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d",
                     "_upsample_bicubic2d_aa"], "promote"),
    # CPU autocast's fp32 pools: averages follow their input; adaptive_avg_pool3d is FP32 per
    # node (ops._avg_pool), avg_pool3d is not (no error measured worse than autocast's).
    "avg_pool3d": "promote", "adaptive_avg_pool3d": "promote",
    # Quantization simulation: no family; unknown ops run in fp32, as autocast runs it.
    "fake_quantize_per_tensor_affine": "fp32 by default",
    # A whole recurrent network's cuDNN kernel, like mkldnn_rnn_layer (torch 2.14 lists it).
    **({"_cudnn_rnn": "fp32 by default"} if TORCH_2_14 else {}),
}


def _aten_op(name: str):
    """``aten::name.overload`` as an operator; the overload packet where this torch has no such
    overload (named-tensor ones); None where it has no such op."""
    base, _, overload = name.partition(".")
    packet = getattr(torch.ops.aten, base, None)
    if packet is None:
        return None
    return getattr(packet, overload or "default", None) or packet


def _class_of(name: str) -> str | None:
    op = _aten_op(name)
    family = ops.family_for_function(op) if op is not None else None
    if family is not None:
        return family.precision.value
    return "fp32 by default" if name.split(".")[0] in ops.FP32_BY_DEFAULT else None


def test_autocast_lists_match_this_torch():
    """The lists above hold every op this torch registers an autocast kernel for (CPU and
    CUDA, whether or not CUDA is here): an op autocast starts casting fails here until it is
    added to the lists, and so to the checks below."""
    for device, key in (("cpu", "AutocastCPU"), ("cuda", "AutocastCUDA")):
        listed = {f"aten::{n}" for (d, _), names in AUTOCAST.items() if d == device
                  for n in names}
        registered = {q for q in torch._C._dispatch_get_all_op_names() if q.startswith("aten::")
                      and torch._C._dispatch_has_kernel_for_dispatch_key(q, key)}
        assert len(registered) > 90
        assert sorted(registered - listed) == []


def test_every_op_in_autocasts_lists_is_classified():
    """Every op torch.autocast casts is classified by the one registry (by its ATen name, as an
    ATen graph spells it), or is one of the ops the registry reviewed as fp32 by default."""
    names = {n for lists in AUTOCAST.values() for n in lists}
    assert len(names) > 200
    unresolved = sorted(n for n in names if _aten_op(n) is None)
    assert unresolved == []  # every listed op exists in this torch
    assert sorted(n for n in names if _class_of(n) is None) == []


def test_autocasts_low_and_fp32_ops_get_our_class_or_a_stated_reason():
    """Autocast's fp32 ops are never LOW here; its low ops are LOW; the exceptions are the
    deliberate ones in AUTOCAST_DISAGREEMENTS."""
    found = {}
    for (_, policy), names in AUTOCAST.items():
        if policy not in ("low", "fp32"):
            continue
        for name in names:
            got = _class_of(name)
            if got != policy:
                found[name.split(".")[0]] = got
    assert found == AUTOCAST_DISAGREEMENTS
    assert "low" not in found.values()
