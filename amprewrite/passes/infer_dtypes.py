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

import torch
from torch import fx

from .. import meta as M
from ..meta import OTHER, UNKNOWN_TENSOR, ValueInfo, info
from ..modules import get_attr
from ..ops import (
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


def _name(node: fx.Node) -> str:
    return op_name(node)


def _dtype_arg(node: fx.Node) -> torch.dtype | None:
    d = node.kwargs.get("dtype")
    if isinstance(d, torch.dtype):
        return d
    for a in node.args[1:] if node.op == "call_method" else node.args:
        if isinstance(a, torch.dtype):
            return a
    return None


def _tensor_infos(node: fx.Node) -> list[ValueInfo]:
    out: list[ValueInfo] = []
    fx.node.map_arg((node.args, node.kwargs), lambda n: out.append(info(n)) or n)
    return [i for i in out if i.kind == "tensor"]


def _has_float_scalar(node: fx.Node) -> bool:
    found = []
    fx.node.map_aggregate((node.args, node.kwargs),
                          lambda a: found.append(a) if type(a) is float else None)
    return bool(found)


def _promote(infos: list[ValueInfo], float_scalar: bool, int_to_float: bool) -> ValueInfo:
    if not infos:
        return UNKNOWN_TENSOR
    floats = {i.dtype for i in infos if i.dtype is not None and i.dtype.is_floating_point}
    if floats:
        if len(floats) == 1:
            return ValueInfo("tensor", floats.pop())
        if torch.float64 in floats:
            return ValueInfo("tensor", torch.float64)
        return ValueInfo("tensor", torch.float32)  # fp32 with low, or bf16 with fp16
    if any(i.dtype is None for i in infos):
        return UNKNOWN_TENSOR
    if float_scalar or int_to_float:
        return ValueInfo("tensor", torch.get_default_dtype())
    return ValueInfo("tensor", functools.reduce(torch.promote_types, [i.dtype for i in infos]))


def _reduces_along_dim(node: fx.Node) -> bool:
    """``x.max(dim)`` returns (values, indices); ``x.max()`` and ``torch.max(x, y)`` a tensor."""
    if "dim" in node.kwargs:
        return True
    return len(node.args) > 1 and isinstance(node.args[1], int)


def _module_info(gm: fx.GraphModule, node: fx.Node) -> ValueInfo:
    mod = gm.get_submodule(str(node.target))
    weight = getattr(mod, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.is_floating_point():
        return ValueInfo("tensor", weight.dtype)
    inputs = _tensor_infos(node)
    return _promote(inputs, False, False) if inputs else UNKNOWN_TENSOR


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
    first = info(node.args[0]) if node.args else OTHER
    if out is Out.ATTR:
        return OTHER if not reads_values(node) else first
    if out is Out.ITEM:
        if first.kind == "seq":
            idx = node.args[1]
            if first.items and isinstance(idx, int) and -len(first.items) <= idx < len(first.items):
                return first.items[idx]
            # A split's items are tensors of its input's dtype (None: unknown, still a tensor).
            return ValueInfo("tensor", first.dtype) if not first.items else OTHER
        return first
    if out is Out.NONTENSOR:
        return OTHER
    if out is Out.CONVERT:
        return _conversion(node, first)
    if out is Out.BOOL:
        return ValueInfo("tensor", torch.bool)
    if out is Out.INDEX:
        return ValueInfo("tensor", torch.int64)
    if out is Out.PAIR or (out is Out.MINMAX and _reduces_along_dim(node)):
        values, indices = ValueInfo("tensor", first.dtype), ValueInfo("tensor", torch.int64)
        return ValueInfo("seq", items=(values, indices))
    if out is Out.SPLIT:
        return ValueInfo("seq", dtype=first.dtype)
    if out is Out.TUPLE:
        return ValueInfo("seq")  # items of unknown dtypes: their casts are guarded
    if out is Out.BROADCAST:
        return ValueInfo("seq", items=tuple(_tensor_infos(node)))
    if out is Out.FACTORY and node.op in ("call_function", "call_method"):
        return _factory(node, first)
    if out is Out.CAT:
        seq = node.args[0] if node.args else node.kwargs.get("tensors", ())
        infos = [info(a) for a in seq] if isinstance(seq, (list, tuple)) else []
        # An element we know nothing about makes the result's dtype unknown, not bool.
        return _promote([i if i.kind == "tensor" else UNKNOWN_TENSOR for i in infos], False,
                        False)
    if out is Out.COMPLEX:
        d = _promote(_tensor_infos(node), False, True).dtype
        return ValueInfo("tensor", None if d is None else _COMPLEX_OF.get(d, torch.complex64))
    if out is Out.REAL:
        inputs = _tensor_infos(node)
        d = inputs[0].dtype if inputs else torch.get_default_dtype()
        if d is not None and d.is_complex:
            d = _REAL_OF.get(d, torch.float32)
        return ValueInfo("tensor", d)
    inputs = _tensor_infos(node)
    if not inputs:
        from_torch = (getattr(node.target, "__module__", "") or "").startswith("torch")
        return UNKNOWN_TENSOR if from_torch and node.op == "call_function" else OTHER
    int_to_float = out is Out.FLOAT and not node.kwargs.get("rounding_mode")
    result = _promote(inputs, _has_float_scalar(node), int_to_float)
    if out is Out.WIDEN and result.dtype is not None and not result.dtype.is_floating_point:
        named = _dtype_arg(node)  # x.sum(dtype=torch.int32)
        return ValueInfo("tensor", named if named is not None else torch.int64)
    return result


def _conversion(node: fx.Node, first: ValueInfo) -> ValueInfo:
    target = conversion_target(node)  # the registry's one reading of every spelling
    if isinstance(target, torch.dtype):
        return ValueInfo("tensor", target)
    if isinstance(target, fx.Node):
        return ValueInfo("tensor", info(target).dtype)  # x.type_as(y), x.to(y)
    if any(_reads_dtype(a) for a in (*node.args[1:], *node.kwargs.values())):
        return UNKNOWN_TENSOR  # x.to(y.dtype) with y's dtype unknown: a conversion to it
    return first


def _factory(node: fx.Node, first: ValueInfo) -> ValueInfo:
    name = _name(node)
    d = _dtype_arg(node)
    if d is not None:
        return ValueInfo("tensor", d)
    if name.endswith("_like") or name.startswith("new_"):
        return ValueInfo("tensor", first.dtype) if first.kind == "tensor" else UNKNOWN_TENSOR
    if name in FACTORY_FROM_DATA:
        return UNKNOWN_TENSOR  # the dtype follows the data
    if name in FACTORY_RANGE:
        # arange(n) of integers is int64; a float bound or fill value makes it float.
        float_valued = _has_float_scalar(node)
        return ValueInfo("tensor", torch.get_default_dtype() if float_valued else torch.int64)
    if node.op == "call_method" and first.kind == "tensor" and name.endswith("_"):
        return first  # x.normal_(), x.uniform_(): in place, x's dtype
    return ValueInfo("tensor", torch.get_default_dtype())


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
