"""rescale_matmuls: with ``overflow="rescale"``, a matmul whose result passes the low dtype's
range runs low on a weight scaled by a power of two, and its result is scaled back in fp32.

Matches (with ``meta[RANGE]`` from record_ranges, in fp16, where the result passes
:func:`amprewrite.ranges.range_limit` and the inputs do not):
    ``y = linear(x, w, b)``  /  ``y = addmm(b, x, w)``  /  ``y = x @ w`` (matmul, mm, bmm)
    with ``w`` a parameter
Rewrite to, with ``s = 2**-k`` the smallest power of two that brings the result in range:
    ``y = linear(x, w * s, b * s) * 2**k``

Multiplying by a power of two is exact in fp32, so the graph computes what the model does; the
matmul runs low on values that fit, so its FLOPs stay in fp16, and its result carries fp16's
rounding (the default, ``overflow="fp32"``, computes it in fp32: more accurate, slower;
measured in docs/benchmarks.md, "fp16 overflow"). The scale-back is forced FP32
(``meta[FORCE]``): its result, the large value, is stored fp32. Only a parameter is scaled (one
far from fp16's subnormals): scaling an activation down would push its small values into them.
A matmul that reads a value past the range, or a weight fp16 cannot hold, stays fp32
(paint_precision).
"""

from __future__ import annotations

import math
import operator

import torch
from torch import fx

from .. import meta as M
from ..ops import FAMILIES, Precision
from ..ranges import TINY_SHARE, ValueRange, describe_limit, narrower_than_fp32, range_limit
from .base import Kind, Match, Replacement, Rule, RulePass, matmul_operands

__all__ = ["RescaleMatmuls"]


def _range(value: object) -> ValueRange | None:
    return value.meta.get(M.RANGE) if isinstance(value, fx.Node) else None


def _scaled(m: Match, value: fx.Node, s: float) -> fx.Node:
    node = m.build.call(operator.mul, value, s, value=M.info(value))
    r = _range(value)
    if r is not None:
        node.meta[M.RANGE] = ValueRange(r.absmax * s, r.tiny_share, r.batches)
    return node


def _rescale(m: Match) -> Replacement | None:
    low = m.policy.dtype
    node = m.node
    out = _range(node)
    found = matmul_operands(m.node, m.args)
    if found is None or out is None or M.info(node).dtype != torch.float32:
        return None
    args, data_key, weight_key, bias_key = found
    data, weight = args[data_key], args[weight_key]
    bias = args.get(bias_key) if bias_key else None
    rd, rw = _range(data), _range(weight)
    if rd is None or rw is None or not isinstance(weight, fx.Node) or weight.op != "get_attr":
        return None  # only a parameter is scaled: an activation could fall into subnormals
    if bias is not None and _range(bias) is None:
        return None
    limit = range_limit(low)
    if (rd.absmax > limit or rw.absmax > torch.finfo(low).max or rw.tiny_share > TINY_SHARE
            or not math.isfinite(out.absmax) or out.absmax <= limit):
        return None  # only the result past the range; inputs fp16 holds (else: fp32)
    k = math.ceil(math.log2(out.absmax / limit))
    s = 2.0 ** -k
    new_args = {**args, weight_key: _scaled(m, weight, s)}
    if bias is not None:
        new_args[bias_key] = _scaled(m, bias, s)
    if m.args is None:  # operator.matmul: positional
        inner = m.build.call(node.target, new_args["input"], new_args["other"],
                             value=M.info(node))
    else:
        inner = m.build.call(node.target, value=M.info(node), **new_args)
    inner.meta[M.RANGE] = ValueRange(out.absmax * s, out.tiny_share, out.batches)
    back = m.build.call(operator.mul, inner, 2.0 ** k, value=M.info(node))
    back.meta[M.RANGE] = out
    why = (f"range: |{node.name}| up to {out.absmax:.3g} > {describe_limit(low)}; "
           f"overflow='rescale': the product runs low on {weight_key} * 2^-{k} and is scaled "
           f"back by 2^{k} in fp32 (exact)")
    back.meta[M.FORCE] = (Precision.FP32, why)
    return Replacement(back, f"{node.name}: {weight_key} * 2^-{k}, result * 2^{k} in fp32", why)


class RescaleMatmuls(RulePass):
    name, kind = "rescale_matmuls", Kind.REWRITE
    requires = (M.ORIG, M.RANGE)
    writes = (M.ORIG, M.RANGE, M.FORCE)
    rules = (Rule((*FAMILIES["linear"].functions, *FAMILIES["matmul"].functions), _rescale),)

    def run(self, gm: fx.GraphModule) -> bool:
        policy = self.policy
        if policy is None or policy.overflow != "rescale" or not narrower_than_fp32(policy.dtype):
            return False  # the default, or bfloat16 (fp32's range: nothing to rescale)
        return super().run(gm)
