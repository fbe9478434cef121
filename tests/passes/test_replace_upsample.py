"""replace_upsample: bit-exact nearest upsampling, the probe, fp32 islands, real decoders."""

import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amprewrite
from amprewrite import meta as M
from amprewrite.ops import Precision
from amprewrite.passes import replace_upsample
from amprewrite.runtime import upsample_nearest

from ..helpers import casts, transform

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
_UPSAMPLES = {F.interpolate, F.upsample, F.upsample_nearest, F.upsample_bilinear,
              upsample_nearest}


def upsample_calls(gm) -> list:
    """Nodes that call an upsample kernel or amprewrite's one-call fallback."""
    return [n for n in gm.graph.nodes if n.target in _UPSAMPLES
            or str(n.target).startswith("upsample")]


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


@pytest.mark.parametrize("dtype", DTYPES)
def test_upsample_nearest_equals_native(dtype):
    for shape, kw in CASES:
        x = torch.randn(shape).to(dtype)
        exact = kw["mode"] == "nearest-exact"
        ours = upsample_nearest(x, kw.get("size"), kw.get("scale_factor"), exact,
                                kw.get("recompute_scale_factor"))
        assert torch.equal(ours, F.interpolate(x, **kw)), (shape, kw)


@pytest.mark.parametrize("shape, layout", [((2, 3, 4, 5), torch.channels_last),
                                           ((1, 2, 3, 4, 5), torch.channels_last_3d),
                                           ((2, 3, 4, 5), torch.contiguous_format)])
@pytest.mark.parametrize("kw", [{"scale_factor": 2}, {"scale_factor": 1.5}])
def test_memory_format_matches_native(shape, layout, kw):
    x = torch.randn(shape).contiguous(memory_format=layout)
    ours, native = upsample_nearest(x, None, kw["scale_factor"]), F.interpolate(x, **kw)
    assert torch.equal(ours, native)
    assert ours.stride() == native.stride()


@pytest.mark.parametrize("factor", [3, 25, 41, 47, 55, 61])
def test_factors_where_float_index_formula_is_not_floor_division(factor):
    """float32(1/s) rounds below 1/s for these s, so PyTorch's own output is not dst // s."""
    x = torch.arange(4096.0).reshape(1, 1, 4096)
    native = F.interpolate(x, scale_factor=factor)
    assert torch.equal(upsample_nearest(x, None, factor), native)


def test_gradients_match_exactly_for_integer_values():
    for shape, kw in CASES[:30]:
        x = torch.randint(-8, 8, shape).float().requires_grad_()
        y = torch.randint(-8, 8, shape).float().requires_grad_()
        out_native = F.interpolate(x, **kw)
        grad = torch.randint(-4, 4, out_native.shape).float()
        out_native.backward(grad)
        exact = kw["mode"] == "nearest-exact"
        upsample_nearest(y, kw.get("size"), kw.get("scale_factor"), exact,
                         kw.get("recompute_scale_factor")).backward(grad)
        assert torch.equal(x.grad, y.grad), (shape, kw)


class Up(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.kw = kw

    def forward(self, x):
        return F.interpolate(x, **self.kw)


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


def test_symbolic_trace_inlines_when_the_rank_is_known():
    """A tuple factor gives the rank; a factor of 2 needs no sizes (ATen shifts): plain ops,
    shape-generic. A scalar factor without example inputs leaves the rank unknown: one exact
    call, and the report says why."""
    tuple_factor = transform(Up(scale_factor=(2, 2)), dtype=torch.bfloat16, upsample="always")
    assert not upsample_calls(tuple_factor)
    scalar = transform(Up(scale_factor=2), dtype=torch.bfloat16, upsample="always")
    assert [n.target for n in upsample_calls(scalar)] == [upsample_nearest]
    (rw,) = [r for r in amprewrite.report(scalar).rewrites if r.pass_name == "replace_upsample"]
    assert "rank unknown" in rw.action and "example_inputs" in rw.action
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
    left = upsample_calls(gm)
    # Symbolic traces know no sizes: only the one exact call where the rank is unknown.
    assert all(n.target is upsample_nearest for n in left)
    if capture == "dynamo":
        assert not left
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


def test_under_torch_compile():
    torch._dynamo.reset()
    for shape, kw in CASES[:12]:
        x = torch.randn(shape)
        gm = transform(Up(**kw), dtype=torch.bfloat16, upsample="always", example_inputs=(x,))
        compiled = torch.compile(gm, fullgraph=True, dynamic=False)
        assert torch.equal(compiled(x), F.interpolate(x, **kw)), (shape, kw)


# --- the probe ---------------------------------------------------------------------------------


@pytest.fixture
def missing_kernels(monkeypatch):
    """Make the probe report no upsample kernel at all, as bf16 on CUDA before torch 2.1."""
    monkeypatch.setattr(replace_upsample, "has_kernel", lambda *a: False)


def test_auto_rewrites_what_the_probe_says_is_missing(missing_kernels):
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.Upsample(scale_factor=2), nn.Conv2d(4, 2, 1),
                          nn.Upsample(scale_factor=2, mode="bilinear"))
    gm = transform(model, dtype=torch.bfloat16)
    (near,) = [n for n in gm.graph.nodes if n.target is upsample_nearest]
    (bil,) = [n for n in gm.graph.nodes if n.meta.get(M.FAMILY) == "interpolate"]
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
    assert not any(n.target is upsample_nearest for n in gm.graph.nodes)
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
    assert not any(n.target is upsample_nearest for n in graphs[0].graph.nodes)


def test_planning_for_an_absent_device_says_what_to_do():
    if torch.cuda.is_available():
        pytest.skip("CUDA is present")
    with pytest.raises(amprewrite.PolicyError, match="upsample='always'"):
        transform(nn.Upsample(scale_factor=2), dtype=torch.bfloat16, device="cuda")
    gm = transform(nn.Upsample(scale_factor=2), dtype=torch.bfloat16, device="cuda",
                   upsample="always")
    assert any(n.target is upsample_nearest for n in gm.graph.nodes)


def test_upsample_option_is_validated():
    with pytest.raises(amprewrite.PolicyError, match="upsample must be"):
        transform(nn.Upsample(scale_factor=2), upsample="sometimes")


def test_gradients_under_torch_compile():
    torch._dynamo.reset()
    for shape, kw in CASES[:6]:
        x = torch.randint(-8, 8, shape).float().requires_grad_()
        y = x.detach().clone().requires_grad_()
        native = F.interpolate(x, **kw)
        grad = torch.randint(-4, 4, native.shape).float()
        native.backward(grad)
        gm = transform(Up(**kw), dtype=torch.bfloat16, upsample="always",
                       example_inputs=(y.detach(),), keep_io_dtype=False)
        out = torch.compile(gm, fullgraph=True, dynamic=False)(y)
        out.float().backward(grad.to(out.dtype).float())
        # Integer values and gradients are exact in bf16 (|v| < 256): the sums are exact too.
        assert torch.equal(y.grad, x.grad), (shape, kw)
