"""Shared test helpers: runtime dtype recording, model snapshots, error metrics."""

from __future__ import annotations

import contextlib

import torch
from torch import fx, nn

import amprewrite
from amprewrite import meta as M
from amprewrite.numerics import rel_err  # noqa: F401  (re-exported for the tests)
from amprewrite.ops import Precision

LOW_DTYPES = [torch.bfloat16, torch.float16]


class DtypeRecorder(fx.Interpreter):
    """Runs a GraphModule and records the dtypes each node actually received and produced."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.seen: dict[str, tuple[list[torch.dtype], object]] = {}

    def run_node(self, n: fx.Node):
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        ins: list[torch.dtype] = []
        fx.node.map_aggregate((args, kwargs), lambda a: ins.append(a.dtype)
                              if isinstance(a, torch.Tensor) and a.is_floating_point() else None)
        out = super().run_node(n)
        self.seen[n.name] = (ins, out.dtype if isinstance(out, torch.Tensor) else None)
        return out


def runtime_dtypes(gm: fx.GraphModule, *inputs) -> dict[str, tuple[list[torch.dtype], object]]:
    rec = DtypeRecorder(gm)
    with torch.no_grad():
        rec.run(*inputs)
    return rec.seen


def assert_classes_respected(gm: fx.GraphModule, *inputs, low: torch.dtype) -> None:
    """Every LOW node got only ``low`` float inputs; every FP32 node only fp32 ones."""
    seen = runtime_dtypes(gm, *inputs)
    for node in gm.graph.nodes:
        cls = node.meta.get(M.CLASS)
        if M.CAST in node.meta or node.name not in seen:
            continue
        ins, _ = seen[node.name]
        if cls == Precision.LOW:
            assert ins and all(d == low for d in ins), (node.format_node(), ins)
        elif cls == Precision.FP32:
            assert all(d == torch.float32 for d in ins), (node.format_node(), ins)


def casts(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if M.CAST in n.meta]


def by_family(gm: fx.GraphModule, family: str) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.meta.get(M.FAMILY) == family]


def snapshot(model: nn.Module) -> dict[str, object]:
    state = {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()}
    modes = {name: m.training for name, m in model.named_modules()}
    grads = {k: p.requires_grad for k, p in model.named_parameters()}
    ids = {k: id(v) for k, v in model.state_dict(keep_vars=True).items()}
    return {"state": state, "modes": modes, "grads": grads, "ids": ids,
            "modules": [id(m) for m in model.modules()]}


def assert_same_snapshot(before: dict, model: nn.Module) -> None:
    after = snapshot(model)
    assert before["state"].keys() == after["state"].keys()
    for k, v in before["state"].items():
        w = after["state"][k]
        assert v.dtype == w.dtype and torch.equal(v, w), k
    assert before["modes"] == after["modes"]
    assert before["grads"] == after["grads"]
    assert before["ids"] == after["ids"]
    assert before["modules"] == after["modules"]


@contextlib.contextmanager
def unchanged(model: nn.Module):
    """Assert the block leaves ``model`` bitwise unchanged (tensors, modes, identities)."""
    before = snapshot(model)
    yield
    assert_same_snapshot(before, model)


def transform(*args, **kwargs):
    return amprewrite.transform(*args, **kwargs)


def transform_via(capture: str, model: nn.Module, *inputs, **kwargs) -> fx.GraphModule:
    """Transform with symbolic tracing (``capture="symbolic"``) or dynamo (``"dynamo"``)."""
    example = inputs if capture == "dynamo" else None
    return amprewrite.transform(model, example_inputs=example, **kwargs)


def graph_signature(gm: fx.GraphModule) -> list[tuple]:
    """The graph's structure without node names: (op, target, args with nodes as positions)."""
    index = {n: i for i, n in enumerate(gm.graph.nodes)}

    def norm(a):
        return fx.node.map_arg(a, lambda n: ("node", index[n]))

    return [(n.op, str(n.target) if n.op in ("placeholder", "get_attr", "call_module",
                                             "call_method") else n.target,
             norm(n.args), norm(dict(n.kwargs))) for n in gm.graph.nodes]


def prepared(model, last: str, example_inputs=None, **options):
    """``model`` captured and run through the passes before the one named ``last``; returns
    (graph, that pass bound to the policy), for a test to run it with ``run_pass`` and inspect."""
    from amprewrite.capture import capture
    from amprewrite.passes import pipeline, run_until
    from amprewrite.policy import Policy
    from amprewrite.report import REPORT_KEY, Report

    policy = Policy(**options)
    gm = capture(model, example_inputs).gm
    gm.meta[REPORT_KEY] = Report(dtype=str(policy.dtype), capture="test")
    gm = run_until(gm, policy, last, include=False)
    (p,) = [p for p in pipeline(policy) if p.name == last]
    return gm, p


def rewrites(gm, pass_name: str) -> list:
    """The report's rewrites made by one pass."""
    return [r for r in gm.meta["amprewrite_report"].rewrites if r.pass_name == pass_name]
