"""Kernel probes without example inputs (issue 27): no probe, no trust.

A symbolic trace has no shapes, so the probe guesses them. An op it confirms runs low; an op
whose low kernel it finds missing, or cannot confirm at all, runs in fp32 and the report says so.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import amprewrite
from amprewrite.graph import meta as M
from amprewrite.precision import kernels, ops
from amprewrite.precision.ops import Precision
from amprewrite.precision.report import Decision

DTYPES = [torch.bfloat16, torch.float16]
# Relative error of a graph against the fp32 model, when its convs run low: bf16 keeps 8 bits
# of mantissa (rounding 2**-9 = 2e-3 per op), fp16 11 (2.4e-4); a few ops accumulate it.
TOL = {torch.bfloat16: 2e-2, torch.float16: 3e-3}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def rows(gm: fx.GraphModule, family: str) -> list[Decision]:
    return [d for d in amprewrite.report(gm).decisions if d.family == family]


def name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# --- a missing kernel --------------------------------------------------------------------------


class Pool3dFunctional(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(2, 4, 3, padding=1)

    def forward(self, x):
        return F.avg_pool3d(self.conv(x), 2)


@pytest.mark.parametrize("dtype", DTYPES, ids=name)
@pytest.mark.parametrize("make", [
    Pool3dFunctional,
    # nn.AvgPool3d stays a call_module node: the probe calls the module itself.
    lambda: nn.Sequential(nn.Conv3d(2, 4, 3, padding=1), nn.AvgPool3d(2)),
], ids=["functional", "module"])
def test_avg_pool3d_without_example_inputs_is_an_fp32_island(make, dtype):
    torch.manual_seed(0)
    model = make().eval()
    gm = amprewrite.transform(model, dtype=dtype, verify=False)  # symbolic trace: no shapes
    (pool,) = rows(gm, "avg_pool")
    assert pool.precision == "fp32"
    assert f"fp32 island: no {name(dtype)} kernel on cpu (probed:" in pool.reason
    assert [d.precision for d in rows(gm, "conv")] == ["low"]  # conv3d has a low kernel
    x = torch.randn(2, 2, 6, 6, 6)
    with torch.no_grad():
        out, ref = gm(x), model(x)  # torch 2.13: "avg_pool3d_out_frame" not implemented
    assert out.dtype == torch.float32
    assert rel_err(out, ref) < TOL[dtype]


# --- real low kernels stay low -----------------------------------------------------------------


class Net(nn.Module):
    """Shapes the probe must fit: a 7x7 conv without padding on 1 channel, a depthwise conv,
    a 784-feature linear after a view whose size the graph computes, an embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, 16, 7)
        self.depthwise = nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.fc = nn.Linear(16 * 7 * 7, 8)
        self.embed = nn.Embedding(10, 8)
        self.out = nn.Linear(8, 3)

    def forward(self, x, ids):
        h = F.relu(self.depthwise(F.relu(self.stem(x))))
        h = F.max_pool2d(h, 2)
        h = h.view(x.size(0), -1)
        h = self.fc(h) + self.embed(ids).mean(1)
        return self.out(F.gelu(h))


@pytest.mark.parametrize("dtype", DTYPES, ids=name)
def test_ops_with_low_kernels_stay_low_without_example_inputs(dtype):
    torch.manual_seed(0)
    model = Net().eval()
    gm = amprewrite.transform(model, dtype=dtype, verify=False)
    assert [d.precision for d in rows(gm, "conv")] == ["low", "low"]
    assert [d.precision for d in rows(gm, "linear")] == ["low", "low"]
    # Every probed op was confirmed: the view sized by x.size(0) and the embedding included.
    report = amprewrite.report(gm)
    assert not [d for d in report.decisions if kernels.NOT_CONFIRMED in d.reason]
    assert not [n for n in report.notes if "not confirmed" in n]
    x, ids = torch.randn(2, 1, 20, 20), torch.randint(0, 10, (2, 5))
    with torch.no_grad():
        assert rel_err(gm(x, ids), model(x, ids)) < TOL[dtype]


# --- a kernel the probe says is missing -------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=name)
def test_probe_saying_no_kernel_makes_an_fp32_island(dtype, monkeypatch):
    """A fake "no": the probe reports gelu's low kernel missing; every other op is probed."""
    real = kernels._probe

    def no_gelu(fn, template, low, device, random):
        if fn is F.gelu:
            return f"no {name(low)} kernel on {device} (probed: fake)"
        return real(fn, template, low, device, random)

    monkeypatch.setattr(kernels, "_probe", no_gelu)
    monkeypatch.setattr(kernels, "_CACHE", kernels._Verdicts())  # no answer from an earlier test
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)).eval()
    gm = amprewrite.transform(model, dtype=dtype, verify=False)
    (gelu,) = rows(gm, "activation")
    assert gelu.precision == "fp32" and gelu.dtype == "torch.float32"
    assert gelu.reason == f"fp32 island: no {name(dtype)} kernel on cpu (probed: fake)"
    assert [d.precision for d in rows(gm, "linear")] == ["low", "low"]
    x = torch.randn(4, 8)
    with torch.no_grad():
        assert rel_err(gm(x), model(x)) < TOL[dtype]


# --- a kernel no probe can confirm ------------------------------------------------------------


def picky(x: torch.Tensor) -> torch.Tensor:
    """Runs only on the shape the model gives it: no guessed probe input can call it."""
    if tuple(x.shape) != (3, 5, 7):
        raise ValueError(f"picky: shape {tuple(x.shape)}")
    return x * 2


fx.wrap("picky")  # a leaf of the symbolic trace, like a C++ op


@pytest.fixture
def picky_family():
    fam = ops.Family("picky_test_op", Precision.PROMOTE, (picky,))
    with ops.override_families(fam):
        yield fam


class Picky(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(7, 7)

    def forward(self, x):
        return picky(self.fc(x))


@pytest.mark.parametrize("dtype", DTYPES, ids=name)
def test_unconfirmed_kernel_runs_fp32_and_the_report_says_how_to_override(picky_family, dtype):
    torch.manual_seed(0)
    model, x = Picky().eval(), torch.randn(3, 5, 7)
    gm = amprewrite.transform(model, dtype=dtype, verify=False)
    (row,) = rows(gm, "picky_test_op")
    assert row.precision == "fp32" and row.dtype == "torch.float32"
    assert row.reason.startswith(f"fp32 island: {kernels.NOT_CONFIRMED}: ")
    assert "ran even in float32" in row.reason and "picky: shape" in row.reason
    (note,) = [n for n in amprewrite.report(gm).notes if "not confirmed" in n]
    assert "'tests.precision.test_kernels.picky' (1 node)" in note
    assert f"{name(dtype)} kernel on cpu" in note
    assert f"allow_low=['node:{row.node}'] to override" in note
    with torch.no_grad():
        assert rel_err(gm(x), model(x)) < TOL[dtype]

    # The override the note names: the user vouches for the kernel, the node runs in its
    # input's precision (the linear's low output) and nothing is noted.
    vouched = amprewrite.transform(model, dtype=dtype, verify=False,
                                   allow_low=[f"node:{row.node}"])
    (row,) = rows(vouched, "picky_test_op")
    assert row.dtype == str(dtype)
    assert not [n for n in amprewrite.report(vouched).notes if "not confirmed" in n]



@pytest.mark.parametrize("dtype", DTYPES, ids=name)
def test_not_confirmed_is_cached_for_the_shapes_it_was_found_with_only(dtype, monkeypatch):
    """A node the probe cannot run must not hide a node of the same op and argument structure
    that it can: "not confirmed" is cached per shape, a definitive answer per op."""
    monkeypatch.setattr(kernels, "_CACHE", kernels._Verdicts())
    g = fx.Graph()
    nodes = []
    for shape in [(4, 5, 7), (3, 5, 7), (3, 5, 7)]:
        x = g.placeholder(f"x{len(nodes)}")
        x.meta[M.ORIG] = M.ValueInfo("tensor", torch.float32, 140, shape=shape)
        nodes.append(g.call_function(picky, (x,)))
    cpu = torch.device("cpu")
    wrong_shape = kernels.low_kernel_problem(nodes[0], dtype, cpu)
    assert wrong_shape is not None and wrong_shape.startswith(kernels.NOT_CONFIRMED)
    assert "picky: shape (4, 5, 7)" in wrong_shape  # the real shape, then shrunk ones, fail
    assert kernels.low_kernel_problem(nodes[1], dtype, cpu) is None  # probed, not cached "no"
    calls = []
    monkeypatch.setattr(kernels, "_probe", lambda *a: calls.append(a))
    assert kernels.low_kernel_problem(nodes[2], dtype, cpu) is None and not calls  # cached


def test_a_verdict_belongs_to_its_function_not_to_a_reused_id():
    """Functions made one after the other reuse a freed one's id: each must get its own probe,
    not a freed function's cached verdict (the cache was keyed by id(target))."""
    import gc

    from torch import fx

    from amprewrite.precision.kernels import low_kernel_problem

    def kernel(low_ok: bool):
        def f(x):
            if x.dtype != torch.float32 and not low_ok:
                raise RuntimeError("no low kernel")
            return x * 2
        return f

    def verdict(fn):
        g = fx.Graph()
        return low_kernel_problem(g.call_function(fn, (g.placeholder("x"),)), torch.bfloat16,
                                  torch.device("cpu"))

    # Keyed by id, the second function got the first one's "works" (checked on the old code:
    # the id was reused on the first round).
    for _ in range(4):
        fn = kernel(True)
        assert verdict(fn) is None
        del fn
        gc.collect()
        assert verdict(kernel(False)) is not None  # its own probe: no low kernel


def test_the_kernel_cache_holds_functions_weakly(monkeypatch):
    """A probed Python function's verdicts leave the cache with the function: the cache keeps
    neither it alive nor a table that grows with every function a process probes."""
    import gc
    import weakref

    from torch import fx

    from amprewrite.precision.kernels import low_kernel_problem

    def make():
        def f(x):
            return x * 2
        return f

    monkeypatch.setattr(kernels, "_CACHE", kernels._Verdicts())
    gc.collect()
    before = len(kernels._CACHE)
    fns = [make() for _ in range(5)]
    for fn in fns:
        g = fx.Graph()
        node = g.call_function(fn, (g.placeholder("x"),))
        assert low_kernel_problem(node, torch.bfloat16, torch.device("cpu")) is None
        del g, node
    assert len(kernels._CACHE) == before + 5
    refs = [weakref.ref(fn) for fn in fns]
    del fns, fn
    gc.collect()
    assert all(r() is None for r in refs)  # the cache did not keep them alive
    assert len(kernels._CACHE) == before


def test_a_probe_leaves_the_callers_random_generators_as_they_were():
    """The probe seeds its own draws and then gives the caller's generators back: the CPU's,
    and CUDA's, whether CUDA runs (its state) or has not started yet (the seed a caller queued
    with torch.cuda.manual_seed_all, which torch.manual_seed(0) inside the probe replaced:
    checked on the old code)."""
    from amprewrite.precision.kernels import low_kernel_problem

    def f(x):
        return x * 2

    def cuda_state() -> list:
        if torch.cuda.is_initialized():  # its generators' states
            return [s.tolist() for s in torch.cuda.get_rng_state_all()]
        # The seeding queued for when CUDA starts: a new callback would carry another seed.
        return [c and c[0] for c in torch.cuda._lazy_seed_tracker.get_calls()]

    g = fx.Graph()
    node = g.call_function(f, (g.placeholder("x"),))
    torch.manual_seed(5)
    torch.cuda.manual_seed_all(1234)
    cpu, cuda = torch.get_rng_state(), cuda_state()
    assert low_kernel_problem(node, torch.bfloat16, torch.device("cpu")) is None  # it probed
    assert torch.equal(torch.get_rng_state(), cpu)
    assert cuda_state() == cuda
