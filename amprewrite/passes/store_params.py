"""store_params: with ``params="low"``, keep low-precision copies of weights only LOW ops read.

Matches:   ``w = self.fc.weight; w_bf16 = w.to(torch.bfloat16)`` where every use of ``fc.weight``
           is that one cast
Rewrite to: ``w = self.fc.weight`` with ``gm.fc.weight`` a bfloat16 copy (same name, so
           ``gm.state_dict()`` keys stay the model's). The caller's tensor is untouched; weights
           an FP32 op reads (BatchNorm statistics, norm scales) stay fp32 and shared.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import fx, nn

from .. import meta as M
from ..capture import set_attr
from ..meta import LOW
from ..report import record
from .base import Kind, Pass

__all__ = ["StoreParams"]


class StoreParams(Pass):
    name, kind = "store_params", Kind.REWRITE
    requires = (M.CAST, M.LABEL)
    writes = (M.ORIG, M.LABEL)

    def run(self, gm: fx.GraphModule) -> bool:
        if self.policy.params != "low":
            return False
        by_target: dict[str, list[fx.Node]] = defaultdict(list)
        for node in M.each_node(gm.graph, "get_attr"):
            by_target[str(node.target)].append(node)
        changed = False
        for target, nodes in by_target.items():
            value = gm.get_parameter(target) if _is_param(gm, target) else None
            if value is None or value.dtype != torch.float32:
                continue
            users = [u for n in nodes for u in n.users]
            if not users or not all(u.meta.get(M.CAST) == self.policy.dtype
                                    and u.op == "call_method" for u in users):
                continue
            low = nn.Parameter(value.detach().to(self.policy.dtype),
                               requires_grad=value.requires_grad)
            set_attr(gm, target, low)
            for node in nodes:
                node.meta[M.ORIG] = M.info_from_value(value)
                node.meta[M.LABEL] = LOW
                for cast in list(node.users):
                    cast.replace_all_uses_with(node)
                    gm.graph.erase_node(cast)
                record(gm, node, f"store {target} as {self.policy.dtype}",
                       "params='low' and every reader is a low-precision op")
            changed = True
        return changed


def _is_param(gm: nn.Module, target: str) -> bool:
    try:
        gm.get_parameter(target)
        return True
    except AttributeError:
        return False
