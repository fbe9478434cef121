"""replace_upsample: bit-exact nearest upsampling, the probe, fp32 islands, real decoders.

Property: every nearest interpolate the policy asks to replace (``upsample="always"``, or a
kernel the probe finds missing for the target dtype) becomes plain tensor ops whose result is
F.interpolate's bit for bit, in fp32, bf16 and fp16, at the traced sizes and others; any other
mode the probe finds missing becomes an fp32 island. With ``"always"`` the rewrite is the same
for both dtypes; with ``"auto"`` it depends on the dtype only through the probe.
"""

import functools
import random
import zlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amprewrite
from amprewrite.graph import meta as M
from amprewrite.graph import runtime
from amprewrite.passes import replace_upsample, run_pass
from amprewrite.precision.ops import Precision

from ..helpers import LOW_DTYPES, casts, graph_signature, prepared, transform

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
_UPSAMPLES = {F.interpolate, F.upsample, F.upsample_nearest, F.upsample_bilinear}


# Not upsample helpers: the layout query reads strides and computes no value; the guarded cast
# is how a symbolic trace casts an input whose dtype it does not know.
_NOT_UPSAMPLE = (runtime.memory_format_of, runtime.cast_if_float, runtime.autocast_off,
                 runtime.autocast_on_again)


def upsample_calls(gm) -> list:
    """Nodes that call an upsample kernel or any other function of amprewrite.graph.runtime: the
    rewrite must leave plain tensor ops only."""
    return [n for n in gm.graph.nodes if n.target in _UPSAMPLES
            or str(n.target).startswith("upsample")
            or (getattr(n.target, "__module__", None) == runtime.__name__
                and n.target not in _NOT_UPSAMPLE)]


def upsample_left(gm) -> list:
    """The interpolate nodes a transform left in the graph (an fp32 island keeps its node)."""
    return [n for n in gm.graph.nodes if n.meta.get(M.FAMILY) == "interpolate"]


def _cases(n: int = 72, seed: int = 0) -> list[tuple[tuple[int, ...], dict]]:
    """Random (shape, interpolate kwargs): rank 3-5, scale or size, integer or not."""
    rng = random.Random(seed)
    cases = []
    i = 0
    while len(cases) < n:
        i += 1
        k = (i % 3) + 1
        shape = (rng.randint(1, 2), rng.randint(1, 3), *[rng.randint(1, 9) for _ in range(k)])
        mode = rng.choice(["nearest", "nearest-exact"])
        kind = i // 3 % 6
        if kind == 0:
            kw = {"scale_factor": rng.randint(1, 5)}
        elif kind == 1:
            kw = {"scale_factor": tuple(float(rng.randint(1, 4)) for _ in range(k))}
        elif kind == 2:
            kw = {"scale_factor": rng.choice([0.5, 1.5, 1.7, 2.3, 3.3, 0.75])}
        elif kind == 3:
            kw = {"size": tuple(s * rng.randint(1, 4) for s in shape[2:])}
        elif kind == 4:
            kw = {"size": tuple(rng.randint(1, 20) for _ in range(k))}
        else:
            kw = {"scale_factor": rng.choice([1.5, 2.0, 2.5, 41.0]),
                  "recompute_scale_factor": rng.choice([True, False])}
        kw["mode"] = mode
        try:
            F.interpolate(torch.zeros(shape), **kw)
        except RuntimeError:
            continue  # an empty output: PyTorch rejects it too
        cases.append((shape, kw))
    return cases


CASES = _cases()


def test_cases_cover_the_space():
    assert len(CASES) >= 50
    assert {len(s) for s, _ in CASES} == {3, 4, 5}
    assert {kw["mode"] for _, kw in CASES} == {"nearest", "nearest-exact"}


class Up(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.kw = kw

    def forward(self, x):
        return F.interpolate(x, **self.kw)


@functools.cache
def _symbolic(kw: tuple, dtype: torch.dtype = torch.bfloat16):
    """``Up(**kw)`` transformed without example inputs (symbolic trace: rank and sizes unknown
    unless a tuple argument gives the rank), every nearest upsample rewritten."""
    return transform(Up(**dict(kw)), dtype=dtype, upsample="always", verify=False)


def symbolic(kw: dict, dtype: torch.dtype = torch.bfloat16):
    return _symbolic(tuple(sorted(kw.items())), dtype)


def _other_sizes(shape: tuple, kw: dict) -> list[tuple]:
    """Inputs of other sizes (and, where no tuple argument fixes it, other ranks) than any
    transform saw: the symbolic graph must be shape- and rank-generic by construction. Each
    is shrunk to an output of at most a million elements (:func:`_bounded`)."""
    fixed = isinstance(kw.get("size", kw.get("scale_factor")), tuple)
    ranks = [len(shape)] if fixed else [3, 4, 5]
    # crc32, not hash(): str hashes change with each process's hash seed.
    rng = random.Random(zlib.crc32(repr((shape, sorted(kw.items()))).encode()))
    sizes = [shape] + [(rng.randint(1, 3), rng.randint(1, 4),
                        *[rng.randint(1, 11) for _ in range(r - 2)]) for r in ranks]
    return [_bounded(s, kw) for s in sizes]


def _bounded(shape: tuple, kw: dict, limit: int = 1 << 20) -> tuple:
    """``shape`` with its largest spatial size halved until the output has at most ``limit``
    elements: a factor of 41 on a rank-5 input made outputs of up to 130 million elements (1.4
    s a case, with nothing more to check than at 1 million)."""
    shape = list(shape)
    while max(shape[2:]) > 1:
        try:
            out = F.interpolate(torch.empty(shape, device="meta"), **kw)
        except RuntimeError:
            break  # an empty output: the test skips this size, as PyTorch rejects it
        if out.numel() <= limit:
            break
        i = max(range(2, len(shape)), key=shape.__getitem__)
        shape[i] = (shape[i] + 1) // 2
    return tuple(shape)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_symbolic_graph_equals_native(case, dtype):
    """Without example inputs: plain ops only, bit for bit F.interpolate on the same input (in
    fp32, and on the low input for bf16/fp16), at the traced call and at other sizes/ranks."""
    shape, kw = CASES[case]
    gm = symbolic(kw, torch.bfloat16 if dtype == torch.float32 else dtype)
    assert not upsample_calls(gm) and not upsample_left(gm), kw
    gm.graph.lint()
    (rw,) = [r for r in amprewrite.report(gm).rewrites if r.pass_name == "replace_upsample"]
    assert "subgraph" in rw.action
    for s in _other_sizes(shape, kw):
        x = torch.randn(s).to(dtype)
        try:
            native = F.interpolate(x, **kw)
        except RuntimeError:
            continue  # an empty output at this size: PyTorch rejects it too
        ours = gm(x)
        assert ours.dtype == dtype and torch.equal(ours, native), (s, kw)


def test_integer_factor_without_sizes_is_an_expand():
    """A factor of 2 needs no sizes (ATen shifts): expand/flatten, no index arithmetic, for
    every rank from one graph."""
    gm = symbolic({"scale_factor": 2})
    targets = {n.target for n in gm.graph.nodes}
    assert {"expand", "flatten"} <= targets and "index_select" not in targets
    for shape in [(2, 3, 7), (1, 2, 5, 3), (2, 1, 3, 4, 2)]:
        x = torch.randn(shape)
        assert torch.equal(gm(x), F.interpolate(x, scale_factor=2))


@pytest.mark.parametrize("shape, layout", [((2, 3, 4, 5), torch.channels_last),
                                           ((1, 2, 3, 4, 5), torch.channels_last_3d),
                                           ((2, 3, 4, 5), torch.contiguous_format)])
@pytest.mark.parametrize("kw", [{"scale_factor": 2}, {"scale_factor": 1.5}, {"size": 7},
                                {"scale_factor": 3, "mode": "nearest-exact"}])
def test_memory_format_matches_native(shape, layout, kw):
    x = torch.randn(shape).contiguous(memory_format=layout)
    ours, native = symbolic(kw)(x), F.interpolate(x, **kw)
    assert torch.equal(ours, native)
    assert ours.stride() == native.stride()


@pytest.mark.parametrize("factor", [3, 25, 41, 47, 55, 61])
def test_factors_where_float_index_formula_is_not_floor_division(factor):
    """float32(1/s) rounds below 1/s for these s, so PyTorch's own output is not dst // s."""
    x = torch.arange(4096.0).reshape(1, 1, 4096)
    native = F.interpolate(x, scale_factor=factor)
    assert torch.equal(symbolic({"scale_factor": factor})(x), native)


def test_gradients_match_exactly_for_integer_values():
    for shape, kw in CASES[:30]:
        x = torch.randint(-8, 8, shape).float().requires_grad_()
        y = torch.randint(-8, 8, shape).float().requires_grad_()
        out_native = F.interpolate(x, **kw)
        grad = torch.randint(-4, 4, out_native.shape).float()
        out_native.backward(grad)
        out = symbolic(kw)(y)
        assert out.dtype == torch.float32  # the graph runs an fp32 input as it comes
        out.backward(grad)
        assert torch.equal(x.grad, y.grad), (shape, kw)


class FromSkip(nn.Module):
    """A UNet decoder's upsample to its skip connection's size, read from the graph."""

    def __init__(self, which: str, mode: str):
        super().__init__()
        self.which, self.mode = which, mode

    def forward(self, x, skip):
        size = {"shape": lambda: skip.shape[2:], "size()": lambda: skip.size()[2:],
                "size(-1)": lambda: skip.size(-1)}[self.which]()
        return F.interpolate(x, size=size, mode=self.mode)


@pytest.mark.parametrize("mode", ["nearest", "nearest-exact"])
@pytest.mark.parametrize("which", ["shape", "size()", "size(-1)"])
def test_size_computed_in_the_graph(which, mode):
    model = FromSkip(which, mode)
    gm = transform(model, dtype=torch.bfloat16, upsample="always", verify=False)
    assert not upsample_calls(gm) and not upsample_left(gm)
    rng = random.Random(0)
    for _ in range(40):
        k = rng.randint(1, 3)
        x = torch.randn(rng.randint(1, 2), 3, *[rng.randint(1, 7) for _ in range(k)])
        skip = torch.randn(1, 1, *[rng.randint(1, 20) for _ in range(k)])
        if k > 1 and rng.random() < 0.5:
            x = x.contiguous(memory_format=torch.channels_last if k == 2 else
                             torch.channels_last_3d)
        for dtype in DTYPES:
            ours, native = gm(x.to(dtype), skip), model(x.to(dtype), skip)
            assert torch.equal(ours, native), (x.shape, skip.shape)
            # Strides agree wherever they mean anything (a size-1 dim's stride does not).
            assert all(a == b for a, b, n in zip(ours.stride(), native.stride(), ours.shape)
                       if n > 1), (x.shape, skip.shape)


@torch.fx.wrap
def _opaque_size(t):
    return t.shape[2:]


def test_size_of_unknown_kind_becomes_an_exact_fp32_island():
    """A size the graph computes with a function it cannot see into may be a number or a
    sequence: not guessed; the upsample runs natively in fp32 (a copy: exact either way)."""

    class M_(nn.Module):
        def forward(self, x, skip):
            return F.interpolate(x, size=_opaque_size(skip))

    gm = transform(M_(), dtype=torch.bfloat16, upsample="always", verify=False)
    (node,) = upsample_left(gm)
    assert node.meta[M.CLASS] == Precision.FP32
    (rw,) = [r for r in amprewrite.report(gm).rewrites if r.pass_name == "replace_upsample"]
    assert "fp32 island" in rw.action
    x, skip = torch.randn(2, 3, 4, 5), torch.randn(1, 1, 9, 7)
    assert torch.equal(gm(x, skip), F.interpolate(x, size=(9, 7)))


class _Together(nn.Module):
    """Several graphs in one module, so one inductor compile covers every case (a compile per
    case cost about 5 s of CPU each)."""

    def __init__(self, graphs: list[nn.Module]):
        super().__init__()
        self.graphs = nn.ModuleList(graphs)

    def forward(self, *xs):
        return [g(x) for g, x in zip(self.graphs, xs)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_transform_always_is_exact_and_follows(dtype):
    for shape, kw in CASES[::4]:
        model = Up(**kw)
        x = torch.randn(shape)
        gm = transform(model, dtype=dtype, upsample="always", example_inputs=(x,))
        assert not upsample_calls(gm), (shape, kw)  # plain ops only: inlined
        moved = [n for n in gm.graph.nodes if n.target in (
            "expand", "flatten", "index_select", "contiguous", "clone")]
        assert moved and all(n.meta[M.CLASS] == Precision.NEUTRAL for n in moved)  # follows
        assert torch.equal(gm(x), model(x)), (shape, kw)
        rewrites = [r for r in amprewrite.report(gm).rewrites if r.pass_name == "replace_upsample"]
        assert len(rewrites) == 1 and "always" in rewrites[0].reason
        assert "subgraph" in rewrites[0].action


@pytest.mark.parametrize("layout", [torch.channels_last, torch.contiguous_format])
@pytest.mark.parametrize("kw", [{"scale_factor": 2}, {"scale_factor": 1.5},
                                {"size": (7, 10), "mode": "nearest-exact"}])
def test_inlined_subgraph_keeps_memory_format(layout, kw):
    x = torch.randn(2, 3, 4, 5).contiguous(memory_format=layout)
    gm = transform(Up(**kw), dtype=torch.bfloat16, upsample="always", example_inputs=(x,))
    assert not upsample_calls(gm)
    ours, native = gm(x), F.interpolate(x, **kw)
    assert torch.equal(ours, native) and ours.stride() == native.stride()


def test_symbolic_trace_inlines_whatever_the_rank():
    """A tuple factor gives the rank; a scalar factor without example inputs does not: the
    input is lifted to rank 5 and reshaped back, plain ops either way, and the report says the
    sizes are read at run time."""
    tuple_factor = transform(Up(scale_factor=(2, 2)), dtype=torch.bfloat16, upsample="always")
    assert not upsample_calls(tuple_factor)
    scalar = transform(Up(scale_factor=2), dtype=torch.bfloat16, upsample="always")
    assert not upsample_calls(scalar) and not upsample_left(scalar)
    (rw,) = [r for r in amprewrite.report(scalar).rewrites if r.pass_name == "replace_upsample"]
    assert "expand/reshape subgraph" in rw.action and "run time" in rw.action
    for shape in [(1, 1, 3, 3), (2, 3, 5, 8), (1, 2, 1, 9)]:
        x = torch.randn(shape)
        assert torch.equal(tuple_factor(x), F.interpolate(x, scale_factor=2))
        assert torch.equal(scalar(x), F.interpolate(x, scale_factor=2))


@pytest.mark.parametrize("capture", ["symbolic", "dynamo"])
@pytest.mark.parametrize("module", [nn.Upsample(scale_factor=2), nn.UpsamplingNearest2d(size=12),
                                    nn.Upsample(scale_factor=(2, 3), mode="nearest-exact")])
def test_every_module_spelling(module, capture):
    model = nn.Sequential(nn.Conv2d(3, 4, 1), module, nn.Conv2d(4, 2, 1))
    x = torch.randn(2, 3, 6, 6)
    example = (x,) if capture == "dynamo" else None
    gm = transform(model, dtype=torch.bfloat16, upsample="always", example_inputs=example)
    never = transform(model, dtype=torch.bfloat16, upsample="never", example_inputs=example)
    assert not upsample_calls(gm) and not upsample_left(gm)  # symbolic traces too
    assert torch.equal(gm(x), never(x))
    # Between two low convs the upsample runs in low precision: no cast is added for it.
    assert len(casts(gm)) == len(casts(never))


@pytest.mark.filterwarnings("ignore:`nn.functional.upsample")
@pytest.mark.parametrize("fn, kw", [(F.upsample, {"scale_factor": 2}),
                                    (F.upsample_nearest, {"scale_factor": 3}),
                                    (F.upsample_bilinear, {"scale_factor": 2})])
def test_functional_spellings(fn, kw):
    class M(nn.Module):
        def forward(self, x):
            return fn(x, **kw)

    x = torch.randn(1, 2, 4, 4)
    gm = transform(M(), dtype=torch.bfloat16, upsample="always", example_inputs=(x,))
    rewritten = not upsample_calls(gm)
    assert rewritten == (fn is not F.upsample_bilinear)  # bilinear is never replaced
    torch.testing.assert_close(gm(x), M()(x), rtol=0, atol=0 if rewritten else 2e-2)


def test_rewritten_graph_runs_at_other_sizes():
    model = nn.Sequential(nn.Upsample(scale_factor=2), nn.Conv2d(3, 3, 1))
    x = torch.randn(1, 3, 4, 4)
    gm = transform(model, dtype=torch.bfloat16, upsample="always", example_inputs=(x,))
    ref = transform(model, dtype=torch.bfloat16, upsample="never", example_inputs=(x,))
    y = torch.randn(3, 3, 7, 5)
    assert torch.equal(gm(y), ref(y))


# Under inductor, a C++ compile of each case's kernels is the cost (a cold cache: 26 s of CPU for
# the 20 graphs of "all"). The default run compiles 6 that cover ranks 3-5, both modes, integer,
# per-dimension, fractional and size arguments, transformed and symbolic; the slow run all 20.
UNDER_INDUCTOR = {"default": ([0, 4, 5, 9], [1, 6]), "all": (range(12), range(8))}


@pytest.mark.parametrize("which", ["default", pytest.param("all", marks=pytest.mark.slow)])
def test_under_torch_compile(which):
    """The rewrite's graphs under inductor, bit for bit: transformed graphs and the pass's own
    symbolic graphs, compiled as one module (one inductor compile)."""
    torch._dynamo.reset()
    cases = [CASES[i] for i in UNDER_INDUCTOR[which][0]]
    symbolic_cases = [CASES[i] for i in UNDER_INDUCTOR[which][1]]
    xs = [torch.randn(shape) for shape, _ in cases]
    gms = [transform(Up(**kw), dtype=torch.bfloat16, upsample="always", example_inputs=(x,))
           for x, (_, kw) in zip(xs, cases)]
    graphs = gms + [symbolic(kw) for _, kw in symbolic_cases]
    sym_xs = [torch.randn(shape) for shape, _ in symbolic_cases]
    inputs = xs + sym_xs
    compiled = torch.compile(_Together(graphs), fullgraph=True, dynamic=False)
    for out, x, (shape, kw) in zip(compiled(*inputs), inputs, cases + symbolic_cases):
        assert torch.equal(out, F.interpolate(x, **kw)), (shape, kw)


# --- the probe ---------------------------------------------------------------------------------


@pytest.fixture
def missing_kernels(monkeypatch):
    """Make the probe report no upsample kernel at all, as bf16 on CUDA before torch 2.1."""
    monkeypatch.setattr(replace_upsample, "has_kernel", lambda *a: False)


def test_auto_rewrites_what_the_probe_says_is_missing(missing_kernels):
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.Upsample(scale_factor=2), nn.Conv2d(4, 2, 1),
                          nn.Upsample(scale_factor=2, mode="bilinear"))
    gm = transform(model, dtype=torch.bfloat16)
    (bil,) = upsample_left(gm)  # the nearest one is plain ops now; its last node is the copy
    (near,) = [n for n in gm.graph.nodes if n.target == "contiguous"]
    assert bil.meta[M.CLASS] == Precision.FP32 and "fp32 island" in bil.meta[M.REASON]
    x = torch.randn(2, 3, 5, 5)
    # Same numbers as keeping the bilinear upsample ("3") in fp32 by hand, without the rewrite.
    by_hand = transform(model, dtype=torch.bfloat16, upsample="never", keep_fp32=["3"])
    assert torch.equal(gm(x), by_hand(x))
    reasons = [r.reason for r in amprewrite.report(gm).rewrites
               if r.pass_name == "replace_upsample"]
    assert len(reasons) == 2 and all("probed" in r for r in reasons)
    # The island: bilinear gets an fp32 input and its output leaves in fp32.
    assert any(c.meta[M.CAST] == torch.float32 and bil.args[0] is c for c in casts(gm))
    assert near.meta[M.LABEL] == M.LOW


def test_auto_leaves_working_kernels_alone():
    assert replace_upsample.has_kernel("cpu", torch.bfloat16, "nearest", 4)
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.Upsample(scale_factor=2))
    gm = transform(model, dtype=torch.bfloat16)
    assert len(upsample_left(gm)) == 1
    assert not [r for r in amprewrite.report(gm).rewrites if r.pass_name == "replace_upsample"]


def test_probe_is_independent_of_the_callers_grad_mode_and_compile_context():
    replace_upsample.has_kernel.cache_clear()
    with torch.no_grad():  # inference: the probe's backward must still run
        assert replace_upsample.has_kernel("cpu", torch.bfloat16, "nearest", 4)
    replace_upsample.has_kernel.cache_clear()
    torch._dynamo.reset()
    graphs = []
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.Upsample(scale_factor=2), nn.Conv2d(4, 2, 1))
    backend = amprewrite.backend(inner=lambda gm, ex: graphs.append(gm) or gm.forward)
    with torch.no_grad():
        torch.compile(model, backend=backend)(torch.randn(1, 3, 4, 4))
    assert not any(n.target in ("expand", "index_select") for n in graphs[0].graph.nodes)


@pytest.mark.parametrize("example", [False, True], ids=["symbolic", "dynamo"])
def test_planning_for_an_absent_device_is_one_behaviour_with_a_note(example):
    """``device="cuda"`` where there is no CUDA: an MLP planned with a note that kernels were
    not probed, and an upsample model refused with PolicyError (issue 65). Now every model is
    planned, as without a low kernel where a probe would have decided (nearest upsample: exact
    copies; bilinear: an fp32 island), and the report says the kernels were not probed."""
    if torch.cuda.is_available():
        pytest.skip("CUDA is present")
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    unet = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Upsample(scale_factor=2),
                         nn.Conv2d(4, 4, 1), nn.Upsample(scale_factor=2, mode="bilinear"),
                         nn.Conv2d(4, 2, 1))
    for model, x in ((mlp, torch.randn(4, 8)), (unet, torch.randn(2, 3, 8, 8))):
        gm = amprewrite.transform(model, dtype=torch.bfloat16, device="cuda",
                                  example_inputs=(x,) if example else None, verify=example)
        notes = amprewrite.report(gm).notes
        assert any(n.startswith("kernels not probed: device 'cuda'") for n in notes), notes
        with torch.no_grad():
            ref, out = model(x), gm(x)
        assert (out - ref).norm() / ref.norm() < 2e-2  # bf16 against fp32 (measured ~3e-3)
    assert len(upsample_left(gm)) == 1  # the bilinear one; the nearest one became copies
    (island,) = [n for n in gm.graph.nodes if n.meta.get(M.FORCE)]
    assert "kernels not probed: device 'cuda'" in island.meta[M.FORCE][1]
    gm = transform(nn.Upsample(scale_factor=2), dtype=torch.bfloat16, device="cuda",
                   upsample="always")
    assert not upsample_calls(gm) and not upsample_left(gm)


def test_upsample_option_is_validated():
    with pytest.raises(amprewrite.PolicyError, match="upsample must be"):
        transform(nn.Upsample(scale_factor=2), upsample="sometimes")


def test_gradients_under_torch_compile():
    torch._dynamo.reset()
    cases, xs, ys, grads, gms = CASES[:6], [], [], [], []
    for shape, kw in cases:
        x = torch.randint(-8, 8, shape).float().requires_grad_()
        y = x.detach().clone().requires_grad_()
        native = F.interpolate(x, **kw)
        grad = torch.randint(-4, 4, native.shape).float()
        native.backward(grad)
        gms.append(transform(Up(**kw), dtype=torch.bfloat16, upsample="always",
                             example_inputs=(y.detach(),), keep_io_dtype=False))
        xs.append(x), ys.append(y), grads.append(grad)
    outs = torch.compile(_Together(gms), fullgraph=True, dynamic=False)(*ys)
    torch.autograd.backward([o.float() for o in outs], [g.to(o.dtype).float()
                                                        for o, g in zip(outs, grads)])
    for x, y, (shape, kw) in zip(xs, ys, cases):
        # Integer values and gradients are exact in bf16 (|v| < 256): the sums are exact too.
        assert torch.equal(y.grad, x.grad), (shape, kw)


# --- the pass alone ----------------------------------------------------------------------------


def _up_model() -> nn.Module:
    return nn.Sequential(nn.Upsample(scale_factor=2),
                         nn.Upsample(size=(5, 7), mode="nearest-exact"))


def test_pass_alone_always_is_the_same_for_both_dtypes_and_exact():
    """Before any cast: the rewritten graph is F.interpolate bit for bit on fp32, bf16 and
    fp16 inputs, and a bf16 policy gets the same graph as an fp16 one."""
    model = _up_model()
    graphs = []
    for dtype in LOW_DTYPES:
        gm, p = prepared(model, "replace_upsample", dtype=dtype, upsample="always")
        assert run_pass(gm, p)
        assert not upsample_calls(gm)
        graphs.append(graph_signature(gm))
        for d in DTYPES:
            x = torch.randn(2, 3, 3, 4).to(d)
            ours = gm(x)
            assert ours.dtype == d and torch.equal(ours, model(x)), d
    assert graphs[0] == graphs[1]


@pytest.mark.parametrize("missing", LOW_DTYPES, ids=["bf16", "fp16"])
def test_auto_depends_on_the_dtype_only_through_the_probe(monkeypatch, missing):
    """A kernel missing for one dtype only: the policy for that dtype rewrites the upsample,
    the other leaves it to its native kernel."""
    monkeypatch.setattr(replace_upsample, "has_kernel",
                        lambda device, dtype, mode, rank: dtype != missing)
    model = nn.Sequential(nn.Conv2d(3, 3, 1), nn.Upsample(scale_factor=2))
    x = torch.randn(1, 3, 4, 4)
    for dtype in LOW_DTYPES:
        gm, p = prepared(model, "replace_upsample", dtype=dtype)
        assert run_pass(gm, p) == (dtype == missing)
        assert bool(upsample_calls(gm)) == (dtype != missing)
        assert torch.equal(gm(x), model(x))
