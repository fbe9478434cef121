"""The options of a transform, as one validated dataclass shared by the API, backend and CLI."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import fx, nn

from ..errors import PolicyError
from ..graph import meta as M
from ..graph.dtypes import low_dtype
from .float8 import parse_fp8
from .ops import FAMILIES, op_qualname
from .saved_plan import load_plan

__all__ = ["CAPTURES", "Policy", "calibration_batches", "check_node_selectors", "check_selectors",
           "matches", "parse_dtype"]

CAPTURES = {
    "dynamo": "torch._dynamo.export, a graph of torch-level ops",
    "export": "non-strict torch.export.export, an ATen-level graph",
}
"""``transform(capture=...)``'s values: how a model with example inputs is captured."""

Selector = str | type
"""A module path (``"encoder.layer.0"``), a module type (``nn.LayerNorm``) or a family name."""


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """Return the low-precision dtype named by ``dtype`` (``torch.bfloat16``, ``"bf16"``, ...).

    >>> parse_dtype("fp16")
    torch.float16
    """
    low = low_dtype(dtype)
    if low is not None:
        return low
    if isinstance(dtype, (torch.Tensor, tuple, list, dict)):
        # transform(model, (x,)): inputs in dtype's place. Name them; never print the tensors.
        raise PolicyError(
            f"dtype got {_what(dtype)}, which looks like example inputs: the second argument "
            "of transform is the dtype. Pass the inputs by keyword, "
            "transform(model, example_inputs=(x,)) (dtype defaults to bfloat16), or both: "
            "transform(model, torch.float16, example_inputs=(x,))."
        )
    raise PolicyError(
        f"amprewrite converts models to bfloat16 or float16, got dtype={_short_repr(dtype)}. "
        "Pass dtype=torch.bfloat16 (or 'bf16') or dtype=torch.float16 (or 'fp16'); "
        "for a pure fp32 model there is nothing to rewrite."
    )


def _what(value: object) -> str:
    """A value described by its type and its tensors' shapes, never its contents: ``a tuple
    of 1 (a Tensor float32[20,20])``."""
    if isinstance(value, torch.Tensor):
        shape = ",".join(map(str, value.shape))
        return f"a Tensor {str(value.dtype).replace('torch.', '')}[{shape}]"
    if isinstance(value, (tuple, list)):
        items = ", ".join(_what(v) for v in value[:3]) + (", ..." if len(value) > 3 else "")
        return f"a {type(value).__name__} of {len(value)} ({items})"
    if isinstance(value, dict):
        return f"a dict of {len(value)} ({', '.join(map(repr, list(value)[:3]))}" + (
            ", ...)" if len(value) > 3 else ")")
    return _short_repr(value)


def _short_repr(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def calibration_batches(value: object) -> tuple:
    """``transform(calibration=...)`` as a tuple of input batches (``None``: none).

    >>> len(calibration_batches([(torch.ones(2),), (torch.zeros(2),)]))
    2
    """
    if value is None:
        return ()
    if isinstance(value, (torch.Tensor, dict, str, bytes)) or not isinstance(value, Iterable):
        raise PolicyError(
            "calibration must be an iterable of input batches, each of the form of "
            "example_inputs (a tuple of positional inputs or a dict of keyword inputs), for "
            f"example [(x1,), (x2,)] or a DataLoader of such; got {type(value).__name__}."
        )
    return tuple(value)


def _selectors(name: str, value: object) -> tuple[Selector, ...]:
    if value is None:
        return ()
    if isinstance(value, (str, type)):
        value = (value,)
    if not isinstance(value, Iterable):
        raise PolicyError(
            f"{name} must be a list of module paths, module types or family names, got {value!r}."
        )
    out = []
    for item in value:
        if isinstance(item, str) and item:
            out.append(item)
        elif isinstance(item, type) and issubclass(item, nn.Module):
            out.append(item)
        else:
            raise PolicyError(
                f"{name} entries must be module paths like 'encoder.layer.0', nn.Module "
                f"subclasses like nn.LayerNorm, or op family names like 'softmax'; got {item!r}."
            )
    return tuple(out)


@dataclass(frozen=True)
class Policy:
    """How a model is converted. Built by :func:`amprewrite.transform` from its keywords.

    >>> Policy(dtype="bf16").dtype
    torch.bfloat16
    >>> Policy(dtype=torch.float16, keep_fp32=["head"]).keep_fp32
    ('head',)
    """

    dtype: torch.dtype = torch.bfloat16
    keep_fp32: tuple[Selector, ...] = field(default=())
    allow_low: tuple[Selector, ...] = field(default=())
    params: Literal["fp32", "low"] = "fp32"
    keep_io_dtype: bool = True
    upsample: Literal["auto", "always", "never"] = "auto"
    device: torch.device | None = None  # the device the graph will run on (for kernel probes)
    # With example inputs: what a call with inputs the graph was not captured for does.
    on_new_shape: Literal["transform", "error"] = "transform"
    # With example inputs: compare the graph against fp32 and autocast before returning it.
    verify: bool = True
    # With example inputs: the sizes the graph serves, as torch.export's dynamic_shapes, or
    # "batch" (dimension 0 dynamic where the model allows it) or None (all static).
    dynamic_shapes: object = field(default="batch", hash=False)
    # With example inputs: how the model is captured (see CAPTURES).
    capture: Literal["dynamo", "export"] = "dynamo"
    # fp16 values past the range (with headroom): "fp32" computes and stores them in fp32;
    # "rescale" runs a matmul whose result passes it low on its weight scaled by 2**-k;
    # "auto" is "fp32" unless that leaves under half the matmul FLOPs in fp16, then rescales
    # from the output backwards until half are (passes/rescale_matmuls.py).
    overflow: Literal["auto", "fp32", "rescale"] = "auto"
    # More input batches whose value ranges the plan reads besides the example inputs'
    # (transform(calibration=...)); data, not options: not compared, hashed or shown.
    calibration: tuple = field(default=(), hash=False, compare=False, repr=False)
    # bf16 only: the linears that pay and stay accurate run in float8 (amprewrite.precision.float8).
    fp8: object = None
    # A saved plan (amprewrite.save_plan; a path, its text or dict, read into a SavedPlan):
    # its decisions are applied instead of deciding again (docs/guide.md, "Plans"). Compared
    # and hashed by its contents.
    plan: object = field(default=None, repr=False)
    # With plan=: refuse a graph with nodes the plan does not know, or without nodes it has
    # (the model changed), instead of deciding those afresh.
    strict: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))
        keep = _selectors("keep_fp32", self.keep_fp32)
        allow = _selectors("allow_low", self.allow_low)
        both = set(keep) & set(allow)
        if both:
            raise PolicyError(
                f"{sorted(map(str, both))} appear in both keep_fp32 and allow_low; "
                "name each module, type or family in one of them only."
            )
        object.__setattr__(self, "keep_fp32", keep)
        object.__setattr__(self, "allow_low", allow)
        if self.params not in ("fp32", "low"):
            raise PolicyError(
                f"params must be 'fp32' (share the model's fp32 weights, cast in the graph) or "
                f"'low' (store low-precision copies of weights used only by low ops), "
                f"got {self.params!r}."
            )
        if self.upsample not in ("auto", "always", "never"):
            raise PolicyError(
                f"upsample must be 'auto' (rewrite nearest upsampling the target has no kernel "
                f"for), 'always' or 'never', got {self.upsample!r}."
            )
        if self.device is not None:
            try:
                object.__setattr__(self, "device", torch.device(self.device))
            except (RuntimeError, TypeError):
                raise PolicyError(f"device must name a torch device such as 'cuda' or 'cpu', "
                                  f"got {self.device!r}.") from None
        if self.on_new_shape not in ("transform", "error"):
            raise PolicyError(
                f"on_new_shape must be 'transform' (transform again, once per new shape class, "
                f"when called with inputs the graph was not captured for) or 'error' (raise "
                f"ShapeError instead), got {self.on_new_shape!r}."
            )
        if not (self.dynamic_shapes is None or self.dynamic_shapes == "batch"
                or isinstance(self.dynamic_shapes, (dict, tuple, list))):
            raise PolicyError(
                "dynamic_shapes must be 'batch' (the default: dimension 0 of each input dynamic "
                "where the model allows it), None (every size static) or torch.export's "
                "dynamic_shapes (a dict by argument name or a tuple by position of "
                f"{{dim: torch.export.Dim(...)}}), got {self.dynamic_shapes!r}."
            )
        if self.capture not in CAPTURES:
            raise PolicyError(
                f"capture must be one of {', '.join(map(repr, CAPTURES))} "
                f"({'; '.join(f'{k!r}: {v}' for k, v in CAPTURES.items())}), got "
                f"{self.capture!r}. It applies with example_inputs; without them the model is "
                "traced with torch.fx.symbolic_trace."
            )
        object.__setattr__(self, "calibration", calibration_batches(self.calibration))
        if self.overflow not in ("auto", "fp32", "rescale"):
            raise PolicyError(
                f"overflow must be 'auto' (the default: 'fp32', unless that leaves under half "
                f"of the matmul FLOPs in fp16, then 'rescale' from the output backwards until "
                f"half are), 'fp32' (values past fp16's range computed and stored in fp32) or "
                f"'rescale' (a matmul whose result passes it runs in fp16 on its weight scaled "
                f"by a power of two, scaled back in fp32), got {self.overflow!r}."
            )
        if not isinstance(self.verify, bool):
            raise PolicyError(f"verify must be True or False, got {self.verify!r}.")
        fp8 = parse_fp8(self.fp8)
        if fp8 is not None:
            fp8 = dataclasses.replace(fp8, include=_selectors("fp8 include", fp8.include),
                                      exclude=_selectors("fp8 exclude", fp8.exclude))
        object.__setattr__(self, "fp8", fp8)
        if self.fp8 is not None and self.dtype != torch.bfloat16:
            raise PolicyError(
                f"fp8 runs the chosen linears in float8 and everything else in bfloat16; with "
                f"dtype={self.dtype} it has no plan to follow. Use dtype=torch.bfloat16 with "
                "fp8=..., or drop fp8.")
        if not isinstance(self.keep_io_dtype, bool):
            raise PolicyError(f"keep_io_dtype must be True or False, got {self.keep_io_dtype!r}.")
        if not isinstance(self.strict, bool):
            raise PolicyError(f"strict must be True or False, got {self.strict!r}.")
        if self.plan is not None:
            plan = load_plan(self.plan)
            object.__setattr__(self, "plan", plan)
            if plan.dtype is not None and plan.dtype != self.dtype:
                raise PolicyError(
                    f"the plan {plan.source} was made for {plan.dtype}, and this transform asks "
                    f"for {self.dtype}: its decisions (which nodes run low, which casts) hold "
                    f"for its dtype only. Pass dtype={plan.dtype}, or transform without plan= "
                    "to decide afresh for this dtype.")


def check_selectors(policy: Policy, paths: Iterable[str], owner: str) -> None:
    """Raise :class:`PolicyError` for a ``keep_fp32``/``allow_low`` entry that names neither a
    module path in ``paths``, a module type nor an op family (``node:`` names are checked
    against the captured graph). ``owner`` names the model in the message. ``transform`` and the
    torch.compile backend both check their options with this.

    >>> check_selectors(Policy(keep_fp32=["fc1", "softmax"]), ["fc1", "fc2"], "Net")
    >>> check_selectors(Policy(keep_fp32=["fc9"]), ["fc1", "fc2"], "Net")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    amprewrite.errors.PolicyError: keep_fp32 names 'fc9', which is neither a module of Net ...
    """

    paths = [p for p in paths if p]
    known = set(paths)
    for option, selectors in (("keep_fp32", policy.keep_fp32), ("allow_low", policy.allow_low)):
        for sel in selectors:
            if (isinstance(sel, type) or sel in FAMILIES or sel in known
                    or sel.startswith("node:") or "::" in sel):
                continue  # operators ("mylib::scale") and families may be absent from a graph
            close = difflib.get_close_matches(sel, paths + list(FAMILIES), n=3, cutoff=0.6)
            hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
            raise PolicyError(
                f"{option} names '{sel}', which is neither a module of {owner} nor an op "
                f"family.{hint} Use a path from model.named_modules(), an nn.Module type, a "
                "family name from amprewrite.FAMILIES, or an operator as 'namespace::name'."
            )


def check_node_selectors(policy: Policy, gm: fx.GraphModule) -> None:
    """Raise :class:`PolicyError` for a ``node:`` selector that names no node of the captured
    graph ``gm``, with the close names."""
    names = [n.name for n in gm.graph.nodes]
    for option, selectors in (("keep_fp32", policy.keep_fp32), ("allow_low", policy.allow_low)):
        for sel in selectors:
            if isinstance(sel, str) and sel.startswith("node:") and sel[5:] not in names:
                close = difflib.get_close_matches(sel[5:], names, n=3, cutoff=0.6)
                hint = (f" Did you mean {', '.join(repr('node:' + c) for c in close)}?"
                        if close else "")
                raise PolicyError(
                    f"{option} names graph node '{sel[5:]}', which the captured graph does not "
                    f"have.{hint} Node names come from amprewrite.report(gm) of the same model "
                    "and example inputs."
                )


def matches(node: fx.Node, selector: Selector) -> bool:
    """Does a keep_fp32 / allow_low entry select ``node``?"""
    if isinstance(selector, type):
        return any(issubclass(t, selector) for t in node.meta.get(M.MODULE_TYPES, ()))
    if selector.startswith("node:"):
        return node.name == selector[5:]
    if selector in FAMILIES:
        return node.meta.get(M.FAMILY) == selector
    if "::" in selector:  # an operator by qualified name: "mylib::scale" (any overload)
        op = op_qualname(node.target) if node.op == "call_function" else None
        return op is not None and (op == selector or op.split(".")[0] == selector)
    path = node.meta.get(M.MODULE_PATH, "")
    return path == selector or path.startswith(selector + ".")
