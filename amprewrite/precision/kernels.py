"""Kernel probes: does an op have a working low-precision kernel on the target device?

Before a node runs in bfloat16/float16, :func:`low_kernel_problem` runs its op once on small
real tensors in fp32 and in the low dtype (forward and, where fp32 has one, backward) and
compares. A missing kernel (``"avg_pool3d" not implemented for 'BFloat16'``), a non-finite
value fp32 does not have, or an error far above the dtype's rounding makes the node an fp32
island. Results are cached per (op, dtype, device, argument structure): a few ms per distinct
op, once per process.

The probe tensors take the node's own shapes when they are small, the same ranks with sides of
at most 4 otherwise (and the real shapes up to 2**20 elements when shrinking breaks the call, a
reshape to sizes read from the graph). Without shapes (a symbolic trace) they are guessed: ranks
4, 3, 5, 2, 1 with sides of 4, shapes fitted to the op's known tensors (a weight's input
features or channels) and to its constant sizes (``view(-1, 784)``); a size the graph computes
(``x.size(0)``) is recomputed from the probe tensors. **No probe, no trust**: when no candidate
runs even in fp32, or the arguments cannot be rebuilt, the low kernel is *not confirmed* and the
node runs in fp32 (:data:`NOT_CONFIRMED` starts the reason); ``allow_low`` overrides that.

>>> import torch
>>> from torch import fx
>>> g = fx.Graph(); x = g.placeholder("x")
>>> n = g.call_function(torch.nn.functional.avg_pool3d, (x, 2))
>>> low_kernel_problem(n, torch.float16, torch.device("cpu"))[:28]  # torch 2.13 CPU: no kernel
'no float16 kernel on cpu (pr'
>>> n = g.call_function(torch.nn.functional.avg_pool2d, (x, 2, n))  # a tensor as stride: no call
>>> low_kernel_problem(n, torch.float16, torch.device("cpu"))[:34]
'low-precision kernel not confirmed'
"""

from __future__ import annotations

import contextlib
import copy
import math
import weakref
from collections.abc import Callable, Iterator

import torch
from torch import fx
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import _disable_current_modes

from ..graph import meta as M
from .ops import Family, Mixed

__all__ = ["NOT_CONFIRMED", "disable_modes", "low_kernel_problem", "mixed_problem"]

# Starts the problem of a node whose low kernel no probe could run: paint_precision makes it an
# fp32 island unless allow_low names it, and writes one report note per op.
NOT_CONFIRMED = "low-precision kernel not confirmed"

_SMALL = 1 << 14  # probe with the node's own shapes up to this many elements per tensor
_LARGE = 1 << 20  # ... and up to this many when no shrunk shape runs (a reshape to real sizes)
_GUESS = 1 << 12  # the largest guessed tensor (no shapes known): bf16 convs on CPU are slow
_SIDE = 4
_RANKS = (4, 3, 5, 2, 1)
_FIT = 256  # an unknown tensor is fitted to known dims and constant sizes up to this
_MAX_CANDIDATES = 64  # bounds the cost of an op no candidate runs for (each try is one raise)
_DEPTH = 12  # how far back a size the graph computes (x.size(0) // 2) is rebuilt
# A low kernel is wrong when its norm-wise relative error on the probe inputs exceeds this.
# Right kernels stay far below it (bf16 SDPA backward, the worst seen: 0.15); broken ones go far
# above (bf16 grid_sample on CPU: 1e31).
_WRONG = 0.5


def disable_modes():
    """Run real kernels whatever the caller's context (a fake mode inside torch.compile)."""
    return _disable_current_modes()


def _shape_of(node: fx.Node) -> tuple[int, ...] | None:
    shape = M.info(node).shape
    if shape is None or None in shape:
        return None
    return tuple(map(int, shape))  # type: ignore[arg-type]


# Leaves _descriptor returns as they are without a call: hashable, never a probe slot or a
# derived size (graph nodes: the arguments of a recipe's op); ints too where none are collected.
_ATOMS = frozenset({str, float, bool, type(None), fx.Node})
_ATOMS_AND_INTS = _ATOMS | {int}


def _descriptor(a: object, blank: tuple[type, ...] = (), ints: list[int] | None = None
                ) -> object:
    """Hashable structure of a constant argument, for the cache key; instances of ``blank``
    (the probe's slots and derived sizes) as None. ``ints``: collects the ints among ``a``'s
    leaves (what ``pytree.tree_leaves`` finds) on the same walk."""
    if isinstance(a, (list, tuple)):  # torch.Size and namedtuples too, as pytree
        atoms = _ATOMS if ints is not None else _ATOMS_AND_INTS
        return (type(a).__name__, *[x if type(x) in atoms else _descriptor(x, blank, ints)
                                    for x in a])
    if isinstance(a, dict):
        return tuple(sorted([(k, _descriptor(v, blank, ints)) for k, v in a.items()]))
    if blank and isinstance(a, blank):
        return None
    if ints is not None and isinstance(a, int) and not isinstance(a, bool):
        ints.append(a)
    try:
        hash(a)
        return a
    except TypeError:
        return repr(a)


def low_kernel_problem(node: fx.Node, dtype: torch.dtype, device: torch.device,
                       family: Family | None = None,
                       module: torch.nn.Module | None = None,
                       memo: dict | None = None) -> str | None:
    """Why ``node`` cannot run in ``dtype`` on ``device``; None when a probe confirmed it can.

    A problem starting with :data:`NOT_CONFIRMED` means no probe could run the op at all.
    ``module`` is the submodule a ``call_module`` node calls; a module that holds float
    parameters or buffers is not probed (it runs on its own weights: paint_precision's call).
    ``memo``: the answers for earlier nodes of a pass, by :func:`_signature`.
    """
    if memo is not None and module is None:
        random = bool(family is not None and family.random)
        return _memoized(memo, ("low", dtype, device, random, _signature(node)),
                         lambda: low_kernel_problem(node, dtype, device, family))
    if node.op == "call_module":
        if module is None or any(t.is_floating_point() for t in
                                 (*module.parameters(), *module.buffers())):
            return None
        # The class and its settings (kernel_size, ...): what decides the kernel it calls.
        what: object = (type(module), repr(module), module.training)
        fn: Callable = module
    elif node.op in ("call_function", "call_method"):
        # The target itself, not id(target): a freed function's id is reused by another one,
        # which would get its verdict.
        what = node.target
        fn = _call(node.op, node.target)
    else:
        return None
    template = _Template.of(node)
    key = (node.op, str(dtype), device.type, template.key)
    # A definitive answer (the kernel works, is missing, is wrong) holds for every node of the
    # same op and argument structure. "Not confirmed" belongs to this node's shapes and sizes
    # only: it is kept under the finer key, so that it cannot hide a node that can be probed.
    return _cached(what, key, template, lambda: _probe(
        fn, template, dtype, device.type, bool(family is not None and family.random)))


def _signature(node: fx.Node, owner: object = None) -> tuple | None:
    """The op, its target (or ``owner``: a module's class and settings) and its arguments with
    each input node as (first position, dtype, shape): two nodes with equal signatures have
    equal templates (:meth:`_Template.of`), so the same verdict. None when an input is not a
    tensor."""
    tokens: dict[fx.Node, tuple] = {}
    # all_input_nodes lists the inputs in argument order, each once: the first positions.
    for a in node.all_input_nodes:
        i = M.info(a)
        if i.kind != "tensor":
            return None
        tokens[a] = (len(tokens), i.dtype, i.shape)
    token = tokens.__getitem__
    # Keyword arguments in their order, as the template's structure lists them.
    return (node.op, node.target if owner is None else owner, fx.node.map_arg(node.args, token),
            tuple(fx.node.map_arg(node.kwargs, token).items()) if node.kwargs else ())


def _memoized(memo: dict, key: tuple, find: Callable[[], str | None]) -> str | None:
    """``find()``, or the answer it gave for ``key`` before (no signature: not kept)."""
    if key[-1] is None:
        return find()
    try:
        return memo[key]
    except KeyError:
        found = memo[key] = find()
        return found
    except TypeError:  # an unhashable constant argument
        return find()


class _Verdicts:
    """Probe verdicts per owner -- the op's target (a function, a method name) or a module's
    class -- and then per key. An owner that can be weakly referenced (a Python function, a
    class) is held weakly: its verdicts go when it does, and a new function that happens to get
    a freed one's id cannot inherit them. Builtins and method names live as long as torch."""

    def __init__(self) -> None:
        self._weak: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._strong: dict[object, dict[tuple, dict[tuple, str | None]]] = {}

    def table(self, owner: object) -> dict[tuple, str | None]:
        """The verdicts of ``owner``; a tuple owner is (module class, its settings...)."""
        rest: tuple = ()
        if isinstance(owner, tuple):
            owner, rest = owner[0], owner[1:]
        try:
            tables = self._weak.setdefault(owner, {})
        except TypeError:  # not weakly referenceable
            tables = self._strong.setdefault(owner, {})
        return tables.setdefault(rest, {})

    def __len__(self) -> int:
        return sum(len(t) for d in (*self._weak.values(), *self._strong.values())
                   for t in d.values())


_CACHE = _Verdicts()


def _cached(owner: object, key: tuple, template: _Template,
            probe: Callable[[], str | None]) -> str | None:
    """``probe()``'s verdict, cached under (``owner``, ``key``), or under (key, the node's
    shapes) for "not confirmed"; uncached when a constant argument is unhashable."""
    fine = (key, template.fine)
    try:
        table = _CACHE.table(owner)
        for k in (key, fine):
            if k in table:
                return table[k]
    except TypeError:  # an unhashable constant argument: probe without caching
        return probe()
    found = probe()
    table[fine if found is not None and found.startswith(NOT_CONFIRMED) else key] = found
    return found


def mixed_problem(node: fx.Node, signature: Mixed, dtype: torch.dtype, device: torch.device,
                  module: torch.nn.Module | None = None, fn: Callable | None = None,
                  memo: dict | None = None) -> str | None:
    """Why ``node``'s kernel cannot take ``signature`` (:class:`amprewrite.precision.ops.Mixed`)
    with its data input (first argument) in ``dtype`` on ``device``; None when a probe confirmed it.

    The probe runs the op twice on the same values, forward and backward: all fp32, then with
    the data input in ``dtype`` (other tensors fp32; ``dtype=torch.float32`` added for
    ``DTYPE_ARG``). Confirmed when the output has the signature's dtype (the input's for
    ``LOW_IO``, fp32 for ``DTYPE_ARG``) and equals the fp32 result (``LOW_IO``: rounded once to
    ``dtype``, at most one unit in the last place apart; ``DTYPE_ARG``: within 1e-5), and the
    data input's gradient is within the dtype's rounding of the fp32 one. The data input has a
    large mean, so a kernel that accumulates in ``dtype`` fails. A module is called on a copy
    (its running statistics stay as they are). ``fn``: probe this function with the node's
    arguments instead of its target (``Mixed.FP32_HELPER``: the family's runtime helper).

    >>> import torch
    >>> from torch import fx
    >>> g = fx.Graph(); x = g.placeholder("x")
    >>> n = g.call_module("bn", (x,))
    >>> bn = torch.nn.BatchNorm2d(8)
    >>> mixed_problem(n, Mixed.LOW_IO, torch.bfloat16, torch.device("cpu"), bn) is None
    True
    >>> n = g.call_function(torch.exp, (x,))
    >>> mixed_problem(n, Mixed.DTYPE_ARG, torch.bfloat16, torch.device("cpu"))[:40]
    'dtype_arg signature not taken on cpu (ex'

    ``memo``: the answers for earlier nodes of a pass, by :func:`_signature`.
    """
    if memo is not None:
        # A module's verdict is its class's and settings' (the cache's owner), not its path's.
        owner = node.target if module is None else (type(module), repr(module), module.training)
        return _memoized(memo, ("mixed", signature, dtype, device, fn,
                                _signature(node, owner)),
                         lambda: mixed_problem(node, signature, dtype, device, module, fn))
    if node.op == "call_module":
        if module is None:
            return "no module to probe"
        if isinstance(module, torch.nn.SyncBatchNorm):
            # Without a process group it runs plain batch_norm: its distributed kernels
            # (batch_norm_gather_stats...) are not what a probe in one process would call.
            return f"{NOT_CONFIRMED}: SyncBatchNorm's distributed kernels cannot be probed here"
        what: object = (type(module), repr(module), module.training)

        def fn(*args, **kwargs):
            return copy.deepcopy(module)(*args, **kwargs)
    elif fn is not None:
        what = fn
    elif node.op in ("call_function", "call_method"):
        # The target itself, not id(target): a freed function's id is reused by another one,
        # which would get its verdict.
        what = node.target
        fn = _call(node.op, node.target)
    else:
        return "not an op"
    first = node.args[0] if node.args else None
    template = _Template.of(node)
    if module is not None:  # its parameters' sizes fit guessed shapes (BatchNorm2d(8): C = 8)
        template.consts |= {int(d) for t in (*module.parameters(), *module.buffers())
                            for d in t.shape if d > 1}
    if not isinstance(first, fx.Node) or template.slot_of.get(first) != 0:
        return "its first argument is not a tensor"
    key = ("mixed", signature, node.op, str(dtype), device.type, template.key)
    return _cached(what, key, template,
                   lambda: _probe_mixed(fn, template, signature, dtype, device.type))


def _probe_mixed(fn: Callable, template: _Template, signature: Mixed, dtype: torch.dtype,
                 device: str) -> str | None:
    data = 0  # the data input: the first argument, the first slot and the first float leaf
    if template.problem is not None:
        return f"{NOT_CONFIRMED}: {template.problem}"
    name = f"{signature.value} signature"
    want = dtype if signature.stores_input_dtype else torch.float32
    call = fn
    if signature is Mixed.DTYPE_ARG:
        def call(*args, **kwargs):
            return fn(*args, **{**kwargs, "dtype": torch.float32})

    def island(*args, **kwargs):  # what the plan builds without the signature
        return pytree.tree_map(lambda t: t.to(want) if isinstance(t, torch.Tensor)
                               and t.is_floating_point() else t, fn(*args, **kwargs))

    eps = torch.finfo(dtype).eps

    def twice(shapes, backward: bool):
        """The same values twice: the low data input upcast (an fp32 copy), and as is."""
        template.slot_dtype = {data: dtype}
        try:
            template.upcast = {data}
            try:
                ref = _run(island, template, shapes, torch.float32, device, backward, True)
            except Exception:
                template.grad_only = {data}  # a running statistic cannot take a grad
                ref = _run(island, template, shapes, torch.float32, device, backward, True)
            template.upcast = set()
            return ref, _run(call, template, shapes, torch.float32, device, backward, True)
        finally:
            template.upcast, template.grad_only = set(), None

    try:
        with disable_modes(), torch.enable_grad():
            for shapes in template.candidates():
                template.slot_dtype, template.slot_floats = {}, {}
                try:
                    _run(fn, template, shapes, torch.float32, device, False)
                except Exception:
                    continue  # not a valid call even in fp32: the next candidate
                try:
                    # The forward on a data input of large mean (a kernel that accumulates in
                    # the low dtype fails); the backward on one of mean 1, where the fp32
                    # island's own gradients are accurate: at mean 64, cancellation puts the
                    # island's fp32 weight gradients 0.3-0.7 eps (fp16) off float64's, so two
                    # fp32-accurate kernels differ by that much (fp16 group_norm, measured).
                    template.slot_floats = {data: 64.0}
                    (ref, _), (out, _) = twice(shapes, False)
                    template.slot_floats = {}
                    (ref_small, ref_grads), (out_small, grads) = twice(shapes, True)
                except Exception as exc:
                    return f"{name} not taken on {device} ({_first_line(exc)})"
                if not ref:
                    continue
                ref, out = ref + ref_small, out + out_small
                if len(out) != len(ref) or any(o.dtype != want for o in out):
                    got = sorted({str(o.dtype).replace("torch.", "") for o in out})
                    return f"{name}: the kernel on {device} returns {', '.join(got)}"
                # Measured on CPU: with fp32 weights the norms are bit-equal to the island or
                # within 0.05 eps; a norm without fp32 weights computes in the low dtype
                # (batch_norm without affine or running stats: 0.3-1.5 eps at these inputs).
                problem = _differs(out, ref, eps / 8 if signature.stores_input_dtype else 1e-5,
                                   f"{name}: the kernel on {device}")
                # Every gradient against the island's: the data input's, rounded to its dtype
                # as the island's cast rounds it, within eps / 4 norm-wise or at most one unit
                # in the last place apart everywhere (the two fp32 results differ in summation
                # order, so a rounding may flip; a backward in the low dtype is 5-30 eps and
                # many units off); the fp32 parameters' within eps / 4
                # (layer_norm's CPU backward sums them in the low dtype: 0.5 eps at probe sizes,
                # 100 at 1024 rows).
                for i, (g, r) in enumerate(zip(grads or (), ref_grads or ())):
                    if problem is not None or r is None:
                        continue
                    if g is None:
                        return f"{name}: no backward on {device} (probed)"
                    if i == data and g.dtype != torch.float32:
                        # Either criterion: a few values two ulps off in a large gradient, or
                        # subnormal values (fp16 softmax at probe sizes), fail one of them only.
                        what = f"{name}: the backward on {device}"
                        problem = _differs([g], [r.to(g.dtype)], eps / 4, what) and _ulps_apart(
                            g, r.to(g.dtype), what)
                    else:
                        problem = _differs([g], [r], eps / 4, f"{name}: the backward on {device}")
                return problem
    finally:
        template.slot_dtype, template.slot_floats = {}, {}
    return f"{NOT_CONFIRMED}: none of the probe inputs ran even in float32 ({name})"


def _ulps_apart(low: torch.Tensor, ref: torch.Tensor, what: str) -> str | None:
    """None when ``low`` and ``ref`` (both in the low dtype) are at most one unit in the last
    place apart everywhere."""
    low, ref = low.detach(), ref.detach()
    if low.shape != ref.shape:
        return f"{what} returns another shape"
    ulp = (torch.nextafter(ref, torch.full_like(ref, float("inf"))) - ref).double().abs()
    far = ((low.double() - ref.double()).abs() > ulp * 1.0001) & torch.isfinite(ref)
    if far.any():
        return (f"{what} does not compute as an fp32 copy would (probed: {int(far.sum())} of "
                f"{far.numel()} gradient values more than one unit in the last place off)")
    return None


def _differs(out: list[torch.Tensor], ref: list[torch.Tensor], bound: float, what: str
             ) -> str | None:
    for o, r in zip(out, ref):
        if o.shape != r.shape:
            return f"{what} returns another shape"
        o, r = o.detach().double(), r.detach().double()
        if not torch.isfinite(o).all() and torch.isfinite(r).all():
            return f"{what} returns non-finite values (probed)"
        err = float((o - r).norm() / r.norm().clamp_min(1e-30))
        if err > bound:
            return (f"{what} does not compute as an fp32 copy would (probed error {err:.2g}, "
                    f"bound {bound:.2g})")
    return None


class _Unreproducible(Exception):
    """A non-tensor argument the probe cannot rebuild (a graph input, a module's output)."""


_UNKNOWN = object()


def _concrete(value: object) -> object:
    """A plain Python value for an example value of a non-tensor node, or _UNKNOWN."""
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        # The example's value, read without a guard (int(SymInt) would specialise it).
        hint = getattr(value.node, "hint", None)
        return _UNKNOWN if hint is None else hint
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device,
                                           torch.layout, torch.memory_format)):
        return value
    if isinstance(value, (tuple, list)):  # torch.Size included
        items = [_concrete(v) for v in value]
        if any(v is _UNKNOWN for v in items):
            return _UNKNOWN
        return items if isinstance(value, list) else tuple(items)
    return _UNKNOWN


def _hint(node: fx.Node) -> object:
    value = M.fake_value(node, _UNKNOWN)
    return _UNKNOWN if value is _UNKNOWN else _concrete(value)


class _Slot:
    """A tensor argument of the probed node: the probe makes it from a candidate shape."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


class _Derived:
    """A non-tensor argument the graph computes (``x.size(0)``): recomputed from probe tensors."""

    __slots__ = ("node",)

    def __init__(self, node: fx.Node):
        self.node = node


class _Template:
    """The node's arguments with tensors described (dtype, known shape) for probe inputs."""

    def __init__(self) -> None:
        self.args: tuple = ()
        self.kwargs: dict = {}
        self.tensors: list[tuple[torch.dtype | None, tuple[int, ...] | None]] = []
        self.slot_of: dict[fx.Node, int] = {}
        self.consts: set[int] = set()  # small ints among the arguments and rebuilt sizes
        self.ints: list[int] = []  # the node's own constant ints, in order (sizes of a view)
        self.hints: list[object] = []  # example values of non-tensor arguments
        self.problem: str | None = None
        # Slots of unknown dtype (graph inputs of a symbolic trace) made as integers: the
        # indices of an embedding. Empty: every unknown dtype is a float.
        self.as_int: frozenset[int] = frozenset()
        self.rebuilt: set[fx.Node] = set()  # tensors recomputed from sizes (_from_sizes)
        self.key: object = None
        self.fine: object = None
        # Probe floats lie in [low, low + 1): (0.5, 1.5) has no zero to divide by; (0, 1) is
        # tried when no candidate ran even in fp32 (probabilities: binary_cross_entropy).
        self.floats: float = 0.5
        # Per-slot dtype and float offset overrides (the mixed-signature probe: the data input
        # low, with a large mean so that a kernel accumulating in the low dtype shows).
        self.slot_dtype: dict[int, torch.dtype] = {}
        self.slot_floats: dict[int, float] = {}
        self.upcast: set[int] = set()  # slots made in their slot dtype, then copied to fp32
        # Slots that require grad in a backward probe (None: every float slot). Running
        # statistics cannot (native_batch_norm refuses), so the mixed probe falls back to the
        # data input alone.
        self.grad_only: set[int] | None = None

    @staticmethod
    def of(node: fx.Node) -> _Template:
        t = _Template()
        slot_of, tensors = t.slot_of, t.tensors
        # Every tensor argument first, so that a size read from one of them (x.size(0)) is
        # recomputed from the same probe tensor.
        for a in node.all_input_nodes:
            i = M.info(a)
            if i.kind == "tensor" and a not in slot_of:
                slot_of[a] = len(tensors)
                tensors.append((i.dtype, _shape_of(a)))
        structure: list[object] = []

        def describe(a: fx.Node) -> object:
            slot = slot_of.get(a)
            if slot is not None:
                i = M.info(a)
                structure.append(("slot", slot, str(i.dtype),
                                  None if i.shape is None else len(i.shape)))
                return _Slot(slot)
            value = _hint(a)
            if value is not _UNKNOWN:
                t.hints.append(value)
                structure.append(("value",))  # the example's sizes: in the fine key only
                return value
            try:
                structure.append(("derived", t._recipe(a, 0)))
            except _Unreproducible as exc:
                structure.append(("unknown",))
                t.problem = t.problem or str(exc)
            return _Derived(a)

        t.args = fx.node.map_arg(node.args, describe)
        t.kwargs = fx.node.map_arg(node.kwargs, describe)
        if not tensors:
            t.problem = t.problem or "no tensor argument to probe with"
        # Coarse key: tensors by dtype and rank, sizes the graph computes by how it computes
        # them, constants by value; the example's shapes and sizes go into the fine key.
        t.key = (tuple(structure), _descriptor((t.args, t.kwargs), (_Slot, _Derived), t.ints))
        t.consts.update(t.ints)
        t.fine = (tuple(s for _, s in tensors), repr(t.hints))
        return t

    def _recipe(self, a: fx.Node, depth: int) -> object:
        """The structure of how the graph computes the non-tensor ``a`` (for the cache key);
        raises _Unreproducible when the probe cannot recompute it."""
        if a in self.slot_of:
            return ("slot", self.slot_of[a])
        i = M.info(a)
        if i.kind == "tensor" and not self._from_sizes(a, depth):
            # Made up at build time, of the first probe tensor's shape.
            return ("tensor", str(i.dtype), None if i.shape is None else len(i.shape))
        value = _hint(a)
        if value is not _UNKNOWN:
            return ("value", repr(value))
        if i.kind != "tensor" and i.has_float():
            # Float tensors inside a tuple would be rebuilt in fp32 for the low run as well.
            raise _Unreproducible(f"argument '{a.name}' holds tensors the probe cannot rebuild")
        if depth >= _DEPTH or a.op not in ("call_function", "call_method"):
            raise _Unreproducible(f"argument '{a.name}' ({a.op} '{a.target}') is only known "
                                  "when the model runs")
        ints: list[int] = []
        _descriptor((a.args, a.kwargs), (_Slot, _Derived), ints)
        self.consts.update(ints)  # n_head in C // n_head: a side to try

        def sub(x: object) -> object:  # nodes inside tuples too: (clamp, arange)[eq]
            return _descriptor(fx.node.map_arg(x, lambda n: self._recipe(n, depth + 1)))

        target = a.target if a.op == "call_method" else getattr(a.target, "__qualname__",
                                                                repr(a.target))
        return (a.op, target, sub(tuple(a.args)), sub(dict(a.kwargs)) if a.kwargs else None)

    def _from_sizes(self, a: fx.Node, depth: int) -> bool:
        """Is the tensor ``a`` computed from sizes and the node's own tensors only (the source
        indices of an inlined upsample: arange(n) * scale)? Then the probe rebuilds it by
        running its ops; any other tensor (a graph input, a conv's output) is made up."""
        if a in self.slot_of:
            return True
        if a in self.rebuilt:
            return True
        if depth >= _DEPTH or a.op not in ("call_function", "call_method"):
            return False
        if all(b in self.slot_of or (M.info(b).kind != "tensor" and not M.info(b).has_float())
               or (M.info(b).kind == "tensor" and self._from_sizes(b, depth + 1))
               for b in a.all_input_nodes):
            self.rebuilt.add(a)
            return True
        return False

    def candidates(self) -> list[list[tuple[int, ...]]]:
        shapes = [s for _, s in self.tensors]
        out: list[list[tuple[int, ...]]] = []

        def add(c: list[tuple[int, ...]]) -> None:
            if c not in out and len(out) < _MAX_CANDIDATES:
                out.append(c)

        def shrink(s: tuple[int, ...]) -> tuple[int, ...]:
            return tuple(min(d, _SIDE) for d in s)

        known = [s for s in shapes if s is not None]
        if len(known) == len(shapes):
            if all(math.prod(s) <= _SMALL for s in known):
                add(known)
            add([shrink(s) for s in known])
            # Channels and groups kept (a depthwise conv: groups=64 needs 64 channels).
            add([tuple(d if d <= 64 else _SIDE for d in s) for s in known])
            if all(math.prod(s) <= _LARGE for s in known):
                add(known)  # sizes read from the graph (view(b, t, 12, 64)) fit only these
            return out

        def fit(s: tuple[int, ...]) -> tuple[int, ...]:
            return s if math.prod(s) <= _SMALL else shrink(s)

        # Unknown integer tensors are often index vectors (index_select, an inlined upsample's
        # source indices): each guess is tried again with them 1-d.
        index = [s is None and (d is None or not (d.is_floating_point or d.is_complex
                                                  or d == torch.bool)) for d, s in self.tensors]

        def guess(shape: tuple[int, ...]) -> None:
            if math.prod(shape) <= _GUESS:
                add([fit(s) if s is not None else shape for s in shapes])
                if any(index):
                    add([fit(s) if s is not None else (2,) if i else shape
                         for s, i in zip(shapes, index)])

        top = max((len(s) for s in known), default=None)
        # A weight's rank first (conv2d: 4); a dim argument d asks for a rank above d
        # (flatten(4, 5) of an upsample's 6-d view).
        ranks = sorted(_RANKS, key=lambda r: r != top) + sorted(
            {c + 1 for c in self.consts if max(_RANKS) < c + 1 <= 8})
        # Sides of 4, then the small constants (C // n_head needs C a multiple of n_head).
        for side in (_SIDE, *sorted(c for c in self.consts if _SIDE < c <= 32)):
            for r in ranks:
                guess((side,) * r)
        for r in ranks:
            guess((2,) * r)  # high ranks at sides of 4 are too large
        # Known tensors at sides of 4 too (a bias of shape (C, 1, 1) against guessed C = 4).
        for r in ranks:
            add([tuple(1 if d == 1 else _SIDE for d in s) if s is not None else (_SIDE,) * r
                 for s in shapes])
        # A per-row target or weight last, one rank lower (cosine_embedding_loss(a, b, y)).
        if len(shapes) >= 2 and shapes[-1] is None:
            for r in ranks:
                if r >= 2:
                    add([fit(s) if s is not None else (_SIDE,) * r for s in shapes[:-1]]
                        + [(_SIDE,) * (r - 1)])
        # The op's constant sizes as the shape (view(-1, 784), expand(4, 8), the 8-d expand of
        # an inlined nearest upsample).
        if 0 < len(self.ints) <= 8:
            guess(tuple(d if d > 0 else 2 for d in self.ints))
            guess(tuple(1 if d > 0 else 2 for d in self.ints))  # what expand(-1, 41) grows
        # Fitted to one dim of a known tensor or a constant, first or last: the input features
        # of a linear's weight, the channels of a conv's or a norm's; other sides as large as
        # the largest kernel (a 7x7 conv without padding).
        dims = sorted({d for s in known for d in s if 1 <= d <= _FIT}
                      | {c for c in self.consts if 2 <= c <= _FIT})
        side = max([_SIDE] + [d for s in known if len(s) >= 3 for d in s[2:] if d <= 16])
        for r in ranks:
            for d in dims:
                for pos in ((-1,) if r == 1 else (1, -1)):
                    shape = [side] * r
                    shape[0] = 2 if r > 1 else shape[0]
                    shape[pos] = d
                    guess(tuple(shape))
        return out

    def build(self, shapes: list[tuple[int, ...]], dtype: torch.dtype, device: str,
              grad: bool = True) -> tuple[tuple, dict, list[torch.Tensor]]:
        g = torch.Generator().manual_seed(0)
        made: list[torch.Tensor] = []
        for i, ((orig, _), shape) in enumerate(zip(self.tensors, shapes)):
            orig = torch.int64 if i in self.as_int else orig
            wants = grad and (self.grad_only is None or i in self.grad_only)
            t = _tensor(orig, shape, self.slot_dtype.get(i, dtype), device, g, grad=wants,
                        low=self.slot_floats.get(i, self.floats))
            if i in self.upcast and t.is_floating_point():
                t = t.detach().float().requires_grad_(wants)
            made.append(t)
        env: dict[fx.Node, object] = {n: made[i] for n, i in self.slot_of.items()}

        def rebuild(n: fx.Node) -> object:
            """The value of the non-tensor ``n``, computed from the probe tensors."""
            if n in env:
                return env[n]
            i = M.info(n)
            if i.kind == "tensor" and n not in self.rebuilt:
                # A tensor the node does not take (x in h.view(x.size(0), -1)): the shape of
                # the first probe tensor, so that the sizes read from it agree with it.
                shape = _shape_of(n)
                if shape is None or math.prod(shape) > _LARGE:
                    shape = shapes[0] if i.shape is None or len(i.shape) == len(shapes[0]) \
                        else (_SIDE,) * len(i.shape)
                value: object = _tensor(i.dtype, shape, torch.float32, device, g, grad=False,
                                        low=self.floats)
            elif (hint := _hint(n)) is not _UNKNOWN:
                value = hint
            else:
                args = fx.node.map_arg(n.args, rebuild)
                kwargs = fx.node.map_arg(n.kwargs, rebuild)
                value = _call(n.op, n.target)(*args, **kwargs)
            env[n] = value
            return value

        def fill(a: object) -> object:
            if isinstance(a, _Slot):
                return made[a.index]
            if isinstance(a, _Derived):
                with torch.no_grad():
                    return rebuild(a.node)
            return a

        leaf = lambda a: isinstance(a, (_Slot, _Derived))  # noqa: E731
        args = pytree.tree_map(fill, self.args, is_leaf=leaf)
        kwargs = pytree.tree_map(fill, self.kwargs, is_leaf=leaf)
        return args, kwargs, [t for t in made if t.is_floating_point()]


def _tensor(orig: torch.dtype | None, shape: tuple[int, ...], dtype: torch.dtype, device: str,
            g: torch.Generator, grad: bool, low: float = 0.5) -> torch.Tensor:
    """A probe tensor: floats in [low, low + 1), indices 0 or 1."""
    if orig is None or orig.is_floating_point:
        t = (torch.rand(shape, generator=g) + low).to(device=device, dtype=dtype)
        return t.requires_grad_(grad)
    if orig == torch.bool:
        return torch.rand(shape, generator=g).gt(0.5).to(device)
    if orig.is_complex:
        return torch.rand(shape, generator=g).to(device=device, dtype=orig)
    return torch.randint(0, 2, shape, generator=g).to(device=device, dtype=orig)


def _call(op: str, target: object) -> Callable:
    if op == "call_method":
        return lambda *a, **k: getattr(a[0], str(target))(*a[1:], **k)
    return target  # type: ignore[return-value]


def _floats(out: object) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(out)
            if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:120]


@contextlib.contextmanager
def _seeded(device: str, seed: int = 0) -> Iterator[None]:
    """Random draws start from ``seed`` on the CPU and on ``device``, and the caller's
    generators are as they were afterwards. Only those two are seeded: ``torch.manual_seed``
    also queues a lazy seeding of every device type torch knows (CUDA, XPU, MTIA) with the
    caller's formatted stack, ~1 ms a call in a deep stack (a transform of the zoo LLaMA probes
    47 times), and it changed the caller's CUDA generator for good, which
    ``fork_rng(devices=[])`` does not restore."""
    dev = torch.device(device)
    try:
        module = torch.get_device_module(dev.type) if dev.type not in ("cpu", "meta") else None
    except RuntimeError:  # a device type torch has no module for
        module = None
    if module is None or not all(hasattr(module, a) for a in ("manual_seed", "current_device",
                                                                "device")):
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            if module is not None and hasattr(module, "manual_seed"):
                module.manual_seed(seed)  # a device without per-index generators (MPS)
            yield
        return
    index = dev.index if dev.index is not None else module.current_device()
    with torch.random.fork_rng(devices=[index], device_type=dev.type), module.device(index):
        torch.default_generator.manual_seed(seed)
        module.manual_seed(seed)
        yield


def _run(fn: Callable, template: _Template, shapes, dtype, device, backward: bool,
         normal_grads: bool = False):
    # Without a backward the tensors don't require grad: an argument that can't
    # (soft_margin_loss's target) then raises nothing. normal_grads: output weights of
    # 1 / sqrt(numel) rather than 1 / numel, so that a low-dtype gradient stays out of fp16's
    # subnormal range (a probe that compares roundings; fp16 training scales its loss for the
    # same reason), while a sum over every output still cannot overflow.
    args, kwargs, leaves = template.build(shapes, dtype, device, grad=backward)
    with _seeded(device):
        out = fn(*args, **kwargs)
    outs = _floats(out)
    grads = None
    if backward and outs and leaves and any(o.requires_grad for o in outs):
        # Random output weights (a plain sum has a zero gradient through softmax-like ops), of
        # total 1 so that a backward that accumulates many outputs cannot overflow fp16.
        g = torch.Generator().manual_seed(1)
        total = sum((o * ((torch.rand(o.shape, generator=g) + 0.5)
                          / (math.sqrt(max(o.numel(), 1)) if normal_grads else max(o.numel(), 1)))
                     .to(device=o.device, dtype=o.dtype)).sum()
                    for o in outs if o.requires_grad)
        grads = torch.autograd.grad(total, [t for t in leaves if t.requires_grad],
                                    allow_unused=True)
    return outs, grads


def _probe(fn: Callable, template: _Template, dtype: torch.dtype, device: str,
           random: bool) -> str | None:
    if template.problem is not None:
        return f"{NOT_CONFIRMED}: {template.problem}"
    low_name = str(dtype).replace("torch.", "")
    candidates = template.candidates()
    # Floats first; then each tensor of unknown dtype as integers in turn (embedding indices).
    unknown = [i for i, (d, _) in enumerate(template.tensors) if d is None][:3]
    tries = [(frozenset(), shapes) for shapes in candidates] + [
        (frozenset((i,)), shapes) for i in unknown for shapes in candidates]
    # Then every try again with floats in [0, 1) (an op that takes probabilities).
    tries = [(0.5, *t) for t in tries] + [(0.0, *t) for t in tries]
    first: str | None = None
    with disable_modes(), torch.enable_grad():
        for floats, as_int, shapes in tries:
            template.as_int, template.floats = as_int, floats
            try:
                ref, ref_grads = _run(fn, template, shapes, torch.float32, device, True)
            except Exception as exc:
                try:
                    ref, ref_grads = _run(fn, template, shapes, torch.float32, device, False)
                except Exception:
                    first = first or _first_line(exc)
                    continue  # this candidate is not a valid call: try the next one
            if not ref:
                continue  # no float output: this call confirms nothing about float kernels
            backward = ref_grads is not None
            try:
                low, low_grads = _run(fn, template, shapes, dtype, device, backward)
            except Exception as exc:
                return f"no {low_name} kernel on {device} (probed: {_first_line(exc)})"
            if random:
                bad = any(not torch.isfinite(t).all() for t in low)
                return f"{low_name} kernel returns non-finite values on {device}" if bad else None
            return _compare(ref, low, dtype, device) or _compare(
                [g for g in ref_grads or () if g is not None],
                [g for g in low_grads or () if g is not None], dtype, device, "backward ")
    known = all(s is not None for _, s in template.tensors)
    return (f"{NOT_CONFIRMED}: none of {len(candidates)} probe inputs "
            f"({'shrunk from the node' if known else 'guessed: shapes unknown'}) ran even in "
            f"float32 (first error: {first})")


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
