"""replace_upsample: nearest upsampling the target cannot run becomes exact tensor copies.

Matches:   ``y = F.interpolate(x, scale_factor=2, mode="nearest")`` (and ``F.upsample``,
           ``F.upsample_nearest``, ``F.upsample_bilinear``, ``nn.Upsample``,
           ``nn.UpsamplingNearest2d``, ``nn.UpsamplingBilinear2d`` after normalisation)
Rewrite to: plain ops in the graph, bit for bit what PyTorch computes::

    v = x[:, :, :, None, :, None]            # when the source index is dst // s (here s = 2)
    e = v.expand(-1, -1, -1, 2, -1, 2)
    y = e.flatten(4, 5).flatten(2, 3).contiguous(memory_format=memory_format_of(x))

or, when the factor is not an integer (``scale_factor=1.5``, ``size=`` not a multiple), per
spatial dim an ``index_select`` whose indices follow ATen's own formula (``arange``, a float32
multiply by ATen's scale, ``floor``, ``clamp``). Output sizes are read from the tensor at run
time (``x.size(d)``) wherever the capture does not fix them; ATen's copy (out == in) and shift
(out == 2 * in) special cases are then picked at run time. Where the rank is unknown too (a
symbolic trace without example inputs and a scalar factor or size), the input is lifted to rank
5 and the result reshaped back, so the same nodes serve 3D, 4D and 5D inputs. The output gets
the memory format PyTorch's kernel would give it (channels_last in, channels_last out): the
next conv's summation order depends on it. Only a ``size``/``scale_factor`` computed in the
graph whose kind (a number or a sequence) the graph does not show becomes an fp32 island
instead (a copy is exact in fp32 too).

Which nodes: ``upsample="always"`` rewrites every nearest upsample; ``"auto"`` (default) those a
capability probe finds no kernel for on the target device and dtype (as bf16 on CUDA before
torch 2.1), every one where the target device is not there to probe (``device="cuda"`` on a
machine without CUDA: planned as without a kernel, like the rest of the graph's unprobed
ops, with a note), and nearest upsampling on CUDA while deterministic algorithms are enabled (its
native backward is nondeterministic); ``"never"`` none. Linear, bilinear, bicubic, trilinear and
area modes without a kernel become fp32 islands (upcast, interpolate, cast down): another
algorithm is never substituted silently.
"""

from __future__ import annotations

import builtins
import functools
import math
import operator

import torch
import torch.nn.functional as F
from torch import fx

from ..graph import meta as M
from ..graph.meta import ValueInfo, info
from ..graph.runtime import memory_format_of, nearest_scale, output_sizes, repeat_factor
from ..precision.kernels import disable_modes
from ..precision.ops import (
    INTERPOLATE_FUNCTIONS,
    MODE_RANK,
    NEAREST_MODES,
    SIZE_ARITHMETIC,
    Precision,
    upsample_mode,
)
from .base import Builder, Kind, Match, Replacement, Rule, RulePass

__all__ = ["ReplaceUpsample", "has_kernel"]



# --- which nodes, and the probe ---------------------------------------------------------------


@functools.cache
def has_kernel(device_type: str, dtype: torch.dtype, mode: str, rank: int) -> bool:
    """Does ``F.interpolate(mode=mode)`` run forward and backward on this device and dtype?"""
    extra = {"align_corners": False} if mode in MODE_RANK else {}
    # Probe real kernels whatever the caller's context: under torch.no_grad() the backward
    # would fail, and inside torch.compile a fake-tensor mode may be active.
    with disable_modes(), torch.enable_grad():
        try:
            x = torch.ones((1, 1) + (2,) * (rank - 2), device=device_type, dtype=dtype,
                           requires_grad=True)
            F.interpolate(x, scale_factor=2, mode=mode, **extra).sum().backward()
            return True
        except RuntimeError:  # a missing kernel: "... not implemented for 'BFloat16'"
            return False


def unavailable(device: torch.device) -> str | None:
    """Why ``device`` cannot run a probe here (``"Torch not compiled with CUDA enabled"``), or
    None where it can."""
    try:
        torch.empty(1, device=device)
    except (RuntimeError, AssertionError) as exc:
        return str(exc).splitlines()[0]
    return None


def _ranks(x: fx.Node, mode: str, size, scale_factor) -> list[int]:
    if mode in MODE_RANK:
        return [MODE_RANK[mode]]
    rank = _rank(x, size, scale_factor)
    return [3, 4, 5] if rank is None else [rank]  # unknown: every rank must work


def _rank(x: fx.Node, size, scale_factor) -> int | None:
    shape = info(x).shape
    if shape is not None:
        return len(shape)
    for spec in (size, scale_factor):
        if isinstance(spec, (list, tuple)):
            return len(spec) + 2
    return None


def _why(policy, mode: str, x: fx.Node, size, scale_factor) -> str | None:
    """Why this interpolate must not run natively, or None."""
    nearest = mode in NEAREST_MODES
    if policy.upsample == "always":
        return "upsample='always'" if nearest else None
    device = torch.device(policy.device or "cpu")
    absent = unavailable(device)
    if absent is not None:
        # Planned as without a kernel: nearest becomes exact copies (bit for bit what the
        # kernel gives), another mode an fp32 island (autocast's choice on CUDA). The plan
        # holds whatever the kernels there are, as the rest of the graph's does (a note says
        # they were not probed).
        return (f"kernels not probed: device '{device}' is not available here ({absent}); "
                "planned as without a low upsample kernel")
    missing = [r for r in _ranks(x, mode, size, scale_factor)
               if not has_kernel(device.type, policy.dtype, mode, r)]
    if missing:
        return (f"no {mode} upsample kernel for {str(policy.dtype).replace('torch.', '')} "
                f"on {device.type} (rank {', '.join(map(str, missing))}; probed)")
    if nearest and device.type == "cuda" and torch.are_deterministic_algorithms_enabled():
        return "deterministic algorithms are on: CUDA's nearest upsample backward is not"
    return None


def _interpolate(m: Match) -> Replacement | None:
    a = m.args
    if a is None or m.policy is None or m.policy.upsample == "never":
        return None
    x, size, scale_factor = a.get("input"), a.get("size"), a.get("scale_factor")
    mode = upsample_mode(m.node)
    if not isinstance(x, fx.Node) or not isinstance(mode, str) or a.get("antialias"):
        return None
    why = _why(m.policy, mode, x, size, scale_factor)
    if why is None:
        return None
    if mode not in NEAREST_MODES:
        m.node.meta[M.FORCE] = (Precision.FP32, f"fp32 island: {why}")
        return Replacement(m.node, f"{mode} interpolate -> fp32 island", why)
    exact = mode == "nearest-exact"
    recompute = a.get("recompute_scale_factor")
    built = _nearest(m.build, x, size, scale_factor, exact, recompute)
    if built is None:
        # A copy is exact in fp32 too, and every device has that kernel.
        m.node.meta[M.FORCE] = (Precision.FP32, f"fp32 island: {why}")
        return Replacement(m.node, f"{mode} interpolate -> fp32 island (size or scale_factor "
                           "computed in the graph: a number or a sequence, not known)", why)
    return Replacement(built[0], f"{mode} interpolate -> {built[1]}", why)


def _static(value) -> bool:
    return value is None or isinstance(value, (int, float)) or (
        isinstance(value, (list, tuple)) and all(isinstance(v, (int, float)) for v in value))


def _nearest(b: Builder, x: fx.Node, size, scale_factor, exact: bool,
             recompute) -> tuple[fx.Node, str] | None:
    """Nodes computing ``F.interpolate(x, size, scale_factor, mode=nearest[-exact])``, or None
    when the kind of a ``size``/``scale_factor`` computed in the graph (a number or a sequence)
    cannot be told from the graph."""
    like_x = ValueInfo("tensor", info(x).dtype)
    rank = _rank(x, size, scale_factor)
    if rank is not None and _static(size) and _static(scale_factor):
        xi = info(x)
        ins = [xi.static_size(2 + d) for d in range(rank - 2)]
        if None not in ins:
            outs, scales = output_sizes(ins, size, scale_factor, recompute)
            factors = [repeat_factor(i, o, s, exact) for i, o, s in zip(ins, outs, scales)]
            if all(f is not None for f in factors):
                out = _repeat(b, x, factors, like_x)
                return _layout(b, x, out, like_x, rank), "expand/reshape subgraph"
            out = _gather(b, x, ins, outs, scales, exact, like_x)
            return _layout(b, x, out, like_x, rank), "exact index_select subgraph"
    return _nearest_at_run_time(b, x, rank, size, scale_factor, exact, recompute, like_x)


# --- sizes known only at run time -------------------------------------------------------------



def _spec_kind(value) -> str | None:
    """``"seq"`` or ``"number"`` for a ``size``/``scale_factor`` argument; None if unknown."""
    if isinstance(value, (list, tuple)):
        return "seq"
    if not isinstance(value, fx.Node):
        return "number"
    if info(value).kind == "seq":
        return "seq"
    n, args = value, value.args
    if n.op == "call_method" and n.target == "size":  # x.size() is a sequence, x.size(d) not
        return "number" if len(args) > 1 or "dim" in n.kwargs else "seq"
    if n.op != "call_function":
        return None
    if n.target is builtins.getattr and args[1:] == ("shape",):
        return "seq"
    if n.target in (builtins.tuple, builtins.list, torch.Size):
        return "seq"
    if n.target is operator.getitem and _spec_kind(args[0]) == "seq":
        return "seq" if isinstance(args[1], slice) else "number"
    if n.target in SIZE_ARITHMETIC and all(_spec_kind(a) == "number" for a in args):
        return "number"
    return None


def _fold(b: Builder, fn, *args):
    """``fn(*args)`` now when no argument is a node, else a node computing it at run time."""
    if any(isinstance(a, fx.Node) for a in args):
        return b.call(fn, *args, value=M.OTHER)
    return fn(*args)


def _nearest_at_run_time(b: Builder, x: fx.Node, rank: int | None, size, scale_factor,
                         exact: bool, recompute, like_x: ValueInfo) -> tuple[fx.Node, str] | None:
    """The same subgraphs with sizes read from the tensor (``x.size(d)``) when tracing did not
    fix them, and for any rank when tracing did not fix that either (a symbolic trace of
    ``scale_factor=2``): the input is then lifted to rank 5 (``x[:, :, None, None]`` with the
    two unit dims and the leading spatial dims merged: ``flatten(2, -3)``), whose spatial dims
    the input lacks get a factor or size of 1 chosen at run time from ``x.dim()``, and the
    result is reshaped back to ``x.shape[:2]`` + its last ``x.dim() - 2`` dims."""
    spec = size if size is not None else scale_factor
    kind = _spec_kind(spec)
    if kind is None:
        return None
    other = M.OTHER
    if rank is None:
        k, src = 3, b.call(operator.getitem, x, (slice(None), slice(None), None, None),
                           value=like_x)
        src = b.method("flatten", src, 2, -3, value=like_x)
        ndim = b.method("dim", x, value=other)
        # Lifted dim j (of 0, 1, 2) is one of x's own spatial dims iff x has rank >= 5 - j.
        real: list = [b.call(operator.ge, ndim, 2 + k - j, value=other) for j in range(k - 1)]
        real.append(True)  # the last dim is always spatial: x has rank >= 3
        ins: list = [None] * k
    else:
        k, src, real, ndim = rank - 2, x, [True] * (rank - 2), None
        ins = [info(x).static_size(2 + d) for d in range(k)]
    if isinstance(spec, (list, tuple)) and len(spec) != k:
        return None  # F.interpolate rejects it; leave the node to say so
    bases = list(spec) if isinstance(spec, (list, tuple)) else [spec] * k
    factors = [_run_time_factor(b, i, base, r, size, recompute, exact)
               for i, base, r in zip(ins, bases, real)]
    if all(f is not None for f in factors):
        out, how = _repeat(b, src, factors, like_x), "expand/reshape subgraph"
    else:
        ins = [b.method("size", src, 2 + d, value=other) if i is None else i
               for d, i in enumerate(ins)]  # read at run time
        unit = 1 if size is not None else 1.0  # what a dim x lacks gets: no change
        if kind == "seq" and isinstance(spec, fx.Node):
            seq = spec
            if rank is None:  # pad on the left: the spatial dims x has are the last ones
                seq = b.call(operator.add, (unit,) * k,
                             b.call(builtins.tuple, spec, value=other), value=other)
            vals = [b.call(operator.getitem, seq, d - k, value=other) for d in range(k)]
        else:
            vals = [_fold(b, operator.getitem, (unit, v), r) for v, r in zip(bases, real)]
        if size is not None:
            outs, scales = vals, [None] * k
        else:  # F.interpolate's floor(float(in) * scale); the kernel's scale unless recomputed
            outs = [_fold(b, math.floor, _fold(b, operator.mul, _fold(b, float, i),
                                               _fold(b, float, v))) for i, v in zip(ins, vals)]
            scales = [None] * k if recompute else vals
        out = _gather(b, src, ins, outs, scales, exact, like_x)
        how = "exact index_select subgraph"
    if ndim is not None:  # back to x's rank: x.shape[:2] + out.shape[7 - x.dim():]
        head = b.call(operator.getitem, b.call(builtins.getattr, x, "shape", value=other),
                      slice(None, 2), value=other)
        start = b.call(operator.sub, 2 + 2 + k, ndim, value=other)
        tail = b.call(operator.getitem, b.call(builtins.getattr, out, "shape", value=other),
                      b.call(builtins.slice, start, None, value=other), value=other)
        out = b.method("reshape", out, b.call(operator.add, head, tail, value=other),
                       value=like_x)
    return _layout(b, x, out, like_x, rank), f"{how} (sizes read at run time)"


def _run_time_factor(b: Builder, i, base, real, size, recompute, exact: bool):
    """The repeat factor of one dim (an int, or a node choosing 1 where x lacks the dim), or
    None when only the index formula is exact for it (or that is not known when tracing).
    ``base`` is the dim's ``size`` or ``scale_factor`` entry."""
    if isinstance(base, fx.Node):
        return None
    if size is not None:
        f = repeat_factor(i, base, None, exact) if isinstance(i, int) else None
    elif isinstance(i, int):
        f = repeat_factor(i, math.floor(float(i) * float(base)),
                          None if recompute else float(base), exact)
    else:  # unsized: only a factor proves dst // s (a factor of 2: ATen shifts)
        f = None if recompute else repeat_factor(None, None, float(base), exact)
    if f is None:
        return None
    return _fold(b, operator.getitem, (1, f), real)


def _layout(b: Builder, x: fx.Node, out: fx.Node, like_x: ValueInfo, rank: int | None) -> fx.Node:
    if rank == 3:
        return out  # rank 3 has no other memory format: the copy is already contiguous
    fmt = b.call(memory_format_of, x, value=M.OTHER)
    return b.method("contiguous", out, memory_format=fmt, value=like_x)


def _repeat(b: Builder, x: fx.Node, factors: list, like_x: ValueInfo) -> fx.Node:
    """Each element of spatial dim d repeated ``factors[d]`` times, by broadcasting. A factor
    may be ``(1, s)[real]``, a node (a lifted dim the input may lack): the dim is expanded by
    ``s`` and sliced back to ``1`` or ``s`` (views, no copy), so that ``expand`` only ever has
    constant sizes (kernel probes and compilers see the usual op)."""
    k = len(factors)
    if all(isinstance(f, int) and f == 1 for f in factors):
        return b.method("clone", x, value=like_x)
    view = b.call(operator.getitem, x, (slice(None), slice(None)) + (slice(None), None) * k,
                  value=like_x)
    shape: list = [-1] * (2 + 2 * k)
    keep: list = [slice(None)] * (2 + 2 * k)
    for d, f in enumerate(factors):
        if isinstance(f, fx.Node):
            shape[3 + 2 * d] = f.args[0][1]  # (1, s)[real]: expand by s
            keep[3 + 2 * d] = slice(None, f)  # and keep 1 or s of the copies
        else:
            shape[3 + 2 * d] = f
    out = b.method("expand", view, *shape, value=like_x)
    if any(isinstance(f, fx.Node) for f in factors):
        out = b.call(operator.getitem, out, tuple(keep), value=like_x)
    for d in reversed(range(k)):
        out = b.method("flatten", out, 2 + 2 * d, 3 + 2 * d, value=like_x)
    return out


def _gather(b: Builder, x: fx.Node, ins: list, outs: list, scales: list,
            exact: bool, like_x: ValueInfo) -> fx.Node:
    """Per spatial dim, ``index_select`` with ATen's ``nearest_idx`` / ``nearest_exact_idx``
    (sizes and scales are ints and floats, or nodes read at run time)."""
    device = b.call(builtins.getattr, x, "device", value=M.OTHER)
    out = x
    for d, (i, o, s) in enumerate(zip(ins, outs, scales)):
        if any(isinstance(v, fx.Node) for v in (i, o, s)):
            idx = _run_time_index(b, device, i, o, s, exact)
        elif o == i and not exact:
            continue  # ATen copies this dim
        else:
            idx = _static_index(b, device, i, o, s, exact)
        out = b.method("index_select", out, 2 + d, idx, value=like_x)
    if out is x:
        out = b.method("clone", x, value=like_x)
    return out


_LONG = ValueInfo("tensor", torch.int64)
_F32 = ValueInfo("tensor", torch.float32)
_F64 = ValueInfo("tensor", torch.float64)


def _formula(b: Builder, dst: fx.Node, f, i, exact: bool) -> fx.Node:
    """``min(floorf(dst * f), i - 1)``, or with ``dst + 0.5`` for nearest-exact, as ATen."""
    if exact:  # floorf((dst + 0.5) * scale): the product in double, floored as float
        pos = b.method("double", dst, value=_F64)
        pos = b.method("add", pos, 0.5, value=_F64)
        pos = b.method("mul", pos, f, value=_F64)
        pos = b.method("float", pos, value=_F32)
    else:  # floorf(dst * scale), in float32 (the scalar is rounded to float32)
        pos = b.method("float", dst, value=_F32)
        pos = b.method("mul", pos, f, value=_F32)
    pos = b.method("floor", pos, value=_F32)
    idx = b.method("long", pos, value=_LONG)
    return b.method("clamp", idx, max=_fold(b, operator.sub, i, 1), value=_LONG)


def _static_index(b: Builder, device: fx.Node, i: int, o: int, s: float | None,
                  exact: bool) -> fx.Node:
    dst = b.call(torch.arange, o, device=device, value=_LONG)
    if not exact and o == 2 * i:
        return b.call(operator.rshift, dst, 1, value=_LONG)
    return _formula(b, dst, nearest_scale(i, o, s), i, exact)


def _run_time_index(b: Builder, device: fx.Node, i, o, s, exact: bool) -> fx.Node:
    """ATen's index for one dim whose sizes or scale are nodes; its special cases (copy when
    ``o == i``, shift when ``o == 2 * i``, nearest only) are picked at run time."""
    dst = b.call(torch.arange, o, device=device, value=_LONG)
    if s is None:  # compute_scales_value: (float)in / out, a float32 division
        num = b.call(torch.scalar_tensor, i, dtype=torch.float32, value=_F32)
        f = b.call(operator.truediv, num, o, value=_F32)
    elif isinstance(s, fx.Node):  # (float)(1.0 / scale): the double quotient rounded to float
        f = b.call(torch.scalar_tensor, b.call(operator.truediv, 1.0, s, value=M.OTHER),
                   dtype=torch.float32, value=_F32)
    else:
        f = nearest_scale(1, 1, s)  # sizes unused when a scale is given
    idx = _formula(b, dst, f, i, exact)
    if exact:
        return idx  # nearest_exact_idx has no special cases
    shift = b.call(operator.rshift, dst, 1, value=_LONG)
    twice = _fold(b, operator.eq, o, _fold(b, operator.mul, 2, i))
    idx = _fold(b, operator.getitem, (idx, shift), twice)
    same = _fold(b, operator.eq, o, i)
    return _fold(b, operator.getitem, (idx, dst), same)


class ReplaceUpsample(RulePass):
    """Nearest upsampling -> exact expand/reshape or index subgraphs; other modes without a
    kernel -> fp32 islands (see module docstring)."""

    name, kind = "replace_upsample", Kind.REWRITE
    requires = (M.ORIG,)
    writes = (M.ORIG, M.FORCE)
    rules = (Rule(INTERPOLATE_FUNCTIONS, _interpolate),)
