"""paint_precision: give every node a precision class and the precision it is computed in.

Order of the rules, each overriding the previous (the reason of the last one is recorded):

1. the op-family table (``amprewrite/ops.py``); unknown functions PROMOTE like autocast does,
   unknown leaf modules run in FP32 on their own fp32 parameters; non-float values NONFLOAT;
2. **position cones**: a float computed from an integer tensor (``arange``, ``position_ids``,
   timesteps) is FP32 up to and including the first bounded op (sin/cos/sigmoid/tanh/softmax) or
   LOW op: bf16 keeps only 769 distinct values of 0..4095, so positions would collide;
3. the user's ``keep_fp32`` / ``allow_low`` overrides (module path, module type, family name).

Then the *natural* precision of each float value follows in topological order: LOW ops are
low, FP32 ops high, PROMOTE and NEUTRAL ops the widest of their float inputs (autocast's rule,
which keeps the residual stream of a transformer in fp32).
"""

from __future__ import annotations

import builtins
import operator

import torch
from torch import fx
from torch.fx.passes.infra.pass_base import PassResult

from .. import meta as M
from ..meta import HIGH, LOW, info
from ..ops import FAMILIES, Precision, family_of, precision_of
from ..plan import float_inputs
from ..policy import Policy, Selector

__all__ = ["PaintPrecision", "matches"]

_CONVERSIONS = {"float": torch.float32, "double": torch.float64, "half": torch.float16,
                "bfloat16": torch.bfloat16}
_ARANGE = {torch.arange, getattr(torch, "range", torch.arange)}


def matches(node: fx.Node, selector: Selector) -> bool:
    """Does a keep_fp32 / allow_low entry select ``node``?"""
    if isinstance(selector, type):
        return any(issubclass(t, selector) for t in node.meta.get(M.MODULE_TYPES, ()))
    if selector.startswith("node:"):
        return node.name == selector[5:]
    if selector in FAMILIES:
        return node.meta.get(M.FAMILY) == selector
    path = node.meta.get(M.MODULE_PATH, "")
    return path == selector or path.startswith(selector + ".")


def _conversion_target(node: fx.Node) -> torch.dtype | None:
    """The float dtype an explicit conversion (``x.float()``, ``x.to(torch.float32)``) names."""
    if node.op != "call_method":
        return None
    name = str(node.target)
    if name in _CONVERSIONS:
        return _CONVERSIONS[name]
    if name in ("to", "type"):
        for a in (*node.args[1:], node.kwargs.get("dtype")):
            if isinstance(a, torch.dtype):
                return a if a.is_floating_point else None
    return None


class PaintPrecision:
    """Set ``meta[CLASS]``, ``meta[REASON]``, ``meta[FAMILY]`` and ``meta[NATURAL]``."""

    def __init__(self, policy: Policy):
        self.policy = policy

    def __call__(self, gm: fx.GraphModule) -> PassResult:
        low = self.policy.dtype
        for node in M.each_node(gm.graph):
            self._classify(gm, node, low)
        self._cones(gm)
        for node in M.each_node(gm.graph):
            self._override(node)
        for node in M.each_node(gm.graph):
            node.meta[M.NATURAL] = self._natural(node, low)
        return PassResult(gm, True)

    def _classify(self, gm: fx.GraphModule, node: fx.Node, low: torch.dtype) -> None:
        module = gm.get_submodule(str(node.target)) if node.op == "call_module" else None
        fam = family_of(node, module)
        node.meta[M.FAMILY] = fam.name if fam else None
        value = info(node)
        if node.op in ("placeholder", "get_attr", "output"):
            cls, why = None, {"placeholder": "graph input", "get_attr": "parameter or buffer",
                              "output": "graph output"}[node.op]
        elif not value.has_float():
            cls, why = Precision.NONFLOAT, "integer, bool or non-tensor value"
        elif value.float_dtype() not in (None, torch.float32, low):
            cls = Precision.NONFLOAT
            why = f"{value.float_dtype()} value: computed as the model does"
        elif (forced := node.meta.get(M.FORCE)) is not None:
            cls, why = forced
        elif M.is_inplace(node):
            # After functionalize, only writes into a private clone or back into a graph input.
            cls, why = Precision.NEUTRAL, "in-place op: runs in the dtype of the tensor it writes"
            node.meta["amp_tied"] = True
        elif (target := _conversion_target(node)) is not None:
            cls = Precision.LOW if target == low else Precision.FP32
            why = f"explicit conversion to {target} in the model"
        elif fam is not None:
            cls, why = precision_of(node, fam, module), f"op family '{fam.name}'"
        elif node.op == "call_module":
            cls, why = Precision.FP32, (f"unknown module {type(module).__name__}: runs with its "
                                        "own fp32 parameters")
        elif node.target is builtins.getattr:
            cls, why = Precision.NEUTRAL, "attribute of a tensor"
        else:
            cls, why = Precision.PROMOTE, "not in the op table: runs in the widest float input"
        if (node.target is operator.getitem and node.args
                and info(node.args[0]).kind == "seq"):
            node.meta["amp_tied"] = True  # an element of a tuple: cast the tuple's producer
        node.meta[M.CLASS] = cls
        node.meta[M.REASON] = why

    def _cones(self, gm: fx.GraphModule) -> None:
        """Mark position cones FP32: from int->float conversions to the first bounded/LOW op."""
        seeds = [n for n in gm.graph.nodes if self._is_seed(n)]
        seen: set[fx.Node] = set()
        stack = [(n, n) for n in seeds]
        while stack:
            node, seed = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            cls = node.meta.get(M.CLASS)
            fam = FAMILIES.get(node.meta.get(M.FAMILY) or "")
            ends = cls == Precision.LOW or (fam is not None and fam.bounded)
            if M.is_inplace(node):
                continue  # runs in the dtype of the tensor it writes, whatever its class
            node.meta[M.CLASS] = Precision.FP32
            node.meta[M.REASON] = f"position cone from '{seed.name}' (integer values as floats)"
            node.meta.pop("amp_tied", None)
            if ends:
                continue
            for user in node.users:
                if user.op != "output" and user.meta.get(M.CLASS) not in (None, Precision.NONFLOAT):
                    stack.append((user, seed))

    @staticmethod
    def _is_seed(node: fx.Node) -> bool:
        if node.meta.get(M.CLASS) in (None, Precision.NONFLOAT):
            return False
        if node.target in _ARANGE:
            return True  # arange(..., dtype=float): integer values born as floats
        fam = FAMILIES.get(node.meta.get(M.FAMILY) or "")
        if fam is not None and not fam.numeric:
            return False  # an embedding reads its integer input as indices, not as numbers
        args: list[fx.Node] = []
        fx.node.map_arg((node.args, node.kwargs), lambda n: args.append(n) or n)
        # Floats born from integers only (x.float(), ids * 0.5, int / int). An op that also
        # reads float tensors uses its integer inputs as indices, offsets or masks (an MoE's
        # grouped matmul with expert offsets), not as the numbers it computes with.
        return any(info(a).is_int for a in args) and not any(info(a).is_float for a in args)

    def _override(self, node: fx.Node) -> None:
        cls = node.meta.get(M.CLASS)
        if cls in (None, Precision.NONFLOAT) or M.is_inplace(node):
            return  # an in-place op (after functionalize: on a private copy) stays tied to it
        for sel in self.policy.keep_fp32:
            if matches(node, sel):
                node.meta[M.CLASS] = Precision.FP32
                node.meta[M.REASON] = f"keep_fp32={_show(sel)}"
                node.meta.pop("amp_tied", None)
                return
        for sel in self.policy.allow_low:
            if matches(node, sel) and cls == Precision.FP32:
                node.meta[M.CLASS] = Precision.PROMOTE
                node.meta[M.REASON] = f"allow_low={_show(sel)}: runs in its inputs' precision"
                return

    @staticmethod
    def _natural(node: fx.Node, low: torch.dtype) -> str | None:
        value = info(node)
        cls = node.meta.get(M.CLASS)
        if node.op == "output" or cls == Precision.NONFLOAT or not value.has_float():
            return None
        if cls is None:  # graph inputs and parameters: as given
            return LOW if value.float_dtype() == low else HIGH
        if cls == Precision.LOW:
            return LOW
        if cls == Precision.FP32:
            return HIGH
        inputs = [n.meta.get(M.NATURAL) for n in float_inputs(node)]
        if node.meta.get("amp_tied") and inputs:
            return inputs[0]
        if not inputs:
            return HIGH  # a factory such as torch.ones(...): fp32 like the model
        return HIGH if HIGH in inputs or None in inputs else LOW


def _show(sel: Selector) -> str:
    return sel.__name__ if isinstance(sel, type) else repr(sel)
