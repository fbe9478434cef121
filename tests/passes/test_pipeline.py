"""The pass protocol: declarations checked, names current, one recompile, errors with context."""

import pytest
import torch
from torch import fx, nn

import amprewrite
from amprewrite.errors import PassError
from amprewrite.graph import meta as M
from amprewrite.passes import (
    PASSES,
    Kind,
    Pass,
    check_order,
    pipeline,
    rewrite_passes,
    run_pipeline,
)
from amprewrite.precision.policy import Policy
from amprewrite.precision.report import REPORT_KEY, Report


def _gm():
    gm = fx.symbolic_trace(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    gm.meta[REPORT_KEY] = Report(dtype="bfloat16", capture="test")
    return gm


def test_every_pass_declares_itself_and_the_order_holds():
    names = [cls.name for cls in PASSES]
    assert len(set(names)) == len(names)
    for cls in PASSES:
        assert isinstance(cls.kind, Kind)
        assert all(k.startswith("amp_") for k in (*cls.requires, *cls.writes)), cls
    check_order(pipeline(Policy()))  # raises if a pass reads what no earlier pass writes
    assert rewrite_passes() == {"transform_bodies", "vectorize_loops", "replace_upsample",
                                "simplify_attention_masks",
                                "rescale_matmuls", "insert_casts", "store_params",
                                "float8_linears", "recompute_islands", "guard_autocast"}
    # Every stage is a named step of the one list: region bodies after the ranges are recorded
    # (the bodies' values are recorded in fp32) and before painting, the cast plan before the
    # casts that realise it.
    assert names[0] == "normalize_modules" and names[-1] == "verify"
    assert names[-2] == "guard_autocast"  # after every rewrite: its calls stay first and last
    assert (names.index("record_ranges") < names.index("transform_bodies")
            < names.index("paint_precision"))
    assert names.index("plan_casts") + 1 == names.index("insert_casts")


def test_a_pass_before_what_it_requires_is_refused():
    passes = pipeline(Policy())
    paint = next(i for i, p in enumerate(passes) if p.name == "paint_precision")
    moved = [passes[paint + 1], *passes[:paint], *passes[paint + 1 + 1:]]  # plan_casts first
    with pytest.raises(PassError, match=r"'plan_casts' requires node\.meta keys"):
        check_order(moved)


class Sneaky(Pass):
    """Writes a key it does not declare."""

    name, kind = "sneaky", Kind.ANALYSIS

    def run(self, gm):
        for n in gm.graph.nodes:
            n.meta[M.CLASS] = "whatever"
        return False


def test_debug_mode_catches_undeclared_writes():
    run_pipeline(_gm(), [Sneaky(None)], debug=False)  # not checked outside debug mode (a walk)
    with pytest.raises(PassError, match=r"'sneaky' wrote node\.meta keys"):
        run_pipeline(_gm(), [Sneaky(None)], debug=True)


class Count(Pass):
    name, kind = "count", Kind.ANALYSIS

    def run(self, gm):
        return False


def test_unmodified_graphs_are_not_recompiled_and_modified_ones_once():
    gm = _gm()
    timings = {}
    run_pipeline(gm, [Count(None), Count(None)], timings)
    assert "recompile" not in timings
    gm = _gm()
    timings = {}
    run_pipeline(gm, pipeline(Policy()), timings)
    assert "recompile" in timings  # the one lint + recompile, after the last pass
    assert "to(torch.bfloat16)" in gm.code


class Boom(Pass):
    name, kind = "boom", Kind.REWRITE

    def run(self, gm):
        for n in M.each_node(gm.graph):
            if n.op == "call_module":
                raise RuntimeError("kaput")
        return False


def test_failures_name_the_pass_and_the_node():
    with pytest.raises(PassError, match=r"pass 'boom' failed on node .*call_module.*kaput"):
        run_pipeline(_gm(), [Boom(None)])


def test_rewrites_are_recorded_under_the_running_pass():
    model = nn.Sequential(nn.Conv2d(3, 3, 1), nn.Upsample(scale_factor=2), nn.Conv2d(3, 3, 1))
    gm = amprewrite.transform(model, torch.bfloat16, upsample="always",
                              example_inputs=(torch.randn(1, 3, 4, 4),))
    by_pass = {r.pass_name for r in amprewrite.report(gm).rewrites}
    assert {"replace_upsample", "insert_casts"} <= by_pass and "" not in by_pass


def test_arguments_tell_apart_overloads_that_differ_by_a_str_parameter():
    # torch.conv2d has two schemas, padding a list or a str ("same"): torch's normalisation
    # calls (x, w, b, stride, (1, 1), ...) ambiguous; the value given picks one.
    from amprewrite.passes.base import arguments

    graph = fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    listed = graph.call_function(torch.conv2d, (x, w, None, (1, 1), (1, 1), (1, 1), 1))
    named = graph.call_function(torch.conv2d, (x, w, None, (1, 1), "same"))
    graph.output((listed, named))
    gm = fx.GraphModule(nn.Module(), graph)
    assert arguments(gm, listed) == {"input": x, "weight": w, "bias": None, "stride": (1, 1),
                                     "padding": (1, 1), "dilation": (1, 1), "groups": 1}
    assert arguments(gm, named)["padding"] == "same"
    assert arguments(gm, named)["dilation"] == [1, 1]  # the schema's default
