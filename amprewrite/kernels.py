"""Kernel probes: does an op have a working low-precision kernel on the target device?

Before a node runs in bfloat16/float16, :func:`low_kernel_problem` runs its op once on small
real tensors in fp32 and in the low dtype (forward and, where fp32 has one, backward) and
compares. A missing kernel (``"avg_pool3d" not implemented for 'BFloat16'``), a non-finite
value fp32 does not have, or an error far above the dtype's rounding makes the node an fp32
island. Results are cached per (op, dtype, device, argument structure): a few ms per distinct
op, once per process.

The probe tensors take the node's own shapes when they are small, the same ranks with sides of
at most 4 otherwise, and ranks 4, 3, 5, 2, 1 when the shapes are unknown (a symbolic trace).
When no candidate runs in fp32 either, the probe cannot tell and the node keeps its class.

>>> import torch
>>> from torch import fx
>>> g = fx.Graph(); x = g.placeholder("x")
>>> n = g.call_function(torch.nn.functional.avg_pool3d, (x, 2))
>>> low_kernel_problem(n, torch.float16, torch.device("cpu"))[:28]  # torch 2.13 CPU: no kernel
'no float16 kernel on cpu (pr'
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import fx
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import _disable_current_modes

from . import meta as M
from .ops import Family

__all__ = ["disable_modes", "low_kernel_problem"]

_SMALL = 1 << 14  # probe with the node's own shapes up to this many elements per tensor
_SIDE = 4
_RANKS = (4, 3, 5, 2, 1)
# A low kernel is wrong when its norm-wise relative error on the probe inputs exceeds this.
# Right kernels stay far below it (bf16 SDPA backward, the worst seen: 0.15); broken ones go far
# above (bf16 grid_sample on CPU: 1e31).
_WRONG = 0.5


def disable_modes():
    """Run real kernels whatever the caller's context (a fake mode inside torch.compile)."""
    return _disable_current_modes()


def _shape_of(node: fx.Node) -> tuple[int, ...] | None:
    shape = M.info(node).shape
    if shape is None or any(s is None for s in shape):
        return None
    return tuple(int(s) for s in shape)  # type: ignore[arg-type]


def _descriptor(a: object) -> object:
    """Hashable structure of an argument, for the cache key."""
    if isinstance(a, fx.Node):
        i = M.info(a)
        return ("node", i.kind, str(i.dtype), None if i.shape is None else len(i.shape))
    if isinstance(a, (list, tuple)):
        return tuple(_descriptor(x) for x in a)
    if isinstance(a, dict):
        return tuple(sorted((k, _descriptor(v)) for k, v in a.items()))
    try:
        hash(a)
        return a
    except TypeError:
        return repr(a)


def low_kernel_problem(node: fx.Node, dtype: torch.dtype, device: torch.device,
                       family: Family | None = None) -> str | None:
    """Why ``node`` cannot run in ``dtype`` on ``device`` (None: it can, or no probe can tell)."""
    if node.op not in ("call_function", "call_method"):
        return None
    key = (node.op, node.target if node.op == "call_method" else id(node.target), str(dtype),
           device.type, _descriptor(node.args), _descriptor(node.kwargs))
    try:
        if key in _CACHE:
            return _CACHE[key]
    except TypeError:  # an unhashable constant argument
        return None
    found = _probe(node.op, node.target, _Template.of(node), dtype, device.type,
                   bool(family is not None and family.random))
    _CACHE[key] = found
    return found


_CACHE: dict[tuple, str | None] = {}


class _Template:
    """The node's arguments with tensors described (dtype, known shape) for probe inputs."""

    def __init__(self, args: tuple, kwargs: dict, tensors: list[tuple[torch.dtype | None,
                                                                      tuple[int, ...] | None]]):
        self.args, self.kwargs, self.tensors = args, kwargs, tensors

    @staticmethod
    def of(node: fx.Node) -> _Template | None:
        tensors: list[tuple[torch.dtype | None, tuple[int, ...] | None]] = []
        ok = True

        def describe(a: fx.Node) -> object:
            nonlocal ok
            i = M.info(a)
            if i.kind != "tensor":
                value = a.meta.get("val", a.meta.get("example_value"))
                hint = M._int_or_none(value) if value is not None else None
                if hint is None:
                    ok = False
                return hint
            tensors.append((i.dtype, _shape_of(a)))
            return _Slot(len(tensors) - 1)

        args = fx.node.map_arg(node.args, describe)
        kwargs = fx.node.map_arg(node.kwargs, describe)
        return _Template(args, kwargs, tensors) if ok and tensors else None

    def candidates(self) -> list[list[tuple[int, ...]]]:
        shapes = [s for _, s in self.tensors]
        out = []
        if all(s is not None for s in shapes):
            if all(math.prod(s) <= _SMALL for s in shapes):  # type: ignore[arg-type]
                out.append(shapes)
            out.append([tuple(min(d, _SIDE) for d in s) for s in shapes])  # type: ignore[union-attr]
        else:
            out += [[s if s is not None and math.prod(s) <= _SMALL else (_SIDE,) * r
                     for s in shapes] for r in _RANKS]
        return out  # type: ignore[return-value]

    def build(self, shapes: list[tuple[int, ...]], dtype: torch.dtype, device: str,
              seed: int = 0) -> tuple[tuple, dict, list[torch.Tensor]]:
        g = torch.Generator().manual_seed(seed)
        made: list[torch.Tensor] = []
        for (orig, _), shape in zip(self.tensors, shapes):
            if orig is None or orig.is_floating_point:
                t = (torch.rand(shape, generator=g) + 0.5).to(device=device, dtype=dtype)
                t.requires_grad_(True)
            elif orig == torch.bool:
                t = torch.rand(shape, generator=g).gt(0.5).to(device)
            elif orig.is_complex:
                t = torch.rand(shape, generator=g).to(device=device, dtype=orig)
            else:
                t = torch.randint(0, 2, shape, generator=g).to(device=device, dtype=orig)
            made.append(t)

        def fill(a: object) -> object:
            return made[a.index] if isinstance(a, _Slot) else a

        args = pytree.tree_map(fill, self.args, is_leaf=lambda a: isinstance(a, _Slot))
        kwargs = pytree.tree_map(fill, self.kwargs, is_leaf=lambda a: isinstance(a, _Slot))
        return args, kwargs, [t for t in made if t.is_floating_point()]


class _Slot:
    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


def _call(op: str, target: object) -> Callable:
    if op == "call_method":
        return lambda *a, **k: getattr(a[0], str(target))(*a[1:], **k)
    return target  # type: ignore[return-value]


def _floats(out: object) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(out)
            if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _run(fn: Callable, template: _Template, shapes, dtype, device, backward: bool):
    args, kwargs, leaves = template.build(shapes, dtype, device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        out = fn(*args, **kwargs)
    outs = _floats(out)
    grads = None
    if backward and outs and leaves and any(o.requires_grad for o in outs):
        # Random output weights (a plain sum has a zero gradient through softmax-like ops), of
        # total 1 so that a backward that accumulates many outputs cannot overflow fp16.
        g = torch.Generator().manual_seed(1)
        total = sum((o * ((torch.rand(o.shape, generator=g) + 0.5) / max(o.numel(), 1))
                     .to(device=o.device, dtype=o.dtype)).sum()
                    for o in outs if o.requires_grad)
        grads = torch.autograd.grad(total, leaves, allow_unused=True)
    return outs, grads


def _probe(op: str, target: object, template: _Template | None, dtype: torch.dtype,
           device: str, random: bool) -> str | None:
    if template is None:
        return None
    fn = _call(op, target)
    low_name = str(dtype).replace("torch.", "")
    with disable_modes(), torch.enable_grad():
        for shapes in template.candidates():
            try:
                ref, ref_grads = _run(fn, template, shapes, torch.float32, device, True)
            except Exception:
                try:
                    ref, ref_grads = _run(fn, template, shapes, torch.float32, device, False)
                except Exception:
                    continue  # this candidate is not a valid call: try the next one
            backward = ref_grads is not None
            try:
                low, low_grads = _run(fn, template, shapes, dtype, device, backward)
            except Exception as exc:
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:120]
                return f"no {low_name} kernel on {device} (probed: {first})"
            if random:
                bad = any(not torch.isfinite(t).all() for t in low)
                return f"{low_name} kernel returns non-finite values on {device}" if bad else None
            return _compare(ref, low, dtype, device) or _compare(
                [g for g in ref_grads or () if g is not None],
                [g for g in low_grads or () if g is not None], dtype, device, "backward ")
        return None


def _compare(ref: list[torch.Tensor], low: list[torch.Tensor], dtype: torch.dtype, device: str,
             what: str = "") -> str | None:
    low_name = str(dtype).replace("torch.", "")
    tol = _WRONG
    for r, lo in zip(ref, low):
        r, lo = r.detach().double(), lo.detach().double()
        if r.shape != lo.shape:
            return f"{low_name} {what}kernel returns another shape on {device}"
        finite = torch.isfinite(r)
        if (finite & ~torch.isfinite(lo)).any():
            return f"{low_name} {what}kernel returns non-finite values on {device} (probed)"
        if not finite.any():
            continue
        err = (lo[finite] - r[finite]).norm() / r[finite].norm().clamp_min(1e-30)
        if err > tol:
            return (f"{low_name} {what}kernel is wrong on {device} (probed error {err:.2g}, "
                    f"bound {tol:.2g})")
    return None
