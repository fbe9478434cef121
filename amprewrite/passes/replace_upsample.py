"""replace_upsample: nearest upsampling the target cannot run becomes exact tensor copies.

Matches:   ``y = F.interpolate(x, scale_factor=2, mode="nearest")`` (and ``F.upsample``,
           ``F.upsample_nearest``, ``F.upsample_bilinear``, ``nn.Upsample``,
           ``nn.UpsamplingNearest2d``, ``nn.UpsamplingBilinear2d`` after normalisation)
Rewrite to: ``y = upsample_nearest(x, None, 2, False, None)``, which computes, bit for bit
           as PyTorch does,
           ``x[:, :, :, None, :, None].expand(n, c, h, 2, w, 2).reshape(n, c, 2h, 2w)``
           when the source index is ``dst // s`` for an integer s, and index gathers whose
           indices follow PyTorch's own formula otherwise. Sizes are read at run time, and the
           output has the memory format PyTorch's kernel would give it.

Which nodes: ``upsample="always"`` rewrites every nearest upsample; ``"auto"`` (default) those a
capability probe finds no kernel for on the target device and dtype (as bf16 on CUDA before
torch 2.1), and nearest upsampling on CUDA while deterministic algorithms are enabled (its
native backward is nondeterministic); ``"never"`` none. Linear, bilinear, bicubic, trilinear and
area modes without a kernel become fp32 islands (upcast, interpolate, cast down): another
algorithm is never substituted silently.
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass
from fractions import Fraction

import torch
import torch.nn.functional as F
from torch import fx
from torch.fx.passes.infra.pass_base import PassResult

from .. import meta as M
from ..errors import PolicyError
from ..kernels import disable_modes
from ..ops import Family, Precision, register_family
from ..policy import Policy
from ..report import record

__all__ = ["ReplaceUpsample", "has_kernel", "upsample_nearest"]

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

_NEAREST = ("nearest", "nearest-exact")
_RANK_OF_MODE = {"linear": 3, "bilinear": 4, "bicubic": 4, "trilinear": 5}
_SIGNATURES = {
    F.interpolate: inspect.signature(F.interpolate),
    F.upsample: inspect.signature(F.upsample),
    F.upsample_nearest: inspect.signature(F.upsample_nearest),
    F.upsample_bilinear: inspect.signature(F.upsample_bilinear),
}
# Past this output size the float32 index formula may drift from dst // s; use the gather.
_EXPAND_LIMIT = 1 << 22


# --- the exact replacement (called from the rewritten graph) ----------------------------------


def _per_dim(value, k: int) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value] * k


def _scale_f32(in_size: int, out_size: int, scale: float | None) -> torch.Tensor:
    """``compute_scales_value<float>`` of ATen's UpSample.h."""
    if scale is not None and scale > 0:
        return torch.tensor(1.0 / scale, dtype=torch.float32)  # double 1/s rounded to float
    return torch.tensor(float(in_size), dtype=torch.float32) / torch.tensor(
        float(out_size), dtype=torch.float32)


def _is_floor_div(in_size: int, out_size: int, scale: float | None, exact: bool) -> int | None:
    """The integer s with source index ``dst // s`` for every dst, if ATen's formula gives it."""
    if out_size == in_size and not exact:
        return 1  # ATen copies
    if out_size == 2 * in_size and not exact:
        return 2  # ATen shifts
    if out_size % in_size or out_size >= _EXPAND_LIMIT:
        return None
    s = out_size // in_size
    if scale is not None and scale > 0 and scale != s:
        return None  # the formula uses 1/scale, not in/out
    if exact:
        return s  # floor((dst + 0.5) / s) == dst // s, with margin 0.5/s against rounding
    # floor(dst * f32(1/s)) == dst // s iff f32(1/s) did not round below 1/s.
    return s if Fraction(_scale_f32(in_size, out_size, scale).item()) >= Fraction(1, s) else None


def _source_index(in_size: int, out_size: int, scale: float | None, exact: bool,
                  device: torch.device) -> torch.Tensor:
    """ATen's ``nearest_idx`` / ``nearest_exact_idx`` for every output position of one dim."""
    dst = torch.arange(out_size, device=device)
    if not exact and out_size == in_size:
        return dst
    if not exact and out_size == 2 * in_size:
        return dst >> 1
    f = _scale_f32(in_size, out_size, scale).to(device)
    if exact:  # floorf((dst + 0.5) * scale): the product in double, floored as float
        src = ((dst.double() + 0.5) * f.double()).float().floor()
    else:  # floorf(dst * scale) in float
        src = (dst.float() * f).floor()
    return src.long().clamp_(max=in_size - 1)


@torch.fx.wrap
def upsample_nearest(x: torch.Tensor, size=None, scale_factor=None, exact: bool = False,
                     recompute_scale_factor: bool | None = None) -> torch.Tensor:
    """``F.interpolate(x, size, scale_factor, mode="nearest" / "nearest-exact")``, bit for bit.

    >>> x = torch.arange(6.0).reshape(1, 1, 2, 3)
    >>> torch.equal(upsample_nearest(x, scale_factor=2), F.interpolate(x, scale_factor=2))
    True
    """
    k = x.dim() - 2
    in_sizes = list(x.shape[2:])
    if size is not None:
        out_sizes, scales = _per_dim(size, k), [None] * k
    else:
        factors = _per_dim(scale_factor, k)
        out_sizes = [math.floor(float(i) * float(f)) for i, f in zip(in_sizes, factors)]
        scales = [None] * k if recompute_scale_factor else [float(f) for f in factors]
    # ATen allocates the output in the input's suggested memory format (channels_last in,
    # channels_last out); the next conv's summation order depends on it, so match it too.
    layout = _suggest_memory_format(x)
    ints = [_is_floor_div(i, o, s, exact) for i, o, s in zip(in_sizes, out_sizes, scales)]
    if all(s is not None for s in ints):
        # Every dim repeats each element s times: a broadcast copy, no index arithmetic.
        index = (slice(None), slice(None)) + (slice(None), None) * k
        view = x[index]
        shape = list(view.shape)
        for d, s in enumerate(ints):
            shape[3 + 2 * d] = s
        out = view.expand(shape).reshape(*x.shape[:2], *out_sizes)
    else:
        out = x
        for d in range(k):
            idx = _source_index(in_sizes[d], out_sizes[d], scales[d], exact, x.device)
            out = out.index_select(2 + d, idx)
    return out.contiguous(memory_format=layout)


register_family(Family("upsample_nearest", Precision.NEUTRAL, (upsample_nearest,), numeric=False))


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


@dataclass(frozen=True)
class _Call:
    x: fx.Node
    size: object
    scale_factor: object
    mode: str
    recompute_scale_factor: object
    antialias: bool


def _parse(node: fx.Node) -> _Call | None:
    sig = _SIGNATURES.get(node.target) if node.op == "call_function" else None
    if sig is None:
        return None
    try:
        bound = sig.bind(*node.args, **node.kwargs)
    except TypeError:
        return None
    a = {**{k: p.default for k, p in sig.parameters.items()}, **bound.arguments}
    mode = {F.upsample_nearest: "nearest", F.upsample_bilinear: "bilinear"}.get(
        node.target, a.get("mode", "nearest"))
    if not isinstance(mode, str) or not isinstance(a["input"], fx.Node):
        return None
    return _Call(a["input"], a.get("size"), a.get("scale_factor"), mode,
                 a.get("recompute_scale_factor"), bool(a.get("antialias", False)))


def _ranks(call: _Call) -> list[int]:
    if call.mode in _RANK_OF_MODE:
        return [_RANK_OF_MODE[call.mode]]
    shape = M.info(call.x).shape
    if shape is not None:
        return [len(shape)]
    for spec in (call.size, call.scale_factor):
        if isinstance(spec, (list, tuple)):
            return [len(spec) + 2]
    return [3, 4, 5]  # a symbolic trace does not know the rank: all must work


class ReplaceUpsample:
    def __init__(self, policy: Policy):
        self.policy = policy

    def __call__(self, gm: fx.GraphModule) -> PassResult:
        mode_opt, device = self.policy.upsample, torch.device(self.policy.device or "cpu")
        if mode_opt == "never":
            return PassResult(gm, False)
        changed = False
        for node in M.each_node(gm.graph, "call_function"):
            call = _parse(node)
            if call is None or call.antialias:
                continue
            why = self._why(call, mode_opt, device)
            if why is None:
                continue
            if call.mode in _NEAREST:
                self._rewrite(gm, node, call, why)
            else:
                node.meta[M.FORCE] = (Precision.FP32, f"fp32 island: {why}")
                record(gm, node, "replace_upsample", f"{call.mode} interpolate -> fp32 island",
                       why)
            changed = True
        return PassResult(gm, changed)

    def _why(self, call: _Call, mode_opt: str, device: torch.device) -> str | None:
        nearest = call.mode in _NEAREST
        if mode_opt == "always":
            return "upsample='always'" if nearest else None
        check_device(device)
        dtype = self.policy.dtype
        missing = [r for r in _ranks(call) if not has_kernel(device.type, dtype, call.mode, r)]
        if missing:
            return (f"no {call.mode} upsample kernel for {str(dtype).replace('torch.', '')} "
                    f"on {device.type} (rank {', '.join(map(str, missing))}; probed)")
        if nearest and device.type == "cuda" and torch.are_deterministic_algorithms_enabled():
            return "deterministic algorithms are on: CUDA's nearest upsample backward is not"
        return None

    @staticmethod
    def _rewrite(gm: fx.GraphModule, node: fx.Node, call: _Call, why: str) -> None:
        exact = call.mode == "nearest-exact"
        with gm.graph.inserting_before(node):
            new = gm.graph.call_function(upsample_nearest, (
                call.x, call.size, call.scale_factor, exact, call.recompute_scale_factor))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        record(gm, new, "replace_upsample", f"{call.mode} interpolate -> upsample_nearest "
               "(expand/reshape or exact index gather)", why)
