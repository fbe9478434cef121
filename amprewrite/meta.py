"""Per-node facts the passes share, all kept in ``node.meta`` under ``amp_*`` keys.

Graph invariants every pass may rely on after capture (and must preserve):

- ``meta[ORIG]`` is a :class:`ValueInfo`: what the *original fp32 model* produces at this node.
- ``meta[MODULE_PATH]`` is the dotted path of the innermost module the node came from ("" = root),
  ``meta[MODULE_TYPES]`` the module types enclosing it, outermost first.
- get_attr targets are the original model's qualified parameter/buffer names.
"""

from __future__ import annotations

import contextvars
import operator
import os
import re
from dataclasses import dataclass
from typing import Literal

import torch
from torch import fx

__all__ = ["ValueInfo", "current_node", "each_node", "source_line"]

ORIG = "amp_orig"  # ValueInfo of the original model's value
MODULE_PATH = "amp_module_path"
MODULE_TYPES = "amp_module_types"
FAMILY = "amp_family"  # Family name or None
CLASS = "amp_class"  # Precision
REASON = "amp_reason"  # why the class was chosen
NATURAL = "amp_natural"  # "high" / "low" / None: the precision the value is computed in
LABEL = "amp_label"  # "high" / "low" / None: the dtype the value physically has after casts
CAST = "amp_cast"  # set on cast nodes amprewrite inserted: the target dtype
FORCE = "amp_force"  # (Precision, reason) a rewrite pass decided for this node

HIGH, LOW = "high", "low"


@dataclass(frozen=True)
class ValueInfo:
    """What a node produces: a tensor (dtype, numel), a sequence of values, or something else.

    ``dtype is None`` on a tensor means the dtype is not known (a graph input traced without
    example inputs); casts of such values are guarded at run time.
    """

    kind: Literal["tensor", "seq", "other"]
    dtype: torch.dtype | None = None
    numel: int | None = None
    items: tuple[ValueInfo, ...] = ()
    shape: tuple[int | None, ...] | None = None

    @property
    def is_float(self) -> bool:
        return self.kind == "tensor" and (self.dtype is None or self.dtype.is_floating_point)

    @property
    def is_int(self) -> bool:
        """An integer (not bool) tensor: the values that position cones start from."""
        return (
            self.kind == "tensor"
            and self.dtype is not None
            and not self.dtype.is_floating_point
            and not self.dtype.is_complex
            and self.dtype != torch.bool
        )

    def float_dtype(self) -> torch.dtype | None:
        """The float dtype of this value, or of the first float item of a sequence."""
        if self.kind == "tensor":
            return self.dtype if self.is_float else None
        if self.kind == "seq" and not self.items and self.dtype is not None:
            # A homogeneous sequence of unknown length (chunk, split, unbind).
            return self.dtype if self.dtype.is_floating_point else None
        for item in self.items:
            d = item.float_dtype()
            if d is not None:
                return d
        return None

    def has_float(self) -> bool:
        if self.kind == "tensor":
            return self.is_float
        return self.float_dtype() is not None


UNKNOWN_TENSOR = ValueInfo("tensor", None)
OTHER = ValueInfo("other")


def _int_or_none(x: object) -> int | None:
    if isinstance(x, torch.SymInt):
        # The example's size, read without a guard: int(SymInt) would specialise the dynamic
        # dimension to it in dynamo's shape environment. Unbacked sizes have no hint.
        hint = getattr(x.node, "hint", None)
        return None if hint is None else int(hint)
    try:
        return int(x)
    except Exception:
        return None


def info_from_value(value: object) -> ValueInfo:
    """ValueInfo of a real or fake value (dynamo's ``example_value``, ShapeProp's results)."""
    if isinstance(value, torch.Tensor):
        shape = tuple(_int_or_none(s) for s in value.shape)
        return ValueInfo("tensor", value.dtype, _int_or_none(value.numel()), shape=shape)
    if isinstance(value, (tuple, list)):
        return ValueInfo("seq", items=tuple(info_from_value(v) for v in value))
    return OTHER


def info(node: object) -> ValueInfo:
    """The ValueInfo of a node argument (constants are 'other')."""
    if isinstance(node, fx.Node):
        return node.meta.get(ORIG, UNKNOWN_TENSOR)
    return OTHER


_DROP_ROOT = re.compile(r"^L\['[^']*'\]")
_GETATTR = re.compile(r"getattr\(([^,()]+),\s*'([^']*)'\)")


def clean_module_path(path: str) -> str:
    """Turn dynamo's ``L['self'].layers[0]._modules['fc']`` into ``layers.0.fc``.

    >>> clean_module_path("L['self'].model.layers[0].self_attn")
    'model.layers.0.self_attn'
    """
    s = path
    while _GETATTR.search(s):
        s = _GETATTR.sub(r"\1.\2", s)
    s = _DROP_ROOT.sub("", s)
    s = re.sub(r"_modules\['([^']*)'\]", r"\1", s)
    s = re.sub(r"\[(\d+)\]", r".\1", s)
    s = re.sub(r"\['([^']*)'\]", r".\1", s)
    s = re.sub(r"\.+", ".", s)
    return s.strip(".")


def source_line(node: fx.Node) -> str | None:
    """``file:line`` of the user code that produced ``node``, when it was recorded."""
    trace = node.meta.get("stack_trace")
    if not trace:
        return None
    found = [(f, line) for f, line in re.findall(r'File "([^"]+)", line (\d+)', trace)
             if not f.startswith(_TORCH_DIR)]  # symbolic traces end in torch/fx/proxy.py
    return f"{found[-1][0]}:{found[-1][1]}" if found else None


_TORCH_DIR = os.path.dirname(torch.__file__)
_CURRENT: contextvars.ContextVar[fx.Node | None] = contextvars.ContextVar("amp_node", default=None)


def each_node(graph: fx.Graph, op: str | None = None):
    """Iterate over a snapshot of ``graph``'s nodes, remembering the current one for errors."""
    for node in list(graph.nodes):
        if op is None or node.op == op:
            _CURRENT.set(node)
            yield node
    _CURRENT.set(None)


def current_node() -> fx.Node | None:
    """The node the running pass was on (for error messages)."""
    return _CURRENT.get()


def is_inplace(node: fx.Node) -> bool:
    """Does ``node`` write into its first argument (``x.add_(y)``, ``F.relu(x, inplace=True)``)?"""
    if node.kwargs.get("inplace") is True:
        return True
    if node.op == "call_method":
        name = str(node.target)
        return name.endswith("_") and not name.endswith("__")
    if node.op == "call_function":
        if node.target in (operator.iadd, operator.isub, operator.imul, operator.itruediv):
            return True
        name = getattr(node.target, "__name__", "")
        return name.endswith("_") and not name.endswith("__") and not name.startswith("_")
    return False
