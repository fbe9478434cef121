"""infer_dtypes: what the original fp32 model produces at each node (``meta[ORIG]``).

Dynamo-captured graphs already carry exact fake values, so this pass only fills nodes that lack
a ValueInfo: the whole graph after ``symbolic_trace``. It then works statically, like a type
checker: parameters have real dtypes, factories and conversions name theirs, comparisons give
bool, and arithmetic follows PyTorch's type promotion. Graph inputs have unknown dtypes; values
derived only from them stay unknown, and amprewrite casts those with a run-time guard.
"""

from __future__ import annotations

import builtins
import operator

import torch
from torch import fx
from torch.fx.passes.infra.pass_base import PassResult

from .. import meta as M
from ..meta import OTHER, UNKNOWN_TENSOR, ValueInfo, info
from ..ops import family_of

__all__ = ["infer_dtypes"]

_CONVERT = {
    "float": torch.float32, "double": torch.float64, "half": torch.float16,
    "bfloat16": torch.bfloat16, "long": torch.int64, "int": torch.int32, "short": torch.int16,
    "bool": torch.bool, "byte": torch.uint8, "char": torch.int8,
}
_COMPARE = {"eq", "ne", "lt", "le", "gt", "ge", "isnan", "isinf", "isfinite", "isneginf",
            "isposinf", "logical_and", "logical_or", "logical_not", "logical_xor", "any", "all",
            "isclose", "isin", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__",
            "signbit", "is_nonzero", "equal"}
_INDEX_OUT = {"argmax", "argmin", "argsort", "nonzero", "searchsorted", "bucketize",
              "argwhere", "count_nonzero", "randint", "randperm", "multinomial"}
_NONTENSOR = {"size", "dim", "numel", "ndimension", "nelement", "tolist", "item", "stride",
              "element_size", "is_floating_point", "is_contiguous", "__len__", "get_device",
              "data_ptr", "is_complex", "storage_offset"}
_NONTENSOR_ATTRS = {"shape", "dtype", "device", "ndim", "is_cuda", "requires_grad", "layout",
                    "is_sparse", "names"}
_FLOAT_FACTORIES = {"zeros", "ones", "empty", "rand", "randn", "eye", "linspace", "logspace",
                    "normal", "empty_strided", "hann_window", "hamming_window", "zeros_like",
                    "ones_like", "empty_like", "rand_like", "randn_like", "full_like", "new_zeros",
                    "new_ones", "new_empty", "new_full", "new_tensor", "tensor", "as_tensor",
                    "full", "scalar_tensor", "arange", "range"}
_PAIR_OUT = {"topk", "sort", "kthvalue", "cummax", "cummin", "mode"}  # (values, indices)
_SPLITS = {"split", "chunk", "unbind", "tensor_split", "split_with_sizes", "hsplit", "vsplit"}
# Families whose integer inputs come out as floats (exp(int) is a float).
_INT_TO_FLOAT_FAMILIES = {"exp", "expm1", "log", "log1p", "reciprocal", "rsqrt", "trig",
                          "softmax", "log_softmax", "softmin", "mean", "var", "norm", "logsumexp",
                          "sigmoid", "tanh", "activation", "normalize", "softplus"}
_TRUE_DIVISION = {operator.truediv, operator.itruediv, torch.true_divide, torch.sqrt, torch.erf}


def _name(node: fx.Node) -> str:
    t = node.target
    return t if isinstance(t, str) else getattr(t, "__name__", "")


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
    if all(i.dtype == torch.bool for i in infos):
        return ValueInfo("tensor", torch.bool)
    return ValueInfo("tensor", torch.int64)


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
        obj = gm
        for part in str(node.target).split("."):
            obj = getattr(obj, part)
        return M.info_from_value(obj)
    if node.op == "call_module":
        return _module_info(gm, node)
    name = _name(node)
    first = info(node.args[0]) if node.args else OTHER
    if node.target is builtins.getattr:
        return OTHER if node.args[1] in _NONTENSOR_ATTRS else first
    if node.target is operator.getitem:
        if first.kind == "seq":
            idx = node.args[1]
            if first.items and isinstance(idx, int) and -len(first.items) <= idx < len(first.items):
                return first.items[idx]
            # A split's items are tensors of its input's dtype (None: unknown, still a tensor).
            return ValueInfo("tensor", first.dtype) if not first.items else OTHER
        return first
    if name in _NONTENSOR:
        return OTHER
    if name in _CONVERT and node.op == "call_method":
        return ValueInfo("tensor", _CONVERT[name])
    if name in ("to", "type", "type_as"):
        d = _dtype_arg(node)
        if d is not None:
            return ValueInfo("tensor", d)
        other = [info(a) for a in node.args[1:] if isinstance(a, fx.Node)]
        if other and other[0].kind == "tensor":
            return ValueInfo("tensor", other[0].dtype)
        if any(_reads_dtype(a) for a in (*node.args[1:], *node.kwargs.values())):
            return UNKNOWN_TENSOR  # x.to(y.dtype) with y's dtype unknown: a conversion to it
        return first
    if name in _COMPARE:
        return ValueInfo("tensor", torch.bool)
    if name in _INDEX_OUT:
        return ValueInfo("tensor", torch.int64)
    if name in _PAIR_OUT or (name in ("max", "min", "median") and _reduces_along_dim(node)):
        values, indices = ValueInfo("tensor", first.dtype), ValueInfo("tensor", torch.int64)
        return ValueInfo("seq", items=(values, indices))
    if name in _SPLITS:
        return ValueInfo("seq", dtype=first.dtype)
    if name in _FLOAT_FACTORIES and node.op in ("call_function", "call_method"):
        d = _dtype_arg(node)
        if d is not None:
            return ValueInfo("tensor", d)
        if name.endswith("_like") or name.startswith("new_"):
            return ValueInfo("tensor", first.dtype) if first.kind == "tensor" else UNKNOWN_TENSOR
        if name in ("tensor", "as_tensor"):
            return UNKNOWN_TENSOR  # the dtype follows the data
        if name in ("arange", "range", "full", "scalar_tensor"):
            # arange(n) of integers is int64; a float bound or fill value makes it float.
            float_valued = _has_float_scalar(node)
            return ValueInfo("tensor", torch.get_default_dtype() if float_valued else torch.int64)
        return ValueInfo("tensor", torch.get_default_dtype())
    if name in ("cat", "concat", "concatenate", "stack", "hstack", "vstack", "dstack"):
        seq = node.args[0] if node.args else node.kwargs.get("tensors", ())
        infos = [info(a) for a in seq] if isinstance(seq, (list, tuple)) else []
        # An element we know nothing about makes the result's dtype unknown, not bool.
        return _promote([i if i.kind == "tensor" else UNKNOWN_TENSOR for i in infos], False,
                        False)
    inputs = _tensor_infos(node)
    if not inputs:
        from_torch = (getattr(node.target, "__module__", "") or "").startswith("torch")
        return UNKNOWN_TENSOR if from_torch and node.op == "call_function" else OTHER
    fam = family_of(node)
    int_to_float = (fam is not None and fam.name in _INT_TO_FLOAT_FAMILIES) or (
        node.target in _TRUE_DIVISION or (name in ("div", "true_divide", "sqrt")
        and not node.kwargs.get("rounding_mode")))
    return _promote(inputs, _has_float_scalar(node), int_to_float)


def infer_dtypes(gm: fx.GraphModule) -> PassResult:
    """Fill ``meta[ORIG]`` for every node that lacks it."""
    changed = False
    for node in M.each_node(gm.graph):
        if node.op != "output" and M.ORIG not in node.meta:
            node.meta[M.ORIG] = _infer(gm, node)
            changed = True
    return PassResult(gm, changed)
