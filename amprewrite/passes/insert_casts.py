"""insert_casts: realise the cast plan (``plan_casts``'s ``meta[LABEL]``) with ``Tensor.to`` nodes.

Matches:   ``y = F.linear(x, w, b)`` with x, w, b fp32 and linear LOW
Rewrite to: ``x_bf16 = x.to(torch.bfloat16); w_bf16 = w.to(torch.bfloat16); ...;
           y = F.linear(x_bf16, w_bf16, b_bf16)``

One cast per (value, dtype), placed right after the value and shared by all its consumers.
Values whose dtype the trace could not know (graph inputs traced without example inputs) get a
guarded cast, :func:`amprewrite.runtime.cast_if_float`, that leaves integer and bool tensors
alone.
"""

from __future__ import annotations

import torch
from torch import fx

from .. import meta as M
from ..meta import HIGH, LOW, info
from ..ops import Mixed, Precision, conversion_target, fp32_helper_of, is_conversion
from ..plan import float_inputs, requirement
from ..report import record
from ..runtime import cast_if_float
from .base import Kind, Pass, new_node

__all__ = ["InsertCasts", "add_cast"]


class InsertCasts(Pass):
    """Realise the labels ``plan_casts`` chose with cast nodes."""

    name, kind = "insert_casts", Kind.REWRITE
    requires = (M.ORIG, M.CLASS, M.NATURAL, M.TIED, M.MIXED, M.LABEL)
    writes = (M.LABEL, M.CAST, M.CLASS, M.NATURAL, M.FAMILY, M.REASON, M.ORIG, M.MIXED)

    def run(self, gm: fx.GraphModule) -> bool:
        low = self.policy.dtype
        casts: dict[tuple[fx.Node, str], fx.Node] = {}
        graph = gm.graph
        for consumer in M.each_node(graph):
            if M.CAST in consumer.meta:
                continue
            for value in float_inputs(consumer):
                if M.LABEL not in value.meta or info(value).kind != "tensor":
                    continue  # tuples are never cast: their elements are tied to them
                need = requirement(consumer, value, self.policy.keep_io_dtype, low)
                if need is None or need == value.meta[M.LABEL]:
                    continue
                key = (value, need)
                if key not in casts:
                    casts[key] = self._cast(gm, value, need, consumer)
                consumer.replace_input_with(value, casts[key])
        changed = self._mixed(gm)
        changed = self._lowered_upcasts(gm) or changed
        return bool(casts) or changed

    def _lowered_upcasts(self, gm: fx.GraphModule) -> bool:
        """A model's own upcast of an fp32 value (a no-op in the fp32 model, ``ops._convert``)
        that the plan stores low (every reader is low): its input is low now, so it goes."""
        gone = []
        for node in M.each_node(gm.graph):
            if (node.meta.get(M.CLASS) == Precision.NEUTRAL and M.CAST not in node.meta
                    and node.meta.get(M.LABEL) == LOW and is_conversion(node)
                    and conversion_target(node) == torch.float32
                    and isinstance(node.args[0], fx.Node)
                    and node.args[0].meta.get(M.LABEL) == LOW):
                gone.append(node)
        for node in gone:
            record(gm, node, f"remove {node.name}",
                   "the model's upcast of a float32 value is a no-op in the fp32 model, and "
                   "every reader of it is low: low -> fp32 -> low changes no value")
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
        return bool(gone)

    def _mixed(self, gm: fx.GraphModule) -> bool:
        """Mixed-signature nodes that read a low input: ``dtype=torch.float32`` on a DTYPE_ARG
        node (softmax, sum); the reason says what a LOW_IO node (a norm) reads and stores."""
        low = str(self.policy.dtype).replace("torch.", "")
        changed = False
        for node in M.each_node(gm.graph):
            mixed = node.meta.get(M.MIXED)
            if mixed is None:
                continue
            data = node.args[0]
            if not isinstance(data, fx.Node) or data.meta.get(M.LABEL) != LOW:
                node.meta.pop(M.MIXED)  # its input is fp32 after all: a plain fp32 op
                continue
            if mixed is Mixed.DTYPE_ARG:
                if node.kwargs.get("dtype") != torch.float32:
                    node.kwargs = {**node.kwargs, "dtype": torch.float32}
                    record(gm, node, "dtype=torch.float32",
                           f"reads its {low} input without an fp32 copy and computes in "
                           "float32 (mixed signature confirmed by the kernel probe)")
                    changed = True
                how = f"reads {low}, computes and writes float32"
            elif mixed is Mixed.FP32_HELPER:
                helper = fp32_helper_of(node)
                if node.target is not helper:
                    node.target = helper
                    record(gm, node, f"call {helper.__name__}",
                           f"computes in float32 and keeps the {low} input, not an fp32 copy, "
                           "for backward (the kernel refused a low input)")
                    changed = True
                how = (f"reads {low}, computes in float32 ({helper.__name__}: the fp32 kernels "
                       f"on an fp32 copy it does not keep), writes {low}")
            else:
                out = "float32" if node.meta.get(M.LABEL) == HIGH else low
                how = f"reads {low} with fp32 parameters, computes in float32, writes {out}"
            node.meta[M.REASON] = f"{node.meta.get(M.REASON, '')}; {how} (probed)"
        return changed

    def _cast(self, gm: fx.GraphModule, value: fx.Node, need: str, consumer: fx.Node) -> fx.Node:
        dtype = torch.float32 if need == HIGH else self.policy.dtype
        what = consumer.meta.get(M.CLASS)
        why = (f"{consumer.name} ({what.value if what else consumer.op}) needs "
               f"{str(dtype).replace('torch.', '')}")
        return add_cast(gm, value, dtype, need, why)


def add_cast(gm: fx.GraphModule, value: fx.Node, dtype: torch.dtype, label: str,
             why: str) -> fx.Node:
    """A cast node right after ``value`` (a guarded one where its dtype is unknown), with the
    meta every cast carries, recorded in the report. Its users are the caller's to rewire."""
    graph = gm.graph
    with graph.inserting_after(value):
        if info(value).dtype is None:
            cast = new_node(graph, "call_function", cast_if_float, (value, dtype))
        else:
            cast = new_node(graph, "call_method", "to", (value, dtype))
    M.copy_provenance(value, cast, value=True)
    cast.meta[M.CAST] = dtype
    cast.meta[M.CLASS] = Precision.NEUTRAL
    cast.meta[M.NATURAL] = value.meta.get(M.NATURAL)
    cast.meta[M.LABEL] = label
    cast.meta[M.FAMILY] = None
    cast.meta[M.REASON] = why
    record(gm, cast, f"cast {value.name} to {dtype}", why)
    return cast

