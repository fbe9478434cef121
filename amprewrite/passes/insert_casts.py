"""insert_casts: realise the cast plan (``plan_casts``'s ``meta[LABEL]``) with ``Tensor.to`` nodes.

Matches:   ``y = F.linear(x, w, b)`` with x, w, b fp32 and linear LOW
Rewrite to: ``x_bf16 = x.to(torch.bfloat16); w_bf16 = w.to(torch.bfloat16); ...;
           y = F.linear(x_bf16, w_bf16, b_bf16)``

One cast per (value, dtype), placed right after the value and shared by all its consumers.
Values whose dtype the trace could not know (graph inputs traced without example inputs) get a
guarded cast, :func:`amprewrite.graph.runtime.cast_if_float`, that leaves integer and bool tensors
alone.
"""

from __future__ import annotations

import torch
from torch import fx

from ..graph import meta as M
from ..graph.meta import HIGH, LOW, info
from ..graph.runtime import cast_if_float
from ..precision.cast_plan import requirement
from ..precision.ops import Mixed, Precision, conversion_target, fp32_helper_of, is_conversion
from ..precision.report import record
from .base import Kind, Pass, new_node

__all__ = ["InsertCasts", "add_cast"]


class InsertCasts(Pass):
    """Realise the labels ``plan_casts`` chose with cast nodes."""

    name, kind = "insert_casts", Kind.REWRITE
    requires = (M.ORIG, M.CLASS, M.NATURAL, M.TIED, M.MIXED, M.LABEL)
    writes = (M.LABEL, M.CAST, M.CLASS, M.NATURAL, M.FAMILY, M.REASON, M.ORIG, M.MIXED)

    def run(self, gm: fx.GraphModule) -> bool:
        low = self.policy.dtype
        keep_io_dtype = self.policy.keep_io_dtype
        dtype_names = {d: str(d).replace("torch.", "") for d in (torch.float32, low)}
        neutral = Precision.NEUTRAL  # looked up once: an enum member costs ~0.1 us
        casts: dict[tuple[fx.Node, str], fx.Node] = {}
        # The nodes the two steps after look at, found in this walk, in graph order: what they
        # test does not change with the casts (new nodes, none of them a candidate).
        mixed, upcasts = [], []
        for consumer in M.each_node(gm.graph):
            meta = consumer.meta
            if meta.get(M.MIXED) is not None:
                mixed.append(consumer)
            if M.CAST in meta:
                continue
            if meta.get(M.CLASS) == neutral and meta.get(M.LABEL) == LOW:
                upcasts.append(consumer)
            for value in consumer.all_input_nodes:
                # float_inputs(consumer), less what is never cast: unlabelled values, and
                # tuples (their elements are tied to them).
                if M.LABEL not in value.meta:
                    continue
                vi = info(value)
                if vi.kind != "tensor" or not vi.is_float:
                    continue
                need = requirement(consumer, value, keep_io_dtype, low)
                if need is None or need == value.meta[M.LABEL]:
                    continue
                cast = casts.get((value, need))
                if cast is None:
                    dtype = torch.float32 if need == HIGH else low
                    what = meta.get(M.CLASS)
                    why = (f"{consumer.name} ({what.value if what else consumer.op}) needs "
                           f"{dtype_names[dtype]}")
                    cast = casts[(value, need)] = add_cast(gm, value, dtype, need, why)
                consumer.replace_input_with(value, cast)
        changed = self._mixed(gm, mixed)
        changed = self._lowered_upcasts(gm, upcasts) or changed
        return bool(casts) or changed

    def _lowered_upcasts(self, gm: fx.GraphModule, candidates: list[fx.Node]) -> bool:
        """A model's own upcast of an fp32 value (a no-op in the fp32 model, ``ops._convert``)
        that the plan stores low (every reader is low): its input is low now, so it goes.
        ``candidates``: the NEUTRAL nodes stored low that are not casts, in graph order."""
        gone = []
        for node in M.each_node_of(candidates):
            if (is_conversion(node) and conversion_target(node) == torch.float32
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

    def _mixed(self, gm: fx.GraphModule, nodes: list[fx.Node]) -> bool:
        """Mixed-signature nodes that read a low input: ``dtype=torch.float32`` on a DTYPE_ARG
        node (softmax, sum); the reason says what a LOW_IO node (a norm) reads and stores.
        ``nodes``: the nodes with ``meta[MIXED]``, in graph order."""
        low = str(self.policy.dtype).replace("torch.", "")
        changed = False
        for node in M.each_node_of(nodes):
            mixed = node.meta[M.MIXED]
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


def add_cast(gm: fx.GraphModule, value: fx.Node, dtype: torch.dtype, label: str,
             why: str) -> fx.Node:
    """A cast node right after ``value`` (a guarded one where its dtype is unknown), with the
    meta every cast carries, recorded in the report. Its users are the caller's to rewire."""
    # Named as create_node would name them from their targets, without its regex; made at
    # the insertion point and moved right after value (cheaper than an inserting_after block).
    if info(value).dtype is None:
        cast = new_node(gm.graph, "call_function", cast_if_float, (value, dtype),
                        name="cast_if_float")
    else:
        cast = new_node(gm.graph, "call_method", "to", (value, dtype), name="to")
    value.append(cast)
    M.copy_provenance(value, cast, value=True)
    cast.meta[M.CAST] = dtype
    cast.meta[M.CLASS] = Precision.NEUTRAL
    cast.meta[M.NATURAL] = value.meta.get(M.NATURAL)
    cast.meta[M.LABEL] = label
    cast.meta[M.FAMILY] = None
    cast.meta[M.REASON] = why
    record(gm, cast, f"cast {value.name} to {dtype}", why)
    return cast

