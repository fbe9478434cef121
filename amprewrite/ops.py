"""Op families: every spelling of an op (module class, function, Tensor method) in one table.

Passes ask :func:`family_of` which family a node belongs to and never compare targets
themselves, so "where is softmax decided?" has one answer: the ``softmax`` row below.

>>> import torch
>>> FAMILIES["softmax"].precision
<Precision.FP32: 'fp32'>
>>> family_for_function(torch.nn.functional.linear).name
'linear'
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import fx, nn

from . import runtime

__all__ = [
    "FAMILIES",
    "Family",
    "Precision",
    "family_for_function",
    "family_for_method",
    "family_for_module",
    "family_of",
]


class Precision(enum.Enum):
    """Precision class of a node (DESIGN.md, "Precision classes")."""

    LOW = "low"  # runs in the target dtype: matmul-like ops
    FP32 = "fp32"  # numerically risky: inputs upcast, computed in fp32
    PROMOTE = "promote"  # elementwise arithmetic: the widest precision among its float inputs
    NEUTRAL = "neutral"  # exact in any dtype: a cast may move across it
    NONFLOAT = "nonfloat"  # integer/bool/non-tensor values, and dtypes amprewrite leaves alone


@dataclass(frozen=True)
class Family:
    """One op family and all its spellings."""

    name: str
    precision: Precision
    functions: tuple[Callable, ...] = ()
    methods: tuple[str, ...] = ()
    modules: tuple[type, ...] = ()
    # Ends a position cone: its output is bounded, so low precision no longer collides values.
    bounded: bool = False
    # Reads the values of an integer input as numbers (not as indices): int in, float out.
    numeric: bool = True
    # Per-node refinement, e.g. interpolate is NEUTRAL for mode="nearest" only.
    classify: Callable[[fx.Node], Precision] | None = field(default=None, compare=False)


def _fns(*names: str) -> tuple[Callable, ...]:
    """Resolve dotted names under torch, skipping those this torch version lacks."""
    out = []
    for name in names:
        obj: object = torch
        for part in name.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if obj is not None and obj not in out:
            out.append(obj)
    return tuple(out)


def _mods(*names: str) -> tuple[type, ...]:
    return tuple(getattr(nn, n) for n in names if hasattr(nn, n))


def _op(name: str, precision: Precision, fn_names: Iterable[str] = (), methods=(), modules=(),
        **kw) -> Family:
    return Family(name, precision, _fns(*fn_names), tuple(methods), _mods(*modules), **kw)


def _interpolate_precision(node: fx.Node) -> Precision:
    mode = node.kwargs.get("mode")
    if mode is None:
        # F.interpolate(input, size, scale_factor, mode, ...): mode is the 4th positional.
        mode = node.args[3] if len(node.args) > 3 else "nearest"
    if node.target in (F.upsample_bilinear,):
        mode = "bilinear"
    # Nearest modes copy values, so they are exact in any dtype.
    return Precision.NEUTRAL if mode in ("nearest", "nearest-exact") else Precision.PROMOTE


L, H, P, N = Precision.LOW, Precision.FP32, Precision.PROMOTE, Precision.NEUTRAL

_LOSSES = [
    # (functional name, module class name)
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
    ("ctc_loss", "CTCLoss"),
]

_TABLE: list[Family] = [
    # LOW: matmul-like ops, where low precision pays and accumulation is fp32 inside the kernel.
    _op("linear", L, ["nn.functional.linear", "_C._nn.linear"], modules=["Linear", "LazyLinear"]),
    _op("bilinear", L, ["nn.functional.bilinear", "bilinear"], modules=["Bilinear"]),
    _op("conv", L, ["nn.functional.conv1d", "nn.functional.conv2d", "nn.functional.conv3d",
                    "conv1d", "conv2d", "conv3d", "convolution"],
        modules=["Conv1d", "Conv2d", "Conv3d", "LazyConv1d", "LazyConv2d", "LazyConv3d"]),
    _op("conv_transpose", L, ["nn.functional.conv_transpose1d", "nn.functional.conv_transpose2d",
                              "nn.functional.conv_transpose3d", "conv_transpose1d",
                              "conv_transpose2d", "conv_transpose3d"],
        modules=["ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d"]),
    _op("matmul", L, ["matmul", "mm", "bmm", "addmm", "baddbmm", "addbmm", "mv", "addmv",
                      "einsum", "tensordot", "chain_matmul", "linalg.multi_dot"],
        methods=["matmul", "mm", "bmm", "addmm", "baddbmm", "addbmm", "mv", "addmv",
                 "__matmul__", "__rmatmul__"]),
    Family("matmul_operator", L, (operator.matmul,)),
    _op("scaled_dot_product_attention", L, ["nn.functional.scaled_dot_product_attention"]),
    # FP32: normalisations (batch statistics overflow fp16; NaN corrupts running stats).
    _op("batch_norm", H, ["nn.functional.batch_norm", "batch_norm"],
        modules=["BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm",
                 "LazyBatchNorm1d", "LazyBatchNorm2d", "LazyBatchNorm3d"]),
    _op("instance_norm", H, ["nn.functional.instance_norm", "instance_norm"],
        modules=["InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d"]),
    _op("group_norm", H, ["nn.functional.group_norm", "group_norm"], modules=["GroupNorm"]),
    _op("layer_norm", H, ["nn.functional.layer_norm", "layer_norm"], modules=["LayerNorm"]),
    _op("rms_norm", H, ["nn.functional.rms_norm", "rms_norm"], modules=["RMSNorm"]),
    _op("local_response_norm", H, ["nn.functional.local_response_norm"],
        modules=["LocalResponseNorm", "CrossMapLRN2d"]),
    _op("normalize", H, ["nn.functional.normalize"]),
    # FP32: softmax family (exp of large logits overflows; bounded output ends a position cone).
    _op("softmax", H, ["nn.functional.softmax", "softmax", "_softmax", "special.softmax"],
        methods=["softmax"], modules=["Softmax", "Softmax2d"], bounded=True),
    _op("log_softmax", H, ["nn.functional.log_softmax", "log_softmax", "special.log_softmax"],
        methods=["log_softmax"], modules=["LogSoftmax"]),
    _op("softmin", H, ["nn.functional.softmin"], modules=["Softmin"], bounded=True),
    # FP32: exp/log/pow family (fp16 exp(12) is inf; log near 0 loses everything).
    _op("exp", H, ["exp", "exp2", "special.exp2"], methods=["exp", "exp2"]),
    _op("expm1", H, ["expm1", "special.expm1"], methods=["expm1"]),
    _op("log", H, ["log", "log2", "log10", "special.xlogy", "xlogy"],
        methods=["log", "log2", "log10", "xlogy"]),
    _op("log1p", H, ["log1p", "special.log1p"], methods=["log1p"]),
    _op("pow", H, ["pow", "float_power"], methods=["pow", "__pow__", "__rpow__", "float_power"]),
    Family("pow_operator", H, (operator.pow,)),
    _op("reciprocal", H, ["reciprocal"], methods=["reciprocal", "__rtruediv__"]),
    _op("rsqrt", H, ["rsqrt"], methods=["rsqrt"]),
    _op("softplus", H, ["nn.functional.softplus"], modules=["Softplus"]),
    _op("trig", H, ["sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "erfinv",
                    "special.erfinv"],
        methods=["sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "erfinv"],
        bounded=True),
    # FP32: reductions (a long fp16 sum overflows or stops growing).
    _op("sum", H, ["sum", "nansum"], methods=["sum", "nansum"]),
    _op("prod", H, ["prod"], methods=["prod"]),
    _op("cumsum", H, ["cumsum", "cumprod"], methods=["cumsum", "cumprod"]),
    _op("mean", H, ["mean", "nanmean"], methods=["mean", "nanmean"]),
    _op("var", H, ["var", "std", "var_mean", "std_mean"],
        methods=["var", "std", "var_mean", "std_mean"]),
    _op("logsumexp", H, ["logsumexp", "special.logsumexp"], methods=["logsumexp", "logcumsumexp"]),
    _op("norm", H, ["norm", "linalg.norm", "linalg.vector_norm", "linalg.matrix_norm", "renorm",
                    "dist", "cdist", "nn.functional.pdist", "nn.functional.cosine_similarity",
                    "nn.functional.pairwise_distance"],
        methods=["norm", "renorm", "dist"], modules=["CosineSimilarity", "PairwiseDistance"]),
    # PROMOTE: elementwise arithmetic and activations run in the widest float input.
    Family("arith", P, (operator.add, operator.sub, operator.mul, operator.truediv,
                        operator.neg, operator.iadd, operator.isub, operator.imul,
                        operator.itruediv, operator.floordiv, operator.mod,
                        *_fns("add", "sub", "subtract", "mul", "multiply", "div", "divide",
                              "true_divide", "neg", "negative", "rsub", "addcmul", "addcdiv",
                              "lerp", "square", "sqrt", "abs", "sign", "floor_divide",
                              "remainder", "fmod", "clamp", "clip", "where", "erf", "special.erf",
                              "frac", "trunc", "round", "floor", "ceil", "nan_to_num",
                              "masked_fill", "hypot", "atan2")),
           methods=("add", "sub", "mul", "div", "true_divide", "neg", "__neg__", "rsub",
                    "addcmul", "addcdiv", "lerp", "square", "sqrt", "abs", "sign",
                    "clamp", "clip", "where", "erf", "floor", "ceil", "round", "trunc",
                    "masked_fill", "__add__", "__radd__", "__sub__", "__rsub__", "__mul__",
                    "__rmul__", "__truediv__", "__floordiv__", "__mod__", "fmod", "remainder",
                    "nan_to_num", "atan2")),
    _op("activation", P, ["nn.functional.gelu", "nn.functional.silu", "nn.functional.mish",
                          "nn.functional.elu", "nn.functional.selu", "nn.functional.celu",
                          "nn.functional.leaky_relu", "nn.functional.hardswish",
                          "nn.functional.hardsigmoid", "nn.functional.softsign",
                          "nn.functional.logsigmoid", "nn.functional.glu", "nn.functional.prelu",
                          "nn.functional.tanhshrink", "nn.functional.softshrink",
                          "nn.functional.hardshrink", "nn.functional.rrelu"],
        methods=["gelu"],
        modules=["GELU", "SiLU", "Mish", "ELU", "SELU", "CELU", "LeakyReLU", "Hardswish",
                 "Hardsigmoid", "Softsign", "LogSigmoid", "GLU", "PReLU", "Tanhshrink",
                 "Softshrink", "Hardshrink", "RReLU"]),
    _op("sigmoid", P, ["sigmoid", "nn.functional.sigmoid", "special.expit"],
        methods=["sigmoid"], modules=["Sigmoid"], bounded=True),
    _op("tanh", P, ["tanh", "nn.functional.tanh"], methods=["tanh"], modules=["Tanh"],
        bounded=True),
    _op("dropout", P, ["nn.functional.dropout", "nn.functional.dropout1d",
                       "nn.functional.dropout2d", "nn.functional.dropout3d",
                       "nn.functional.alpha_dropout", "nn.functional.feature_alpha_dropout",
                       "dropout"],
        methods=["dropout"],
        modules=["Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "AlphaDropout",
                 "FeatureAlphaDropout"]),
    # fold sums overlapping patches: not a pure copy.
    _op("fold", P, ["nn.functional.fold"], modules=["Fold"]),
    _op("avg_pool", P, ["nn.functional.avg_pool1d", "nn.functional.avg_pool2d",
                        "nn.functional.avg_pool3d", "nn.functional.adaptive_avg_pool1d",
                        "nn.functional.adaptive_avg_pool2d", "nn.functional.adaptive_avg_pool3d",
                        "avg_pool1d", "adaptive_avg_pool1d", "_C._nn.avg_pool2d",
                        "_C._nn.avg_pool3d", "_C._nn.adaptive_avg_pool2d",
                        "_C._nn.adaptive_avg_pool3d", "nn.functional.lp_pool1d",
                        "nn.functional.lp_pool2d"],
        modules=["AvgPool1d", "AvgPool2d", "AvgPool3d", "AdaptiveAvgPool1d", "AdaptiveAvgPool2d",
                 "AdaptiveAvgPool3d", "LPPool1d", "LPPool2d"]),
    _op("interpolate", P, ["nn.functional.interpolate", "nn.functional.upsample",
                           "nn.functional.upsample_nearest", "nn.functional.upsample_bilinear"],
        modules=["Upsample", "UpsamplingNearest2d", "UpsamplingBilinear2d"],
        # Nearest modes copy values (exact in any dtype); every other mode averages.
        classify=_interpolate_precision),
    # NEUTRAL: exact in any dtype (copies, selections, sign-preserving clamps at 0).
    _op("relu", N, ["relu", "relu_", "nn.functional.relu", "nn.functional.relu6",
                    "nn.functional.hardtanh"],
        methods=["relu", "relu_"], modules=["ReLU", "ReLU6", "Hardtanh"]),
    _op("max_pool", N, ["nn.functional.max_pool1d", "nn.functional.max_pool2d",
                        "nn.functional.max_pool3d", "nn.functional.adaptive_max_pool1d",
                        "nn.functional.adaptive_max_pool2d", "nn.functional.adaptive_max_pool3d",
                        "max_pool1d", "max_pool2d", "max_pool3d"],
        modules=["MaxPool1d", "MaxPool2d", "MaxPool3d", "AdaptiveMaxPool1d",
                 "AdaptiveMaxPool2d", "AdaptiveMaxPool3d"]),
    _op("embedding", N, ["nn.functional.embedding", "embedding"], modules=["Embedding"],
        numeric=False),
    _op("index", N, ["gather", "index_select", "take_along_dim", "take", "masked_select",
                     "narrow", "select", "diagonal", "tril", "triu"],
        methods=["gather", "index_select", "take_along_dim", "take", "masked_select",
                 "narrow", "select", "diagonal", "tril", "triu", "__getitem__"],
        numeric=False),
    Family("getitem", N, (operator.getitem,), numeric=False),
    # Writes made explicit by the functionalize pass: copies of values, exact in any dtype.
    Family("setitem", N, (runtime.setitem,), numeric=False),
    Family("write_view", N, (runtime.write_view,), numeric=False),
    _op("shape", N, ["reshape", "flatten", "unflatten", "squeeze", "unsqueeze", "permute",
                     "transpose", "swapaxes", "movedim", "t", "broadcast_to", "flip", "roll",
                     "rot90", "clone", "detach", "atleast_1d", "atleast_2d", "atleast_3d",
                     "nn.functional.pixel_shuffle", "nn.functional.pixel_unshuffle",
                     "nn.functional.pad", "nn.functional.unfold",
                     "nn.functional.channel_shuffle"],
        methods=["view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "squeeze",
                 "unsqueeze", "permute", "transpose", "swapaxes", "movedim", "t", "expand",
                 "expand_as", "repeat", "repeat_interleave", "tile", "contiguous", "flip",
                 "roll", "clone", "detach", "unfold", "chunk", "split", "unbind",
                 "tensor_split", "mT", "T"],
        modules=["Flatten", "Unflatten", "PixelShuffle", "PixelUnshuffle", "Identity",
                 "ZeroPad1d", "ZeroPad2d", "ZeroPad3d", "ConstantPad1d", "ConstantPad2d",
                 "ConstantPad3d", "ReflectionPad1d", "ReflectionPad2d", "ReflectionPad3d",
                 "ReplicationPad1d", "ReplicationPad2d", "ReplicationPad3d"]),
    _op("join", N, ["cat", "concat", "concatenate", "stack", "hstack", "vstack", "dstack",
                    "split", "chunk", "unbind", "tensor_split", "repeat_interleave", "tile"]),
    _op("minmax", N, ["max", "min", "amax", "amin", "maximum", "minimum", "topk", "sort",
                      "kthvalue", "median", "cummax", "cummin"],
        methods=["max", "min", "amax", "amin", "maximum", "minimum", "topk", "sort",
                 "kthvalue", "median", "cummax", "cummin"]),
]
_TABLE += [_op(fn, H, [f"nn.functional.{fn}"], modules=[mod]) for fn, mod in _LOSSES]

FAMILIES: dict[str, Family] = {f.name: f for f in _TABLE}

_BY_FUNCTION: dict[object, Family] = {}
_BY_METHOD: dict[str, Family] = {}
_BY_MODULE: dict[type, Family] = {}


def register_family(family: Family) -> Family:
    """Add a family (or replace one of the same name) with all its spellings.

    Rewrite passes use it for the functions they put into graphs, e.g. ``upsample_nearest``.
    Spellings already claimed by an earlier family keep that family.
    """
    FAMILIES[family.name] = family
    _reindex()
    return family


def _reindex() -> None:
    _BY_FUNCTION.clear()
    _BY_METHOD.clear()
    _BY_MODULE.clear()
    for fam in FAMILIES.values():
        for fn in fam.functions:
            _BY_FUNCTION.setdefault(fn, fam)
        for m in fam.methods:
            _BY_METHOD.setdefault(m, fam)
        for mod in fam.modules:
            _BY_MODULE.setdefault(mod, fam)


def family_for_function(fn: object) -> Family | None:
    """The family of a ``call_function`` target, or None."""
    try:
        return _BY_FUNCTION.get(fn)
    except TypeError:  # unhashable target
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


def family_of(node: fx.Node, module: nn.Module | None = None) -> Family | None:
    """The family of ``node``; ``module`` is the submodule a ``call_module`` node calls."""
    if node.op == "call_function":
        return family_for_function(node.target)
    if node.op == "call_method":
        return family_for_method(str(node.target))
    if node.op == "call_module" and module is not None:
        return family_for_module(type(module))
    return None


def precision_of(node: fx.Node, family: Family, module: nn.Module | None = None) -> Precision:
    """The family's precision for this particular node (e.g. interpolate by mode)."""
    if family.name == "interpolate" and node.op == "call_module":
        mode = getattr(module, "mode", "nearest")
        return Precision.NEUTRAL if mode in ("nearest", "nearest-exact") else Precision.PROMOTE
    if family.classify is not None:
        return family.classify(node)
    return family.precision


def families_markdown() -> str:
    """The op-family table as Markdown (docs/families.md is this output)."""
    def spell(f: Family) -> str:
        module = {"_operator": "operator"}
        names = [f"`{module.get(fn.__module__, fn.__module__ or 'torch')}.{fn.__name__}`"
                 for fn in f.functions]
        names += [f"`Tensor.{m}`" for m in f.methods]
        names += [f"`nn.{m.__name__}`" for m in f.modules]
        return ", ".join(names)

    lines = [
        "# Op families and precision classes",
        "",
        "Generated from `amprewrite/ops.py` by `amprewrite families > docs/families.md`;",
        "a test fails when this file and the table disagree.",
        "",
        "Unknown functions and methods are PROMOTE (they run in the widest float input, as under",
        "autocast); unknown leaf modules are FP32 (they run on their own fp32 parameters).",
        "`bounded` families end a position cone. Non-`numeric` families read integer inputs as",
        "indices, so they do not start one.",
        "",
    ]
    for cls in Precision:
        fams = [f for f in FAMILIES.values() if f.precision == cls]
        if not fams:
            continue
        lines += [f"## {cls.name}", "", "| family | notes | spellings |", "|---|---|---|"]
        for f in fams:
            notes = ", ".join(n for n, on in (("bounded", f.bounded), ("indices", not f.numeric),
                                              ("per-node", f.classify is not None)) if on)
            lines.append(f"| `{f.name}` | {notes} | {spell(f)} |")
        lines.append("")
    return "\n".join(lines)


_reindex()
