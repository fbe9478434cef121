"""normalize_modules: leaf-module calls become functional calls on ``get_attr`` parameters.

Matches:   ``y = self.fc(x)``                        (call_module, nn.Linear)
Rewrite to: ``w = self.fc.weight; b = self.fc.bias; y = F.linear(x, w, b)``

so that every later pass sees one IR — the one dynamo (and so the torch.compile backend)
produces — and LOW ops can have their weights cast in the graph. Modules whose behaviour depends
on ``module.training`` (BatchNorm, Dropout) stay ``call_module`` so ``gm.train()``/``gm.eval()``
switch them at run time; so do subclasses (their ``forward`` may differ) and hooked modules.
The lowering of each module class is its family's ``lower`` entry in :mod:`amprewrite.ops`.
The lowered modules stay in ``gm`` (unused): they hold the parameters under their names.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import fx, nn

from .. import meta as M
from ..modules import hooked
from ..ops import lowering
from .base import Builder, Kind, Match, Replacement, Rule, RulePass

__all__ = ["NormalizeModules"]


class _Attrs:
    """Makes the nodes a lowering needs, before the module call and with its provenance."""

    def __init__(self, build: Builder, node: fx.Node, mod: nn.Module, path: str):
        self.build, self.node, self.mod, self.path = build, node, mod, path

    def __call__(self, name: str) -> fx.Node | None:
        value = getattr(self.mod, name, None)
        if value is None:
            return None
        return self.build.node("get_attr", f"{self.path}.{name}",
                               value=M.info_from_value(value))

    def pad(self, x: fx.Node, pad: tuple, mode: str) -> fx.Node:
        return self.build.call(F.pad, x, pad, mode=mode, value=self.node.meta.get(M.ORIG))


def _lower(m: Match) -> Replacement | None:
    node = m.node
    mod = m.gm.get_submodule(str(node.target))
    rule = lowering(mod)
    if rule is None or hooked(mod) or node.kwargs or len(node.args) != 1:
        return None
    target, args, kwargs = rule(mod, node.args[0], _Attrs(m.build, node, mod, str(node.target)))
    new = M.copy_provenance(node, m.build.call(target, *args, **kwargs), value=True)
    return Replacement(new, f"call_module {type(mod).__name__} -> "
                       f"{getattr(target, '__name__', target)}", "one functional IR for every pass")


class NormalizeModules(RulePass):
    """Lower known leaf modules to their functional form (see module docstring)."""

    name, kind = "normalize_modules", Kind.CANONICALIZE
    requires = (M.MODULE_PATH, M.MODULE_TYPES)
    writes = (M.ORIG,)  # of the get_attr nodes it makes
    rules = (Rule((), _lower, op="call_module", normalize=False),)
