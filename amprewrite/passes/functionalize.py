"""functionalize: every in-place write becomes explicit data flow.

After this pass no node changes a value another node reads (the one exception: a closing
``copy_`` into each graph input the model writes to). Every later pass may therefore assume
what the cast plan needs: a value is fixed once its node has run, so a cast placed right after
it reads what every consumer reads.

Matches (dynamo graph of ``h = lin(x); h[:, 0].mul_(2); t = h.t(); h.exp_(); lin(h) + t``)::

    h = linear(x, w);  v = h[:, 0];  m = v.mul_(2);  t = h.t();  e = h.exp_();  y = linear(e, w)

Rewrite to::

    h = linear(x, w);  v = h[:, 0];  m = v.mul(2)
    h1 = write_view(h, m, (("__getitem__", ((slice(None), 0),), {}),))   # h with v written
    t = h.t()                     # created before the write, so it is re-derived when read
    e = h1.exp()                  # in-place op -> out-of-place op: it gets that op's class
    y = linear(e, w);  t1 = e.t();  out = y + t1

Rules:

- an in-place op (``x.op_``, ``x += y``, ``x[i] = v``, ``out=``, ``inplace=True``) becomes its
  out-of-place op (or, without one, the same op on a private ``clone``), with a conversion back
  to the written tensor's dtype where PyTorch's promotion would widen it;
- a write into a view also updates its base: ``write_view`` replays the view chain on a copy;
- a read of any alias (the base or a view of it) after a write reads the new value: views are
  re-derived from the new base by replaying their view ops;
- which values alias which comes from dynamo's fake tensors (two values alias when they share
  a storage: exact, even for ``reshape``/``contiguous``/``to``); for symbolic traces from a table
  of view ops. Where aliasing cannot be known (a symbolic ``reshape`` whose source is read after
  a write) or replayed (``broadcast_tensors``), the transform refuses with a clear error rather
  than guess;
- writes to graph inputs and buffers are kept: a final ``input.copy_(new value)``; writes to
  float parameters are refused (amprewrite casts those where they are read, and
  ``params="low"`` may store them as low copies).
"""

from __future__ import annotations

import builtins
import inspect
import operator
from dataclasses import dataclass, field

import torch
from torch import fx, nn

from ..errors import ModelError
from ..graph import meta as M
from ..graph.meta import ValueInfo, info
from ..graph.modules import get_attr, submodule
from ..graph.runtime import VIEW_FUNCTIONS, setitem, view_function_key, write_view
from ..precision.ops import (
    Alias,
    Write,
    alias_of,
    family_of,
    function_counterpart,
    inplace_counterpart,
    inplace_flag,
    is_conversion,
    write_of,
)
from ..precision.report import record
from .base import Kind, Pass

__all__ = ["Functionalize"]


# Tensor properties as torch 2.14's dynamo writes them (aten.numpy_T for t.T): a view chain
# replays them as the property.
_PROPERTY_OPS = {"numpy_T": "T", "matrix_H": "H", "mT": "mT", "mH": "mH"}


def _op_name(node: fx.Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    if node.target is builtins.getattr and len(node.args) > 1:
        return str(node.args[1])
    if node.target is operator.getitem:
        return "__getitem__"
    return getattr(node.target, "__name__", "")


def _storages(value: object) -> set[int]:
    if isinstance(value, torch.Tensor):
        try:
            return {value.untyped_storage()._cdata}
        except Exception:  # sparse, nested or otherwise storage-less tensors
            return set()
    if isinstance(value, (tuple, list)):
        return set().union(*(_storages(v) for v in value))
    return set()


def _fake(node: fx.Node) -> object:
    return M.fake_value(node)


def _is_tensorish(node: fx.Node) -> bool:
    v = info(node)
    if v.kind == "seq":  # a tuple of views (split, chunk), possibly of unknown length
        return any(i.kind == "tensor" for i in v.items) or not v.items
    return v.kind == "tensor"


@dataclass
class _Write:
    """An in-place node: which tensor it writes, and how to compute the written value."""

    target: fx.Node  # the tensor written
    kind: str  # "method", "operator", "function", "setitem", "out", "flag"


def _write_of(node: fx.Node) -> _Write | None:
    """The write ``node`` makes, or None when it writes nothing."""
    if node.op not in ("call_method", "call_function") or not node.args:
        return None
    first = node.args[0]
    out = node.kwargs.get("out")
    if isinstance(out, fx.Node):
        return _Write(out, "out")
    if not isinstance(first, fx.Node) or info(first).kind != "tensor":
        return None
    if node.target is operator.setitem:
        return _Write(first, "setitem")
    if inplace_counterpart(node.target) is not None:
        return _Write(first, "operator")
    if write_of(node, _op_name(node)) is None:
        return None
    if inplace_flag(node) and not _op_name(node).endswith("_"):
        return _Write(first, "flag")
    return _Write(first, "method" if node.op == "call_method" else "function")


def _unsupported(node: fx.Node, why: str) -> ModelError:
    where = M.source_line(node)
    return ModelError(
        f"amprewrite cannot make the in-place write {node.format_node()}"
        f"{' at ' + where if where else ''} explicit: {why}. A graph that reads around an "
        "in-place write could return a silently wrong result, so the transform stops. Write "
        "that line out of place (y = x.op(...) instead of x.op_(...)) or pass "
        "example_inputs=(...) so dynamo records which tensors alias."
    )


@dataclass
class _State:
    """Alias facts while walking the graph in order."""

    order: dict[fx.Node, int]
    root: dict[fx.Node, fx.Node] = field(default_factory=dict)  # node -> storage (its root)
    parent: dict[fx.Node, fx.Node] = field(default_factory=dict)  # view -> what it views
    opaque: set[fx.Node] = field(default_factory=set)  # aliases that cannot be re-derived
    uncertain: dict[fx.Node, fx.Node] = field(default_factory=dict)  # root -> maybe-alias src
    version: dict[fx.Node, int] = field(default_factory=dict)  # root -> writes so far
    current: dict[fx.Node, fx.Node] = field(default_factory=dict)  # root -> latest value
    stamp: dict[fx.Node, int] = field(default_factory=dict)  # node -> version it was read at
    cache: dict[tuple[fx.Node, int], fx.Node] = field(default_factory=dict)
    written: dict[fx.Node, None] = field(default_factory=dict)  # roots written, in order
    attrs: dict[str, fx.Node] = field(default_factory=dict)  # get_attr target -> first read


def _view_parent(node: fx.Node, st: _State) -> tuple[fx.Node | None, bool, bool]:
    """(what ``node`` aliases, whether that is certain, whether it can be re-derived)."""
    tensors = [a for a in node.all_input_nodes if a in st.root]
    if not tensors:
        return None, True, True
    first = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    fake = _fake(node)
    if fake is not None and all(_fake(a) is not None for a in tensors):
        mine = _storages(fake)
        shared = [a for a in tensors if mine & _storages(_fake(a))]
        if not shared:
            return None, True, True
        if shared == [first] and first is not None:
            return first, True, True
        return shared[0], True, False
    name = _op_name(node)
    if first is None or first not in st.root:
        return None, True, True
    alias = alias_of(name)
    if alias is Alias.MULTI:
        return first, True, False
    if name == "__getitem__":
        if info(first).kind == "seq":
            return first, True, True
        index: list = []
        fx.node.map_arg(node.args[1:], lambda n: index.append(n) or n)
        advanced = any(info(n).kind == "tensor" for n in index)  # x[idx] copies
        return (None, True, True) if advanced else (first, True, True)
    if alias is Alias.VIEW:
        return first, True, True
    if is_conversion(node):  # returns its input itself when the dtype (and device) stay
        src, dst = info(first).dtype, info(node).dtype
        if src is not None and dst is not None:
            return (first, True, True) if src == dst else (None, True, True)
        return first, False, True
    if alias is Alias.MAYBE_VIEW:
        return first, False, True
    if node.op in ("call_function", "call_method") and family_of(node) is None:
        # An op the registry does not know may return a view of its input (a library's
        # ``rows_of(x)``): a write through it, where it could matter, is refused, not guessed.
        return first, False, True
    return None, True, True


class _Functionalizer:
    def __init__(self, gm: fx.GraphModule):
        self.gm, self.graph = gm, gm.graph
        self.st = _State({n: i for i, n in enumerate(self.graph.nodes)})
        self.changed = False

    # -- reading values --------------------------------------------------------------------
    def _stale(self, a: fx.Node) -> bool:
        r = self.st.root.get(a)
        return r is not None and self.st.stamp.get(a, 0) < self.st.version.get(r, 0)

    def _fresh(self, a: fx.Node, before: fx.Node) -> fx.Node:
        """The current value of alias ``a``, re-derived from its root's latest value."""
        st = self.st
        r = st.root[a]
        v = st.version.get(r, 0)
        if not self._stale(a):
            return a
        if (a, v) in st.cache:
            return st.cache[(a, v)]
        if a in st.opaque:
            raise _unsupported(before, f"'{a.name}' aliases '{r.name}', which an earlier "
                               "in-place op wrote, through an op whose view amprewrite cannot "
                               "replay")
        if a not in st.parent:
            new = st.current[r]
        else:
            p = self._fresh(st.parent[a], before)
            with self.graph.inserting_before(before):
                new = self.graph.node_copy(a, lambda n: p if n is st.parent[a] else n)
            st.root[new], st.parent[new], st.stamp[new] = r, p, v
        st.cache[(a, v)] = new
        return new

    # -- the walk --------------------------------------------------------------------------
    def run(self) -> bool:
        for node in M.each_node(self.graph):
            if node.op == "output":
                self._refresh_inputs(node)
                self._epilogue(node)
                continue
            if node.op == "call_module":
                self._module(node)
            self._refresh_inputs(node)
            write = _write_of(node)
            if write is not None and write.target in self.st.root:
                self._write(node, write)
            elif _is_tensorish(node):
                self._track(node)
        return self.changed

    def modules_only(self) -> bool:
        """What :meth:`run` changes in a graph where no node writes in place: the leaf
        modules built with ``inplace=True`` (no alias needs tracking)."""
        for node in M.each_node(self.graph, "call_module"):
            self._module(node)
        return self.changed

    def _refresh_inputs(self, node: fx.Node) -> None:
        for a in list(node.all_input_nodes):
            if a in self.st.root and self._stale(a):
                node.replace_input_with(a, self._fresh(a, node))
                self.changed = True

    def _track(self, node: fx.Node) -> None:
        st = self.st
        if node.op == "get_attr":  # every read of one attribute is the same tensor
            first = st.attrs.setdefault(str(node.target), node)
            st.root[node] = st.root.get(first, node)
            st.stamp[node] = 0  # reads the tensor, so its value as of the latest write
            return
        parent, certain, replayable = _view_parent(node, st)
        if parent is not None and info(parent).kind == "seq" and parent not in st.parent:
            parent = None  # an item of a fresh tuple (topk's values): a storage of its own
        if parent is None:
            st.root[node] = node
            return
        r = st.root[parent]
        if not certain:  # a new storage as far as we can tell; remember where it came from
            st.root[node] = node
            st.uncertain[node] = parent
            return
        st.root[node] = r
        st.stamp[node] = st.version.get(r, 0)
        st.parent[node] = parent
        if not replayable or parent in st.opaque:
            st.opaque.add(node)

    def _module(self, node: fx.Node) -> None:
        """A leaf module with ``inplace=True`` (ReLU, Dropout): its graph copy computes out of
        place (capture gave the graph its own module objects, so the caller's are untouched)."""
        mod = submodule(self.gm, str(node.target))
        if getattr(mod, "inplace", False) is True:
            mod.inplace = False
            record(self.gm, node, f"{type(mod).__name__}(inplace=True) -> "
                   "out of place", "a later reader of the input must see the input")
            self.changed = True

    # -- writes ----------------------------------------------------------------------------
    def _write(self, node: fx.Node, write: _Write) -> None:
        st = self.st
        a = write.target
        r = st.root[a]
        self._check_writable(node, a, r)
        value = self._functional(node, write)
        if a is r or a not in st.parent:
            new_root = value
        else:
            steps, base = self._steps(a)
            with self.graph.inserting_before(node):
                new_root = self.graph.call_function(write_view, (base, value, steps))
            self._meta(new_root, node, info(r))
        st.version[r] = st.version.get(r, 0) + 1
        v = st.version[r]
        st.current[r] = new_root
        st.root[new_root] = r
        st.stamp[new_root] = v
        st.cache[(a, v)] = value
        st.cache[(r, v)] = new_root
        st.written[r] = None
        for user in list(node.users):
            user.replace_input_with(node, a)  # read the written tensor: re-derived when read
        what = _op_name(node) if node.target is not operator.setitem else "setitem"
        record(self.gm, value, f"{what} on {a.name} -> "
               f"{_op_name(value) or value.name}"
               + (f" + write_view into {r.name}" if new_root is not value else ""),
               "in-place write made explicit: later readers read the new value")
        self.graph.erase_node(node)
        self.changed = True

    def _check_writable(self, node: fx.Node, a: fx.Node, r: fx.Node) -> None:
        st = self.st
        if a in st.opaque:
            raise _unsupported(node, f"it writes '{a.name}', a view amprewrite cannot replay")
        if write_of(node, _op_name(node)) is Write.METADATA:
            raise _unsupported(node, "it changes the tensor's shape or storage, not its values")
        if r.op == "get_attr" and not _traced_constant(r):
            value = get_attr(self.gm, str(r.target), None)
            if isinstance(value, nn.Parameter) and value.is_floating_point():
                # A buffer update (running statistics, spectral_norm's power iteration) is
                # data flow like any other and copied back at the end. A Parameter is refused:
                # params='low' may store it as a low copy, and the copy back would run outside
                # the model's no_grad block, which autograd rejects for a leaf.
                where = M.source_line(node)
                raise ModelError(
                    f"{type(self.gm).__name__}.forward updates floating-point parameter "
                    f"'{r.target}' in place ({_op_name(node)}{' at ' + where if where else ''}"
                    "). amprewrite casts parameters where they are read and may store them in "
                    "low precision, so it does not capture updates of them. Move the update "
                    "out of forward (into the training step, or a hook), or keep such state in "
                    "a buffer."
                )
        src = st.uncertain.get(r)
        while src is not None:  # a symbolic maybe-view: refuse only where it could matter
            base = st.root.get(src, src)
            later = [u for n, rr in st.root.items() if rr is base for u in n.users
                     if st.order.get(u, -1) > st.order[node]]
            if base.op in ("placeholder", "get_attr") or later:
                what = (f"a {_op_name(r)} copies only when it must" if family_of(r) is not None
                        else f"'{_op_name(r)}' is an op amprewrite's registry does not know, "
                        "so whether it returns a view is unknown")
                raise _unsupported(node, f"it writes '{a.name}', which may or may not share "
                                   f"memory with '{src.name}' ({what}), and that tensor is "
                                   "read again")
            src = st.uncertain.get(base)

    def _steps(self, a: fx.Node) -> tuple[tuple, fx.Node]:
        """The view chain from ``a``'s root value to ``a``, as data for ``write_view``."""
        chain = []
        n = a
        while n in self.st.parent:
            chain.append(n)
            n = self.st.parent[n]
        steps = []
        for view in reversed(chain):
            name = _op_name(view)
            if is_conversion(view) or name == "contiguous":
                continue  # identities wherever they alias (x.float() of a float x is x)
            if name in ("reshape", "reshape_as"):
                name = name.replace("reshape", "view")  # fails loudly where it would copy
            if view.op == "call_function" and (view.target is builtins.getattr
                                               or name in _PROPERTY_OPS):
                steps.append((_PROPERTY_OPS.get(name, name), (), {}))
            elif view.op == "call_function" and alias_of(name) is Alias.VIEW and not hasattr(
                    torch.Tensor, name):
                # A view function the registry names (a library's view op): replayed by calling
                # it on the base, as a Tensor method is.
                key = view_function_key(view.target)
                if key not in VIEW_FUNCTIONS:
                    raise _unsupported(view, f"'{name}' is no view function of the registry")
                steps.append(("fn:" + key, tuple(view.args[1:]), dict(view.kwargs)))
            else:
                if not hasattr(torch.Tensor, name):
                    raise _unsupported(view, f"'{name}' has no Tensor method to replay it with")
                steps.append((name, tuple(view.args[1:]), dict(view.kwargs)))
        r = self.st.root[a]
        return tuple(steps), self.st.current.get(r, r)

    def _functional(self, node: fx.Node, write: _Write) -> fx.Node:
        """Insert the out-of-place computation of what ``node`` writes; return its node."""
        g = self.graph
        args, kwargs = node.args, dict(node.kwargs)
        a = write.target
        name = _op_name(node)
        with g.inserting_before(node):
            if write.kind == "setitem":
                value = g.call_function(setitem, tuple(args))
            elif write.kind == "operator":
                value = g.call_function(inplace_counterpart(node.target), tuple(args), kwargs)
            elif write.kind == "out":
                kwargs.pop("out")
                value = g.create_node(node.op, node.target, tuple(args), kwargs)
            elif write.kind == "flag":
                kwargs["inplace"] = False
                params = list(inspect.signature(node.target).parameters)
                if "inplace" in params and len(args) > params.index("inplace"):
                    args = tuple(args[:params.index("inplace")])
                value = g.call_function(node.target, tuple(args), kwargs)
            else:
                value = self._counterpart(node, name, args, kwargs)
        self._meta(value, node, info(a))
        if write.kind in ("operator", "method", "function", "out"):
            value = self._keep_dtype(node, value, a)
        return value

    def _counterpart(self, node: fx.Node, name: str, args: tuple, kwargs: dict) -> fx.Node:
        g = self.graph
        plain = name[:-1]
        function = function_counterpart(node.target) if node.op == "call_function" else None
        if function is not None:
            return g.call_function(function, args, kwargs)
        if write_of(node, name) is not Write.CLONE and hasattr(torch.Tensor, plain):
            return g.call_method(plain, args, kwargs)
        if name == "zero_" and not kwargs:
            return g.call_function(torch.zeros_like, (args[0],))
        if name == "fill_" and len(args) == 2 and isinstance(args[1], (int, float, bool)):
            return g.call_function(torch.full_like, (args[0], args[1]))
        # No out-of-place form with the same meaning: the same op on a private copy.
        clone = g.call_method("clone", (args[0],))
        self._meta(clone, node, info(args[0]))
        return g.create_node(node.op, node.target, (clone, *args[1:]), kwargs)

    def _keep_dtype(self, node: fx.Node, value: fx.Node, a: fx.Node) -> fx.Node:
        """In-place ops keep the written tensor's dtype; the out-of-place op may promote."""
        want = info(a).dtype
        if want is None:
            return value
        promoted = want
        for other in [*node.args[1:], *node.kwargs.values()]:
            oi = info(other) if isinstance(other, fx.Node) else None
            if oi is not None and oi.kind == "tensor" and oi.dtype is not None and oi.shape != ():
                promoted = torch.promote_types(promoted, oi.dtype)
        if promoted == want:
            return value
        value.meta[M.ORIG] = ValueInfo("tensor", promoted, info(a).numel, shape=info(a).shape)
        with self.graph.inserting_after(value):
            conv = self.graph.call_method("to", (value, want))
        self._meta(conv, node, info(a))
        return conv

    def _meta(self, new: fx.Node, like: fx.Node, value: ValueInfo) -> None:
        M.copy_provenance(like, new)
        new.meta[M.ORIG] = value

    def _epilogue(self, output: fx.Node) -> None:
        """Writes to graph inputs stay visible to the caller: copy the final value back."""
        for r in self.st.written:
            if r.op not in ("placeholder", "get_attr") or _traced_constant(r):
                continue
            final = self.st.current[r]
            with self.graph.inserting_before(output):
                back = self.graph.call_method("copy_", (r, final))
            self._meta(back, r, info(r))
            record(self.gm, back, f"copy the new value of {r.name} back",
                   "the model writes this input in place; the caller sees the write")


def _traced_constant(node: fx.Node) -> bool:
    """A tensor symbolic tracing made by running ``torch.zeros(4, 8)`` once: the model makes
    it anew on every call, so a write into it is a local value, not a state update."""
    return node.op == "get_attr" and str(node.target).startswith("_tensor_constant")


class Functionalize(Pass):
    """Rewrite in-place writes as out-of-place data flow (see the module docstring)."""

    name, kind = "functionalize", Kind.CANONICALIZE
    requires = (M.ORIG,)
    writes = (M.ORIG,)

    def run(self, gm: fx.GraphModule) -> bool:
        walk = _Functionalizer(gm)
        if not any(_write_of(n) is not None for n in gm.graph.nodes):
            return walk.modules_only()
        return walk.run()
