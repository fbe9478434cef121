"""simplify_attention_masks: an SDPA mask that masks nothing becomes no mask; an exactly causal
one becomes ``is_causal=True``.

transformers materialises its attention mask whenever it is traced (``torch._dynamo.export``,
``torch.export``): its eager path checks the mask's values and passes SDPA ``attn_mask=None``
(with ``is_causal=True`` for a decoder), but a traced graph cannot branch on values, so every
``scaled_dot_product_attention`` of BERT, ViT, LLaMA and GPT-2 gets a ``(B, 1, S, S)`` mask
built from ``arange`` and the input's sizes. Such a mask costs a tensor per layer and, on a
GPU, rules out flash attention, which takes no mask.

A mask is simplified only when its value is a function of the graph's input *sizes* alone:
its cone reads no input's values and no parameter or buffer (they are evaluated as meta
tensors, so any read of their data leaves the cone unevaluated), makes no random numbers, and
at the example sizes and at two other sizes of every dynamic dimension it is

- all true (a boolean mask) or all zero (an additive one): SDPA gets ``attn_mask=None``;
- exactly ``tril(ones(L, S))`` in every (L, S) slice (a boolean mask, or an additive one of 0
  and ``-inf`` / the dtype's ``min``): SDPA gets ``attn_mask=None, is_causal=True``, which
  computes the same softmax (a masked score adds exactly nothing to it either way).

A mask that reads an input (a padded ``attention_mask``) is kept, as are masks of any other
pattern (a sliding window). Each rewrite is in the report with the sizes it was checked at.

>>> import torch
>>> import torch.nn.functional as F
>>> from torch import fx
>>> def attend(q, k, v):
...     keep = torch.arange(q.shape[-2])[:, None] >= torch.arange(k.shape[-2])[None, :]
...     return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
>>> gm = fx.symbolic_trace(attend)
>>> from amprewrite.graph.meta import ORIG, info_from_value
>>> for n, t in zip(gm.graph.find_nodes(op="placeholder"), [torch.ones(1, 2, 4, 8)] * 3):
...     n.meta[ORIG] = info_from_value(t)
>>> SimplifyAttentionMasks(None).run(gm)
True
>>> [(n.kwargs["attn_mask"], n.kwargs["is_causal"]) for n in gm.graph.nodes
...  if n.target is F.scaled_dot_product_attention]
[(None, True)]
"""

from __future__ import annotations

import torch
from torch import fx

from ..graph import meta as M
from ..graph.modules import get_attr
from ..precision.ops import family_of
from ..precision.report import record
from .base import Kind, Pass, arguments

__all__ = ["SimplifyAttentionMasks", "mask_pattern"]

_SDPA = (torch.nn.functional.scaled_dot_product_attention,
         torch.ops.aten.scaled_dot_product_attention.default)


def _cone(mask: fx.Node) -> list[fx.Node] | None:
    """The nodes ``mask`` is computed from, in graph order; None when one of them is a call
    that cannot be evaluated apart (a submodule, a random op)."""
    seen: set[fx.Node] = set()
    stack = [mask]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "call_module":
            return None
        fam = family_of(n) if n.op in ("call_function", "call_method") else None
        if fam is not None and fam.random:
            return None
        stack.extend(n.all_input_nodes)
    return [n for n in mask.graph.nodes if n in seen]


def _symbols(node: fx.Node) -> list[object]:
    """Per dimension of a placeholder: its size symbol where capture made it dynamic (dynamo's
    fake value), else None."""
    fake = node.meta.get("val", node.meta.get("example_value"))
    if not isinstance(fake, torch.Tensor):
        return []
    return [s.node.expr if isinstance(s, torch.SymInt) and s.node.expr.is_Symbol else None
            for s in fake.shape]


def _range(node: fx.Node, symbol: object) -> tuple[int, int | None]:
    """The sizes capture allows ``symbol`` (a placeholder's dynamic size): (lower, upper),
    upper None where unbounded."""
    fake = node.meta.get("val", node.meta.get("example_value"))
    env = next(s.node.shape_env for s in fake.shape if isinstance(s, torch.SymInt))
    vr = env.var_to_range.get(symbol)
    if vr is None:
        return 2, None
    try:  # int_oo (unbounded) converts to no int
        upper: int | None = int(vr.upper)
    except (TypeError, ValueError, AttributeError, OverflowError):
        upper = None
    return int(vr.lower), upper


def _meta_value(gm: fx.GraphModule, node: fx.Node, sizes: dict[object, int]) -> object:
    """A placeholder's or get_attr's stand-in: a meta tensor of its shape, each dynamic
    dimension of size symbol ``s`` sized ``sizes[s]`` where given."""
    if node.op == "get_attr":
        value = get_attr(gm, str(node.target))
        if not isinstance(value, torch.Tensor):
            return value
        return torch.empty_like(value, device="meta")
    vi = M.info(node)
    if vi.kind != "tensor" or vi.shape is None or None in vi.shape:
        raise LookupError(node.name)
    symbols = _symbols(node) or [None] * len(vi.shape)
    shape = [sizes.get(sym, s) if sym is not None else s for s, sym in zip(vi.shape, symbols)]
    return torch.empty(shape, dtype=vi.dtype or torch.float32, device="meta")


def _evaluate(gm: fx.GraphModule, cone: list[fx.Node], sizes: dict[object, int]
              ) -> torch.Tensor | None:
    """The mask (the cone's last node) with the inputs' dynamic sizes set by ``sizes`` (by
    size symbol); None when it reads a value it cannot have (an input's data)."""
    env: dict[fx.Node, object] = {}

    def load(a: object) -> object:
        return fx.node.map_arg(a, lambda n: env[n])

    try:
        for n in cone:
            if n.op in ("placeholder", "get_attr"):
                env[n] = _meta_value(gm, n, sizes)
            elif n.op == "call_function":
                env[n] = n.target(*load(n.args), **load(n.kwargs))
            elif n.op == "call_method":
                self_, *rest = load(n.args)
                env[n] = getattr(self_, str(n.target))(*rest, **load(n.kwargs))
            else:
                return None
    except Exception:  # a meta tensor's data was read, or the sizes are inconsistent
        return None
    out = env[cone[-1]]
    if not isinstance(out, torch.Tensor) or out.is_meta:
        return None
    return out


def mask_pattern(mask: torch.Tensor) -> str | None:
    """``"none"`` for a mask that masks nothing (all true, or all zero), ``"causal"`` for one
    equal to ``tril(ones(L, S))`` in every (L, S) slice (boolean, or 0 and ``-inf`` / the
    dtype's ``min`` additive), else None.

    >>> mask_pattern(torch.ones(2, 1, 3, 3, dtype=torch.bool))
    'none'
    >>> mask_pattern(torch.zeros(3, 3).masked_fill(torch.ones(3, 3).triu(1).bool(), -torch.inf))
    'causal'
    >>> mask_pattern(torch.ones(4, 4, dtype=torch.bool).tril(-1)) is None
    True
    """
    if mask.dtype == torch.bool:
        keep = mask
    elif mask.is_floating_point():
        masked = (mask == -torch.inf) | (mask == torch.finfo(mask.dtype).min)
        if not bool(((mask == 0) | masked).all()):
            return None
        keep = mask == 0
    else:
        return None
    if bool(keep.all()):
        return "none"
    if keep.dim() < 2 or keep.shape[-1] < 2 or keep.shape[-2] < 2:
        return None
    causal = torch.ones(keep.shape[-2:], dtype=torch.bool, device=keep.device).tril()
    return "causal" if bool((keep == causal).all()) else None


_SEQUENCE_CHECKED = 4096
"""The largest size of a dynamic dimension that reaches a mask's (L, S) plane it is checked at:
a dimension that may grow past it (or has no bound) keeps the mask."""


def _simplify(gm: fx.GraphModule, node: fx.Node) -> tuple[str, str] | None:
    """Rewrite one SDPA call whose mask masks nothing or is causal: (action, reason).

    The mask is evaluated at the example sizes, then with each dynamic size symbol of the
    cone's inputs at its lower bound, its example + 1 and 2 x example + 1; a symbol that
    changes the mask's last two dims (a sequence length) also at its upper bound, which
    must be at most ``_SEQUENCE_CHECKED`` (the other symbols at their lower bounds there)."""
    bound = arguments(gm, node)
    mask = (bound or {}).get("attn_mask")
    if not isinstance(mask, fx.Node) or bound.get("is_causal") not in (None, False):
        return None
    cone = _cone(mask)
    if cone is None:
        return None
    value = _evaluate(gm, cone, {})
    pattern = None if value is None else mask_pattern(value)
    if pattern is None:
        return None
    q, k = M.info(bound.get("query")), M.info(bound.get("key"))
    if pattern == "causal" and (q.shape is None or k.shape is None
                                or tuple(value.shape[-2:]) != (q.shape[-2], k.shape[-2])):
        return None
    example: dict[object, int] = {}
    ranges: dict[object, tuple[int, int | None]] = {}
    for n in cone:
        if n.op == "placeholder":
            for size, sym in zip(M.info(n).shape or (), _symbols(n)):
                if sym is not None and sym not in example:
                    example[sym], ranges[sym] = size, _range(n, sym)
    lowest = {sym: lo for sym, (lo, _) in ranges.items()}
    checked = {tuple(value.shape)}
    for sym, size in example.items():
        lo, hi = ranges[sym]
        tries = [lo, size + 1, 2 * size + 1]
        if hi is not None:
            tries = [t for t in tries if t <= hi]
        sequence = False
        for t in tries:
            other = _evaluate(gm, cone, {sym: t})
            if other is None or mask_pattern(other) != pattern:
                return None
            checked.add(tuple(other.shape))
            sequence |= other.shape[-2:] != value.shape[-2:]
        if sequence:
            if hi is None or hi > _SEQUENCE_CHECKED:
                return None
            other = _evaluate(gm, cone, {**lowest, sym: hi})
            if other is None or mask_pattern(other) != pattern:
                return None
            checked.add(tuple(other.shape))
    bound["attn_mask"] = None
    if pattern == "causal":
        bound["is_causal"] = True
    node.args = tuple(bound.pop(p) for p in ("query", "key", "value"))
    node.kwargs = bound
    shapes = ", ".join(str(list(s)) for s in sorted(checked))
    what = ("masks nothing" if pattern == "none"
            else "is exactly causal (tril(ones(L, S)) in every slice)")
    action = "attn_mask -> None" + (", is_causal=True" if pattern == "causal" else "")
    return action, (f"its mask is computed from the input sizes alone and {what} at every "
                    f"size it was checked at ({shapes}): without a mask SDPA can run flash "
                    f"attention, as the model's eager path does")


def _erase_unused(graph: fx.Graph, nodes: list[fx.Node]) -> None:
    """Erase the calls among ``nodes`` (a cone, in graph order) nothing reads any more."""
    for n in reversed(nodes):
        if n.op in ("call_function", "call_method") and not n.users and not n.is_impure():
            graph.erase_node(n)


class SimplifyAttentionMasks(Pass):
    """SDPA masks computed from sizes alone that mask nothing -> None; causal ones ->
    ``is_causal=True`` (see module docstring)."""

    name, kind = "simplify_attention_masks", Kind.REWRITE
    requires = (M.ORIG,)

    def run(self, gm: fx.GraphModule) -> bool:
        changed = False
        cones: set[fx.Node] = set()
        for node in M.each_node_of(n for n in gm.graph.nodes
                                   if n.op == "call_function" and n.target in _SDPA):
            mask = (arguments(gm, node) or {}).get("attn_mask")
            done = _simplify(gm, node)
            if done is None:
                continue
            record(gm, node, *done)
            changed = True
            cones.update(_cone(mask) or ())
        # after every call: the layers of a model share one mask
        _erase_unused(gm.graph, [n for n in gm.graph.nodes if n in cones])
        return changed
