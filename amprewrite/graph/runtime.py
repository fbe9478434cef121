"""Functions that transformed graphs call at run time.

They are plain functions of their arguments (no state, no registration): a pass puts a
``call_function`` node with one of them as target into the graph, and
``amprewrite/precision/ops.py`` gives each a row in the op table. Each is ``torch.fx.wrap``-ped, so
re-tracing a transformed graph keeps it one node.

>>> import torch
>>> x = torch.zeros(2, 3)
>>> y = setitem(x, (0, slice(None)), 1.0)
>>> y.tolist(), x.sum().item()
([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]], 0.0)
>>> write_view(x, torch.ones(2), (("t", (), {}), ("__getitem__", (1,), {}))).tolist()
[[0.0, 1.0, 0.0], [0.0, 1.0, 0.0]]
"""

from __future__ import annotations

import contextlib
import inspect
import math
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from fractions import Fraction

import torch

from ..errors import AutocastIgnoredWarning
from .meta import REPORT_KEY

__all__ = [
    "AUTOCAST_DEVICES",
    "ViewStep",
    "autocast_off",
    "autocast_on_again",
    "autograd_function_apply",
    "batch_gather",
    "batch_index",
    "cast_if_float",
    "group_norm_fp32",
    "layer_norm_fp32",
    "memory_format_of",
    "nearest_scale",
    "no_enclosing_autocast",
    "recompute",
    "replay_view",
    "setitem",
    "vmap_call",
    "write_view",
]

ViewStep = tuple[str, tuple, dict]
"""One view op as data: a Tensor attribute name (``"transpose"``, ``"__getitem__"``, ``"T"``),
its positional arguments after the tensor, and its keyword arguments."""


# Tensor attributes that are properties (``T``, ``mT``, ``real``, ``data``), not methods. Known
# ahead of the call so that replaying a step is a plain attribute read or method call: dynamo
# traces both, and cannot trace ``callable()`` of an attribute it does not know
# (``torch.compile(gm, fullgraph=True)`` failed on every graph with a write through a view).
_PROPERTIES = frozenset(name for name in dir(torch.Tensor)
                        if not callable(inspect.getattr_static(torch.Tensor, name, None)))


def replay_view(base: torch.Tensor, steps: Sequence[ViewStep]) -> torch.Tensor:
    """Apply the view ops ``steps`` to ``base`` in order (a property such as ``T`` takes none).

    >>> replay_view(torch.arange(6.0).reshape(2, 3), (("T", (), {}), ("narrow", (0, 1, 2), {})))
    tensor([[1., 4.],
            [2., 5.]])
    """
    view = base
    for name, args, kwargs in steps:
        if name.startswith("fn:"):  # a view function the registry names: fn(view, ...)
            view = VIEW_FUNCTIONS[name[3:]](view, *args, **kwargs)
        elif name in _PROPERTIES:
            view = getattr(view, name)
        else:
            view = getattr(view, name)(*args, **kwargs)
    return view


# View functions of the registry's families (``Family.aliases``), by :func:`view_function_key`:
# a view chain names them as ``"fn:<key>"``, data a graph can hold. Filled by amprewrite.ops.
VIEW_FUNCTIONS: dict[str, Callable] = {}


def view_function_key(fn: object) -> str:
    """The name a view chain gives a view function: ``module.qualname``."""
    return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', repr(fn))}"


def setitem(base: torch.Tensor, index: object, value: object) -> torch.Tensor:
    """``base`` with ``base[index] = value`` applied, as a new tensor (``base`` is unchanged)."""
    out = base.clone()
    out[index] = value
    return out


def write_view(base: torch.Tensor, value: torch.Tensor, steps: Sequence[ViewStep]) -> torch.Tensor:
    """``base`` with the view ``replay_view(base, steps)`` overwritten by ``value``, as a new
    tensor: what an in-place write through that view does to ``base``."""
    out = base.clone()
    replay_view(out, steps).copy_(value)
    return out


# --- custom autograd Functions ----------------------------------------------------------------


class _GraphFunction(torch.autograd.Function):
    """A custom ``torch.autograd.Function`` as dynamo captured it: a forward and a backward
    graph (see :func:`autograd_function_apply`)."""

    @staticmethod
    def forward(ctx, fwd, bwd, non_differentiable_idx, saved_for_backward_idx, dirty_idx,
                *args):
        out, saved = fwd(*args)
        # What the Function saved with ctx.save_for_backward is saved so again (version
        # checked); what it kept on ctx as attributes stays an attribute.
        keep = set(saved_for_backward_idx)
        ctx.save_for_backward(*[v for i, v in enumerate(saved) if i in keep])
        ctx.stashed = tuple(None if i in keep else v for i, v in enumerate(saved))
        ctx.keep = tuple(i in keep for i in range(len(saved)))
        ctx.bwd = bwd
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if dirty_idx:
            ctx.mark_dirty(*[o for i, o in enumerate(outs) if i in set(dirty_idx)])
        if non_differentiable_idx:
            ctx.mark_non_differentiable(*[o for i, o in enumerate(outs)
                                          if i in set(non_differentiable_idx)])
        return out

    @staticmethod
    def backward(ctx, *grads):
        tensors = iter(ctx.saved_tensors)
        saved = [next(tensors) if k else v for k, v in zip(ctx.keep, ctx.stashed)]
        return (None, None, None, None, None, *ctx.bwd(*grads, *saved))


def autograd_function_apply(fwd: torch.nn.Module, bwd: torch.nn.Module, *args,
                            non_differentiable_idx: Sequence[int] = (),
                            saved_for_backward_idx: Sequence[int] = (),
                            dirty_idx: Sequence[int] = ()):
    """A custom ``torch.autograd.Function`` that dynamo captured as the graphs ``fwd`` and
    ``bwd`` (``torch.ops.higher_order.autograd_function_apply``, what a capture holds), applied
    to ``args`` as a Function again, its own backward kept: the form ``torch.compile`` accepts
    in a graph it is handed (it cannot trace the higher-order op itself).

    ``fwd(*args)`` returns ``(outputs, saved)``; ``bwd(*grads, *saved)`` the input gradients.

    >>> fwd = lambda x: ((x * 2,), (x,))
    >>> bwd = lambda g, x: (g * 10,)   # a deliberately different backward
    >>> x = torch.ones(2, requires_grad=True)
    >>> (y,) = autograd_function_apply(fwd, bwd, x, saved_for_backward_idx=[0])
    >>> y.sum().backward(); x.grad.tolist()
    [10.0, 10.0]
    """
    return _GraphFunction.apply(fwd, bwd, tuple(non_differentiable_idx),
                                tuple(saved_for_backward_idx), tuple(dirty_idx), *args)


# --- norms that compute in fp32 and store low ----------------------------------------------


class _Fp32Norm(torch.autograd.Function):
    """A norm on a low input computed exactly as an fp32 island would (the input upcast, the
    fp32 kernel forward and backward), saving the low input for backward instead of its fp32
    copy: upcasting is exact, so backward rebuilds the copy bit for bit."""

    @staticmethod
    def forward(ctx, kind, x, arg, weight, bias, eps):
        xf = _dense(x.float(), x)
        if kind == "group":
            n, c = x.shape[0], x.shape[1]
            hw = x.numel() // max(n * c, 1)
            out, mean, rstd = torch.ops.aten.native_group_norm(xf, weight, bias, n, c, hw, arg,
                                                               eps)
            ctx.sizes = (n, c, hw, arg)
        else:
            out, mean, rstd = torch.ops.aten.native_layer_norm(xf, arg, weight, bias, eps)
            ctx.sizes = tuple(arg)
        ctx.kind = kind
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        mask = [ctx.needs_input_grad[1], weight is not None and ctx.needs_input_grad[3],
                bias is not None and ctx.needs_input_grad[4]]
        xf, grad = _dense(x.float(), x), _dense(grad.float(), x)
        if ctx.kind == "group":
            dx, dw, db = torch.ops.aten.native_group_norm_backward(
                grad, xf, mean, rstd, weight, *ctx.sizes, mask)
        else:
            dx, dw, db = torch.ops.aten.native_layer_norm_backward(
                grad, xf, ctx.sizes, mean, rstd, weight, bias, mask)
        return None, None if dx is None else dx.to(x.dtype), None, dw, db, None


def _dense(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t`` in the memory format ATen's group and layer norms run in for an input like
    ``like``: as it is where it is dense in that format (channels-last included), else a
    contiguous copy, as ``aten.group_norm`` makes (its native kernels refuse other strides: a
    transposed ``(N, C, L)`` input)."""
    return t.contiguous(memory_format=_suggest_memory_format(like))


_NORMS = {"group": torch.nn.functional.group_norm, "layer": torch.nn.functional.layer_norm}


def _norm_island(kind: str, input: torch.Tensor, arg, weight, bias, eps: float) -> torch.Tensor:
    return _NORMS[kind](input.float(), arg, weight, bias, eps).to(input.dtype)


def _fp32_norm(kind: str, input: torch.Tensor, arg, weight, bias, eps: float) -> torch.Tensor:
    if input.dtype == torch.float32 or input.dtype == torch.float64:
        return _NORMS[kind](input, arg, weight, bias, eps)
    if torch.compiler.is_compiling():
        # Under torch.compile the partitioner, handed the Function, kept the fp32 copy (the
        # backward's upcast merged with the forward's): a checkpointed island keeps the low
        # input, and inductor recomputes the fused norm in backward.
        if not torch.is_grad_enabled():
            return _norm_island(kind, input, arg, weight, bias, eps)
        return torch.utils.checkpoint.checkpoint(_norm_island, kind, input, arg, weight, bias,
                                                 eps, use_reentrant=False,
                                                 preserve_rng_state=False)
    if kind == "layer":
        arg = tuple(int(d) for d in arg)
    return _Fp32Norm.apply(kind, input, arg, weight, bias, eps)


@torch.fx.wrap
def group_norm_fp32(input: torch.Tensor, num_groups: int, weight: torch.Tensor | None = None,
                    bias: torch.Tensor | None = None, eps: float = 1e-5,
                    cudnn_enabled: bool = True) -> torch.Tensor:
    """``F.group_norm`` that computes in fp32 and returns (and saves) the input's dtype. It takes
    the arguments of ``F.group_norm``, ``torch.group_norm`` and ``aten.group_norm`` as they are
    (``cudnn_enabled`` is not read).

    For a kernel that refuses a low input with fp32 weights, or sums the weights' gradients in
    the low dtype: the forward and backward are the fp32 kernels on an exact fp32 copy of the
    input, made when needed and not kept. Bit-equal to an fp32 island
    (``F.group_norm(x.float(), ...).to(x.dtype)``), forward and backward.

    >>> x = torch.randn(2, 4, 3, 3).to(torch.bfloat16)
    >>> w, b = torch.rand(4), torch.rand(4)
    >>> y = group_norm_fp32(x, 2, w, b)
    >>> y.dtype, torch.equal(y, torch.nn.functional.group_norm(x.float(), 2, w, b).bfloat16())
    (torch.bfloat16, True)
    """
    return _fp32_norm("group", input, num_groups, weight, bias, eps)


@torch.fx.wrap
def layer_norm_fp32(input: torch.Tensor, normalized_shape: Sequence[int],
                    weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                    eps: float = 1e-5, cudnn_enable: bool = True) -> torch.Tensor:
    """``F.layer_norm`` that computes in fp32 and returns (and saves) the input's dtype; see
    :func:`group_norm_fp32` (``torch.layer_norm``'s ``cudnn_enable`` is not read).

    >>> x = torch.randn(2, 3, 8).to(torch.float16)
    >>> w, b = torch.rand(8), torch.rand(8)
    >>> y = layer_norm_fp32(x, (8,), w, b)
    >>> y.dtype, torch.equal(y, torch.nn.functional.layer_norm(x.float(), (8,), w, b).half())
    (torch.float16, True)
    """
    return _fp32_norm("layer", input, normalized_shape, weight, bias, eps)


def recompute(body: Callable, *args):
    """``body(*args)``, its intermediate values recomputed in backward instead of kept
    (``torch.utils.checkpoint``, non-reentrant): an fp32 region that reads low values keeps
    those for backward, not its fp32 intermediates. Without a gradient to take, a plain call.

    >>> body = lambda x: (x.float().exp() * 2).to(x.dtype)
    >>> x = torch.ones(3, dtype=torch.bfloat16, requires_grad=True)
    >>> recompute(body, x).float().sum().backward(); x.grad.tolist()
    [5.4375, 5.4375, 5.4375]
    """
    if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad
                                       for a in args):
        # The region draws no random numbers (recompute_islands leaves those out).
        return torch.utils.checkpoint.checkpoint(body, *args, use_reentrant=False,
                                                 preserve_rng_state=False)
    return body(*args)


# --- casts ------------------------------------------------------------------------------------


@torch.fx.wrap
def cast_if_float(x, dtype: torch.dtype):
    """``x.to(dtype)`` if ``x`` is a floating-point tensor, else ``x`` unchanged (the cast of a
    value whose dtype the trace could not know).

    >>> cast_if_float(torch.ones(2), torch.bfloat16).dtype
    torch.bfloat16
    >>> cast_if_float(torch.ones(2, dtype=torch.int64), torch.bfloat16).dtype
    torch.int64
    """
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.to(dtype)
    return x


# --- re-rolled loops --------------------------------------------------------------------------


@torch.fx.wrap
def batch_index(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``torch.stack([t[i][index[i]] for i in range(t.size(0))])`` in one indexing op.

    >>> t, idx = torch.arange(12.0).reshape(2, 3, 2), torch.tensor([[2, 0], [1, 1]])
    >>> torch.equal(batch_index(t, idx), torch.stack([t[i][idx[i]] for i in range(2)]))
    True
    """
    rows = torch.arange(t.size(0), device=t.device).view(-1, *([1] * (index.dim() - 1)))
    return t[rows, index]


@torch.fx.wrap
def batch_gather(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``torch.stack([torch.gather(t[i], 0, index[i]) for i in ...])`` as one gather.

    >>> t, idx = torch.arange(6.0).reshape(2, 3), torch.tensor([[2, 0], [1, 1]])
    >>> loop = torch.stack([torch.gather(t[i], 0, idx[i]) for i in range(2)])
    >>> torch.equal(batch_gather(t, idx), loop)
    True
    """
    return torch.gather(t, 1, index)


@torch.fx.wrap
def vmap_call(body: torch.nn.Module, in_dims: tuple, *args):
    """``torch.stack([body(*per_sample_args(i)) for i in ...])`` as ``torch.vmap(body)``."""
    return torch.vmap(body, in_dims=in_dims)(*args)


# --- nearest upsampling -----------------------------------------------------------------------

try:  # ATen's Tensor::suggest_memory_format, mirrored in Python
    from torch._prims_common import suggest_memory_format as _suggest_memory_format
except ImportError:  # older torch: the common cases

    def _suggest_memory_format(x: torch.Tensor) -> torch.memory_format:
        if x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(
                memory_format=torch.channels_last):
            return torch.channels_last
        if x.dim() == 5 and not x.is_contiguous() and x.is_contiguous(
                memory_format=torch.channels_last_3d):
            return torch.channels_last_3d
        return torch.contiguous_format

# Past this output size the float32 index formula may drift from dst // s; use the gather.
EXPAND_LIMIT = 1 << 22


@torch.fx.wrap
def memory_format_of(x: torch.Tensor) -> torch.memory_format:
    """The memory format ATen gives a new tensor made from ``x`` (``channels_last`` in,
    ``channels_last`` out): an upsample's output must match it, because the next conv's
    summation order depends on it.

    >>> memory_format_of(torch.ones(1, 3, 4, 4).to(memory_format=torch.channels_last))
    torch.channels_last
    """
    return _suggest_memory_format(x)


def _per_dim(value, k: int) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value] * k


def nearest_scale(in_size: int, out_size: int, scale: float | None) -> float:
    """``compute_scales_value<float>`` of ATen's UpSample.h, as the Python float of that f32."""
    if scale is not None and scale > 0:
        return torch.tensor(1.0 / scale, dtype=torch.float32).item()  # double 1/s as float
    return (torch.tensor(float(in_size), dtype=torch.float32)
            / torch.tensor(float(out_size), dtype=torch.float32)).item()


def repeat_factor(in_size: int | None, out_size: int | None, scale: float | None,
                  exact: bool) -> int | None:
    """The integer s with source index ``dst // s`` for every dst, if ATen's formula gives it.

    ``in_size``/``out_size`` None mean unknown until run time (a dynamic or untraced size);
    then only a factor given as ``scale`` can be proved.
    """
    if in_size is not None and out_size is not None:
        if out_size == in_size and not exact:
            return 1  # ATen copies
        if out_size == 2 * in_size and not exact:
            return 2  # ATen shifts
        if out_size % in_size or out_size >= EXPAND_LIMIT:
            return None
        s = out_size // in_size
        if scale is not None and scale > 0 and scale != s:
            return None  # the formula uses 1/scale, not in/out
    elif scale is not None and scale > 0 and float(scale).is_integer():
        s = int(scale)
        if s == 2 and not exact:
            return 2  # ATen shifts whenever out == 2 * in, which a factor of 2 guarantees
        return None  # past EXPAND_LIMIT the float formula may drift: not provable unsized
    else:
        return None
    if exact:
        return s  # floor((dst + 0.5) / s) == dst // s, with margin 0.5/s against rounding
    # floor(dst * f32(1/s)) == dst // s iff f32(1/s) did not round below 1/s.
    return s if Fraction(nearest_scale(in_size, out_size, scale)) >= Fraction(1, s) else None


def output_sizes(in_sizes: Sequence[int | None], size, scale_factor,
                 recompute_scale_factor: bool | None
                 ) -> tuple[list[int | None], list[float | None]]:
    """The output sizes ``F.interpolate`` computes, and the scale ATen's index formula uses
    (an input size None, unknown until run time, gives an output size None)."""
    k = len(in_sizes)
    if size is not None:
        return _per_dim(size, k), [None] * k
    factors = _per_dim(scale_factor, k)
    out = [None if i is None else math.floor(float(i) * float(f))
           for i, f in zip(in_sizes, factors)]
    return out, ([None] * k if recompute_scale_factor else [float(f) for f in factors])


# --- an enclosing autocast ----------------------------------------------------------------------

# The device types whose autocast a graph turns off while it runs (torch's autocast has one
# switch per device type; an enclosing ``torch.autocast("cuda")`` leaves CPU ops alone).
AUTOCAST_DEVICES = ("cpu", "cuda")


def autocast_off() -> list | None:
    """The first call of every transformed graph: turn off each enclosing ``torch.autocast``
    (transformers' Trainer, accelerate and Lightning put one around every forward), whose
    casts would undo the plan's (a matmul kept fp32 recast to fp16 is inf). Returns what
    :func:`autocast_on_again`, the graph's last call, turns back on: None when none was on, the
    common case, which costs two flag reads. Backward follows the forward's dtypes when it is
    called outside the autocast block (torch's AMP recipe; the trainers do); a ``backward()``
    called inside one runs under it. The first time a graph meets one it says so, in its report
    (``amprewrite.report(gm).notes``) and once as a warning.

    Under ``torch.compile`` and ``torch.export`` the flags are read while tracing: a graph
    traced outside autocast keeps none of this, one traced inside keeps autocast off.
    """
    on = [d for d in AUTOCAST_DEVICES if torch.is_autocast_enabled(d)]
    if not on:
        return None
    if not torch.compiler.is_compiling():
        _say_autocast_ignored(on, sys._getframe(1).f_locals.get("self"))
    return [torch.amp.autocast_mode._enter_autocast(d, None, False, None) for d in on]


def autocast_on_again(entered: list | None) -> None:
    """The last call of every transformed graph: undo :func:`autocast_off`."""
    if entered is not None:
        for mode in reversed(entered):
            torch.amp.autocast_mode._exit_autocast(mode)


@contextlib.contextmanager
def no_enclosing_autocast() -> Iterator[None]:
    """Turn an enclosing ``torch.autocast`` off for the block, silently: a transform, the
    backend's compile and a re-plan run the fp32 model to record its ranges and check the
    graph, and those runs must be fp32's, whatever autocast the call is made in.

    >>> with torch.autocast("cpu", dtype=torch.bfloat16), no_enclosing_autocast():
    ...     torch.ones(2, 2).mm(torch.ones(2, 2)).dtype
    torch.float32
    """
    entered = [torch.amp.autocast_mode._enter_autocast(d, None, False, None)
               for d in AUTOCAST_DEVICES if torch.is_autocast_enabled(d)]
    try:
        yield
    finally:
        autocast_on_again(entered)


def _say_autocast_ignored(devices: list[str], gm: object) -> None:
    meta = getattr(gm, "meta", None)
    if not isinstance(meta, dict) or meta.get("amprewrite_autocast_seen"):
        return
    meta["amprewrite_autocast_seen"] = True
    which = ", ".join(f"torch.autocast({d!r}, dtype={torch.get_autocast_dtype(d)})"
                      for d in devices)
    text = (f"an enclosing {which} was found and ignored inside this graph: the plan's casts "
            "are explicit, and autocast's would undo them (a matmul kept fp32 because its "
            "values pass fp16's range would run fp16); the ops outside the graph still run "
            "under it")
    report = meta.get(REPORT_KEY)
    if report is not None:
        report.notes.append(text)
    warnings.warn(AutocastIgnoredWarning(f"amprewrite: {text}."), stacklevel=3)
