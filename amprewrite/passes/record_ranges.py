"""record_ranges: the range of every value, read from the values themselves.

Parameters and buffers are read where they are (no input needed). With example inputs (and
calibration batches, ``transform(calibration=...)``), the graph, still the fp32 model's
computation, runs once per batch and every float tensor's range is recorded
(:func:`record_ranges`: buffers restored, one random state). paint_precision
reads them (DESIGN.md, "Values are facts too"). Without inputs, activation ranges are unknown:
the report says so.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable

import torch
from torch import fx

from .. import meta as M
from ..capture import split_inputs
from ..errors import ModelError
from ..modules import get_attr
from ..ranges import ValueRange, merge, tensor_range
from ..report import REPORT_KEY
from ..verify import replayed
from .base import Kind, Pass

__all__ = ["RecordRanges", "record_ranges"]


# Values an activation's fp16-subnormal share is estimated from (a report figure; the plan reads
# the shares of parameters, measured whole).
_SAMPLE = 65536


class _RangeRecorder(fx.Interpreter):
    """Runs a graph and keeps, per node, the range of each float tensor it produces."""

    def __init__(self, gm: fx.GraphModule, low: torch.dtype, ranges: dict[fx.Node, ValueRange]):
        super().__init__(gm)
        self.low, self.ranges = low, ranges

    def run_node(self, n: fx.Node) -> object:
        out = super().run_node(n)
        if (n.op != "get_attr" and isinstance(out, torch.Tensor) and out.is_floating_point()
                and not out.is_meta):
            self.ranges[n] = merge(self.ranges.get(n),
                                   tensor_range(out, self.low, 1, sample=_SAMPLE))
        return out


def record_ranges(gm: fx.GraphModule, batches: Iterable[object], low: torch.dtype
                  ) -> dict[fx.Node, ValueRange]:
    """Run ``gm`` (an fp32 graph) on each batch of inputs and return every float tensor node's
    range over all of them. Each run starts from one random state and leaves the buffers as it
    found them (train-mode BatchNorm statistics, the caller's model), like verification's."""
    ranges: dict[fx.Node, ValueRange] = {}
    signature = inspect.signature(gm.forward)

    def run(inputs: object) -> None:
        args, kwargs = split_inputs(inputs)
        _RangeRecorder(gm, low, ranges).run(*signature.bind(*args, **kwargs).args)

    with replayed(gm) as replay:
        for k, inputs in enumerate(batches):
            if k == 0:  # the example inputs the graph was captured on: a failure is a bug
                replay(run, inputs)
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


class RecordRanges(Pass):
    """Set ``meta[RANGE]`` of parameters, buffers and (with example inputs) every float value."""

    name, kind = "record_ranges", Kind.ANALYSIS
    requires = (M.ORIG,)
    writes = (M.RANGE,)
    example_inputs: object = None  # set by passes.pipeline(...); None: parameters only

    @property
    def needs_code(self) -> bool:
        """It runs the graph when it has inputs: the pipeline recompiles before it."""
        return bool(self._batches())

    def _batches(self) -> list[object]:
        if self.example_inputs is None:
            return []
        return [self.example_inputs, *(self.policy.calibration if self.policy else ())]

    def run(self, gm: fx.GraphModule) -> bool:
        low = self.policy.dtype if self.policy is not None else torch.bfloat16
        seen: dict[int, object] = {}  # a tensor read by several get_attr nodes: measured once
        for node in gm.graph.nodes:
            if node.op != "get_attr":
                continue
            value = get_attr(gm, str(node.target), None)
            if isinstance(value, torch.Tensor) and value.is_floating_point() and not value.is_meta:
                if id(value) not in seen:
                    seen[id(value)] = tensor_range(value, low)
                node.meta[M.RANGE] = seen[id(value)]
        batches = self._batches()
        if not batches:
            return False
        ranges = record_ranges(gm, batches, low)
        for node, r in ranges.items():
            node.meta[M.RANGE] = r
        rep = gm.meta.get(REPORT_KEY)
        if rep is not None and len(batches) > 1:
            rep.notes.append(f"ranges: recorded on the example inputs and {len(batches) - 1} "
                             f"calibration batch{'es' * (len(batches) > 2)}")
        return False
