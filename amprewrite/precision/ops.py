"""The op registry: everything amprewrite knows about an op, in one entry per op family.

A :class:`Family` holds an op's precision class, every spelling of it (``torch.X``,
``torch.nn.functional.X``, ``Tensor.X``, the in-place ``X_``, the ``torch.special`` /
``torch.linalg`` / ``torch.fft`` / ``torch._C._nn`` aliases, its module classes and operator
forms), how its output dtype follows from its inputs (:class:`Out`), whether it reads integer
inputs as numbers, whether it needs float operands, and how its module form lowers to a
function. Passes ask this module and keep no op names of their own, so adding an op is one
entry below. An op the registry does not know runs in fp32 (see ``paint_precision``).

>>> import torch
>>> FAMILIES["softmax"].precision
<Precision.FP32: 'fp32'>
>>> family_for_function(torch.nn.functional.linear).name
'linear'
>>> family_for_method("exp_").name  # the in-place spelling has the out-of-place op's family
'exp'
>>> family_for_function(torch.special.gammaln).name
'special'
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import enum
import functools
import inspect
import math
import operator
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch
import torch.nn.functional as F
from torch import fx, nn

from ..graph import meta as M
from ..graph import runtime
from ..graph.modules import get_attr

__all__ = [
    "FAMILIES",
    "Alias",
    "Family",
    "Mixed",
    "Out",
    "Precision",
    "Write",
    "alias_of",
    "family_for_function",
    "family_for_method",
    "family_for_module",
    "family_of",
    "fp32_helper_of",
    "inplace_counterpart",
    "is_pointwise",
    "kept_for_backward",
    "op_name",
    "op_qualname",
    "override_families",
    "reads_values",
    "register_family",
    "write_of",
    "writes_in_place",
]


class Precision(enum.Enum):
    """Precision class of a node (DESIGN.md, "Precision classes")."""

    LOW = "low"  # runs in the target dtype: matmul-like ops
    FP32 = "fp32"  # numerically risky: inputs upcast, computed in fp32
    PROMOTE = "promote"  # elementwise arithmetic: the widest precision among its float inputs
    NEUTRAL = "neutral"  # exact in any dtype: a cast may move across it
    NONFLOAT = "nonfloat"  # integer/bool/non-tensor values, and dtypes amprewrite leaves alone


class Out(enum.Enum):
    """How an op's output dtype follows from its inputs (used where no fake value says it)."""

    PROMOTE = "promote"  # PyTorch type promotion; integer inputs give integers
    WIDEN = "widen"  # PROMOTE, but integer and bool inputs give int64 (sum, cumsum, prod)
    FLOAT = "float"  # type promotion, but integer inputs give the default float (exp(int))
    BOOL = "bool"  # comparisons and predicates
    INDEX = "index"  # int64 indices (argmax, nonzero, randint)
    NONTENSOR = "nontensor"  # Python values: sizes, flags, numbers
    SPLIT = "split"  # a sequence of tensors of the input's dtype (split, chunk, unbind)
    PAIR = "pair"  # (values of the input's dtype, int64 indices): topk, sort
    MINMAX = "minmax"  # PAIR when reducing along a dim (x.max(1)), else PROMOTE
    TUPLE = "tuple"  # a sequence of unknown dtypes (linalg factorizations with int pivots)
    BROADCAST = "broadcast"  # one tensor per input, each of its input's dtype
    CAT = "cat"  # type promotion over a list argument
    FACTORY = "factory"  # dtype=, else the input's (``*_like``, ``new_*``), else the default
    CONVERT = "convert"  # the dtype the call names (x.float(), x.to(torch.bfloat16))
    COMPLEX = "complex"  # the complex dtype of a float input (fft, polar)
    REAL = "real"  # the real dtype of a complex input (irfft, abs of complex)
    ITEM = "item"  # operator.getitem: an item of a sequence, or a tensor's dtype
    ATTR = "attr"  # getattr(x, name): a tensor attribute, or metadata


class Mixed(enum.Enum):
    """A mixed-dtype signature of an FP32 family's kernel: it reads its data input (the first
    tensor argument) in the low dtype, without an fp32 copy, and computes in the family's
    ``accumulate`` dtype (DESIGN.md, "Compute dtype is not storage dtype"). Upcasting a low
    tensor is exact, so the result is what the fp32 copy would have given. A kernel probe
    confirms the signature per device and dtype before the plan uses it
    (:func:`amprewrite.precision.kernels.mixed_problem`).
    """

    # Reads a low input with its fp32 parameters (weight, bias, running statistics) as they
    # are and writes the input's dtype: batch/layer/group norm (Apex's keep_batchnorm_fp32).
    LOW_IO = "low_io"
    # Takes ``dtype=torch.float32``: reads a low input, writes fp32 (softmax, sum, mean).
    DTYPE_ARG = "dtype_arg"
    # Where the kernel refuses LOW_IO: the family's ``fp32_helper`` (amprewrite/graph/runtime.py),
    # which runs the fp32 kernels forward and backward on an exact fp32 copy it makes when needed,
    # and returns and saves the low input's dtype (bit-equal to the fp32 island, half its bytes).
    FP32_HELPER = "fp32_helper"

    @property
    def stores_input_dtype(self) -> bool:
        """Reads and writes its data input's dtype (LOW_IO, FP32_HELPER), not fp32."""
        return self is not Mixed.DTYPE_ARG


class Alias(enum.Enum):
    """What an op's result shares storage with (``functionalize`` replays writes through it)."""

    VIEW = "view"  # a view of the first argument (x.view, x.transpose, x.T)
    MAYBE_VIEW = "maybe_view"  # sometimes a view, sometimes a copy (reshape of a strided tensor)
    MULTI = "multi"  # views of several arguments (broadcast_tensors): not re-derivable


class Write(enum.Enum):
    """What an op named like an in-place op (``x.op_``) does to its first argument."""

    DATA = "data"  # writes values the out-of-place ``op`` computes (the default for ``op_``)
    CLONE = "clone"  # writes values, but ``op`` means something else: run on a private copy
    METADATA = "metadata"  # changes the tensor's shape or strides, not its values
    NONE = "none"  # writes nothing the graph reads (requires_grad_, share_memory_)


# Module form: (module, input node, attribute-node maker) -> (function, args, kwargs).
Lowering = Callable[[nn.Module, fx.Node, object], tuple]


@dataclass(frozen=True)
class Family:
    """One op family and all its spellings.

    ``precision`` is the class; ``classify`` refines it per node (interpolate's mode, the
    dtype a conversion names) and returns (class, reason) or None for the family's class.
    ``refine`` maps an operator spelling to another family (``x * x`` is ``pow``).
    """

    name: str
    precision: Precision
    functions: tuple[Callable, ...] = ()
    methods: tuple[str, ...] = ()
    modules: tuple[type, ...] = ()
    # Ends a position cone: its output is bounded, so low precision no longer collides values.
    bounded: bool = False
    # Reads the values of an integer input as numbers (not as indices): int in, float out.
    numeric: bool = True
    out: Out = Out.PROMOTE
    # Needs floating-point operands of one dtype (eager linear(int, float) fails).
    needs_float: bool = False
    # Draws random numbers: the kernel probe compares no values.
    random: bool = False
    # Reads only a tensor's metadata (sizes, device), never its values: no cast feeds it.
    metadata: bool = False
    # Makes a grid of positions (arange, linspace): a position cone starts at every node.
    positions: bool = False
    # Whether the kernel probe runs for this family's nodes in low precision.
    probe: bool = True
    lower: Mapping[type, Lowering] = field(default_factory=dict, compare=False)
    classify: Callable[[fx.Node, torch.dtype], tuple[Precision, str] | None] | None = field(
        default=None, compare=False)
    refine: Callable[[fx.Node], str | None] | None = field(default=None, compare=False)
    why: str = ""  # one line for docs/families.md: why this class
    # The arguments whose values the op computes with, converted to its result's dtype: ATen
    # schema names, or positions for Python callables without a schema. None: every tensor
    # argument except indices, masks, offsets and labels (``INDEX_ARGUMENTS``); a family with
    # ``numeric=False`` then reads none. Position cones start where an integer tensor is read
    # as a number (``number_inputs``).
    values: tuple[str | int, ...] | None = None
    # What the kernel accumulates in when it reads a low input, and the mixed-dtype signatures
    # it accepts (:class:`Mixed`): the plan reads a low input without an fp32 copy where the
    # kernel probe confirms one. None / (): a low input is copied to fp32 first (an island).
    accumulate: torch.dtype | None = None
    mixed: tuple[Mixed, ...] = ()
    # For ``Mixed.FP32_HELPER``: the runtime function that replaces a call of the family's
    # functional form (same arguments; see :func:`fp32_helper_of`).
    fp32_helper: Callable | None = field(default=None, compare=False)
    # Aliasing, per op name as :func:`op_name` spells it (attributes by their name: "T"): which
    # results share storage with an argument (:class:`Alias`).
    aliases: Mapping[str, Alias] = field(default_factory=dict, compare=False)
    # In-place spellings that are not "write what ``op`` computes" (:class:`Write`), by name.
    writes: Mapping[str, Write] = field(default_factory=dict, compare=False)
    # In-place operator functions and their out-of-place forms (operator.iadd -> operator.add).
    inplace: Mapping[Callable, Callable] = field(default_factory=dict, compare=False)
    # Custom operators (``torch.ops.ns.name``) by qualified name, e.g. "transformers::foo".
    # ATen operators (``torch.ops.aten.add.Tensor``) need none: they map by their base name.
    # Python functions of a module costly to import, by ``__module__.__qualname__``.
    op_names: tuple[str, ...] = ()
    # Its backward needs its float input, so autograd keeps it (a max pooling, a norm; a LOW
    # family, a matmul or a conv, always does): the memory plan's estimate (kept_for_backward).
    keeps_input: bool = False


# --- spellings ----------------------------------------------------------------------------------

_NAMESPACES = (torch, F, torch.special, torch.linalg, torch.fft, torch._C._nn)
_DUNDER = {"add": ("__add__", "__radd__", "__iadd__"), "sub": ("__sub__", "__rsub__", "__isub__"),
           "mul": ("__mul__", "__rmul__", "__imul__"),
           "div": ("__truediv__", "__rtruediv__", "__itruediv__", "__div__", "__rdiv__",
                   "__idiv__"),
           "neg": ("__neg__",), "abs": ("__abs__",), "pos": ("__pos__",),
           "floor_divide": ("__floordiv__", "__rfloordiv__", "__ifloordiv__"),
           "remainder": ("__mod__", "__rmod__", "__imod__"),
           "pow": ("__pow__", "__rpow__", "__ipow__"),
           "matmul": ("__matmul__", "__rmatmul__", "__imatmul__"),
           "eq": ("__eq__",), "ne": ("__ne__",), "lt": ("__lt__",), "le": ("__le__",),
           "gt": ("__gt__",), "ge": ("__ge__",),
           "bitwise_and": ("__and__", "__rand__", "__iand__"),
           "bitwise_or": ("__or__", "__ror__", "__ior__"),
           "bitwise_xor": ("__xor__", "__rxor__", "__ixor__"),
           "bitwise_not": ("__invert__",),
           "bitwise_left_shift": ("__lshift__", "__rlshift__", "__ilshift__"),
           "bitwise_right_shift": ("__rshift__", "__rrshift__", "__irshift__"),
           "getitem": ("__getitem__",), "len": ("__len__",)}


def _resolve(dotted: str) -> object | None:
    return get_attr(torch, dotted, None)


def _spellings(names: Iterable[str]) -> tuple[tuple[Callable, ...], tuple[str, ...]]:
    """Every function and Tensor method spelling of ``names``.

    A bare name ``X`` is looked up as ``torch.X``, ``torch.nn.functional.X``,
    ``torch.special.X``, ``torch.linalg.X``, ``torch.fft.X``, ``torch._C._nn.X`` and their
    in-place ``X_``, and as the Tensor method ``X`` (with its operator dunders). A dotted name
    is exactly that attribute of ``torch``.
    """
    fns: list[Callable] = []
    methods: list[str] = []

    def add(obj: object) -> None:
        if callable(obj) and not isinstance(obj, type) and obj not in fns:
            fns.append(obj)  # type: ignore[arg-type]

    for name in names:
        if "." in name:
            add(_resolve(name))
            continue
        for ns in _NAMESPACES:
            add(getattr(ns, name, None))
            add(getattr(ns, name + "_", None))
        for m in (name, name + "_", *_DUNDER.get(name, ())):
            if hasattr(torch.Tensor, m) and m not in methods:
                methods.append(m)
    return tuple(fns), tuple(methods)


def _op(name: str, precision: Precision, names: Iterable[str] = (), *,
        methods: Iterable[str] = (), modules: Iterable[str] = (),
        functions: Iterable[Callable] = (), **kw) -> Family:
    fns, meths = _spellings(names)
    mods = tuple(getattr(nn, n) for n in modules if hasattr(nn, n))
    extra = tuple(f for f in functions if f not in fns)
    return Family(name, precision, fns + extra, meths + tuple(m for m in methods
                                                              if m not in meths), mods, **kw)


# --- per-node refinements ---------------------------------------------------------------------


def _arg(node: fx.Node, index: int, name: str, default: object = None) -> object:
    if name in node.kwargs:
        return node.kwargs[name]
    args = node.args[1:] if node.op == "call_method" and index > 0 else node.args
    if node.op == "call_method":
        index -= 1
    return args[index] if 0 <= index < len(args) else default


# Upsampling modes that copy values (exact in any dtype), and the input rank of the others.
NEAREST_MODES = ("nearest", "nearest-exact")
MODE_RANK: Mapping[str, int] = MappingProxyType(
    {"linear": 3, "bilinear": 4, "bicubic": 4, "trilinear": 5})
# Factories whose dtype follows their data, and those whose integer arguments give int64
# (``arange(n)``) and float ones the default float.
FACTORY_FROM_DATA = frozenset({"tensor", "as_tensor", "asarray", "from_numpy"})
FACTORY_RANGE = frozenset({"arange", "range", "full", "scalar_tensor"})
# ATen ops that draw dropout masks (verification draws them as fp32 does in every run).
MASK_DRAWS = frozenset({torch.ops.aten.bernoulli, torch.ops.aten.bernoulli_,
                        torch.ops.aten.native_dropout})
# Public ops no family claims: they run in fp32 (the unknown-op default), which is right or
# harmless for each. Reviewed by hand; the coverage test (amprewrite/precision/coverage.py) fails on
# any public op not here.
FP32_BY_DEFAULT: frozenset[str] = frozenset({
    # Whole recurrent networks: flat weight lists; nn.LSTM/GRU/RNN are unknown modules (fp32),
    # and so are the mkldnn kernel of one layer and the cuDNN kernel of a whole network (CPU
    # and CUDA autocast run them low; CUDA's registers _cudnn_rnn from torch 2.14).
    "lstm", "gru", "rnn_tanh", "rnn_relu", "mkldnn_rnn_layer", "_cudnn_rnn",
    # A composite traced through by both captures; only called whole by a symbolic trace.
    "multi_head_attention_forward",
    # Tuple of differences (arithmetic); rare in models.
    "gradient",
    # Sparse and MKL-DNN layouts: values of a sparse tensor, sparse matmuls, layout moves.
    "values", "values_copy", "to_sparse", "sparse_mask", "to_mkldnn", "hsmm", "hspmm", "saddmm",
    "smm", "sspaddmm", "sparse_resize_", "sparse_resize_and_clear_",
    # Quantization: integer storage or fp32 scales; amprewrite leaves quantized models alone.
    "dequantize", "int_repr", "quantize_per_channel", "quantize_per_tensor",
    "quantize_per_tensor_dynamic", "q_per_channel_axis", "q_per_channel_scales",
    "q_per_channel_zero_points", "q_scale", "q_zero_point", "qscheme", "quantized_batch_norm",
    "quantized_gru_cell", "quantized_lstm_cell", "quantized_max_pool1d", "quantized_max_pool2d",
    "quantized_max_pool3d", "quantized_rnn_relu_cell", "quantized_rnn_tanh_cell",
    "fake_quantize_per_channel_affine", "fake_quantize_per_tensor_affine",
    "fused_moving_avg_obs_fake_quant", "choose_qparams_optimized",
    # Vendor kernels (FBGEMM int8/fp16 weights, MIOpen): their own precision contracts.
    "fbgemm_linear_fp16_weight", "fbgemm_linear_fp16_weight_fp32_activation",
    "fbgemm_linear_int8_weight", "fbgemm_linear_int8_weight_fp32_activation",
    "fbgemm_linear_quantize_weight", "fbgemm_pack_gemm_matrix_fp16",
    "fbgemm_pack_quantized_matrix", "miopen_batch_norm", "miopen_convolution",
    "miopen_convolution_add_relu", "miopen_convolution_relu", "miopen_convolution_transpose",
    "miopen_depthwise_convolution", "miopen_rnn",
    # Python callbacks, storage resizing and advanced indexing by a C++ index object.
    "apply_", "map_", "map2_", "resize", "resize_", "resize_as", "resize_as_", "set_", "index",
    "autocast", "__get__", "resize_as_sparse_",
})

# Python arithmetic on sizes (a size known only at run time: ``x.size(2) * 2``).
SIZE_ARITHMETIC = frozenset({operator.add, operator.sub, operator.mul, operator.floordiv,
                             operator.truediv, operator.neg, math.floor, math.ceil, builtins.int,
                             builtins.float, builtins.round, torch.ops.aten.sym_size.int})
# The functions that take interpolate's (input, size, scale_factor, mode, ...) arguments.
INTERPOLATE_FUNCTIONS = (F.interpolate, F.upsample, F.upsample_nearest, F.upsample_bilinear)


def upsample_mode(node: fx.Node, module: nn.Module | None = None) -> str | None:
    """The interpolation mode of an upsampling node: its ``mode`` argument, its module's
    ``mode``, or the mode its op's name fixes (``upsample_bilinear``,
    ``torch._C._nn.upsample_bilinear2d``, ``aten._upsample_nearest_exact2d``); None when the node
    is no upsampling.

    >>> import operator
    >>> g = fx.Graph(); x = g.placeholder("x")
    >>> upsample_mode(g.call_function(torch._C._nn.upsample_bilinear2d, (x, (4, 4), False)))
    'bilinear'
    >>> upsample_mode(g.call_function(F.interpolate, (x,), {"scale_factor": 2.0}))
    'nearest'
    """
    if module is not None:
        return getattr(module, "mode", "nearest")
    target = node.target
    if target in (F.interpolate, F.upsample):
        mode = _arg(node, 3, "mode", "nearest")  # (input, size, scale_factor, mode, ...)
        return mode if isinstance(mode, str) else None
    name = getattr(target, "__name__", "") if not isinstance(target, str) else target
    name = name.split(".")[0].lstrip("_").removesuffix("_aa")  # _aa: antialiased
    if not name.startswith("upsample_"):
        return None
    mode = name[len("upsample_"):].rstrip("123d").rstrip("_")
    return {"nearest_exact": "nearest-exact"}.get(mode, mode)


def _interpolate(node: fx.Node, low: torch.dtype) -> tuple[Precision, str] | None:
    mode = upsample_mode(node)
    if mode in NEAREST_MODES:
        return Precision.NEUTRAL, f"{mode} interpolate copies values: exact in any dtype"
    return None


# Methods that name the dtype they convert to: the one table of them (dtype inference, painting
# and functionalize read it through ``conversion_target``).
DTYPE_METHODS: Mapping[str, torch.dtype] = MappingProxyType({
    "float": torch.float32, "double": torch.float64, "half": torch.float16,
    "bfloat16": torch.bfloat16, "long": torch.int64, "int": torch.int32, "short": torch.int16,
    "bool": torch.bool, "byte": torch.uint8, "char": torch.int8, "cfloat": torch.complex64,
    "cdouble": torch.complex128, "chalf": torch.complex32})


def _named_dtype(a: object) -> torch.dtype | None:
    """``torch.float32``, ``torch.FloatTensor`` or ``"torch.cuda.HalfTensor"`` as a dtype."""
    if isinstance(a, torch.dtype):
        return a
    if isinstance(a, str) and a.startswith("torch."):
        a = _resolve(a[len("torch."):])
    dtype = getattr(a, "dtype", None) if isinstance(a, type) else None
    return dtype if isinstance(dtype, torch.dtype) else None


def conversion_target(node: fx.Node) -> torch.dtype | fx.Node | None:
    """What an explicit conversion converts to.

    A dtype the call names (``x.float()``, ``x.to(torch.float32)``, ``x.to(device, dtype)``,
    ``x.type(torch.FloatTensor)``, ``x.type("torch.HalfTensor")``), the node of the tensor whose
    dtype it takes (``x.type_as(y)``, ``x.to(y)``), or None: not a conversion, or a move
    (``x.cpu()``, ``x.to("cuda")``) that keeps the dtype.

    >>> import torch
    >>> gm = torch.fx.symbolic_trace(type("M", (torch.nn.Module,), {
    ...     "forward": lambda self, x, y: x.to(y) + x.type("torch.HalfTensor")})())
    >>> [conversion_target(n) for n in gm.graph.nodes if n.op == "call_method"]
    [y, torch.float16]
    """
    fam = family_of(node)
    if fam is None or fam.out is not Out.CONVERT or node.op not in ("call_method",
                                                                  "call_function"):
        return None
    name = op_name(node)
    if name in DTYPE_METHODS:
        return DTYPE_METHODS[name]
    for a in (*node.args[1:], *node.kwargs.values()):
        if (dtype := _named_dtype(a)) is not None:
            return dtype
    other = [a for a in node.args[1:2] if isinstance(a, fx.Node)]
    if other and M.info(other[0]).kind == "tensor":
        return other[0]  # x.type_as(y), x.to(y): y's dtype
    return None


def _convert(node: fx.Node, low: torch.dtype) -> tuple[Precision, str] | None:
    target = conversion_target(node)
    if isinstance(target, fx.Node):
        # x.to(y), x.type_as(y): y's dtype, which the plan decides: the widest of the two.
        return Precision.PROMOTE, "conversion to another tensor's dtype: runs in the wider"
    if target is None or not target.is_floating_point:
        return Precision.NEUTRAL, "a move or a conversion to the value's own dtype"
    source = node.args[0] if node.args else None
    if (target == torch.float32 and isinstance(source, fx.Node)
            and M.info(source).dtype == torch.float32):
        # A no-op in the fp32 model (``h.to(q.dtype)`` with the read frozen, ``h.float()``):
        # its value is fp32 by nature (the plan keeps it fp32 for every reader that computes
        # in its inputs' precision), but where every reader is low the plan may skip the round
        # trip low -> fp32 -> low, which changes no value.
        return Precision.NEUTRAL, ("conversion to float32 of a float32 value (a no-op in the "
                                   "fp32 model): fp32 unless every reader is low")
    # The model asks for this dtype: LOW when it names the target dtype, else computed high.
    cls = Precision.LOW if target == low else Precision.FP32
    return cls, f"explicit conversion to {target} in the model"


def is_conversion(node: fx.Node) -> bool:
    """Does ``node`` convert or move a tensor (``to``, ``type_as``, ``float``, ``cpu``, ...)?

    Such a node returns its input itself when nothing changes, so it may alias it.
    """
    fam = family_of(node)
    return fam is not None and fam.out is Out.CONVERT


# Schema argument names that hold indices, offsets, masks or labels: integers there select,
# count or compare; they are never numbers an op computes with.
INDEX_ARGUMENTS = frozenset({
    "index", "indices", "mask", "condition", "offs", "offsets", "target", "targets", "lengths",
    "input_lengths", "target_lengths", "batch_sizes", "boundaries", "sorter", "repeats"})
# Python-level callables without an ATen schema: their parameter names.
_PY_SIGNATURES = {"tensor": ("data",), "as_tensor": ("data",), "asarray": ("obj",),
                  "new_tensor": ("self", "data"), "setitem": ("self", "key", "value"),
                  "__setitem__": ("self", "key", "value"), "write_view": ("self", "value")}


@functools.cache
def _schemas(name: str) -> tuple[tuple[tuple[str, bool, bool], ...], ...]:
    """(argument name, takes tensors, keyword-only) per overload of ``aten::name``."""
    try:
        schemas = torch._C._jit_get_schemas_for_operator("aten::" + name)
    except RuntimeError:
        return ()
    return tuple(tuple((a.name, "Tensor" in str(a.type), a.kwarg_only) for a in s.arguments)
                 for s in schemas)


def argument_names(node: fx.Node) -> list[str | int]:
    """The name of each positional argument of ``node``, read from its op's ATen schema.

    The overload is the first whose arguments take tensors exactly where the node passes
    tensors; where no schema fits, the names of ``_PY_SIGNATURES`` or the positions.

    >>> import torch
    >>> g = torch.fx.symbolic_trace(type("M", (torch.nn.Module,), {
    ...     "forward": lambda self, x, i, v: x.index_put((i,), v)})()).graph
    >>> argument_names([n for n in g.nodes if n.op == "call_method"][0])
    ['self', 'indices', 'values']
    """
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        candidates: tuple = (tuple((a.name, "Tensor" in str(a.type), a.kwarg_only)
                                   for a in target._schema.arguments),)
        name = ""
    else:
        name = op_name(node)
        if name.endswith("_") and not name.endswith("__"):
            name = name[:-1]  # the in-place spelling reads its arguments as the op does
        candidates = _schemas(name)
    tensors = [isinstance(a, fx.Node) and M.info(a).kind == "tensor" for a in node.args]
    for schema in candidates:
        positional = [s for s in schema if not s[2]]
        names = {s[0] for s in schema}
        if len(positional) < len(node.args) or not set(node.kwargs) <= names:
            continue
        if all(positional[i][1] or not t for i, t in enumerate(tensors)):
            return [positional[i][0] for i in range(len(node.args))]
    py = _PY_SIGNATURES.get(name) or _PY_SIGNATURES.get(getattr(target, "__name__", ""))
    if py is None and node.op == "call_function":
        py = _python_parameters(target)  # F.cross_entropy(input, target, ...)
    if py is not None and len(py) >= len(node.args):
        return list(py[:len(node.args)])
    first = ["self"] if node.op == "call_method" else []
    return first + list(range(len(first), len(node.args)))


def _python_parameters(fn: object) -> tuple[str, ...] | None:
    """The positional parameter names of a Python function, or None (builtins, C functions)."""
    try:
        params = inspect.signature(fn).parameters.values()  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return tuple(p.name for p in params
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def number_inputs(node: fx.Node) -> list[fx.Node] | None:
    """The tensor arguments whose values ``node`` computes with, or None for an unknown op.

    ``x.type_as(y)`` reads only ``x``'s values (``y`` gives a dtype), ``t.index_put((i,), v)``
    only ``v``'s (``i`` holds indices), ``a * b`` both: an integer tensor among them is turned
    into floats there, which is where a position cone starts.
    """
    fam = family_of(node)
    if fam is None or node.op not in ("call_function", "call_method"):
        return None
    if fam.values is None and not fam.numeric:
        return []
    names = argument_names(node)
    read: list[tuple[str | int, object]] = [*zip(names, node.args), *node.kwargs.items()]
    out: list[fx.Node] = []
    for name, a in read:
        wanted = (name in fam.values if fam.values is not None
                  else name not in INDEX_ARGUMENTS)
        if wanted:
            fx.node.map_arg(a, lambda n: out.append(n) or n)
    return [n for n in out if M.info(n).kind == "tensor"]


def _is_tensor_node(a: object) -> bool:
    return isinstance(a, fx.Node)


def _power_of_two(value: object) -> bool:
    """A Python number ``±2**k``: multiplying a float by it is exact (short of overflow and
    subnormals) in every float dtype."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and value != 0
            and math.isfinite(value) and math.frexp(abs(value))[0] == 0.5)


def _arith_refine(node: fx.Node) -> str | None:
    """Operator forms of FP32 ops: ``x * x`` squares (pow), ``1 / x`` is a reciprocal; and an
    exact one: a float tensor times or over a power of two (``0.5 * x`` in GELU, ``s / 8`` in
    attention) is an ``exact_scale``, NEUTRAL, so the cast plan may compute it on either side of a
    cast (GPT-2's GELU reads its input in fp32 for ``pow`` and ``0.5 * x`` in fp16: one cast
    each; computed in fp32, both share one)."""
    name = op_name(node)
    args = node.args
    if len(args) == 2 and not node.kwargs and name in (
            "mul", "multiply", "__mul__", "__rmul__", "truediv", "div", "divide", "true_divide",
            "__truediv__"):
        tensor, number = (args if _is_tensor_node(args[0]) else args[::-1])
        divides = name not in ("mul", "multiply", "__mul__", "__rmul__")
        dtype = M.info(tensor).dtype if _is_tensor_node(tensor) else None
        if (dtype is not None and dtype.is_floating_point and _power_of_two(number)
                and not (divides and tensor is not args[0])):  # a known float: not an id
            return "exact_scale"
    if name in ("mul", "multiply", "__mul__", "__rmul__") and len(args) == 2 \
            and _is_tensor_node(args[0]) and args[0] is args[1]:
        return "pow"
    if name in ("truediv", "div", "divide", "true_divide") and len(args) == 2 \
            and not _is_tensor_node(args[0]) and _is_tensor_node(args[1]) \
            and not node.kwargs.get("rounding_mode"):
        return "reciprocal"
    if name == "__rtruediv__":
        return "reciprocal"
    return None


def _accumulates(node: fx.Node, low: torch.dtype) -> tuple[Precision, str] | None:
    """index_put(accumulate=True) and scatter(reduce=...) add values: PROMOTE, not a copy."""
    if node.kwargs.get("accumulate") or node.kwargs.get("reduce"):
        return Precision.PROMOTE, "accumulating write: adds values"
    return None


def _avg_pool(node: fx.Node, low: torch.dtype) -> tuple[Precision, str] | None:
    """adaptive_avg_pool3d is FP32, as under CPU autocast: it has a low kernel, but that kernel
    rounds each average to the low dtype, and a global pool (output size 1) is a mean over a
    whole volume, which autocast returns in fp32 (after a low Conv3d, run low it had 1.5x
    autocast's error in bf16, 1.8x in fp16)."""
    if op_name(node) == "adaptive_avg_pool3d":
        return Precision.FP32, "adaptive_avg_pool3d: averages in fp32, as autocast runs it"
    return None


def _dtensor(node: fx.Node, low: torch.dtype) -> tuple[Precision, str] | None:
    """The DTensor calls that sum across ranks, with the reason.

    A ``redistribute`` from a ``Partial`` placement sums the ranks' partial sums (an
    all-reduce, or a reduce-scatter): PROMOTE, sent in the dtype its partial sums have, as
    autocast sends a row-parallel linear's; its ranges (fp16) keep a sum past the low range in
    fp32. ``DTensor.from_local`` of a replicated tensor sums the ranks' gradients in backward,
    in the dtype it runs in (NEUTRAL: the plan's cast of a column-parallel linear's input may
    move before it). Moving shards (all-gather, shard, replicate) copies values: NEUTRAL."""
    if node.op == "call_method" and node.target == "redistribute" and node.args:
        source = node.args[0]
        fake = (source.meta.get("example_value", source.meta.get("val"))
                if isinstance(source, fx.Node) else None)
        if any(p.is_partial() for p in getattr(fake, "placements", ())):
            return Precision.PROMOTE, (
                "redistribute from Partial: sums the ranks' partial sums (all-reduce or "
                "reduce-scatter), sent in the dtype they are computed in, as autocast sends it")
    elif node.op == "call_function" and getattr(node.target, "__name__", "") == "from_local":
        placements = node.kwargs.get("placements", node.args[2] if len(node.args) > 2 else ())
        if any(getattr(p, "is_replicate", lambda: False)() for p in placements or ()):
            return Precision.NEUTRAL, (
                "DTensor.from_local of a replicated tensor: a copy; its backward sums the "
                "ranks' gradients (an all-reduce) in the dtype it runs in")
    return None


# --- lowerings (module form -> function) ------------------------------------------------------

_CONV = {nn.Conv1d: F.conv1d, nn.Conv2d: F.conv2d, nn.Conv3d: F.conv3d}
_CONV_T = {nn.ConvTranspose1d: F.conv_transpose1d, nn.ConvTranspose2d: F.conv_transpose2d,
           nn.ConvTranspose3d: F.conv_transpose3d}


def _conv(m, x, attr):
    if m.padding_mode != "zeros":
        # Conv._conv_forward's own lowering: pad explicitly, then convolve without padding.
        x = attr.pad(x, m._reversed_padding_repeated_twice, m.padding_mode)
        return _CONV[type(m)], (x, attr("weight"), attr("bias"), m.stride, 0, m.dilation,
                                m.groups), {}
    return _CONV[type(m)], (x, attr("weight"), attr("bias"), m.stride, m.padding, m.dilation,
                            m.groups), {}


def _conv_t(m, x, attr):
    return _CONV_T[type(m)], (x, attr("weight"), attr("bias"), m.stride, m.padding,
                              m.output_padding, m.groups, m.dilation), {}


def _upsample(m, x, attr):
    return F.interpolate, (x,), {
        "size": m.size, "scale_factor": m.scale_factor, "mode": m.mode,
        "align_corners": m.align_corners, "recompute_scale_factor": m.recompute_scale_factor}


_ACTIVATION_LOWERINGS: dict[type, Lowering] = {
    nn.GELU: lambda m, x, attr: (F.gelu, (x,), {"approximate": m.approximate}),
    nn.SiLU: lambda m, x, attr: (F.silu, (x,), {"inplace": m.inplace}),
}


# --- the table ----------------------------------------------------------------------------------

L, H, P, N, X = (Precision.LOW, Precision.FP32, Precision.PROMOTE, Precision.NEUTRAL,
                 Precision.NONFLOAT)

_LOSSES = [
    # (function name, module class name); each also has torch.X / torch._C._nn.X spellings.
    ("binary_cross_entropy", "BCELoss"),
    ("binary_cross_entropy_with_logits", "BCEWithLogitsLoss"),
    ("cross_entropy", "CrossEntropyLoss"),
    ("nll_loss", "NLLLoss"),
    ("mse_loss", "MSELoss"),
    ("l1_loss", "L1Loss"),
    ("smooth_l1_loss", "SmoothL1Loss"),
    ("huber_loss", "HuberLoss"),
    ("kl_div", "KLDivLoss"),
    ("poisson_nll_loss", "PoissonNLLLoss"),
    ("gaussian_nll_loss", "GaussianNLLLoss"),
    ("cosine_embedding_loss", "CosineEmbeddingLoss"),
    ("hinge_embedding_loss", "HingeEmbeddingLoss"),
    ("margin_ranking_loss", "MarginRankingLoss"),
    ("multi_margin_loss", "MultiMarginLoss"),
    ("multilabel_margin_loss", "MultiLabelMarginLoss"),
    ("multilabel_soft_margin_loss", "MultiLabelSoftMarginLoss"),
    ("soft_margin_loss", "SoftMarginLoss"),
    ("triplet_margin_loss", "TripletMarginLoss"),
    ("triplet_margin_with_distance_loss", "TripletMarginWithDistanceLoss"),
    ("ctc_loss", "CTCLoss"),
    ("linear_cross_entropy", ""),
]
_LOSS_ALIASES = {"cross_entropy": ["_C._nn.cross_entropy_loss"],
                 "nll_loss": ["_C._nn.nll_loss2d", "_C._nn.nll_loss_nd"]}
# ATen-only forms (no torch function): what a loss dispatches to in an ATen graph.
_LOSS_OPS = {"multilabel_margin_loss": ("aten::multilabel_margin_loss_forward",)}

_SPECIAL = [
    # Special functions: steep, with poles or long tails; autocast leaves them out of its
    # low-precision lists, and torch.special has no bf16/fp16 kernel for several of them.
    "lgamma", "digamma", "polygamma", "mvlgamma", "erfc", "erfcx", "i0", "i0e", "i1", "i1e",
    "igamma", "igammac", "gammaln", "psi", "multigammaln", "gammainc", "gammaincc", "ndtr",
    "ndtri", "log_ndtr", "logit", "xlog1py", "zeta", "entr", "sinc", "logaddexp", "logaddexp2",
    "bessel_j0", "bessel_j1", "bessel_y0", "bessel_y1", "modified_bessel_i0",
    "modified_bessel_i1", "modified_bessel_k0", "modified_bessel_k1",
    "scaled_modified_bessel_k0", "scaled_modified_bessel_k1", "spherical_bessel_j0",
    "airy_ai", "chebyshev_polynomial_t", "chebyshev_polynomial_u", "chebyshev_polynomial_v",
    "chebyshev_polynomial_w", "shifted_chebyshev_polynomial_t", "shifted_chebyshev_polynomial_u",
    "shifted_chebyshev_polynomial_v", "shifted_chebyshev_polynomial_w", "hermite_polynomial_h",
    "hermite_polynomial_he", "laguerre_polynomial_l", "legendre_polynomial_p", "ldexp",
    "nextafter",
]

_LINALG = [
    # Factorizations and solves: condition numbers amplify the input's rounding; torch has no
    # bf16/fp16 CPU kernels for most of them (autocast lists them fp32).
    "inverse", "inv", "det", "logdet", "svdvals", "eigvalsh", "cholesky", "cholesky_inverse",
    "cholesky_solve", "solve", "solve_triangular", "pinv", "pinverse", "matrix_power",
    "matrix_exp", "lu_solve", "ldl_solve", "matrix_rank", "householder_product", "orgqr",
    "ormqr", "tensorinv", "tensorsolve", "cond", "vander",
    "matrix_sqrth",  # torch.linalg.matrix_sqrth, new in torch 2.14
]
# The same, returning tuples (some items integer pivots or infos, some complex).
_LINALG_TUPLES = [
    "slogdet", "svd", "eig", "eigh", "eigvals", "qr", "cholesky_ex", "inv_ex", "solve_ex",
    "lstsq", "lu", "lu_factor", "lu_factor_ex", "lu_unpack", "ldl_factor", "ldl_factor_ex",
    "geqrf", "triangular_solve", "pca_lowrank", "svd_lowrank", "lobpcg", "frexp",
    "_lu_with_info",
    "linalg.polar",  # the polar decomposition (torch 2.14); torch.polar is the complex family's
]

_FFT = ["fft.fft", "fft.ifft", "fft.fft2", "fft.ifft2", "fft.fftn", "fft.ifftn", "fft.rfft",
        "fft.rfft2", "fft.rfftn", "fft.ihfft", "fft.ihfft2", "fft.ihfftn", "stft"]
_IFFT_REAL = ["fft.irfft", "fft.irfft2", "fft.irfftn", "fft.hfft", "fft.hfft2", "fft.hfftn",
              "istft"]

# The mixed signatures of FP32 kernels, measured on CPU for bf16 and fp16 (forward and backward:
# the norms' output is bit-equal to the fp32 result rounded once; dtype=float32 reductions are
# bit-equal to the fp32 copy's). The probe still confirms them per device before use: CUDA
# layer_norm and group_norm refuse a low input with fp32 weights (benchmarks/kernel_probe.py).
_NORM = {"accumulate": torch.float32, "mixed": (Mixed.LOW_IO,), "keeps_input": True}
# Group and layer norm: on CPU layer_norm's backward sums the weight gradients in the low dtype;
# on CUDA both refuse a low input with fp32 weights. Where the probe refuses LOW_IO, the runtime
# helper gives the same saved bytes (it writes an fp32 copy it does not keep).
_NORM_HELPER = {"accumulate": torch.float32, "mixed": (Mixed.LOW_IO, Mixed.FP32_HELPER),
                "keeps_input": True}
_DTYPE_ARG = {"accumulate": torch.float32, "mixed": (Mixed.DTYPE_ARG,)}

_TABLE: list[Family] = [
    # LOW: matmul-like ops, where low precision pays and accumulation is fp32 inside the kernel.
    _op("linear", L, ["linear"], modules=["Linear", "LazyLinear"], needs_float=True,
        lower={nn.Linear: lambda m, x, attr: (F.linear, (x, attr("weight"), attr("bias")), {})},
        why="matmul: fp32 accumulation inside the kernel"),
    _op("bilinear", L, ["bilinear"], modules=["Bilinear"], needs_float=True),
    _op("conv", L, ["conv1d", "conv2d", "conv3d", "convolution", "conv_tbc", "_convolution",
                    "cudnn_convolution"],
        modules=["Conv1d", "Conv2d", "Conv3d", "LazyConv1d", "LazyConv2d", "LazyConv3d"],
        needs_float=True, lower={cls: _conv for cls in _CONV}),
    _op("conv_transpose", L, ["conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
                              "cudnn_convolution_transpose"],
        modules=["ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d"], needs_float=True,
        lower={cls: _conv_t for cls in _CONV_T}),
    _op("matmul", L, ["matmul", "mm", "bmm", "addmm", "baddbmm", "addbmm", "mv", "addmv",
                      "einsum", "tensordot", "chain_matmul", "multi_dot", "dot", "vdot", "inner",
                      "outer", "ger", "addr", "vecdot", "_addmm_activation", "_grouped_mm"],
        functions=[operator.matmul], needs_float=True,
        inplace={operator.imatmul: operator.matmul},
        op_names=("transformers::grouped_mm_fallback",)),
    _op("rnn_cell", L, ["lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell"],
        needs_float=True,
        op_names=("aten::_thnn_fused_lstm_cell", "aten::_thnn_fused_gru_cell")),
    # The fused kernels SDPA dispatches to (ATen graphs after dispatch: aot_autograd, inductor)
    # and the fused multi-head attention of nn.MultiheadAttention's fast path; autocast runs
    # them low, and they return their logsumexp in fp32 whatever the input's dtype.
    _op("scaled_dot_product_attention", L, [
        "scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_native_multi_head_attention"]),
    # FlexAttention (torch.nn.attention.flex_attention; torchtitan's attention for Llama 3): the
    # same attention as SDPA, its query, key and value low; the score and mask functions are
    # subgraphs that run as written on the scores the kernel makes (fp32 accumulation), and
    # the tensors they capture (a bias table, document ids) are read as they are.
    _op("flex_attention", L, functions=[torch.ops.higher_order.flex_attention],
        values=(0, 1, 2), probe=False,
        why="attention like scaled_dot_product_attention: query, key and value low; its "
            "score and mask functions run as written"),
    # FP32: normalisations (batch statistics overflow fp16; NaN corrupts running stats).
    _op("batch_norm", H, ["batch_norm", "native_batch_norm", "_native_batch_norm_legit",
                          "batch_norm_elemt", "batch_norm_stats", "batch_norm_gather_stats",
                          "batch_norm_gather_stats_with_counts", "batch_norm_update_stats",
                          "batch_norm_backward_elemt", "batch_norm_backward_reduce"],
        modules=["BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm",
                 "LazyBatchNorm1d", "LazyBatchNorm2d", "LazyBatchNorm3d"], **_NORM,
        op_names=("aten::_native_batch_norm_legit_no_training",)),
    _op("instance_norm", H, ["instance_norm"],
        modules=["InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d"], **_NORM),
    _op("group_norm", H, ["group_norm", "native_group_norm"], modules=["GroupNorm"],
        functions=[runtime.group_norm_fp32], fp32_helper=runtime.group_norm_fp32,
        **_NORM_HELPER,
        lower={nn.GroupNorm: lambda m, x, attr: (F.group_norm, (
            x, m.num_groups, attr("weight"), attr("bias"), m.eps), {})}),
    _op("layer_norm", H, ["layer_norm", "native_layer_norm"], modules=["LayerNorm"],
        functions=[runtime.layer_norm_fp32], fp32_helper=runtime.layer_norm_fp32,
        **_NORM_HELPER,
        lower={nn.LayerNorm: lambda m, x, attr: (F.layer_norm, (
            x, m.normalized_shape, attr("weight"), attr("bias"), m.eps), {})}),
    _op("rms_norm", H, ["rms_norm"], modules=["RMSNorm"], keeps_input=True,
        lower={nn.RMSNorm: lambda m, x, attr: (F.rms_norm, (
            x, m.normalized_shape, attr("weight"), m.eps), {})} if hasattr(nn, "RMSNorm") else {}),
    _op("local_response_norm", H, ["local_response_norm"],
        modules=["LocalResponseNorm", "CrossMapLRN2d"],
        why="sums squares of neighbouring channels (fp16 overflows from 256); no "
            "low-precision CPU kernel (avg_pool3d)"),
    _op("normalize", H, ["normalize"], out=Out.FLOAT),
    # FP32: softmax family (exp of large logits overflows; bounded output ends a position cone).
    _op("softmax", H, ["softmax", "_softmax", "gumbel_softmax"],
        modules=["Softmax", "Softmax2d"], bounded=True, out=Out.FLOAT, **_DTYPE_ARG,
        lower={nn.Softmax: lambda m, x, attr: (F.softmax, (x,), {"dim": m.dim})}),
    _op("log_softmax", H, ["log_softmax", "_log_softmax"], modules=["LogSoftmax"],
        out=Out.FLOAT, **_DTYPE_ARG,
        lower={nn.LogSoftmax: lambda m, x, attr: (F.log_softmax, (x,), {"dim": m.dim})}),
    _op("softmin", H, ["softmin"], modules=["Softmin"], bounded=True, out=Out.FLOAT),
    # FP32: exp/log/pow family (fp16 exp(12) is inf; log near 0 loses everything).
    _op("exp", H, ["exp", "exp2"], out=Out.FLOAT),
    _op("expm1", H, ["expm1"], out=Out.FLOAT),
    _op("log", H, ["log", "log2", "log10", "xlogy"], out=Out.FLOAT),
    _op("log1p", H, ["log1p"], out=Out.FLOAT),
    # x ** 2 overflows fp16 from 256 on; ``x * x`` and ``square`` are spellings of it.
    _op("pow", H, ["pow", "float_power", "square"], functions=[operator.pow, operator.ipow],
        inplace={operator.ipow: operator.pow}),
    _op("reciprocal", H, ["reciprocal"], out=Out.FLOAT),
    _op("rsqrt", H, ["rsqrt"], out=Out.FLOAT),
    _op("softplus", H, ["softplus"], modules=["Softplus"], out=Out.FLOAT),
    _op("trig", H, ["sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "arcsin",
                    "arccos", "arctan", "asinh", "acosh", "atanh", "arcsinh", "arccosh",
                    "arctanh", "erfinv"],
        bounded=True, out=Out.FLOAT),
    _op("special", H, _SPECIAL, out=Out.FLOAT,
        why="steep, poles or long tails; several have no low-precision kernel"),
    # FP32: reductions (a long fp16 sum overflows or stops growing).
    _op("sum", H, ["sum", "nansum", "trace", "trapezoid", "trapz", "cumulative_trapezoid",
                   "sum_to_size"], out=Out.WIDEN, **_DTYPE_ARG),
    _op("prod", H, ["prod"], out=Out.WIDEN),
    # cumsum(dtype=float32) is not listed: its backward was 1.3x a rounding off on CPU at some
    # shapes and within it at others (a verdict the probe's small shapes cannot settle).
    _op("cumsum", H, ["cumsum", "cumprod"], out=Out.WIDEN),
    _op("mean", H, ["mean", "nanmean"], out=Out.FLOAT, **_DTYPE_ARG),
    _op("var", H, ["var", "std", "var_mean", "std_mean", "cov", "corrcoef"], out=Out.FLOAT),
    _op("logsumexp", H, ["logsumexp", "logcumsumexp"], out=Out.FLOAT),
    _op("quantile", H, ["quantile", "nanquantile", "histc", "histogram", "histogramdd",
                        "bincount"],
        why="sorts and interpolates; no low-precision kernel"),
    _op("norm", H, ["norm", "native_norm", "norm_except_dim", "vector_norm", "matrix_norm",
                    "frobenius_norm", "nuclear_norm", "renorm", "dist", "cdist", "pdist",
                    "cosine_similarity", "pairwise_distance"],
        modules=["CosineSimilarity", "PairwiseDistance"], out=Out.FLOAT,
        op_names=("aten::_cdist_forward", "aten::_pdist_forward")),
    _op("linalg", H, _LINALG, out=Out.FLOAT,
        why="factorizations and solves amplify rounding; no low-precision kernels"),
    _op("linalg_tuple", H, _LINALG_TUPLES, out=Out.TUPLE,
        why="as linalg; results are tuples (with integer pivots, complex eigenvalues)"),
    # FP32: FFT and complex numbers (no bf16 FFT; fp16 FFT needs power-of-two sizes).
    _op("fft", H, _FFT, out=Out.COMPLEX, why="no bf16 FFT kernels; fp16 needs powers of two",
        op_names=("aten::_fft_r2c",)),
    _op("ifft_real", H, _IFFT_REAL, out=Out.REAL,
        why="reads complex spectra, which keep the model's dtype; no bf16 FFT kernels",
        op_names=("aten::_fft_c2r",)),
    # torch.polar by name: a bare "polar" would also take torch.linalg.polar (torch 2.14), the
    # polar decomposition of a matrix, which returns a tuple of real matrices.
    _op("complex", H, ["view_as_complex", "complex", "view_as_complex_copy"],
        functions=[torch.polar], out=Out.COMPLEX, aliases={"view_as_complex": Alias.VIEW},
        why="complex results: no bf16 complex dtype, few complex32 kernels"),
    _op("angle", H, ["angle"], out=Out.REAL),
    _op("complex_parts", N, ["view_as_real", "real", "imag", "conj", "conj_physical",
                             "resolve_conj", "resolve_neg", "fft.fftfreq", "fft.rfftfreq",
                             "view_as_real_copy"],
        out=Out.REAL, aliases=dict.fromkeys(["view_as_real", "real", "imag"], Alias.VIEW)),
    # FP32: sampling (coordinates lose sub-pixel precision; bf16 grid_sample on CPU returns
    # garbage, 9.5e31 errors measured with torch 2.13).
    _op("sampling", H, ["grid_sample", "affine_grid", "grid_sampler", "grid_sampler_2d",
                        "grid_sampler_3d", "affine_grid_generator",
                        "_grid_sampler_2d_cpu_fallback"], out=Out.FLOAT),
    # PROMOTE: elementwise arithmetic and activations run in the widest float input.
    _op("arith", P, ["add", "sub", "subtract", "mul", "multiply", "neg", "negative", "positive",
                     "rsub", "addcmul", "addcdiv", "lerp", "abs", "absolute", "sign", "sgn",
                     "floor_divide", "remainder", "fmod", "clamp", "clamp_min", "clamp_max",
                     "clip", "where", "erf", "frac", "trunc", "fix", "round", "floor", "ceil",
                     "nan_to_num", "masked_fill", "hypot", "atan2", "arctan2", "copysign",
                     "heaviside", "deg2rad", "rad2deg", "diff", "cross", "kron", "index_add",
                     "scatter_add", "scatter_reduce", "index_reduce", "threshold"],
        functions=[operator.add, operator.sub, operator.mul, operator.neg, operator.iadd,
                   operator.isub, operator.imul, operator.floordiv, operator.mod, operator.pos,
                   operator.abs, operator.ifloordiv, operator.imod],
        inplace={operator.iadd: operator.add, operator.isub: operator.sub,
                 operator.imul: operator.mul, operator.ifloordiv: operator.floordiv,
                 operator.imod: operator.mod},
        refine=_arith_refine),
    _op("embedding_bag", P, ["embedding_bag"], modules=["EmbeddingBag"], numeric=False),
    _op("div", P, ["div", "divide", "true_divide", "sqrt"],
        functions=[operator.truediv, operator.itruediv], out=Out.FLOAT, refine=_arith_refine,
        inplace={operator.itruediv: operator.truediv}),
    # NEUTRAL: a float times or over a power of two is exact in any float dtype (refined from
    # arith and div: ``0.5 * x``, ``scores / 8``).
    _op("exact_scale", N, [], probe=False,
        why="times or over a power of two: exact in any float dtype"),
    _op("activation", P, ["gelu", "silu", "mish", "elu", "selu", "celu", "leaky_relu",
                          "hardswish", "hardsigmoid", "softsign", "logsigmoid", "glu", "prelu",
                          "tanhshrink", "softshrink", "hardshrink", "rrelu", "log_sigmoid",
                          "_prelu_kernel"],
        modules=["GELU", "SiLU", "Mish", "ELU", "SELU", "CELU", "LeakyReLU", "Hardswish",
                 "Hardsigmoid", "Softsign", "LogSigmoid", "GLU", "PReLU", "Tanhshrink",
                 "Softshrink", "Hardshrink", "RReLU", "Threshold"],
        out=Out.FLOAT, lower=_ACTIVATION_LOWERINGS),
    _op("sigmoid", P, ["sigmoid", "expit"], modules=["Sigmoid"], bounded=True, out=Out.FLOAT,
        lower={nn.Sigmoid: lambda m, x, attr: (torch.sigmoid, (x,), {})}),
    _op("tanh", P, ["tanh"], modules=["Tanh"], bounded=True, out=Out.FLOAT,
        lower={nn.Tanh: lambda m, x, attr: (torch.tanh, (x,), {})}),
    _op("dropout", P, ["dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout",
                       "feature_alpha_dropout", "feature_dropout", "native_dropout"],
        modules=["Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "AlphaDropout",
                 "FeatureAlphaDropout"], random=True),
    # fold sums overlapping patches: not a pure copy.
    _op("fold", P, ["fold"], modules=["Fold"],
        op_names=("aten::col2im",)),
    _op("avg_pool", P, ["avg_pool1d", "avg_pool2d", "avg_pool3d", "adaptive_avg_pool1d",
                        "adaptive_avg_pool2d", "adaptive_avg_pool3d", "lp_pool1d", "lp_pool2d",
                        "lp_pool3d"],
        modules=["AvgPool1d", "AvgPool2d", "AvgPool3d", "AdaptiveAvgPool1d", "AdaptiveAvgPool2d",
                 "AdaptiveAvgPool3d", "LPPool1d", "LPPool2d", "LPPool3d"],
        classify=_avg_pool,
        # As a function, so that _avg_pool sees which pool a symbolic trace's module node is.
        lower={nn.AdaptiveAvgPool3d: lambda m, x, attr: (F.adaptive_avg_pool3d,
                                                          (x, m.output_size), {})}),
    _op("interpolate", P, ["interpolate", "upsample", "upsample_nearest", "upsample_bilinear",
                           "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d",
                           "upsample_linear1d", "upsample_bilinear2d", "upsample_bicubic2d",
                           "upsample_trilinear3d", "_C._nn._upsample_nearest_exact1d",
                           "_C._nn._upsample_nearest_exact2d", "_C._nn._upsample_nearest_exact3d",
                           "_C._nn._upsample_bilinear2d_aa", "_C._nn._upsample_bicubic2d_aa"],
        modules=["Upsample", "UpsamplingNearest2d", "UpsamplingBilinear2d"],
        # Nearest modes copy values (exact in any dtype); every other mode averages.
        classify=_interpolate,
        lower={nn.Upsample: _upsample, nn.UpsamplingNearest2d: _upsample,
               nn.UpsamplingBilinear2d: _upsample}),
    # Factories: no float input; the value is made as the model makes it (fp32 by default).
    # Grids: positions born as numbers (bf16 keeps 769 distinct values of 0..4095).
    _op("grid", P, ["arange", "range", "linspace", "logspace"], out=Out.FACTORY, probe=False,
        positions=True, values=("start", "end")),
    _op("factory", P, ["zeros", "ones", "empty", "full", "eye",
                       "empty_strided", "hann_window", "hamming_window", "blackman_window",
                       "bartlett_window", "kaiser_window", "zeros_like", "ones_like",
                       "empty_like", "full_like", "new_zeros", "new_ones", "new_empty",
                       "new_empty_strided", "new_full", "new_tensor", "tensor", "as_tensor",
                       "scalar_tensor", "asarray", "from_numpy"],
        # Only data and fill values are numbers the result is made of (zeros_like(ids) reads
        # no value of ids; torch.tensor(ids, dtype=float) converts them).
        out=Out.FACTORY, probe=False, values=("data", "obj", "fill_value", "start", "end")),
    _op("random", P, ["rand", "randn", "normal", "rand_like", "randn_like", "bernoulli",
                      "poisson", "binomial", "uniform", "exponential", "cauchy", "log_normal",
                      "geometric", "random", "_standard_gamma", "_sample_dirichlet"],
        out=Out.FACTORY, random=True, probe=False,
        # x.normal_() draws into x; torch.normal(x) would read x as the mean.
        writes=dict.fromkeys(["bernoulli_", "random_", "normal_", "uniform_", "exponential_",
                              "geometric_", "log_normal_", "cauchy_"], Write.CLONE)),
    # NEUTRAL: exact in any dtype (copies, selections, sign-preserving clamps at 0).
    _op("relu", N, ["relu", "relu6", "hardtanh"], modules=["ReLU", "ReLU6", "Hardtanh"],
        lower={nn.ReLU: lambda m, x, attr: (F.relu, (x,), {"inplace": m.inplace})}),
    _op("max_pool", N, ["max_pool1d", "max_pool2d", "max_pool3d", "adaptive_max_pool1d",
                        "adaptive_max_pool2d", "adaptive_max_pool3d", "max_unpool1d",
                        "max_unpool2d", "max_unpool3d", "fractional_max_pool2d",
                        "fractional_max_pool3d", "max_pool1d_with_indices",
                        "max_pool2d_with_indices", "max_pool3d_with_indices",
                        "adaptive_max_pool1d_with_indices", "adaptive_max_pool2d_with_indices",
                        "adaptive_max_pool3d_with_indices", "fractional_max_pool2d_with_indices",
                        "fractional_max_pool3d_with_indices"], keeps_input=True,
        modules=["MaxPool1d", "MaxPool2d", "MaxPool3d", "AdaptiveMaxPool1d",
                 "AdaptiveMaxPool2d", "AdaptiveMaxPool3d", "MaxUnpool1d", "MaxUnpool2d",
                 "MaxUnpool3d", "FractionalMaxPool2d", "FractionalMaxPool3d"]),
    _op("embedding", N, ["embedding"], modules=["Embedding"], numeric=False,
        lower={nn.Embedding: lambda m, x, attr: (F.embedding, (
            x, attr("weight"), m.padding_idx, m.max_norm, m.norm_type, m.scale_grad_by_freq,
            m.sparse), {})}),
    _op("index", N, ["gather", "index_select", "take_along_dim", "take", "masked_select",
                     "narrow", "narrow_copy", "select", "diagonal", "diag", "diag_embed",
                     "diagflat", "tril", "triu", "index_copy", "index_fill", "index_put",
                     "scatter", "masked_scatter", "put", "select_scatter", "slice_scatter",
                     "diagonal_scatter", "as_strided_scatter", "block_diag", "cartesian_prod",
                     "combinations"],
        numeric=False, classify=_accumulates,
        aliases=dict.fromkeys(["select", "narrow", "diagonal"], Alias.VIEW),
        # What is written or read is a number; the index and mask arguments are not.
        values=("self", "input", "src", "source", "value", "values"),
        op_names=("aten::index",)),
    _op("getitem", N, [], functions=[operator.getitem], methods=["__getitem__"], numeric=False,
        out=Out.ITEM, probe=False),
    # DTensor (tensor parallel): local <-> distributed views and moves of shards copy values,
    # exact in any dtype; a redistribute that sums partial sums is refined to PROMOTE
    # (_dtensor). DTensor.from_local by name: importing DTensor costs ~0.9 s.
    _op("dtensor", N, [], methods=["to_local", "redistribute", "full_tensor"], probe=False,
        classify=_dtensor,
        op_names=("torch.distributed.tensor._api.DTensor.from_local",),
        why="a DTensor's local tensor, or its shards moved between ranks: copies of values; "
            "a sum of partial sums follows the precision of what it sums"),
    # Writes made explicit by the functionalize pass: copies of values, exact in any dtype.
    Family("setitem", N, (runtime.setitem, operator.setitem), ("__setitem__",), numeric=False,
           values=("value",),
           probe=False),
    Family("write_view", N, (runtime.write_view,), numeric=False, probe=False, values=("value",)),
    # What other passes put into graphs (amprewrite/graph/runtime.py): exact copies of values.
    Family("batch_index", N, (runtime.batch_index,), numeric=False),
    # An fp32 region recomputed in backward (recompute_islands): it reads what it is given.
    Family("recompute", H, (runtime.recompute,), probe=False, out=Out.TUPLE,
           why="an fp32 region of pointwise ops recomputed in backward from its low inputs"),
    Family("batch_gather", N, (runtime.batch_gather,), numeric=False),
    Family("memory_format_of", X, (runtime.memory_format_of,), numeric=False, out=Out.NONTENSOR,
           metadata=True, probe=False),
    # The first and last calls of every transformed graph (guard_autocast): an enclosing
    # autocast off while the graph runs, then on again. They read no tensor.
    Family("autocast_guard", X, (runtime.autocast_off, runtime.autocast_on_again),
           numeric=False, out=Out.NONTENSOR, metadata=True, probe=False,
           why="turns an enclosing torch.autocast off while the graph runs: the plan's casts "
               "are explicit"),
    # In-place fills and copies (after functionalize: on private clones or graph inputs).
    # copy_(src) and fill_(tensor) convert the numbers they write to the written tensor's dtype.
    _op("fill", N, ["fill", "zero", "fill_diagonal", "copy"], numeric=False, probe=False,
        values=("src", "value"),
        writes=dict.fromkeys(["fill_", "zero_", "copy_", "fill_diagonal_", "index_fill_",
                              "map_", "apply_"], Write.CLONE),
        op_names=("aten::copy",)),
    # Autograd and storage bookkeeping: the value passes through unchanged.
    _op("autograd", N, ["requires_grad_", "retain_grad", "register_hook",
                        "register_post_accumulate_grad_hook", "backward", "record_stream",
                        "share_memory_", "module_load"], probe=False,
        aliases={"requires_grad_": Alias.VIEW},
        writes=dict.fromkeys(["requires_grad_", "share_memory_", "retain_grad_"], Write.NONE)),
    _op("shape", N, ["reshape", "flatten", "unflatten", "squeeze", "unsqueeze", "permute",
                     "transpose", "swapaxes", "swapdims", "movedim", "moveaxis", "t", "adjoint",
                     "broadcast_to", "flip", "fliplr", "flipud", "roll", "rot90", "clone",
                     "detach", "atleast_1d", "atleast_2d", "atleast_3d", "pixel_shuffle",
                     "pixel_unshuffle", "pad", "constant_pad_nd", "unfold", "channel_shuffle",
                     "native_channel_shuffle", "ravel", "view", "view_as", "reshape_as",
                     "expand", "expand_as", "repeat", "contiguous", "as_strided", "alias",
                     "reflection_pad1d", "reflection_pad2d", "reflection_pad3d",
                     "replication_pad1d", "replication_pad2d", "replication_pad3d",
                     "squeeze_copy", "unsqueeze_copy", "view_copy", "permute_copy",
                     "transpose_copy", "expand_copy", "t_copy", "detach_copy", "clone",
                     "to_dense", "coalesce", "pin_memory",
                     "align_as", "align_to", "refine_names", "rename",
                     "fft.fftshift", "fft.ifftshift", "alias_copy", "as_strided_copy",
                     "diagonal_copy", "select_copy", "slice_copy", "unfold_copy", "slice_inverse",
                     "__reversed__", "__deepcopy__"],
        modules=["Flatten", "Unflatten", "PixelShuffle", "PixelUnshuffle", "Identity",
                 "ChannelShuffle", "ZeroPad1d", "ZeroPad2d", "ZeroPad3d", "ConstantPad1d",
                 "ConstantPad2d", "ConstantPad3d", "ReflectionPad1d", "ReflectionPad2d",
                 "ReflectionPad3d", "ReplicationPad1d", "ReplicationPad2d", "ReplicationPad3d",
                 "CircularPad1d", "CircularPad2d", "CircularPad3d"],
        lower={nn.Flatten: lambda m, x, attr: (torch.flatten, (x, m.start_dim, m.end_dim), {})},
        aliases={**dict.fromkeys(
            ["view", "view_as", "transpose", "t", "permute", "unsqueeze", "squeeze", "unflatten",
             "movedim", "moveaxis", "swapaxes", "swapdims", "as_strided", "unfold", "detach",
             "alias", "expand", "expand_as", "T", "mT", "H", "mH", "data", "adjoint",
             "numpy_T", "matrix_H"], Alias.VIEW),
                 **dict.fromkeys(["reshape", "reshape_as", "flatten", "contiguous"],
                                 Alias.MAYBE_VIEW),
                 **dict.fromkeys(["atleast_1d", "atleast_2d", "atleast_3d"], Alias.MULTI)},
        writes=dict.fromkeys(["t_", "transpose_", "squeeze_", "unsqueeze_", "as_strided_",
                              "swapdims_", "swapaxes_", "resize_", "resize_as_", "set_",
                              "detach_"], Write.METADATA),
        # t.T, t.mT, t.H, t.mH: torch 2.14's dynamo writes them as these ATen ops. A constant
        # torch.tensor(...) in model code is exported as lift_fresh_copy(constant): a copy.
        op_names=("aten::alias", "aten::slice", "aten::resize_", "aten::numpy_T", "aten::mT",
                  "aten::mH", "aten::matrix_H", "aten::lift_fresh_copy", "aten::lift_fresh")),
    _op("split", N, ["split", "chunk", "unbind", "tensor_split", "split_with_sizes",
                     "unsafe_split", "unsafe_chunk", "unsafe_split_with_sizes", "hsplit",
                     "vsplit", "dsplit", "meshgrid", "split_copy", "split_with_sizes_copy",
                     "unbind_copy"], out=Out.SPLIT,
        aliases={**dict.fromkeys(["split", "chunk", "unbind", "tensor_split", "split_with_sizes",
                                  "hsplit", "vsplit", "dsplit"], Alias.VIEW),
                 "meshgrid": Alias.MULTI}),
    _op("broadcast", N, ["broadcast_tensors"], out=Out.BROADCAST,
        aliases={"broadcast_tensors": Alias.MULTI}),
    _op("join", N, ["cat", "concat", "concatenate", "stack", "hstack", "vstack", "dstack",
                    "column_stack", "row_stack"], out=Out.CAT),
    _op("repeat", N, ["repeat_interleave", "tile"]),
    _op("minmax", N, ["max", "min", "amax", "amin", "maximum", "minimum", "median", "nanmedian",
                      "msort", "fmax", "fmin"], out=Out.MINMAX),
    _op("sort", N, ["topk", "sort", "kthvalue", "cummax", "cummin", "mode", "aminmax",
                    "unique", "unique_consecutive"], out=Out.PAIR),
    # Conversions: the precision is the dtype the model names.
    # Conversions and moves (every op whose ``out`` is CONVERT; ``conversion_target`` reads what
    # they convert to). Each reads only its first argument's values: an integer tensor
    # converted to floats starts a position cone, whatever the spelling.
    _op("convert", N, ["to", "type", "float", "double", "half", "bfloat16", "cpu", "cuda",
                       "xpu", "ipu", "mtia"],
        classify=_convert, out=Out.CONVERT, probe=False, values=("self",),
        op_names=("aten::_to_copy",)),
    _op("convert_nonfloat", X, ["long", "int", "short", "bool", "byte", "char", "cfloat",
                                "cdouble", "chalf"],
        out=Out.CONVERT, probe=False, values=("self",)),
    # x.type_as(y): y's dtype, which the plan decides: the widest of the two, like arithmetic.
    _op("type_as", P, ["type_as"], out=Out.CONVERT, probe=False, values=("self",)),
    # NONFLOAT: results that are not floats; what matters is that casts never change them.
    _op("compare", X, ["eq", "ne", "lt", "le", "gt", "ge", "greater", "less", "greater_equal",
                       "less_equal", "not_equal", "isnan", "isinf", "isfinite", "isneginf",
                       "isposinf", "isreal", "logical_and", "logical_or", "logical_not",
                       "logical_xor", "any", "all", "isclose", "isin", "signbit"],
        functions=[operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge,
                   operator.not_, operator.and_, operator.or_, operator.xor, operator.invert],
        out=Out.BOOL, probe=False,
        inplace={operator.iand: operator.and_, operator.ior: operator.or_,
                 operator.ixor: operator.xor}),
    _op("bitwise", X, ["bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not",
                       "bitwise_left_shift", "bitwise_right_shift", "gcd", "lcm"],
        functions=[operator.lshift, operator.rshift], probe=False,
        inplace={operator.ilshift: operator.lshift, operator.irshift: operator.rshift}),
    _op("indices", X, ["argmax", "argmin", "argsort", "nonzero", "nonzero_static",
                       "searchsorted", "bucketize", "argwhere", "count_nonzero", "randint",
                       "randint_like", "randperm", "multinomial", "tril_indices", "triu_indices",
                       "one_hot", "unravel_index", "indices", "crow_indices", "col_indices",
                       "row_indices", "ccol_indices", "indices_copy", "crow_indices_copy",
                       "col_indices_copy", "row_indices_copy", "ccol_indices_copy"],
        out=Out.INDEX, probe=False),
    _op("metadata", X, ["size", "dim", "numel", "ndimension", "nelement", "stride",
                        "element_size", "is_floating_point", "is_contiguous", "len",
                        "get_device", "data_ptr", "is_complex", "storage_offset", "is_signed",
                        "is_inference", "is_conj", "is_neg", "is_pinned", "is_set_to",
                        "is_shared", "is_nonzero", "is_same_size", "is_tensor", "is_storage",
                        "result_type", "can_cast", "promote_types", "sym_size", "sym_numel",
                        "sym_stride", "untyped_storage", "dim_order", "has_names",
                        "is_coalesced", "is_distributed", "dense_dim", "sparse_dim", "storage",
                        "storage_type", "const_data_ptr", "hash_tensor", "sym_float", "sym_int",
                        "sym_ite", "sym_max", "sym_min", "sym_not", "sym_sum", "__contains__",
                        "__format__", "__repr__", "__get__", "__dlpack_device__",
                        "ops.aten.sym_size.int",
                        "ops.aten.sym_numel.default", "ops.aten.sym_stride.int"],
        out=Out.NONTENSOR, metadata=True, probe=False,
        op_names=("aten::sym_storage_offset", "aten::sym_is_contiguous")),
    _op("value", X, ["item", "tolist", "equal", "allclose", "__bool__", "__int__",
                     "__float__", "__index__", "__long__", "__nonzero__", "__complex__",
                     "numpy", "__array__", "__array_wrap__", "__dlpack__", "__reduce_ex__",
                     "__setstate__"],
        out=Out.NONTENSOR, probe=False,
        op_names=("aten::_local_scalar_dense",)),
    Family("attribute", N, (builtins.getattr,), out=Out.ATTR, probe=False),
]
# Losses no test can show worse in low precision on CPU (tests/test_precision_classes.py).
_LOSS_WHY = {
    "multi_margin_loss": "a loss (sums); no low-precision CPU kernel",
    "multilabel_margin_loss": "a loss (sums); no low-precision CPU kernel",
    "ctc_loss": "sums probabilities over alignments; no low-precision CPU kernel",
    "linear_cross_entropy": "a Python function: capture traces through it into linear and "
                            "cross_entropy, which carry the classes",
}
for _fn, _mod in _LOSSES:
    _TABLE.append(_op(_fn, H, [_fn, *_LOSS_ALIASES.get(_fn, [])], modules=[_mod],
                      why=_LOSS_WHY.get(_fn, ""), op_names=_LOSS_OPS.get(_fn, ())))

# Spellings whose bare names also exist with another meaning, or that moved family.
_METADATA_ATTRS = frozenset({"shape", "dtype", "device", "ndim", "is_cuda", "requires_grad",
                             "layout", "is_sparse", "names", "is_leaf", "grad_fn", "is_meta",
                             "is_quantized", "itemsize", "nbytes"})

_FAMILIES: dict[str, Family] = {f.name: f for f in _TABLE}
FAMILIES: Mapping[str, Family] = MappingProxyType(_FAMILIES)

_BY_FUNCTION: dict[object, Family] = {}
_BY_METHOD: dict[str, Family] = {}
_BY_MODULE: dict[type, Family] = {}
_BY_OP_NAME: dict[str, Family] = {}
_ALIASES: dict[str, Alias] = {}
_WRITES: dict[str, Write] = {}
_INPLACE: dict[Callable, Callable] = {}


def register_family(family: Family) -> Family:
    """Add a family (or replace one of the same name) with all its spellings.

    Spellings already claimed by an earlier family keep that family.
    """
    _FAMILIES[family.name] = family
    _reindex()
    return family


@contextlib.contextmanager
def override_families(*families: Family, **precisions: Precision) -> Iterator[None]:
    """Use ``families`` (each replacing the family of its name, or added) and the given
    precision classes (``softmax=Precision.LOW``) inside the block; on exit, whatever happened,
    the registry is as it was. For tests, and for trying a change before registering it.

    >>> import torch
    >>> with override_families(softmax=Precision.LOW):
    ...     FAMILIES["softmax"].precision
    <Precision.LOW: 'low'>
    >>> FAMILIES["softmax"].precision
    <Precision.FP32: 'fp32'>
    """
    saved = dict(_FAMILIES)
    try:
        for name, precision in precisions.items():
            if name not in _FAMILIES:
                raise KeyError(f"no op family named {name!r}; see amprewrite.FAMILIES")
            _FAMILIES[name] = dataclasses.replace(_FAMILIES[name], precision=precision)
        for family in families:
            _FAMILIES[family.name] = family
        _reindex()
        yield
    finally:
        _FAMILIES.clear()
        _FAMILIES.update(saved)
        _reindex()


def _reindex() -> None:
    _BY_FUNCTION.clear()
    _BY_METHOD.clear()
    _BY_MODULE.clear()
    _BY_OP_NAME.clear()
    _ALIASES.clear()
    _WRITES.clear()
    _INPLACE.clear()
    for fam in _FAMILIES.values():
        for key, alias in fam.aliases.items():
            _ALIASES.setdefault(key, alias)
        for fn in fam.functions:  # view functions a view chain replays (runtime.replay_view)
            name = getattr(fn, "__name__", "")
            if fam.aliases.get(name) is Alias.VIEW and not hasattr(torch.Tensor, name):
                runtime.VIEW_FUNCTIONS.setdefault(runtime.view_function_key(fn), fn)
        for key, write in fam.writes.items():
            _WRITES.setdefault(key, write)
        for fn, plain in fam.inplace.items():
            _INPLACE.setdefault(fn, plain)
        for name in fam.op_names:
            _BY_OP_NAME.setdefault(name, fam)
        for fn in fam.functions:
            _BY_FUNCTION.setdefault(fn, fam)
        for m in fam.methods:
            _BY_METHOD.setdefault(m, fam)
        for mod in fam.modules:
            _BY_MODULE.setdefault(mod, fam)


def family_for_function(fn: object) -> Family | None:
    """The family of a ``call_function`` target, or None.

    ``torch.ops`` operators map by name: ATen ones by their base name (``aten::add.Tensor`` is
    ``torch.add``'s family), custom ones by a family's ``op_names``.
    """
    try:
        fam = _BY_FUNCTION.get(fn)
    except TypeError:  # unhashable target
        return None
    if fam is None and isinstance(fn, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        qualified = (fn._qualified_op_name if isinstance(fn, torch._ops.OpOverloadPacket)
                     else fn.name().split(".")[0])
        fam = _BY_OP_NAME.get(qualified)
        space, _, base = qualified.partition("::")
        if fam is None and space == "aten":
            fam = _aten_family(base)
    if fam is None and callable(fn) and hasattr(fn, "__qualname__"):
        fam = _BY_OP_NAME.get(f"{getattr(fn, '__module__', '')}.{fn.__qualname__}")
    return fam


def _aten_family(base: str) -> Family | None:
    """An ATen op's family by its base name: ``torch.X``, ``F.X``, ``torch._C._nn.X``,
    ``torch.special/linalg/fft.X`` (``linalg_inv`` is ``torch.linalg.inv``), ``Tensor.X``; a
    leading underscore (``_softmax``, ``_adaptive_avg_pool2d``) names the public op."""
    for name in (base, base.lstrip("_")) if base.startswith("_") else (base,):
        for prefix, space in (("special_", torch.special), ("linalg_", torch.linalg),
                              ("fft_", torch.fft)):
            if name.startswith(prefix):
                fam = _BY_FUNCTION.get(getattr(space, name[len(prefix):], None))
                if fam is not None:
                    return fam
        for space in _NAMESPACES:
            fn = getattr(space, name, None)
            if fn is not None:
                try:
                    fam = _BY_FUNCTION.get(fn)
                except TypeError:
                    fam = None
                if fam is not None:
                    return fam
        fam = family_for_method(name)
        if fam is not None:
            return fam
    return None


def family_for_method(name: str) -> Family | None:
    """The family of a ``call_method`` name; in-place ``x.add_`` maps to ``add``'s family."""
    fam = _BY_METHOD.get(name)
    if fam is None and name.endswith("_") and not name.endswith("__"):
        fam = _BY_METHOD.get(name[:-1])
    return fam


def family_for_module(module_type: type) -> Family | None:
    """The family of a module class, walking its bases (a subclass of nn.Linear is linear)."""
    for base in module_type.__mro__:
        fam = _BY_MODULE.get(base)
        if fam is not None:
            return fam
    return None


# The matmul spellings that compute ``x @ w`` (``linear``: ``x @ w.T``, ``addmm``: ``b + x @ w``)
# of two matrix operands and nothing else: what a float8 GEMM may replace (float8_linears).
# ``dot``, ``inner``, ``outer``, ``einsum``, ``bmm`` and the rest of the matmul family do not.
PLAIN_MATMULS = frozenset({F.linear, torch.matmul, torch.mm, torch.addmm, torch.linalg.matmul,
                           operator.matmul,
                           # capture="export" graphs: the ATen overloads
                           torch.ops.aten.linear.default, torch.ops.aten.matmul.default,
                           torch.ops.aten.mm.default, torch.ops.aten.addmm.default})
PLAIN_MATMUL_METHODS = frozenset({"matmul", "mm", "addmm"})


def is_plain_matmul(node: fx.Node) -> bool:
    """Is ``node`` one of :data:`PLAIN_MATMULS` (or the method spelling of one)?"""
    if node.op == "call_function":
        return node.target in PLAIN_MATMULS
    return node.op == "call_method" and node.target in PLAIN_MATMUL_METHODS


def family_of(node: fx.Node, module: nn.Module | None = None) -> Family | None:
    """The family of ``node``; ``module`` is the submodule a ``call_module`` node calls.

    Operator spellings are refined: ``x * x`` is ``pow``, ``1 / x`` is ``reciprocal``.
    """
    fam: Family | None = None
    if node.op == "call_function":
        fam = family_for_function(node.target)
        if fam is None and getattr(node.target, "__objclass__", None) in (torch._C.TensorBase,
                                                                           torch.Tensor):
            # A Tensor method called unbound (``getattr(t, name)(...)`` in a symbolic trace).
            fam = family_for_method(node.target.__name__)
        if fam is None and getattr(node.target, "__name__", "").endswith("_"):
            fam = family_for_function(getattr(torch, node.target.__name__[:-1], None))
    elif node.op == "call_method":
        fam = family_for_method(str(node.target))
    elif node.op == "call_module" and module is not None:
        fam = family_for_module(type(module))
    if fam is not None and fam.refine is not None and node.op != "call_module":
        other = fam.refine(node)
        if other is not None:
            return _FAMILIES[other]
    return fam


def precision_of(node: fx.Node, family: Family, module: nn.Module | None,
                 low: torch.dtype) -> tuple[Precision, str]:
    """The family's precision for this node and the reason (interpolate by mode, ...)."""
    if family.name == "interpolate" and node.op == "call_module":
        mode = upsample_mode(node, module)
        if mode in NEAREST_MODES:
            return Precision.NEUTRAL, f"{mode} upsample copies values: exact in any dtype"
    elif family.classify is not None:
        refined = family.classify(node, low)
        if refined is not None:
            return refined
    return family.precision, f"op family '{family.name}'"


def op_name(node: fx.Node) -> str:
    """The bare name of a node's op: ``add`` for ``operator.add``, ``torch.add`` or ``x.add``."""
    t = node.target
    return t if isinstance(t, str) else getattr(t, "__name__", "")


def fp32_helper_of(node: fx.Node) -> Callable | None:
    """The runtime function (``Family.fp32_helper``) that can replace ``node`` as it is: a call of
    the family's functional form (``F.group_norm``, ``torch.group_norm``, ``aten.group_norm``),
    whose arguments the helper takes unchanged. None for other spellings (``native_group_norm``
    returns statistics too) and families without one.

    >>> from torch import fx
    >>> g = fx.Graph(); x = g.placeholder("x")
    >>> fp32_helper_of(g.call_function(F.group_norm, (x, 2))).__name__
    'group_norm_fp32'
    >>> fp32_helper_of(g.call_function(torch.native_group_norm, (x, None, None, 1, 4, 9, 2, 0.1)))
    """
    fam = FAMILIES.get(node.meta.get(M.FAMILY) or "") or family_of(node)
    if fam is None or fam.fp32_helper is None or node.op != "call_function":
        return None
    name = op_qualname(node.target) or op_name(node)
    return fam.fp32_helper if name.split("::")[-1] == fam.name else None


@functools.cache
def _aten_pointwise(name: str) -> bool:
    packet = getattr(torch.ops.aten, name, None)
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return False
    return any(torch.Tag.pointwise in getattr(packet, o).tags for o in packet.overloads())


def is_pointwise(node: fx.Node) -> bool:
    """Whether ``node`` computes each output element from the same element of its inputs
    (``torch.Tag.pointwise`` on the ATen op of its name or its family's: ``torch.tanh``,
    ``x.mul``, ``operator.add``, ``F.gelu``), drawing no random numbers.

    >>> from torch import fx
    >>> g = fx.Graph(); x = g.placeholder("x")
    >>> is_pointwise(g.call_function(torch.tanh, (x,))), is_pointwise(g.call_method("sum", (x,)))
    (True, False)
    """
    if node.op not in ("call_function", "call_method"):
        return False
    fam = family_of(node)
    if fam is None or fam.random:
        return False
    name = op_qualname(node.target)
    names = [name.split("::")[-1].split(".")[0]] if name else [op_name(node), fam.name]
    return any(_aten_pointwise(n) for n in names if n)


# Pointwise ops whose backward keeps no tensor: sums and differences (and negation) ...
_KEEPS_NOTHING = frozenset({"add", "sub", "rsub", "neg", "positive"})
# ... and products and quotients, when only one operand is a tensor (scaling by a number).
_KEEPS_OPERANDS = frozenset({"mul", "div", "truediv", "true_divide", "multiply", "divide"})


def kept_for_backward(node: fx.Node) -> int:
    """How many tensors the size of its output autograd keeps for ``node``'s backward. For a
    pointwise op: 0 for a sum or difference and for scaling by a number, 2 for a product or
    quotient of two tensors, 1 for the rest (``exp``/``tanh`` keep their output, ``pow``/``gelu``
    their input). For another op: 1 where its family keeps its input (a LOW family: matmul,
    conv; ``Family.keeps_input``: a norm, a max pooling) or is unknown, 0 for the rest (views,
    ``cat``, padding, indexing). An estimate for the memory plan (``recompute_islands``,
    ``plan_casts`` in training).

    >>> from torch import fx
    >>> import operator
    >>> g = fx.Graph(); x, y = g.placeholder("x"), g.placeholder("y")
    >>> [kept_for_backward(g.call_function(f, a)) for f, a in
    ...  ((operator.add, (x, y)), (operator.mul, (x, 2.0)), (operator.mul, (x, y)),
    ...   (torch.tanh, (x,)), (torch.cat, ([x, y],)), (torch.matmul, (x, y)))]
    [0, 0, 2, 1, 0, 1]
    """
    if not is_pointwise(node):
        fam = family_of(node) if node.op in ("call_function", "call_method", "call_module") \
            else None
        if fam is None:
            return int(node.op in ("call_function", "call_method", "call_module"))
        return int(fam.precision == Precision.LOW or fam.keeps_input)
    name = (op_qualname(node.target) or op_name(node)).split("::")[-1].split(".")[0]
    name = name.strip("_").removeprefix("r") if name.startswith("__") else name
    tensors = sum(1 for a in (*node.args, *node.kwargs.values()) if isinstance(a, fx.Node))
    if name in _KEEPS_NOTHING:
        return 0
    if name in _KEEPS_OPERANDS:
        return 0 if tensors < 2 else 2
    return 1


def op_qualname(target: object) -> str | None:
    """``mylib::scale`` for a ``torch.ops`` operator (``aten::add.Tensor`` for an overload other
    than ``default``); None for anything else. Selectors and reports spell custom ops this way.

    >>> op_qualname(torch.ops.aten.add.Tensor), op_qualname(torch.ops.aten.relu.default)
    ('aten::add.Tensor', 'aten::relu')
    """
    if isinstance(target, torch._ops.OpOverload):
        base = target._schema.name
        overload = target._overloadname
        return base if overload in ("default", "") else f"{base}.{overload}"
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    return None


def qualified_name(node: fx.Node) -> str:
    """``torch.foo`` / ``Tensor.foo`` / ``mymodule.foo`` / ``mylib::foo``: how a user would
    spell the op."""
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    t = node.target
    op = op_qualname(t)
    if op is not None:
        return op
    module = getattr(t, "__module__", None) or ""
    module = {"torch._C._nn": "torch.nn.functional", "torch._C._special": "torch.special",
              "torch._C._linalg": "torch.linalg", "torch._C._fft": "torch.fft",
              "torch._C._VariableFunctions": "torch", "_operator": "operator"}.get(module, module)
    name = getattr(t, "__qualname__", None) or getattr(t, "__name__", None) or str(t)
    if module.startswith("torch._C") or not module:
        module = "torch"
    return f"{module}.{name}"


def reads_values(node: fx.Node) -> bool:
    """False when ``node`` reads only metadata of its inputs (``x.size()``, ``x.shape``)."""
    if node.target is builtins.getattr and len(node.args) > 1:
        return node.args[1] not in _METADATA_ATTRS
    fam = family_of(node)
    if fam is not None:
        return not fam.metadata
    return not op_name(node).startswith("sym_")


def alias_of(name: str) -> Alias | None:
    """What the result of the op (or tensor attribute) ``name`` shares storage with; None: a
    new tensor.

    >>> alias_of("transpose"), alias_of("reshape"), alias_of("add")
    (<Alias.VIEW: 'view'>, <Alias.MAYBE_VIEW: 'maybe_view'>, None)
    """
    return _ALIASES.get(name)


def function_counterpart(fn: object) -> Callable | None:
    """``torch.relu_`` -> ``torch.relu``, ``F.elu_`` -> ``F.elu``: the out-of-place function
    next to an in-place one in the same namespace, if there is one."""
    name = getattr(fn, "__name__", "")
    for space in _NAMESPACES:
        if getattr(space, name, None) is fn:
            return getattr(space, name[:-1], None)
    return None


def inplace_counterpart(fn: object) -> Callable | None:
    """The out-of-place form of an in-place operator function (``operator.iadd`` -> ``add``)."""
    try:
        return _INPLACE.get(fn)  # type: ignore[arg-type]
    except TypeError:  # an unhashable callable
        return None


def write_of(node: fx.Node, name: str | None = None) -> Write | None:
    """What ``node`` writes into its first argument (:class:`Write`); None when it writes
    nothing there. ``name`` is the node's op name when the caller knows it better (the
    attribute of a ``getattr``).

    In-place operators (``x += y``), names ending in ``_`` (``x.add_``, ``torch.relu_``) and a
    true ``inplace`` argument (``F.relu(x, inplace=True)``, also given by position) write;
    the registry's ``writes`` say which of them write nothing, only metadata, or values the
    out-of-place name does not compute.
    """
    if node.op not in ("call_method", "call_function"):
        return None
    if inplace_counterpart(node.target) is not None:
        return Write.DATA
    name = op_name(node) if name is None else name
    if name in _WRITES:
        write = _WRITES[name]
        return None if write is Write.NONE else write
    if (name.endswith("_") and not name.endswith("__") and not name.startswith("_")
            and not _python_operator(node)):
        return Write.DATA
    return Write.DATA if inplace_flag(node) else None


def _python_operator(node: fx.Node) -> bool:
    """``operator.and_`` / ``or_`` / ``not_``: Python's ``&``, ``|`` and ``not``, whose names
    end in ``_`` only because ``and`` is a keyword (``&=`` is ``operator.iand``)."""
    return node.op == "call_function" and getattr(node.target, "__module__", None) in (
        "_operator", "operator")


def writes_in_place(node: fx.Node) -> bool:
    """Does ``node`` write into its first argument (``x.add_(y)``, ``F.relu(x, True)``)?"""
    return write_of(node) is not None


def inplace_flag(node: fx.Node) -> bool:
    """Whether ``node`` passes ``inplace=True`` (by keyword, or by position per the signature)."""
    if node.kwargs.get("inplace") is True:
        return True
    if node.op != "call_function" or not callable(node.target):
        return False
    try:
        i = _inplace_position(node.target)
    except TypeError:  # an unhashable callable
        i = _inplace_position.__wrapped__(node.target)
    return i is not None and len(node.args) > i and node.args[i] is True


@functools.cache
def _inplace_position(fn: object) -> int | None:
    """The position of ``fn``'s ``inplace`` parameter (parsing a signature costs ~0.3 ms)."""
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None
    return params.index("inplace") if "inplace" in params else None


def lowering(module: nn.Module) -> Lowering | None:
    """The module form -> function rule for exactly this module class (subclasses may differ)."""
    fam = family_for_module(type(module))
    return fam.lower.get(type(module)) if fam is not None else None


_reindex()
