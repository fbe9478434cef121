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
time (``x.size(d)``) wherever the capture does not fix them. The output gets the memory format
PyTorch's kernel would give it (channels_last in, channels_last out): the next conv's
summation order depends on it. Where the rank is unknown (a symbolic trace without example
inputs, a scalar factor) or the index formula would need a branch on run-time sizes, the graph
calls :func:`amprewrite.runtime.upsample_nearest`, the same computation as one exact function,
and the report says why.

Which nodes: ``upsample="always"`` rewrites every nearest upsample; ``"auto"`` (default) those a
capability probe finds no kernel for on the target device and dtype (as bf16 on CUDA before
torch 2.1), and nearest upsampling on CUDA while deterministic algorithms are enabled (its
native backward is nondeterministic); ``"never"`` none. Linear, bilinear, bicubic, trilinear and
area modes without a kernel become fp32 islands (upcast, interpolate, cast down): another
algorithm is never substituted silently.
"""

from __future__ import annotations

import builtins
import functools
import operator

import torch
import torch.nn.functional as F
from torch import fx

from .. import meta as M
from ..errors import PolicyError
from ..kernels import disable_modes
from ..meta import ValueInfo, info
from ..ops import Precision
from ..runtime import memory_format_of, nearest_scale, output_sizes, repeat_factor, upsample_nearest
from .base import Builder, Kind, Match, Replacement, Rule, RulePass

__all__ = ["ReplaceUpsample", "has_kernel"]

_NEAREST = ("nearest", "nearest-exact")
_RANK_OF_MODE = {"linear": 3, "bilinear": 4, "bicubic": 4, "trilinear": 5}
_FIXED_MODE = {F.upsample_nearest: "nearest", F.upsample_bilinear: "bilinear"}


# --- which nodes, and the probe ---------------------------------------------------------------


@functools.cache
def has_kernel(device_type: str, dtype: torch.dtype, mode: str, rank: int) -> bool:
    """Does ``F.interpolate(mode=mode)`` run forward and backward on this device and dtype?"""
    extra = {"align_corners": False} if mode in _RANK_OF_MODE else {}
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


def check_device(device: torch.device) -> None:
    try:
        torch.empty(1, device=device)
    except (RuntimeError, AssertionError) as exc:
        raise PolicyError(
            f"cannot probe upsample kernels on device '{device}': it is not available here "
            f"({str(exc).splitlines()[0]}). Plan on a machine that has it, or pass "
            "upsample='always' or upsample='never' to decide without probing."
        ) from None


def _ranks(x: fx.Node, mode: str, size, scale_factor) -> list[int]:
    if mode in _RANK_OF_MODE:
        return [_RANK_OF_MODE[mode]]
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
    nearest = mode in _NEAREST
    if policy.upsample == "always":
        return "upsample='always'" if nearest else None
    device = torch.device(policy.device or "cpu")
    check_device(device)
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
    mode = _FIXED_MODE.get(m.node.target, a.get("mode", "nearest"))
    if not isinstance(x, fx.Node) or not isinstance(mode, str) or a.get("antialias"):
        return None
    why = _why(m.policy, mode, x, size, scale_factor)
    if why is None:
        return None
    if mode not in _NEAREST:
        m.node.meta[M.FORCE] = (Precision.FP32, f"fp32 island: {why}")
        return Replacement(m.node, f"{mode} interpolate -> fp32 island", why)
    exact = mode == "nearest-exact"
    recompute = a.get("recompute_scale_factor")
    new, how = _nearest(m.build, x, size, scale_factor, exact, recompute)
    return Replacement(new, f"{mode} interpolate -> {how}", why)


def _static(value) -> bool:
    return value is None or isinstance(value, (int, float)) or (
        isinstance(value, (list, tuple)) and all(isinstance(v, (int, float)) for v in value))


def _nearest(b: Builder, x: fx.Node, size, scale_factor, exact: bool,
             recompute) -> tuple[fx.Node, str]:
    """Nodes computing ``F.interpolate(x, size, scale_factor, mode=nearest[-exact])``."""
    like_x = ValueInfo("tensor", info(x).dtype)
    rank = _rank(x, size, scale_factor)
    if rank is not None and _static(size) and _static(scale_factor):
        k = rank - 2
        xi = info(x)
        ins = [xi.static_size(2 + d) for d in range(k)]
        outs, scales = output_sizes(ins, size, scale_factor, recompute)
        factors = [repeat_factor(i, o, s, exact) for i, o, s in zip(ins, outs, scales)]
        if all(f is not None for f in factors):
            return _repeat(b, x, factors, like_x), "expand/reshape subgraph"
        if None not in ins:
            return _gather(b, x, ins, outs, scales, exact, like_x), "exact index_select subgraph"
        why = "sizes known only at run time"
    else:
        why = "rank unknown when tracing" if rank is None else "sizes computed in the graph"
    new = b.call(upsample_nearest, x, size, scale_factor, exact, recompute, value=like_x)
    return new, f"upsample_nearest ({why}: one exact call; pass example_inputs to inline it)"


def _layout(b: Builder, x: fx.Node, out: fx.Node, like_x: ValueInfo, rank: int) -> fx.Node:
    if rank == 3:
        return out  # rank 3 has no other memory format: the copy is already contiguous
    fmt = b.call(memory_format_of, x, value=M.OTHER)
    return b.method("contiguous", out, memory_format=fmt, value=like_x)


def _repeat(b: Builder, x: fx.Node, factors: list[int], like_x: ValueInfo) -> fx.Node:
    """Each element of spatial dim d repeated ``factors[d]`` times, by broadcasting."""
    k = len(factors)
    if all(f == 1 for f in factors):
        return _layout(b, x, b.method("clone", x, value=like_x), like_x, 2 + k)
    view = b.call(operator.getitem, x, (slice(None), slice(None)) + (slice(None), None) * k,
                  value=like_x)
    shape = [-1] * (2 + 2 * k)
    for d, s in enumerate(factors):
        shape[3 + 2 * d] = s
    out = b.method("expand", view, *shape, value=like_x)
    for d in reversed(range(k)):
        out = b.method("flatten", out, 2 + 2 * d, 3 + 2 * d, value=like_x)
    return _layout(b, x, out, like_x, 2 + k)


def _gather(b: Builder, x: fx.Node, ins: list[int], outs: list[int],
            scales: list[float | None], exact: bool, like_x: ValueInfo) -> fx.Node:
    """Per spatial dim, ``index_select`` with ATen's ``nearest_idx`` / ``nearest_exact_idx``."""
    long = ValueInfo("tensor", torch.int64)
    device = b.call(builtins.getattr, x, "device", value=M.OTHER)
    out = x
    for d, (i, o, s) in enumerate(zip(ins, outs, scales)):
        if o == i and not exact:
            continue  # ATen copies this dim
        dst = b.call(torch.arange, o, device=device, value=long)
        if not exact and o == 2 * i:
            idx = b.call(operator.rshift, dst, 1, value=long)
        else:
            f = nearest_scale(i, o, s)
            if exact:  # floorf((dst + 0.5) * scale): the product in double, floored as float
                pos = b.method("double", dst, value=ValueInfo("tensor", torch.float64))
                pos = b.method("add", pos, 0.5, value=ValueInfo("tensor", torch.float64))
                pos = b.method("mul", pos, f, value=ValueInfo("tensor", torch.float64))
                pos = b.method("float", pos, value=ValueInfo("tensor", torch.float32))
            else:  # floorf(dst * scale), in float32 (the scalar is rounded to float32)
                pos = b.method("float", dst, value=ValueInfo("tensor", torch.float32))
                pos = b.method("mul", pos, f, value=ValueInfo("tensor", torch.float32))
            pos = b.method("floor", pos, value=ValueInfo("tensor", torch.float32))
            idx = b.method("long", pos, value=long)
            idx = b.method("clamp", idx, max=i - 1, value=long)
        out = b.method("index_select", out, 2 + d, idx, value=like_x)
    if out is x:
        out = b.method("clone", x, value=like_x)
    return _layout(b, x, out, like_x, 2 + len(ins))


class ReplaceUpsample(RulePass):
    """Nearest upsampling -> exact expand/reshape or index subgraphs; other modes without a
    kernel -> fp32 islands (see module docstring)."""

    name, kind = "replace_upsample", Kind.REWRITE
    requires = (M.ORIG,)
    writes = (M.ORIG, M.FORCE)
    rules = (Rule((F.interpolate, F.upsample, F.upsample_nearest, F.upsample_bilinear),
                  _interpolate),)
