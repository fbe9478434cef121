"""rescale_matmuls: a matmul whose fp16 result passes the range runs low on a weight scaled by a
power of two, and its result is scaled back in fp32: every such matmul with
``overflow="rescale"``; with ``overflow="auto"`` (the default), only where keeping them fp32
would leave less than half of the matmul FLOPs in fp16 (:data:`LOW_FLOPS`).

Matches (with ``meta[RANGE]`` from record_ranges, in fp16, where the result passes
:func:`amprewrite.precision.ranges.range_limit` and the inputs do not):
    ``y = linear(x, w, b)``  /  ``y = addmm(b, x, w)``  /  ``y = x @ w`` (matmul, mm, bmm)
    /  ``y = conv2d(x, w, b, ...)`` (conv1d/2d/3d, transposed, ``convolution``)
    with ``w`` a parameter
Rewrite to, with ``s = 2**-k`` the smallest power of two that brings the result in range:
    ``y = linear(x, w * s, b * s) * 2**k``

Multiplying by a power of two is exact in fp32, so the graph computes what the model does; the
matmul runs low on values that fit, so its FLOPs stay in fp16, and its result carries fp16's
rounding (``overflow="fp32"`` computes every one in fp32: more accurate, slower; measured in
docs/benchmarks.md, "fp16 overflow"). The scale-back is forced FP32 (``meta[FORCE]``): its
result, the large value, is stored fp32. Only a parameter is scaled (one far from fp16's
subnormals): scaling an activation down would push its small values into them. A matmul that
reads a value past the range, or a weight fp16 cannot hold, stays fp32 (paint_precision).

``"auto"`` counts the FLOPs of every LOW matmul-like op (convolutions included) on the
captured shapes, and those the ranges will keep fp32
(:func:`~amprewrite.passes.paint_precision.range_reason`). At or above half low, nothing
changes: the overflowing matmuls stay fp32, the most accurate plan; nor where even rescaling
all of them would leave less than half low. Otherwise the rescalable ones are rescaled **from
the output backwards** until half are low: a rounding
made late reaches the output through fewer ops that amplify it (on the overflow cases,
rescaling the last of GPT-2's two overflowing up-projections gives 1.24x the error of keeping
both fp32, the first 1.46x; LLaMA 1.06x and 1.15x).

First, in fp16 whatever ``overflow`` is, a matmul whose only obstacle is its bias is split from
it: a bias fp16 would store mostly subnormal (torchvision's ViT initialises its MLP biases with
std 1e-6) costs its own add, not its matmul's FLOPs.

Matches (a parameter ``b`` with more than :data:`~amprewrite.precision.ranges.TINY_SHARE` of its
nonzero values below fp16's smallest normal number; the data, the weight and the result in range):
    ``y = linear(x, w, b)``  /  ``y = addmm(b, x, w)``  /  ``y = conv2d(x, w, b, ...)``
Rewrite to:
    ``y = linear(x, w, None) + b``  /  ``y = mm(x, w) + b``  /  ``y = conv2d(x, w, None, ...) +
    b.reshape(-1, 1, 1)``
The matmul keeps its name and runs low; the add reads the fp32 bias, so painting (PROMOTE, the
widest input) computes it in fp32: the bias is never rounded. A matmul the user's ``allow_low``
selects is left as the model wrote it.
"""

from __future__ import annotations

import math
import operator

import torch
from torch import fx

from ..graph import meta as M
from ..precision.ops import FAMILIES, Precision, family_of
from ..precision.policy import matches
from ..precision.ranges import (
    TINY_SHARE,
    ValueRange,
    describe_limit,
    narrower_than_fp32,
    range_limit,
)
from .base import (
    LOW_FLOPS,
    Kind,
    Match,
    Pass,
    Replacement,
    Rule,
    apply_rules,
    arguments,
    given_parameters,
    matmul_flops,
    matmul_operands,
    new_node,
)
from .paint_precision import range_reason

__all__ = ["LOW_FLOPS", "RescaleMatmuls"]

# LOW_FLOPS (passes.base), for overflow="auto": the share of matmul FLOPs that should stay in
# fp16. fp16 is chosen for its speed, and the matmuls are where it is; below half, the plan
# rescales rather than give up more of them.


def _range(value: object) -> ValueRange | None:
    return value.meta.get(M.RANGE) if isinstance(value, fx.Node) else None


def _scaled(m: Match, value: fx.Node, s: float) -> fx.Node:
    node = m.build.call(operator.mul, value, s, value=M.info(value))
    r = _range(value)
    if r is not None:
        node.meta[M.RANGE] = ValueRange(r.absmax * s, r.tiny_share, r.batches)
    return node


def _exponent(node: fx.Node, args: dict | None, low: torch.dtype,
              params: frozenset[fx.Node]) -> int | None:
    """k such that the matmul ``node`` computes in range on its weight scaled by ``2**-k``;
    None where it is not rescalable (result in range, an input past it, a weight that is not a
    parameter or that fp16 cannot hold, ranges unknown). ``params``: the placeholders that are
    parameters (the backend's graphs, :func:`~amprewrite.passes.base.given_parameters`)."""
    out = _range(node)
    found = matmul_operands(node, args)
    if found is None or out is None or M.info(node).dtype != torch.float32:
        return None
    args, data_key, weight_key, bias_key = found
    data, weight = args[data_key], args[weight_key]
    bias = args.get(bias_key) if bias_key else None
    rd, rw = _range(data), _range(weight)
    if (rd is None or rw is None or not isinstance(weight, fx.Node)
            or not (weight.op == "get_attr" or weight in params)):
        return None  # only a parameter is scaled: an activation could fall into subnormals
    if bias is not None and _range(bias) is None:
        return None
    limit = range_limit(low)
    if (rd.absmax > limit or rw.absmax > torch.finfo(low).max or rw.tiny_share > TINY_SHARE
            or not math.isfinite(out.absmax) or out.absmax <= limit):
        return None  # only the result past the range; inputs fp16 holds (else: fp32)
    return math.ceil(math.log2(out.absmax / limit))


def _vouched(node: fx.Node, policy) -> bool:
    """Does the user's ``allow_low`` select ``node``? They vouch for it running low as the model
    wrote it: it is neither rescaled nor counted as fp32 (painting gives it back its class)."""
    fam = family_of(node)
    return any(matches(node, sel) or (fam is not None and sel == fam.name)
               for sel in policy.allow_low)


def _rescale(m: Match, params: frozenset[fx.Node],
             only: frozenset[fx.Node] | None = None) -> Replacement | None:
    low = m.policy.dtype
    node = m.node
    if _vouched(node, m.policy) or (only is not None and node not in only):
        return None
    k = _exponent(node, m.args, low, params)
    if k is None:
        return None
    out = _range(node)
    args, _, weight_key, bias_key = matmul_operands(node, m.args)
    weight = args[weight_key]
    bias = args.get(bias_key) if bias_key else None
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
    mode = m.policy.overflow
    when = _AUTO_WHY if mode == "auto" else ""
    why = (f"range: |{node.name}| up to {out.absmax:.3g} > {describe_limit(low)}; "
           f"overflow={mode!r}{when}: the product runs low on {weight_key} * 2^-{k} and is "
           f"scaled back by 2^{k} in fp32 (exact)")
    back.meta[M.FORCE] = (Precision.FP32, why)
    return Replacement(back, f"{node.name}: {weight_key} * 2^-{k}, result * 2^{k} in fp32", why)


def _tiny_bias(node: fx.Node, args: dict | None, policy) -> fx.Node | None:
    """The bias parameter of the matmul ``node`` that alone would keep it out of fp16 (stored
    mostly subnormal, every other operand in range); None where there is none."""
    low = policy.dtype
    found = matmul_operands(node, args)
    if (found is None or M.info(node).dtype != torch.float32
            or "conv_tbc" in str(getattr(node.target, "__name__", ""))):
        return None  # conv_tbc's bias is not optional
    args, data_key, weight_key, bias_key = found
    bias = args.get(bias_key) if bias_key else None
    rb = _range(bias)
    if (not isinstance(bias, fx.Node) or bias.op != "get_attr" or rb is None
            or rb.tiny_share <= TINY_SHARE or rb.absmax > torch.finfo(low).max):
        return None
    data, weight = args[data_key], args[weight_key]
    rd, rw, out = _range(data), _range(weight), _range(node)
    limit = range_limit(low)
    if rd is not None and rd.absmax > limit:
        return None  # fp32 for its input either way
    if rw is not None and (rw.absmax > torch.finfo(low).max or (
            isinstance(weight, fx.Node) and weight.op == "get_attr"
            and rw.tiny_share > TINY_SHARE)):
        return None  # fp32 for its weight either way
    if out is not None and out.absmax > limit and policy.overflow == "fp32":
        return None  # fp32 for its result either way
    return bias


def _split_bias(m: Match) -> Replacement | None:
    """``linear(x, w, b)`` -> ``linear(x, w, None) + b`` where ``b`` alone keeps it from fp16
    (:func:`_tiny_bias`). The matmul node stays (its name, its provenance); the add, after it,
    takes its users."""
    node, policy = m.node, m.policy
    if _vouched(node, policy):
        return None
    bias = _tiny_bias(node, m.args, policy)
    if bias is None:
        return None
    args, _, weight_key, bias_key = matmul_operands(node, m.args)
    rb, out = _range(bias), _range(node)
    graph = m.gm.graph
    users = list(node.users)
    if node.target is torch.addmm:
        node.target, node.args, node.kwargs = torch.mm, (args["mat1"], args["mat2"]), {}
    else:
        node.args, node.kwargs = (), {**args, bias_key: None}
    if out is not None:  # the product alone: the recorded result less at most |b|
        node.meta[M.RANGE] = ValueRange(out.absmax + rb.absmax, out.tiny_share, out.batches)
    added, value = node, M.info(node)
    # A convolution's bias has one value per channel (dimension 0 of an unbatched input, 1 of
    # a batch): b.reshape(-1, 1, ..., 1).
    if (fam := family_of(node)) is not None and fam.name in ("conv", "conv_transpose"):
        kernel = len(M.info(args[weight_key]).shape or ()) - 2
        shape = (M.info(bias).numel,) + (1,) * kernel
        with graph.inserting_after(added):
            bias = added = new_node(graph, "call_method", "reshape", (bias, -1, *shape[1:]))
        M.copy_provenance(node, bias)
        bias.meta[M.ORIG] = M.ValueInfo("tensor", torch.float32, shape[0], shape=shape)
        bias.meta[M.RANGE] = rb
    with graph.inserting_after(added):
        add = new_node(graph, "call_function", operator.add, (node, bias))
    M.copy_provenance(node, add)
    add.meta[M.ORIG] = value
    if out is not None:
        add.meta[M.RANGE] = out
    for user in users:
        user.replace_input_with(node, add)
    low = policy.dtype
    name = bias.args[0].target if bias.op == "call_method" else bias.target
    why = (f"range: fp16 would store bias '{name}' mostly subnormal ({rb.tiny_share:.0%} of "
           f"its nonzero values below {torch.finfo(low).tiny:.2g}): the product runs without "
           "it and the bias is added after it, in fp32")
    return Replacement(node, f"{node.name}: bias '{name}' added after the product", why)


_AUTO_WHY = f" (fp32 would leave under {LOW_FLOPS:.0%} of the matmul FLOPs in fp16)"
_TARGETS = (*FAMILIES["linear"].functions, *FAMILIES["matmul"].functions,
            *FAMILIES["conv"].functions, *FAMILIES["conv_transpose"].functions)


def auto_choice(gm: fx.GraphModule, policy, params: frozenset[fx.Node]) -> frozenset[fx.Node]:
    """The matmuls ``overflow="auto"`` rescales: none while the ranges leave at least
    :data:`LOW_FLOPS` of the matmul FLOPs low, else rescalable ones from the output backwards
    until they do; none where rescaling every rescalable one would still leave less (a value
    past the range that the ops after it read: they stay fp32 either way, and the rescaled
    ones would only add roundings)."""
    low = policy.dtype
    total = low_flops = 0.0
    rescalable: list[tuple[fx.Node, float]] = []
    for node in gm.graph.nodes:
        flops = matmul_flops(gm, node)
        if flops is None:
            continue
        total += flops
        if range_reason(node, low) is None or _vouched(node, policy):
            low_flops += flops
        elif (node.target in _TARGETS
              and _exponent(node, arguments(gm, node), low, params) is not None):
            rescalable.append((node, flops))
    chosen: list[fx.Node] = []
    for node, flops in reversed(rescalable):
        if total == 0 or low_flops >= LOW_FLOPS * total:
            break
        chosen.append(node)
        low_flops += flops
    if total and low_flops < LOW_FLOPS * total:
        return frozenset()  # half is out of reach: no rounding added for less (the accurate plan)
    return frozenset(chosen)


class RescaleMatmuls(Pass):
    name, kind = "rescale_matmuls", Kind.REWRITE
    requires = (M.ORIG, M.RANGE)
    writes = (M.ORIG, M.RANGE, M.FORCE)
    example_inputs: object = None  # the backend's call: which placeholders are parameters

    def run(self, gm: fx.GraphModule) -> bool:
        policy = self.policy
        if policy is None or not narrower_than_fp32(policy.dtype):
            return False  # bfloat16 (fp32's range: nothing to rescale)
        # First: a product without its tiny bias is one auto counts and rescale scales.
        split = bool(apply_rules(gm, (Rule(_TARGETS, _split_bias),), policy))
        if policy.overflow == "fp32":
            return split
        params = given_parameters(gm, self.example_inputs)
        only = None if policy.overflow == "rescale" else auto_choice(gm, policy, params)
        if only is not None and not only:
            return split
        rule = Rule(_TARGETS, lambda m: _rescale(m, params, only))
        return bool(apply_rules(gm, (rule,), policy)) or split
