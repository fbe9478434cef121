"""recompute_islands: in training, an fp32 region of pointwise ops that reads low values keeps
those for backward, not its fp32 intermediates.

Matches:   ``u = h.to(float32); v = pow(u, 3); w = tanh(u + 0.04 * v); y = (u * w).to(bf16)``,
           a connected group of pointwise nodes stored fp32 (GPT-2's ``gelu_new`` next to its
           bf16 matmuls), entered through casts up of low values
Rewrite to: ``y = runtime.recompute(body, h)``: the group, its casts up and its casts down
           outlined into the GraphModule ``body`` (an attribute ``amp_recompute_<i>``), called
           through ``torch.utils.checkpoint`` (non-reentrant) when a gradient is taken.

Every value is computed by the same ops in the same dtypes, forward and backward: the output
and every gradient are bit-equal to the graph without the rewrite. What changes is what autograd
keeps: the region's low inputs (2 bytes a value) instead of its fp32 copies and intermediates
(4 bytes each); backward recomputes the pointwise ops, which cost little next to the matmuls
around them. Only in a graph transformed in train mode (``model.training``); regions that draw
random numbers, read no low value, or whose outlining would reorder the graph stay as they are.
``torch.compile`` sees the checkpoint as its ``tag_activation_checkpoint`` region.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from ..graph import meta as M
from ..graph import runtime
from ..graph.meta import HIGH, LOW
from ..precision.ops import Precision, is_pointwise, kept_for_backward
from ..precision.report import record, region_bodies
from .base import Kind, Pass

__all__ = ["RecomputeIslands", "region_bodies"]

PREFIX = "amp_recompute_"


def _bytes(node: fx.Node, low: torch.dtype) -> int:
    """Bytes of a tensor value as stored (numel 1 where the capture has no sizes)."""
    value = M.info(node)
    if value.kind != "tensor":
        return 0
    label = node.meta.get(M.LABEL)
    dtype = torch.float32 if label == HIGH else low if label == LOW else value.dtype
    return (dtype.itemsize if dtype is not None else low.itemsize) * (value.numel or 1)


class RecomputeIslands(Pass):
    name, kind = "recompute_islands", Kind.REWRITE
    requires = (M.CAST, M.LABEL)
    writes = (M.ORIG, M.LABEL, M.NATURAL, M.CLASS, M.FAMILY, M.REASON)

    def run(self, gm: fx.GraphModule) -> bool:
        if not gm.training:
            return False
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        changed = False
        for region in self._regions(gm):
            changed |= self._outline(gm, region, order)
        return changed

    def _compute(self, n: fx.Node) -> bool:
        return (M.CAST not in n.meta and n.meta.get(M.LABEL) == HIGH
                and M.info(n).kind == "tensor" and is_pointwise(n))

    def _upcast(self, n: fx.Node) -> bool:
        src = n.args[0] if n.args else None
        return (n.meta.get(M.CAST) == torch.float32 and isinstance(src, fx.Node)
                and src.meta.get(M.LABEL) == LOW)

    def _regions(self, gm: fx.GraphModule) -> list[list[fx.Node]]:
        """Connected groups of fp32 pointwise nodes, in graph order."""
        parent: dict[fx.Node, fx.Node] = {}

        def find(n: fx.Node) -> fx.Node:
            while parent[n] is not n:
                parent[n] = parent[parent[n]]
                n = parent[n]
            return n

        for n in gm.graph.nodes:
            if self._compute(n):
                parent[n] = n
                for a in n.all_input_nodes:
                    if a in parent:
                        parent[find(a)] = find(n)
        groups: dict[fx.Node, list[fx.Node]] = {}
        for n in parent:
            groups.setdefault(find(n), []).append(n)
        return list(groups.values())

    def _outline(self, gm: fx.GraphModule, group: list[fx.Node],
                 order: dict[fx.Node, int]) -> bool:
        low = self.policy.dtype
        region = set(group)
        # Casts up whose every reader is in the group come in: the region then reads the low
        # value. Casts down of the group's values come in too: the region writes low values.
        for n in group:
            for a in n.all_input_nodes:
                if a not in region and self._upcast(a) and all(u in region for u in a.users):
                    region.add(a)
        if not any(M.CAST in n.meta for n in region):
            return False  # reads no low value: nothing to gain
        # What autograd keeps now (fp32 values of the group) against what the checkpoint keeps
        # (the region's inputs; parameters cost nothing more).
        kept = sum(kept_for_backward(n) * _bytes(n, torch.float32) for n in group)
        inputs = {a for n in region for a in n.all_input_nodes if a not in region}
        if sum(_bytes(a, low) for a in inputs if a.op != "get_attr") >= kept:
            return False
        for n in group:
            for u in n.users:
                if u not in region and u.meta.get(M.CAST) == low:
                    region.add(u)
        nodes = sorted(region, key=order.__getitem__)
        inputs = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes
                                    if a not in region))
        outputs = [n for n in nodes if any(u not in region for u in n.users)]
        last = nodes[-1]
        readers = [u for o in outputs for u in o.users if u not in region]
        # Outlined at the place of its last node: every reader of its outputs must come later.
        if not outputs or any(order[u] < order[last] for u in readers):
            return False
        body_graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for a in inputs:
            p = body_graph.placeholder(a.name)
            p.meta.update({k: v for k, v in a.meta.items() if k in (M.ORIG, M.LABEL)})
            env[a] = p
        for n in nodes:
            env[n] = body_graph.node_copy(n, env.__getitem__)
        body_graph.output(env[outputs[0]] if len(outputs) == 1
                          else tuple(env[o] for o in outputs))
        body = fx.GraphModule(torch.nn.Module(), body_graph)
        k = sum(1 for name, _ in gm.named_children() if name.startswith(PREFIX))
        name = f"{PREFIX}{k}"
        gm.add_submodule(name, body)
        graph = gm.graph
        ops = [n for n in nodes if M.CAST not in n.meta]
        names = ", ".join(dict.fromkeys(str(n.meta.get(M.FAMILY) or n.target) for n in ops))
        why = (f"{len(ops)} fp32 pointwise ops ({names}) reading {str(low)[6:]} values: "
               f"recomputed in backward from those instead of keeping fp32 copies "
               f"(torch.utils.checkpoint); the same values forward and backward")
        with graph.inserting_after(last):
            ref = graph.get_attr(name)
        with graph.inserting_after(ref):
            call = graph.call_function(runtime.recompute, (ref, *inputs))
        M.copy_provenance(last, call)
        for key, value in ((M.CLASS, Precision.FP32), (M.FAMILY, "recompute"),
                           (M.REASON, why)):
            call.meta[key] = value
        ref.meta[M.ORIG] = M.OTHER
        ref.meta[M.REASON] = f"the body of {call.name} (its ops follow it)"
        if len(outputs) == 1:
            self._take_value(outputs[0], call)
            outputs[0].replace_all_uses_with(call)
        else:
            call.meta[M.ORIG] = M.ValueInfo("seq", items=tuple(M.info(o) for o in outputs))
            prev = call
            for i, o in enumerate(outputs):
                with graph.inserting_after(prev):
                    item = graph.call_function(operator.getitem,
                                               (call, i))
                M.copy_provenance(o, item)
                self._take_value(o, item)
                item.meta.update({M.CLASS: Precision.NEUTRAL, M.FAMILY: "getitem"})
                o.replace_all_uses_with(item, delete_user_cb=lambda u, i=item: u is not i)
                prev = item
        for n in reversed(nodes):
            graph.erase_node(n)
        record(gm, call, f"recompute {len(ops)} fp32 ops in backward ({name})", why)
        return True

    @staticmethod
    def _take_value(src: fx.Node, dst: fx.Node) -> None:
        for key in (M.ORIG, M.LABEL, M.NATURAL):
            if key in src.meta:
                dst.meta[key] = src.meta[key]
