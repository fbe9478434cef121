"""infer_dtypes: what the original fp32 model produces at each node (``meta[ORIG]``).

Dynamo-captured graphs already carry exact fake values, so this pass only fills nodes that lack
a ValueInfo: the whole graph after ``symbolic_trace``. It then works statically, like a type
checker: parameters have real dtypes, factories and conversions name theirs, comparisons give
bool, and arithmetic follows PyTorch's type promotion. Graph inputs have unknown dtypes; values
derived only from them stay unknown, and amprewrite casts those with a run-time guard.
"""

from __future__ import annotations

import builtins
import functools
from collections.abc import Callable

import torch
from torch import fx

from ..graph import meta as M
from ..graph.meta import OTHER, UNKNOWN_TENSOR, ValueInfo, info
from ..graph.modules import get_attr, submodule
from ..precision.ops import (
    FACTORY_FROM_DATA,
    FACTORY_RANGE,
    Out,
    conversion_target,
    family_of,
    op_name,
    reads_values,
)
from .base import Kind, Pass

__all__ = ["InferDtypes", "infer_value"]

_COMPLEX_OF = {torch.float64: torch.complex128, torch.float16: torch.complex32}
_REAL_OF = {torch.complex128: torch.float64, torch.complex32: torch.float16}


@functools.cache
def _tensor(dtype: torch.dtype | None) -> ValueInfo:
    """A tensor of ``dtype`` (None: unknown), size unknown: one shared (frozen) ValueInfo per
    dtype, as most nodes of a symbolic trace get one of a handful."""
    return ValueInfo("tensor", dtype)


def _first(node: fx.Node) -> ValueInfo:
    """What the node's first argument is ('other' for a constant or no argument)."""
    return info(node.args[0]) if node.args else OTHER


def _dtype_arg(node: fx.Node) -> torch.dtype | None:
    d = node.kwargs.get("dtype")
    if isinstance(d, torch.dtype):
        return d
    for a in node.args[1:] if node.op == "call_method" else node.args:
        if isinstance(a, torch.dtype):
            return a
    return None


def _tensor_infos(node: fx.Node) -> list[ValueInfo]:
    """The ValueInfos of ``node``'s tensor inputs in argument order, each input once: what type
    promotion reads (a repeated input, ``x * x``, adds nothing to it)."""
    return [i for a in node.all_input_nodes
            if (i := a.meta.get(M.ORIG, UNKNOWN_TENSOR)).kind == "tensor"]


def _has_float_scalar(node: fx.Node) -> bool:
    found = []
    fx.node.map_aggregate((node.args, node.kwargs),
                          lambda a: found.append(a) if type(a) is float else None)
    return bool(found)


def _promote(infos: list[ValueInfo], int_to_float: bool = False,
             scalars_of: fx.Node | None = None) -> ValueInfo:
    """PyTorch's type promotion over ``infos``; a float scalar among the arguments of
    ``scalars_of`` makes integer inputs float (looked for only when no input is float)."""
    if not infos:
        return UNKNOWN_TENSOR
    floats = {i.dtype for i in infos if i.dtype is not None and i.dtype.is_floating_point}
    if floats:
        if len(floats) == 1:
            return _tensor(floats.pop())
        if torch.float64 in floats:
            return _tensor(torch.float64)
        return _tensor(torch.float32)  # fp32 with low, or bf16 with fp16
    if any(i.dtype is None for i in infos):
        return UNKNOWN_TENSOR
    if int_to_float or (scalars_of is not None and _has_float_scalar(scalars_of)):
        return _tensor(torch.get_default_dtype())
    return _tensor(functools.reduce(torch.promote_types, [i.dtype for i in infos]))


def _reduces_along_dim(node: fx.Node) -> bool:
    """``x.max(dim)`` returns (values, indices); ``x.max()`` and ``torch.max(x, y)`` a tensor."""
    if "dim" in node.kwargs:
        return True
    return len(node.args) > 1 and isinstance(node.args[1], int)


def _module_info(gm: fx.GraphModule, node: fx.Node) -> ValueInfo:
    mod = submodule(gm, str(node.target))
    weight = getattr(mod, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.is_floating_point():
        return _tensor(weight.dtype)
    return _promote(_tensor_infos(node))


def _reads_dtype(arg: object) -> bool:
    """Is ``arg`` the node ``getattr(y, "dtype")`` (``y.dtype`` in a symbolic trace)?"""
    return (isinstance(arg, fx.Node) and arg.target is builtins.getattr
            and len(arg.args) > 1 and arg.args[1] == "dtype")


def _infer(gm: fx.GraphModule, node: fx.Node) -> ValueInfo:
    if node.op == "placeholder":
        return UNKNOWN_TENSOR
    if node.op == "get_attr":
        return M.info_from_value(get_attr(gm, str(node.target)))
    if node.op == "call_module":
        return _module_info(gm, node)
    fam = family_of(node)
    out = fam.out if fam is not None else None
    if out is None or out is Out.PROMOTE:  # most nodes: asked first (an Enum hashes in Python)
        return _arithmetic(node, out)
    rule = _BY_OUT.get(out)
    return rule(node) if rule is not None else _arithmetic(node, out)


def _arithmetic(node: fx.Node, out: Out | None) -> ValueInfo:
    """Type promotion over the tensor inputs (PROMOTE, FLOAT, WIDEN, an unknown op)."""
    inputs = _tensor_infos(node)
    if not inputs:
        from_torch = (getattr(node.target, "__module__", "") or "").startswith("torch")
        return UNKNOWN_TENSOR if from_torch and node.op == "call_function" else OTHER
    int_to_float = out is Out.FLOAT and not node.kwargs.get("rounding_mode")
    result = _promote(inputs, int_to_float, scalars_of=node)
    if out is Out.WIDEN and result.dtype is not None and not result.dtype.is_floating_point:
        named = _dtype_arg(node)  # x.sum(dtype=torch.int32)
        return _tensor(named if named is not None else torch.int64)
    return result


def _attribute(node: fx.Node) -> ValueInfo:
    return OTHER if not reads_values(node) else _first(node)


def _item(node: fx.Node) -> ValueInfo:
    first = _first(node)
    if first.kind == "seq":
        idx = node.args[1]
        if first.items and isinstance(idx, int) and -len(first.items) <= idx < len(first.items):
            return first.items[idx]
        # A split's items are tensors of its input's dtype (None: unknown, still a tensor).
        return _tensor(first.dtype) if not first.items else OTHER
    return first


def _pair(node: fx.Node) -> ValueInfo:
    return ValueInfo("seq", items=(_tensor(_first(node).dtype), _tensor(torch.int64)))


def _minmax(node: fx.Node) -> ValueInfo:
    return _pair(node) if _reduces_along_dim(node) else _arithmetic(node, Out.MINMAX)


def _broadcast(node: fx.Node) -> ValueInfo:
    args: list[fx.Node] = []  # one item per tensor argument, a repeated one each time
    fx.node.map_arg((node.args, node.kwargs), lambda n: args.append(n) or n)
    return ValueInfo("seq", items=tuple(i for i in map(info, args) if i.kind == "tensor"))


def _cat(node: fx.Node) -> ValueInfo:
    seq = node.args[0] if node.args else node.kwargs.get("tensors", ())
    infos = [info(a) for a in seq] if isinstance(seq, (list, tuple)) else []
    # An element we know nothing about makes the result's dtype unknown, not bool.
    return _promote([i if i.kind == "tensor" else UNKNOWN_TENSOR for i in infos])


def _complex(node: fx.Node) -> ValueInfo:
    d = _promote(_tensor_infos(node), int_to_float=True).dtype
    return _tensor(None if d is None else _COMPLEX_OF.get(d, torch.complex64))


def _real(node: fx.Node) -> ValueInfo:
    inputs = _tensor_infos(node)
    d = inputs[0].dtype if inputs else torch.get_default_dtype()
    if d is not None and d.is_complex:
        d = _REAL_OF.get(d, torch.float32)
    return _tensor(d)


def _conversion(node: fx.Node) -> ValueInfo:
    target = conversion_target(node)  # the registry's one reading of every spelling
    if isinstance(target, torch.dtype):
        return _tensor(target)
    if isinstance(target, fx.Node):
        return _tensor(info(target).dtype)  # x.type_as(y), x.to(y)
    if any(_reads_dtype(a) for a in (*node.args[1:], *node.kwargs.values())):
        return UNKNOWN_TENSOR  # x.to(y.dtype) with y's dtype unknown: a conversion to it
    return _first(node)


def _factory(node: fx.Node) -> ValueInfo:
    name = op_name(node)
    d = _dtype_arg(node)
    if d is not None:
        return _tensor(d)
    first = _first(node)
    if name.endswith("_like") or name.startswith("new_"):
        return _tensor(first.dtype) if first.kind == "tensor" else UNKNOWN_TENSOR
    if name in FACTORY_FROM_DATA:
        return UNKNOWN_TENSOR  # the dtype follows the data
    if name in FACTORY_RANGE:
        # arange(n) of integers is int64; a float bound or fill value makes it float.
        float_valued = _has_float_scalar(node)
        return _tensor(torch.get_default_dtype() if float_valued else torch.int64)
    if node.op == "call_method" and first.kind == "tensor" and name.endswith("_"):
        return first  # x.normal_(), x.uniform_(): in place, x's dtype
    return _tensor(torch.get_default_dtype())


# The output kinds with a rule of their own; the others are type promotion (_arithmetic).
# Every node that reaches them is a call_function or call_method (the op a family names).
_BY_OUT: dict[Out, Callable[[fx.Node], ValueInfo]] = {
    Out.ATTR: _attribute,
    Out.ITEM: _item,
    Out.NONTENSOR: lambda node: OTHER,
    Out.CONVERT: _conversion,
    Out.BOOL: lambda node: _tensor(torch.bool),
    Out.INDEX: lambda node: _tensor(torch.int64),
    Out.PAIR: _pair,
    Out.MINMAX: _minmax,
    Out.SPLIT: lambda node: ValueInfo("seq", dtype=_first(node).dtype),
    Out.TUPLE: lambda node: ValueInfo("seq"),  # items of unknown dtypes: their casts are guarded
    Out.BROADCAST: _broadcast,
    Out.FACTORY: _factory,
    Out.CAT: _cat,
    Out.COMPLEX: _complex,
    Out.REAL: _real,
}


def infer_value(gm: fx.GraphModule, node: fx.Node) -> ValueInfo:
    """What ``node`` produces, from its target and its inputs' ``meta[ORIG]``."""
    return _infer(gm, node)


class InferDtypes(Pass):
    """Fill ``meta[ORIG]`` for every node that lacks it."""

    name, kind = "infer_dtypes", Kind.ANALYSIS
    writes = (M.ORIG,)

    def run(self, gm: fx.GraphModule) -> bool:
        for node in M.each_node(gm.graph):
            if node.op != "output" and M.ORIG not in node.meta:
                node.meta[M.ORIG] = _infer(gm, node)
        return False  # meta only: the graph's code is unchanged
