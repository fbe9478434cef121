"""Per-node facts the passes share, all kept in ``node.meta`` under ``amp_*`` keys.

Graph invariants every pass may rely on after capture (and must preserve):

- ``meta[ORIG]`` is a :class:`ValueInfo`: what the *original fp32 model* produces at this node.
- ``meta[MODULE_PATH]`` is the dotted path of the innermost module the node came from ("" = root),
  ``meta[MODULE_TYPES]`` the module types enclosing it, outermost first.
- get_attr targets are the original model's qualified parameter/buffer names.

Every key, who writes it and who reads it (each pass declares the same in its ``writes`` and
``requires``; :func:`amprewrite.passes.run_pipeline` checks the order):

==============  =====================================  ==========================================
key             written by                             read by
==============  =====================================  ==========================================
ORIG            capture (dynamo), infer_dtypes, any    every pass
                rewrite for the nodes it makes
MODULE_PATH     capture (copied by copy_provenance)    reports, keep_fp32 / allow_low selectors
MODULE_TYPES    capture (copied by copy_provenance)    keep_fp32 / allow_low by module type
FORCE           transform_bodies, replace_upsample     paint_precision
RANGE           record_ranges                          paint_precision, reports
FLOAT8          float8_linears                         reports (each candidate linear's verdict)
FAMILY          paint_precision                        plan, insert_casts, reports
CLASS           paint_precision, insert_casts          plan, insert_casts, reports
REASON          paint_precision, insert_casts          reports
TIED            paint_precision                        plan (never cast the tied input)
MIXED           paint_precision (probe-confirmed)      plan, insert_casts (dtype=), reports
NATURAL         paint_precision, insert_casts          plan
LABEL           plan_casts, store_params               insert_casts, reports
CAST            insert_casts                           store_params, reports, re-transforms
MADE_BY         copy_provenance (the running pass)     reports (nodes a rewrite pass made)
PLAN_KEY        paint_precision                        saved plans (the node's stable key)
==============  =====================================  ==========================================

``PASS_WRITTEN`` lists the keys a pass decides; a re-transform drops them (:func:`reset`) and
keeps what capture wrote.

Graph-level keys, in ``gm.meta``:

==============  =====================================  ==========================================
key             written by                             read by
==============  =====================================  ==========================================
REPORT_KEY      transform (a Report), transform_bodies  every pass that records, reports, views
                (a body's own)
POLICY_KEY      transform (the Policy)                 re-transforms, reports
==============  =====================================  ==========================================
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import functools
import os
import re
from dataclasses import dataclass
from typing import Literal

import torch
from torch import fx

__all__ = ["PASS_WRITTEN", "PROVENANCE", "Label", "ValueInfo", "copy_provenance",
           "current_node", "current_pass", "each_node", "fake_value", "node_kind", "reset",
           "source_line"]

ORIG = "amp_orig"  # ValueInfo of the original model's value
MODULE_PATH = "amp_module_path"
MODULE_TYPES = "amp_module_types"
FAMILY = "amp_family"  # Family name or None
CLASS = "amp_class"  # Precision
REASON = "amp_reason"  # why the class was chosen
TIED = "amp_tied"  # True: the node's first float input is the same variable (in-place, tuple item)
NATURAL = "amp_natural"  # Label or None: the precision the value is computed in
LABEL = "amp_label"  # Label or None: the dtype the value physically has after casts
CAST = "amp_cast"  # set on cast nodes amprewrite inserted: the target dtype
FORCE = "amp_force"  # (Precision, reason) a rewrite pass decided for this node
RANGE = "amp_range"  # ranges.ValueRange: the fp32 value's range on the example inputs
FLOAT8 = "amp_float8"  # str: a candidate linear's float8 verdict and reason (float8_linears)
REPORT_KEY = "amprewrite_report"  # gm.meta: the transform's Report
POLICY_KEY = "amprewrite_policy"  # gm.meta: the Policy a GraphModule was transformed with
# gm.meta: every recorded value's range by node name, what the plan was made from
# (record_ranges; amprewrite.compile.block_plans widens it with later blocks, ranks and steps)
RANGES_KEY = "amprewrite_ranges"
# gm.meta: each float8 candidate's (bf16 error, float8 error) by node name (float8_linears)
FP8_ERRORS_KEY = "amprewrite_fp8_errors"
# gm.meta: each checkpointed region body's inputs on the example inputs, by the body's attribute
# (record_ranges, with fp8; transform_bodies hands them to the body's float8 check and drops them)
BODY_INPUTS_KEY = "amprewrite_body_inputs"
MADE_BY = "amp_made_by"  # name of the pass that made this node (set by copy_provenance)
# ops.Mixed: the mixed-dtype signature an FP32 node's kernel was confirmed to take (it reads its
# data input low and computes in fp32; DESIGN.md, "Compute dtype is not storage dtype").
MIXED = "amp_mixed"
# str: the node's key in a saved plan (module path, op, occurrence; precision/saved_plan.py)
PLAN_KEY = "amp_plan_key"

# Where a node came from: what every node a pass makes inherits from the node it replaces.
PROVENANCE = (MODULE_PATH, MODULE_TYPES, "stack_trace", "nn_module_stack")
# What passes decide: dropped when a transformed graph is transformed again.
PASS_WRITTEN = (FORCE, RANGE, FAMILY, CLASS, REASON, TIED, NATURAL, LABEL, CAST, MADE_BY, MIXED,
                FLOAT8, PLAN_KEY)


class Label(str, enum.Enum):
    """The precision a float value is computed in or stored as: fp32 (HIGH) or the target dtype."""

    HIGH = "high"
    LOW = "low"


HIGH, LOW = Label.HIGH, Label.LOW


def node_kind(node: fx.Node) -> str:
    """What a node is, in the one vocabulary of reports, checks and views: ``"cast"`` (one
    amprewrite inserted), its precision class (``"low"``, ``"fp32"``, ...), or ``"input"``,
    ``"param"``, ``"output"``, ``"nonfloat"``."""
    if CAST in node.meta:
        return "cast"
    cls = node.meta.get(CLASS)
    if cls is not None:
        return cls.value
    return {"placeholder": "input", "get_attr": "param", "output": "output"}.get(node.op,
                                                                                 "nonfloat")


def fake_value(node: fx.Node, default: object = None) -> object:
    """The value a capture recorded for ``node``: dynamo's ``example_value``, else the ``val``
    of ATen-level graphs; ``default`` when there is none (symbolic traces)."""
    value = node.meta.get("example_value", _NONE)
    if value is _NONE:
        value = node.meta.get("val", default)
    return value


_NONE = object()


def copy_provenance(src: fx.Node, dst: fx.Node, value: bool = False) -> fx.Node:
    """Give ``dst`` the module path, module types and source line of ``src`` (and with
    ``value=True`` its ValueInfo too); returns ``dst``."""
    keys = (*PROVENANCE, ORIG) if value else PROVENANCE
    for key in keys:
        if key in src.meta:
            dst.meta[key] = src.meta[key]
    made_by = _PASS.get()
    if made_by is not None and dst is not src:
        dst.meta[MADE_BY] = made_by
    return dst


def reset(node: fx.Node) -> None:
    """Drop what passes decided for ``node``; keep what capture knows about it."""
    for key in PASS_WRITTEN:
        node.meta.pop(key, None)


@dataclass(frozen=True)
class ValueInfo:
    """What a node produces: a tensor (dtype, numel), a sequence of values, or something else.

    ``dtype is None`` on a tensor means the dtype is not known (a graph input traced without
    example inputs); casts of such values are guarded at run time. ``shape`` holds the
    example's sizes; ``dynamic`` the dims whose size may differ at run time (a dynamic
    dimension of a dynamo capture), so a rewrite must read them from the tensor.
    """

    kind: Literal["tensor", "seq", "other"]
    dtype: torch.dtype | None = None
    numel: int | None = None
    items: tuple[ValueInfo, ...] = ()
    shape: tuple[int | None, ...] | None = None
    dynamic: tuple[int, ...] = ()

    def static_size(self, dim: int) -> int | None:
        """The size of ``dim`` if it is known and fixed for every call, else None."""
        if self.shape is None or not -len(self.shape) <= dim < len(self.shape):
            return None
        return None if dim % len(self.shape) in self.dynamic else self.shape[dim]

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


def _is_constant(s: torch.SymInt) -> bool:
    try:
        return s.node.is_constant() or s.node.maybe_as_int() is not None
    except Exception:
        return False


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def info_from_value(value: object) -> ValueInfo:
    """ValueInfo of a real or fake value (dynamo's ``example_value``, ShapeProp's results)."""
    if type(value) in _PLAIN:  # a real tensor (a parameter, a buffer): int sizes, none dynamic
        return _real_info(value.dtype, value.numel(), tuple(value.shape))
    if isinstance(value, torch.Tensor):
        shape = tuple(_int_or_none(s) for s in value.shape)
        dynamic = tuple(d for d, s in enumerate(value.shape)
                        if isinstance(s, torch.SymInt) and not _is_constant(s))
        return ValueInfo("tensor", value.dtype, _int_or_none(value.numel()), shape=shape,
                         dynamic=dynamic)
    if isinstance(value, (tuple, list)):
        return ValueInfo("seq", items=tuple(info_from_value(v) for v in value))
    return OTHER


@functools.lru_cache(maxsize=4096)
def _real_info(dtype: torch.dtype, numel: int, shape: tuple[int, ...]) -> ValueInfo:
    """One (frozen) ValueInfo per dtype and shape: a model's layers repeat a few weight shapes,
    and making a ValueInfo costs more than finding it."""
    return ValueInfo("tensor", dtype, numel, shape=shape)


def info(node: object) -> ValueInfo:
    """The ValueInfo of a node argument (constants are 'other')."""
    if isinstance(node, fx.Node):
        return node.meta.get(ORIG, UNKNOWN_TENSOR)
    return OTHER


# The root module: L['self'], or L['args'][0] when dynamo traced forward through a wrapper that
# takes the module as its first argument (transformers 5 decorates forward so).
_DROP_ROOT = re.compile(r"^L\['args'\]\[0\]|^L\['[^']*'\]")
# A module reached through its instance dict: .__dict__['_modules'] (or its params/buffers).
_INSTANCE_DICT = re.compile(r"\.__dict__\['_(?:modules|parameters|buffers)'\]")
_GETATTR = re.compile(r"getattr\(([^,()]+),\s*'([^']*)'\)")


def clean_module_path(path: str) -> str:
    """Turn dynamo's ``L['self'].layers[0]._modules['fc']`` into ``layers.0.fc``.

    >>> clean_module_path("L['self'].model.layers[0].self_attn")
    'model.layers.0.self_attn'
    >>> clean_module_path("L['self'].__dict__['_modules']['down_blocks'][0]")  # diffusers
    'down_blocks.0'
    >>> clean_module_path("L['args'][0].model.layers.0.mlp")  # forward called via a wrapper
    'model.layers.0.mlp'
    """
    s = path
    while _GETATTR.search(s):
        s = _GETATTR.sub(r"\1.\2", s)
    s = _DROP_ROOT.sub("", s)
    s = _INSTANCE_DICT.sub("", s)
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
_PASS: contextvars.ContextVar[str | None] = contextvars.ContextVar("amp_pass", default=None)


def each_node(graph: fx.Graph, op: str | None = None):
    """Iterate over a snapshot of ``graph``'s nodes, remembering the current one for errors."""
    if op is None:
        yield from each_node_of(graph.nodes)
    elif op in ("call_function", "call_method"):  # find_nodes wants their target
        yield from each_node_of([n for n in graph.nodes if n.op == op])
    else:
        yield from each_node_of(graph.find_nodes(op=op))


def each_node_of(nodes):
    """Iterate over a snapshot of ``nodes``, remembering the current one for errors."""
    for node in list(nodes):
        _CURRENT.set(node)
        yield node
    _CURRENT.set(None)


def current_node() -> fx.Node | None:
    """The node the running pass was on (for error messages)."""
    return _CURRENT.get()


def current_pass() -> str | None:
    """The name of the pass the pipeline is running (reports record rewrites under it)."""
    return _PASS.get()


@contextlib.contextmanager
def running_pass(name: str):
    """Make ``name`` the current pass for the duration of the block."""
    token = _PASS.set(name)
    try:
        yield
    finally:
        _PASS.reset(token)
