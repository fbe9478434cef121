"""Numerics tools: per-node error against fp32, the first non-finite node, and a guided search
for the fp32 nodes that make a model meet a tolerance.

>>> import torch, amprewrite
>>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Softmax(-1))
>>> result = amprewrite.check_numerics(model, (torch.randn(2, 8),), dtype=torch.bfloat16)
>>> result.finite and result.output_error < 1e-2
True
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from . import meta as M
from .api import transform
from .capture import _buffer_clone_copy, capture, split_inputs
from .errors import VerificationError
from .ops import Precision

__all__ = ["CheckResult", "NodeError", "check_numerics", "find_fp32_nodes", "rel_err",
           "verify_graph"]


@dataclass(frozen=True)
class NodeError:
    """How far one node's output is from the fp32 model's value of the same node."""

    node: str
    module_path: str
    family: str | None
    precision: str
    rel_err: float | None  # None: no fp32 counterpart (a cast amprewrite inserted)
    finite: bool
    source: str | None


@dataclass
class CheckResult:
    """What :func:`check_numerics` found."""

    output_error: float
    finite: bool
    nodes: list[NodeError] = field(default_factory=list)  # worst first
    first_nonfinite: NodeError | None = None

    def passed(self, rtol: float) -> bool:
        return self.finite and self.output_error <= rtol


class _Recorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.values: dict[str, torch.Tensor] = {}

    def run_node(self, n: fx.Node):
        out = super().run_node(n)
        if isinstance(out, torch.Tensor) and out.is_floating_point():
            self.values[n.name] = out.detach()
        return out


def _record(gm: fx.GraphModule, inputs: object) -> dict[str, torch.Tensor]:
    args, kwargs = split_inputs(inputs)
    rec = _Recorder(gm)
    with torch.no_grad():  # keyword inputs bound to the graph's placeholders by name
        rec.run(*inspect.signature(gm.forward).bind(*args, **kwargs).args)
    return rec.values


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L2 error ``|out - ref| / |ref|`` in float64; ``inf`` when ``out`` is not finite.

    >>> rel_err(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0]))
    0.0
    >>> rel_err(torch.tensor([float("nan")]), torch.tensor([1.0]))
    inf
    """
    out, ref = out.detach().double(), ref.detach().double()
    if not torch.isfinite(out).all():
        return math.inf
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def float_leaves(value: object) -> list[torch.Tensor]:
    """The floating-point tensors in a model output (tensors, tuples, dicts, ModelOutput)."""
    if hasattr(value, "to_tuple"):
        value = value.to_tuple()
    return [t for t in pytree.tree_leaves(value)
            if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _call(fn, inputs: object) -> object:
    args, kwargs = split_inputs(inputs)
    return fn(*args, **kwargs)


def check_numerics(model: nn.Module, example_inputs: object, dtype=torch.bfloat16,
                   gm: fx.GraphModule | None = None, **options) -> CheckResult:
    """Run ``model`` in fp32 and transformed on the same inputs; compare outputs and nodes.

    ``options`` are :func:`amprewrite.transform`'s keywords. Nodes are matched by name between
    the fp32 captured graph and the transformed one (amprewrite keeps the names it captured).
    """
    inputs = example_inputs
    reference = _record(capture(model, inputs).gm, inputs)
    if gm is None:
        options.setdefault("verify", False)  # measuring the error is this function's job
        gm = transform(model, dtype=dtype, example_inputs=inputs, **options)
    values = _record(gm, inputs)
    with torch.no_grad():
        outs, refs = float_leaves(_call(gm, inputs)), float_leaves(_call(model, inputs))
    finite = all(bool(torch.isfinite(o).all()) for o in outs)
    output_error = max((rel_err(o, r) for o, r in zip(outs, refs)), default=0.0)
    rows: list[NodeError] = []
    first_bad = None
    for node in gm.graph.nodes:
        if node.name not in values:
            continue
        value, ref = values[node.name], reference.get(node.name)
        cls = node.meta.get(M.CLASS)
        kind = "cast" if M.CAST in node.meta else (cls.value if cls else node.op)
        is_finite = bool(torch.isfinite(value).all())
        comparable = ref is not None and ref.shape == value.shape and M.CAST not in node.meta
        row = NodeError(node.name, node.meta.get(M.MODULE_PATH, ""), node.meta.get(M.FAMILY),
                        kind, rel_err(value, ref) if comparable else None, is_finite,
                        M.source_line(node))
        rows.append(row)
        ref_finite = ref is None or bool(torch.isfinite(ref).all())
        if first_bad is None and not is_finite and ref_finite:
            first_bad = row
    rows.sort(key=lambda r: -(r.rel_err if r.rel_err is not None else -1.0))
    return CheckResult(output_error, finite, rows, first_bad)


def _culprit(gm: fx.GraphModule, result: CheckResult, kept: set[str]) -> str | None:
    """The node whose move to fp32 most likely helps: the first non-finite one, else the
    node that adds the most error on top of its inputs'."""
    nodes = {n.name: n for n in gm.graph.nodes}

    def movable(n: fx.Node) -> bool:
        return (n.meta.get(M.CLASS) not in (None, Precision.FP32, Precision.NONFLOAT)
                and M.CAST not in n.meta and n.name not in kept)

    if result.first_nonfinite is not None:
        start = nodes[result.first_nonfinite.node]
        # A cast that overflows: the consumers that wanted the low value must go fp32.
        todo = list(start.users) if M.CAST in start.meta else [start]
        for n in todo:
            if movable(n):
                return n.name
    errors = {r.node: r.rel_err for r in result.nodes if r.rel_err is not None}
    best, best_gain = None, 0.0
    for r in result.nodes:
        n = nodes.get(r.node)
        if n is None or r.rel_err is None or not movable(n):
            continue
        base = max((errors.get(_through_casts(a).name, 0.0) for a in n.all_input_nodes),
                   default=0.0)
        gain = r.rel_err - base
        if gain > best_gain:
            best, best_gain = n.name, gain
    return best


def _through_casts(n: fx.Node) -> fx.Node:
    while M.CAST in n.meta:
        n = n.args[0]
    return n


def find_fp32_nodes(model: nn.Module, example_inputs: object, rtol: float = 1e-2,
                    dtype=torch.bfloat16, max_nodes: int = 16, **options) -> list[str]:
    """A small ``keep_fp32`` list of graph nodes with which ``model`` meets ``rtol``.

    Guided by the per-node errors of :func:`check_numerics`: each round keeps the first
    non-finite node (or the node that adds the most error) in fp32 and checks again. Returns
    selectors such as ``["node:linear"]`` to pass as ``keep_fp32=``; raises ``RuntimeError`` when
    ``max_nodes`` nodes are not enough.

    >>> import torch, amprewrite
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Softmax(-1))
    >>> amprewrite.find_fp32_nodes(model, (torch.randn(2, 4),), rtol=0.5)
    []
    """
    inputs = example_inputs
    keep = [s for s in options.pop("keep_fp32", ())]
    options.setdefault("verify", False)  # the search starts from graphs that fail
    for _ in range(max_nodes + 1):
        gm = transform(model, dtype=dtype, example_inputs=inputs, keep_fp32=keep, **options)
        result = check_numerics(model, inputs, dtype, gm=gm)
        if result.passed(rtol):
            return keep
        name = _culprit(gm, result, {k[5:] for k in keep if isinstance(k, str)})
        if name is None:
            break
        keep.append(f"node:{name}")
    raise RuntimeError(
        f"find_fp32_nodes: {len(keep)} fp32 nodes did not bring the output error under "
        f"rtol={rtol} (last: {result.output_error:.3g}, finite={result.finite}). Raise rtol or "
        "max_nodes, or keep whole modules in fp32 with keep_fp32=[<module path>]."
    )


# The built-in check's rule: the graph fails when its error exceeds autocast's by this factor
# plus this many unit roundoffs of the dtype (docs/guide.md, "The built-in check").
VERIFY_FACTOR = 4.0
VERIFY_ROUNDOFFS = 16
_UNIT = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def verify_bound(autocast_error: float, dtype: torch.dtype) -> float:
    """The largest output error :func:`verify_graph` accepts, given autocast's."""
    floor = VERIFY_ROUNDOFFS * _UNIT[dtype]
    if not math.isfinite(autocast_error):
        return floor
    return VERIFY_FACTOR * autocast_error + floor


def verify_graph(model: nn.Module, gm: fx.GraphModule, example_inputs: object,
                 dtype: torch.dtype) -> dict[str, float]:
    """Run the fp32 model, autocast and ``gm`` once on ``example_inputs``; raise
    :class:`~amprewrite.errors.VerificationError` when ``gm`` is far from fp32 (see
    :func:`verify_bound`) or non-finite where fp32 and autocast are finite. Returns the errors.

    The model runs on a structural copy with cloned buffers, so the caller's state is kept.
    """
    device = next((t.device.type for t in [*model.parameters(), *model.buffers()]), "cpu")
    copy = _buffer_clone_copy(model)
    with torch.no_grad():
        refs = float_leaves(_call(copy, example_inputs))
        try:
            with torch.autocast(device, dtype=dtype):
                autos: list[torch.Tensor] | None = float_leaves(_call(copy, example_inputs))
        except Exception:  # autocast itself fails (an op without a low kernel): no reference
            autos = None
        outs = float_leaves(_call(gm, example_inputs))
    ours = max((rel_err(o, r) for o, r in zip(outs, refs)), default=0.0)
    theirs = (math.inf if autos is None
              else max((rel_err(a, r) for a, r in zip(autos, refs)), default=0.0))
    refs_finite = all(bool(torch.isfinite(r).all()) for r in refs)
    bound = verify_bound(theirs, dtype)
    if not refs_finite or ours <= bound:
        return {"error": ours, "autocast_error": theirs}
    result = check_numerics(model, example_inputs, dtype, gm=gm)
    culprit = result.first_nonfinite
    if culprit is None:
        nodes = {r.node: r for r in result.nodes}
        culprit = next((nodes[n.name] for n in gm.graph.nodes if n.name in nodes
                        and (nodes[n.name].rel_err or 0.0) > bound), None)
    where = ""
    if culprit is not None:
        at = f" ({culprit.module_path})" if culprit.module_path else ""
        src = f" at {culprit.source}" if culprit.source else ""
        err = "non-finite" if not culprit.finite else f"error {culprit.rel_err:.3g}"
        where = (f" The first node that departs from fp32 is '{culprit.node}'{at}{src}, "
                 f"a {culprit.precision} node ({err}).")
    keep = f"keep_fp32=['node:{culprit.node}']" if culprit is not None else "keep_fp32=[...]"
    raise VerificationError(
        f"the transformed graph's output error against fp32 is {ours:.3g} on the example "
        f"inputs, where torch.autocast's is {theirs:.3g} (accepted: up to {bound:.3g}).{where} "
        f"Keep that part in fp32 ({keep}, or amprewrite.find_fp32_nodes finds a list), and "
        "please report the model if the node is not one you chose to run low; "
        "verify=False skips this check."
    )
