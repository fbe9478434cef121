"""record_ranges: the range of every value, read from the values themselves.

Parameters and buffers are read where they are (no input needed). With example inputs (and
calibration batches, ``transform(calibration=...)``), the graph, still the fp32 model's
computation, runs once per batch and every float tensor's range is recorded
(:func:`record_ranges`: buffers restored, one random state). paint_precision
reads them (DESIGN.md, "Values are facts too"). Without inputs, activation ranges are unknown:
the report says so. With a saved plan (``transform(plan=...)``) the ranges it recorded are
taken instead, the parameters' too, and the graph runs only where the plan does not know some
of its values (a changed model).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping

import torch
from torch import fx
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..capture.verify import replayed
from ..errors import ModelError
from ..graph import meta as M
from ..graph.modules import get_attr
from ..graph.shapes import split_inputs
from ..precision.ranges import ValueRange, merge, tensor_range, widest
from ..precision.report import REPORT_KEY
from ..precision.saved_plan import node_keys, saved_range
from .base import Kind, Pass

__all__ = ["RecordRanges", "by_name", "qualified_names", "record_ranges"]


# Values an activation's fp16-subnormal share is estimated from (a report figure; the plan reads
# the shares of parameters, measured whole).
_SAMPLE = 65536


class _RangeRecorder(fx.Interpreter):
    """Runs a graph and keeps, per node, the range of each float tensor it produces; the body
    of a checkpointed region (transform_bodies.BODY_OPS) is run node by node too, so its values
    have ranges (its forward is the region's: checkpointing only changes what backward keeps)."""

    def __init__(self, gm: fx.GraphModule, low: torch.dtype, ranges: dict[fx.Node, ValueRange],
                 bodies: dict[str, tuple] | None = None,
                 params: Mapping[fx.Node, object] | None = None):
        super().__init__(gm)
        self.low, self.ranges = low, ranges
        # bodies: each region body's inputs on its first call, by its attribute (the parameters
        # as given, ``params``: the placeholders a Parameter was handed to), else not kept.
        self.bodies, self.params = bodies, params or {}

    def run_node(self, n: fx.Node) -> object:
        body = _body(self.module, n)
        if body is not None:
            args, _ = self.fetch_args_kwargs_from_env(n)
            if self.bodies is not None and str(n.args[0].target) not in self.bodies:
                self.bodies[str(n.args[0].target)] = tuple(
                    self.params.get(a, v) if isinstance(a, fx.Node) else v
                    for a, v in zip(n.args[1:], args[1:]))
            out = _RangeRecorder(body, self.low, self.ranges).run(*args[1:])
            return tuple(out) if isinstance(out, list) else out
        out = super().run_node(n)
        if (n.op != "get_attr" and isinstance(out, torch.Tensor) and out.is_floating_point()
                and not out.is_meta):
            # A DTensor (tensor parallel): this rank's shard; ranges are widened across ranks.
            local = out.to_local() if hasattr(out, "to_local") else out
            self.ranges[n] = merge(self.ranges.get(n),
                                   tensor_range(local, self.low, 1, sample=_SAMPLE))
        return out


def record_ranges(gm: fx.GraphModule, batches: Iterable[object], low: torch.dtype,
                  bodies: dict[str, tuple] | None = None) -> dict[fx.Node, ValueRange]:
    """Run ``gm`` (an fp32 graph) on each batch of inputs and return every float tensor node's
    range over all of them. Each run starts from one random state and leaves the buffers as it
    found them (train-mode BatchNorm statistics, the caller's model), like verification's.
    ``bodies``, if given, receives each region body's inputs on the first batch (the float8
    check of a checkpointed body runs on them)."""
    ranges: dict[fx.Node, ValueRange] = {}
    signature = inspect.signature(gm.forward)
    holders = list(gm.graph.find_nodes(op="placeholder"))

    def bind(inputs: object) -> tuple:
        args, kwargs = split_inputs(inputs)
        return signature.bind(*args, **kwargs).args

    def run(inputs: object, keep: dict[str, tuple] | None = None,
            params: dict[fx.Node, object] | None = None) -> None:
        _RangeRecorder(gm, low, ranges, keep, params).run(*(_fp32(a) for a in bind(inputs)))

    with replayed(gm) as replay:
        for k, inputs in enumerate(batches):
            if k == 0:  # the example inputs the graph was captured on: a failure is a bug
                # the Parameters as given (the replay runs on clones), for the bodies' inputs
                params = {n: a for n, a in zip(holders, bind(inputs))
                          if isinstance(a, torch.nn.Parameter)} if bodies is not None else None
                replay(lambda i, p=params: run(i, bodies, p), inputs)
                continue
            try:
                replay(run, inputs)
            except Exception as exc:
                first = str(exc).splitlines()[0] if str(exc) else ""
                raise ModelError(
                    f"amprewrite could not run the captured graph on calibration batch {k - 1} "
                    f"to record value ranges: {type(exc).__name__}: {first}. Calibration "
                    "batches must be inputs of the same form as example_inputs (a tuple of "
                    "positional inputs or a dict of keyword inputs), with the sizes the graph "
                    "serves (dimension 0 may differ where the batch is dynamic)."
                ) from exc
    return ranges


def _fp32(value: object) -> object:
    """A bf16/fp16 tensor (or DTensor) as fp32 (exact), else ``value``: the graph is the fp32
    model's, and FSDP2 with a low ``param_dtype`` hands the backend's graph low weights next to
    fp32 activations, a mix only the plan's casts make valid. Other tensor subclasses (torchao's
    float8 weights) have no fp32 form of their own and are passed as they are."""
    plain = not is_traceable_wrapper_subclass(value) or hasattr(value, "to_local")
    if (isinstance(value, torch.Tensor) and plain
            and value.dtype in (torch.float16, torch.bfloat16)):
        return value.float()
    return value


def _body(gm: fx.GraphModule, node: fx.Node) -> fx.GraphModule | None:
    """The subgraph ``node`` calls when it is a checkpointed (or ``wrap``) region, else None."""
    from .transform_bodies import BODY_OPS

    if (node.op != "call_function" or getattr(node.target, "__name__", "") not in BODY_OPS
            or not node.args or not isinstance(node.args[0], fx.Node)
            or node.args[0].op != "get_attr"):
        return None
    body = get_attr(gm, str(node.args[0].target), None)
    return body if isinstance(body, fx.GraphModule) else None


def qualified_names(gm: fx.GraphModule) -> dict[fx.Node, str]:
    """Each node of ``gm`` and of the region bodies it calls by a name unique among them:
    its own name, ``<body>.<name>`` inside a body (the key that survives a copy of the graph)."""
    names = {n: n.name for n in gm.graph.nodes}
    for node in gm.graph.nodes:
        body = _body(gm, node)
        if body is not None:
            prefix = str(node.args[0].target)
            names.update({n: f"{prefix}.{q}" for n, q in qualified_names(body).items()})
    return names


def by_name(ranges: Mapping[fx.Node, ValueRange], gm: fx.GraphModule) -> dict[str, ValueRange]:
    """``ranges`` of ``gm``'s nodes (and its bodies') by :func:`qualified_names`."""
    names = qualified_names(gm)
    return {names[node]: r for node, r in ranges.items() if node in names}


class RecordRanges(Pass):
    """Set ``meta[RANGE]`` of parameters, buffers and (with example inputs) every float value."""

    name, kind = "record_ranges", Kind.ANALYSIS
    requires = (M.ORIG,)
    writes = (M.RANGE,)
    example_inputs: object = None  # set by passes.pipeline(...); None: parameters only
    # Set by passes.pipeline(...): ranges by node name the plan must also hold for (other
    # blocks, steps), widened with the recorded ones; and a function that widens ranges by
    # name across ranks (amprewrite.compile.block_plans.across_ranks), or None.
    prior: Mapping[str, ValueRange] | None = None
    reduce: Callable[[dict[str, ValueRange]], dict[str, ValueRange]] | None = None

    @property
    def needs_code(self) -> bool:
        """It runs the graph when it has inputs: the pipeline recompiles before it."""
        return bool(self._batches())

    def _batches(self) -> list[object]:
        if self.example_inputs is None:
            return []
        return [self.example_inputs, *(self.policy.calibration if self.policy else ())]

    def _saved(self, gm: fx.GraphModule
               ) -> tuple[dict[fx.Node, ValueRange], bool, dict[fx.Node, ValueRange]] | None:
        """With a saved plan: the ranges it recorded of the values, by node, whether it knows
        every value the graph computes (then no input needs to run), and the ranges of the
        parameters it recorded; None without one."""
        plan = self.policy.plan if self.policy is not None else None
        if plan is None:
            return None
        keys = node_keys(gm)
        values = [n for n in gm.graph.nodes
                  if n.op in ("call_function", "call_method", "call_module")
                  and M.info(n).has_float()]
        found = plan.match(keys, values)
        ranges = {n: r for n, e in found.entries.items() if (r := saved_range(e)) is not None}
        params = {n: r for n, r in ranges.items() if n.op == "get_attr"}
        return {n: r for n, r in ranges.items() if n not in params}, not found.new, params

    def run(self, gm: fx.GraphModule) -> bool:
        low = self.policy.dtype if self.policy is not None else torch.bfloat16
        saved = self._saved(gm)
        known = saved[2] if saved is not None else {}
        seen: dict[int, object] = {}  # a tensor read by several get_attr nodes: measured once
        for node in gm.graph.nodes:
            if node.op != "get_attr":
                continue
            if node in known:  # a saved plan's range of the parameter: not read again
                node.meta[M.RANGE] = known[node]
                continue
            value = get_attr(gm, str(node.target), None)
            if isinstance(value, torch.Tensor) and value.is_floating_point() and not value.is_meta:
                if id(value) not in seen:
                    seen[id(value)] = tensor_range(value, low)
                node.meta[M.RANGE] = seen[id(value)]
        batches = self._batches()
        if saved is not None:
            ranges, complete, _ = saved
            if complete or not batches:  # the plan knows every value: nothing to run
                for node, r in ranges.items():
                    node.meta[M.RANGE] = r
                gm.meta[M.RANGES_KEY] = by_name(ranges, gm)
                return False
        if not batches:
            return False
        # The float8 check of a checkpointed body (transform_bodies) runs on its inputs.
        fp8 = self.policy is not None and self.policy.fp8 is not None
        bodies: dict[str, tuple] | None = {} if fp8 else None
        named = by_name(record_ranges(gm, batches, low, bodies), gm)
        if bodies:
            gm.meta[M.BODY_INPUTS_KEY] = bodies
        for name, r in (self.prior or {}).items():
            named[name] = widest(named.get(name), r)
        if self.reduce is not None:
            named = self.reduce(named)
        for node, name in qualified_names(gm).items():  # region bodies' nodes too
            if name in named:
                node.meta[M.RANGE] = named[name]
        if saved is not None:  # recorded for the nodes the plan does not know; its own for the rest
            for node, r in saved[0].items():
                node.meta[M.RANGE] = r
                named[node.name] = r
        gm.meta[M.RANGES_KEY] = named
        rep = gm.meta.get(REPORT_KEY)
        if rep is not None and len(batches) > 1:
            rep.notes.append(f"ranges: recorded on the example inputs and {len(batches) - 1} "
                             f"calibration batch{'es' * (len(batches) > 2)}")
        return False
