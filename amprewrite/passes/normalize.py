"""normalize_modules: leaf-module calls become functional calls on ``get_attr`` parameters.

Matches:   ``y = self.fc(x)``                        (call_module, nn.Linear)
Rewrite to: ``w = self.fc.weight; b = self.fc.bias; y = F.linear(x, w, b)``

so that every later pass sees one IR — the one dynamo (and so the torch.compile backend)
produces — and LOW ops can have their weights cast in the graph. Modules whose behaviour depends
on ``module.training`` (BatchNorm, Dropout) stay ``call_module`` so ``gm.train()``/``gm.eval()``
switch them at run time; so do subclasses (their ``forward`` may differ) and hooked modules.
The lowering of each module class is its family's ``lower`` entry in
:mod:`amprewrite.precision.ops`. The lowered modules stay in ``gm`` (unused): they hold the
parameters under their names. """

from __future__ import annotations

import torch.nn.functional as F
from torch import fx, nn

from ..graph import meta as M
from ..graph.modules import hooked, submodule, tensor_attr
from ..precision.ops import lowering
from .base import Kind, Match, Replacement, Rule, RulePass, new_node

__all__ = ["NormalizeModules"]


class _Lowering:
    """Makes the nodes of one module call's lowering (its ``attr`` argument), each with the
    call's provenance. They go in order right before the call, which is the graph's insertion
    point while the lowering runs: one insertion point for them all, not a context per node."""

    def __init__(self, gm: fx.GraphModule, node: fx.Node, mod: nn.Module):
        self.graph, self.node, self.mod = gm.graph, node, mod

    def make(self, op: str, target: object, args: tuple = (), kwargs: dict | None = None,
             value: M.ValueInfo | None = None) -> fx.Node:
        n = M.copy_provenance(self.node, new_node(self.graph, op, target, args, kwargs))
        if value is not None:
            n.meta[M.ORIG] = value
        return n

    def __call__(self, name: str) -> fx.Node | None:
        value = tensor_attr(self.mod, name)
        if value is None:
            return None
        return self.make("get_attr", f"{self.node.target}.{name}",
                         value=M.info_from_value(value))

    def pad(self, x: fx.Node, pad: tuple, mode: str) -> fx.Node:
        return self.make("call_function", F.pad, (x, pad), {"mode": mode},
                         value=self.node.meta.get(M.ORIG))


def _lower(m: Match) -> Replacement | None:
    node = m.node
    mod = submodule(m.gm, str(node.target))
    rule = lowering(mod)
    if rule is None or hooked(mod) or node.kwargs or len(node.args) != 1:
        return None
    attr = _Lowering(m.gm, node, mod)
    with m.gm.graph.inserting_before(node):
        target, args, kwargs = rule(mod, node.args[0], attr)
        new = attr.make("call_function", target, args, kwargs)  # its ORIG: the driver copies it
    return Replacement(new, f"call_module {type(mod).__name__} -> "
                       f"{getattr(target, '__name__', target)}", "one functional IR for every pass")


class NormalizeModules(RulePass):
    """Lower known leaf modules to their functional form (see module docstring)."""

    name, kind = "normalize_modules", Kind.CANONICALIZE
    requires = (M.MODULE_PATH, M.MODULE_TYPES)
    writes = (M.ORIG,)  # of the get_attr nodes it makes
    rules = (Rule((), _lower, op="call_module", normalize=False),)
