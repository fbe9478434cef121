"""normalize_modules: leaf-module calls become functional calls on ``get_attr`` parameters.

Matches:   ``y = self.fc(x)``                        (call_module, nn.Linear)
Rewrite to: ``w = self.fc.weight; b = self.fc.bias; y = F.linear(x, w, b)``

so that every later pass sees one IR — the one dynamo (and so the torch.compile backend)
produces — and LOW ops can have their weights cast in the graph. Modules whose behaviour depends
on ``module.training`` (BatchNorm, Dropout) stay ``call_module`` so ``gm.train()``/``gm.eval()``
switch them at run time; so do subclasses (their ``forward`` may differ) and hooked modules.
The lowering of each module class is its family's ``lower`` entry in :mod:`amprewrite.ops`.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import fx, nn
from torch.fx.passes.infra.pass_base import PassResult

from .. import meta as M
from ..ops import lowering
from ..report import record

__all__ = ["normalize_modules"]

class _Attrs:
    """Makes the nodes a lowering needs, before the module call and with its metadata."""

    def __init__(self, graph: fx.Graph, node: fx.Node, mod: nn.Module, path: str):
        self.graph, self.node, self.mod, self.path = graph, node, mod, path

    def _new(self, op: str, target, args=(), kwargs=None) -> fx.Node:
        with self.graph.inserting_before(self.node):
            n = self.graph.create_node(op, target, args, kwargs or {})
        n.meta.update({k: v for k, v in self.node.meta.items()
                       if k in (M.MODULE_PATH, M.MODULE_TYPES, "stack_trace", "nn_module_stack")})
        return n

    def __call__(self, name: str) -> fx.Node | None:
        value = getattr(self.mod, name, None)
        if value is None:
            return None
        n = self._new("get_attr", f"{self.path}.{name}")
        n.meta[M.ORIG] = M.info_from_value(value)
        return n

    def pad(self, x: fx.Node, pad: tuple, mode: str) -> fx.Node:
        n = self._new("call_function", F.pad, (x, pad), {"mode": mode})
        if M.ORIG in self.node.meta:
            n.meta[M.ORIG] = self.node.meta[M.ORIG]
        return n


def _hooked(m: nn.Module) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks)


def normalize_modules(gm: fx.GraphModule) -> PassResult:
    """Lower known leaf modules to their functional form (see module docstring)."""
    changed = False
    graph = gm.graph
    for node in M.each_node(graph, "call_module"):
        mod = gm.get_submodule(str(node.target))
        rule = lowering(mod)
        if rule is None or _hooked(mod) or node.kwargs or len(node.args) != 1:
            continue
        (x,) = node.args
        path = str(node.target)

        target, args, kwargs = rule(mod, x, _Attrs(graph, node, mod, path))
        with graph.inserting_before(node):
            new = graph.call_function(target, args, kwargs)
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        record(gm, new, "normalize_modules", f"call_module {type(mod).__name__} -> "
               f"{getattr(target, '__name__', target)}", "one functional IR for every pass")
        changed = True
    # The lowered modules stay in gm (unused): they hold the parameters under their names.
    return PassResult(gm, changed)

