"""freeze_dtype_reads: ``x.dtype`` reads become the dtype the original model had there.

Matches:   ``d = getattr(x, "dtype"); y = h.to(d)``     (symbolic traces keep dtype reads)
Rewrite to: ``y = h.to(torch.float32)``

Model code like ``hidden.to(input_dtype)`` means "back to what the model computes in". After
casts are inserted ``x`` may be bfloat16, so a live read would silently change the model's own
conversions; freezing the read keeps them as the author wrote them for the fp32 model.
"""

from __future__ import annotations

import builtins

from ..graph import meta as M
from ..graph.meta import info
from .base import Kind, Match, Replacement, Rule, RulePass

__all__ = ["FreezeDtypeReads"]


def _freeze(m: Match) -> Replacement | None:
    if m.node.args[1:2] != ("dtype",):
        return None
    dtype = info(m.node.args[0]).dtype
    if dtype is None:
        return None
    return Replacement(dtype, f"x.dtype -> {dtype}",
                       "the model's own conversions keep the dtype the fp32 model had")


class FreezeDtypeReads(RulePass):
    name, kind = "freeze_dtype_reads", Kind.CANONICALIZE
    requires = (M.ORIG,)
    rules = (Rule((builtins.getattr,), _freeze, normalize=False),)
