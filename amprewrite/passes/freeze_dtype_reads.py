"""freeze_dtype_reads: ``x.dtype`` reads become the dtype the original model had there.

Matches:   ``d = getattr(x, "dtype"); y = h.to(d)``     (symbolic traces keep dtype reads)
Rewrite to: ``y = h.to(torch.float32)``

Model code like ``hidden.to(input_dtype)`` means "back to what the model computes in". After
casts are inserted ``x`` may be bfloat16, so a live read would silently change the model's own
conversions; freezing the read keeps them as the author wrote them for the fp32 model.
"""

from __future__ import annotations

import builtins

from torch import fx
from torch.fx.passes.infra.pass_base import PassResult

from .. import meta as M
from ..meta import info
from ..report import record

__all__ = ["freeze_dtype_reads"]


def freeze_dtype_reads(gm: fx.GraphModule) -> PassResult:
    changed = False
    for node in M.each_node(gm.graph, "call_function"):
        if node.target is not builtins.getattr or node.args[1:2] != ("dtype",):
            continue
        dtype = info(node.args[0]).dtype
        if dtype is None:
            continue
        def freeze(n: fx.Node, read: fx.Node = node, d=dtype):
            return d if n is read else n

        for user in list(node.users):
            user.args = fx.node.map_arg(user.args, freeze)
            user.kwargs = fx.node.map_arg(user.kwargs, freeze)
        record(gm, node, "freeze_dtype_reads", f"x.dtype -> {dtype}",
               "the model's own conversions keep the dtype the fp32 model had")
        gm.graph.erase_node(node)
        changed = True
    return PassResult(gm, changed)
