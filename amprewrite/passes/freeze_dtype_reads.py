"""freeze_dtype_reads: ``x.dtype`` reads become the dtype the original model had there.

Matches:   ``d = getattr(x, "dtype"); y = h.to(d)``     (symbolic traces keep dtype reads)
Rewrite to: ``y = h.to(torch.float32)``

Model code like ``hidden.to(input_dtype)`` means "back to what the model computes in". After
casts are inserted ``x`` may be bfloat16, so a live read would silently change the model's own
conversions; freezing the read keeps them as the author wrote them for the fp32 model.

A read the capture already froze into a constant: ``torch.finfo(key.dtype).min``, the "minus
infinity, but finite" of an attention mask (transformers' ``torch.where(mask, bias, min)``,
``(1 - mask) * min``), is fp32's -3.40e38 in the graph. bfloat16's largest finite value is
3.39e38, so the plan's bf16 cast of that mask gave -inf, and a row with every key masked (a
left-padded decoder row) gave NaN in softmax, which the next layer spread to every row.

Matches:   ``torch.where(mask, bias, -3.4028234663852886e+38)``   (with ``dtype=bf16``)
Rewrite to: ``torch.where(mask, bias, -3.3895313892515355e+38)``

the value the model computes when loaded in bfloat16 (``finfo(bfloat16).min``). fp16 is left
alone: with example inputs (``transform``'s, the backend's), the ranges recorded on them keep
values past its range in fp32.
"""

from __future__ import annotations

import builtins

import torch

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


_FP32_MAX = torch.finfo(torch.float32).max
_BF16_MAX = torch.finfo(torch.bfloat16).max


def _bf16_sentinel(value: object, found: list[str]) -> object:
    """``value`` with fp32's finfo extremes as bf16's (those it replaced named in ``found``);
    in a plain list or tuple too."""
    if isinstance(value, float) and abs(value) == _FP32_MAX:
        found.append("max" if value > 0 else "min")
        return _BF16_MAX if value > 0 else -_BF16_MAX
    if type(value) in (list, tuple):
        return type(value)(_bf16_sentinel(v, found) for v in value)
    return value


def _sentinels(m: Match) -> Replacement | None:
    if m.policy is None or m.policy.dtype != torch.bfloat16:
        return None
    node, found = m.node, []
    args = tuple(_bf16_sentinel(a, found) for a in node.args)
    kwargs = {k: _bf16_sentinel(v, found) for k, v in node.kwargs.items()}
    if not found:
        return None
    node.args, node.kwargs = args, kwargs
    which = "/".join(sorted(set(found)))
    return Replacement(node, f"finfo(float32).{which} -> finfo(bfloat16).{which}",
                       "fp32's extreme rounds to inf in bf16 (a fully masked row's softmax "
                       "would be NaN); bf16's is what the model computes when loaded in bf16")


class FreezeDtypeReads(RulePass):
    name, kind = "freeze_dtype_reads", Kind.CANONICALIZE
    requires = (M.ORIG,)
    rules = (Rule((builtins.getattr,), _freeze, normalize=False),
             Rule((), _sentinels, normalize=False),
             Rule((), _sentinels, op="call_method", normalize=False))
