"""torch.fx's code generation, the same source byte for byte, in a quarter of the time.

A transform ends with one ``GraphModule.recompile()``: fx writes the graph as the Python source
of ``forward`` (``Graph.python_code``) and CPython compiles it. At 20,000 nodes fx's writer took
~25 us a node, as long as all the passes before it together: it renames every node through a
context manager that sets two attributes per node, formats each argument through a chain of
``isinstance`` tests, and finds its line map again by a regular expression over every line.

:func:`python_code` writes the same source (the same names, from fx's own ``_Namespace`` asked
in the same order; the same globals, line map and prologue) for the nodes and arguments
amprewrite's graphs hold: plain constants, tuples, lists, slices, dtypes, enums, OpOverloads.
Anything else -- a type annotation, a dict argument, a torch whose fx writes differently --
goes to fx itself, for the whole graph: the result is fx's either way. Once per process it
checks itself against fx on a graph with every node kind and every argument kind it handles,
and stays off if the two differ. With ``check(True)`` (the test suite sets it) every graph is
generated both ways and compared.

>>> import torch
>>> from torch import fx
>>> gm = fx.symbolic_trace(lambda x: torch.relu(x) + 1)
>>> python_code(gm.graph).src == gm.graph.python_code(root_module="self").src
True
"""

from __future__ import annotations

import contextlib
import enum
import functools
import inspect
import operator
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import fx
from torch.fx import graph as _fxg
from torch.fx.node import _get_qualified_name

__all__ = ["check", "fast_python_code", "lint", "python_code", "recompile", "refresh"]

# fx's own pieces, so names and spellings stay fx's; absent in some torch: fx then writes.
try:
    _Namespace = _fxg._Namespace
    _custom_builtins = _fxg._custom_builtins
    _format_target = _fxg._format_target
    _is_from_torch = _fxg._is_from_torch
    _magic = _fxg.magic_methods
    _inplace = _fxg.inplace_methods
    _PythonCode = _fxg.PythonCode
    _CodeGen = _fxg.CodeGen
    _PyTreeCodeGen = _fxg._PyTreeCodeGen
    _immutable_list = fx.immutable_collections.immutable_list
    _AVAILABLE = True
except AttributeError:  # pragma: no cover - a torch whose fx is laid out differently
    _AVAILABLE = False

# Constants fx writes as ``repr(value)`` (its last case): exact types only, so a subclass
# (an IntEnum, a namedtuple) takes fx's own path.
_PLAIN = frozenset({int, float, bool, str, type(None), type(...), torch.dtype, torch.device,
                    torch.layout, torch.memory_format})
_OPS = (torch._ops.OpOverload, torch._ops.HigherOrderOperator)
_ENV = ("FX_GRAPH_SHOW_STRIDE", "FX_GRAPH_SHOW_DEVICE", "FX_GRAPH_SHOW_META")
_state = {"ok": None, "check": False}  # ok: None until the self-check has run


class _Unhandled(Exception):
    """Something this writer does not spell as fx would: fx writes the graph."""


def check(on: bool = True) -> None:
    """Generate every graph both ways and raise if they differ (for tests)."""
    _state["check"] = on


def python_code(graph: fx.Graph, root_module: str = "self", **options: Any) -> _fxg.PythonCode:
    """``graph.python_code(root_module, **options)``, written fast where it can be."""
    if options.get("record_func") is False:
        options = {k: v for k, v in options.items() if k != "record_func"}
    fx_code = functools.partial(fx.Graph.python_code, graph, root_module, **options)
    if options or not _enabled() or any(os.environ.get(k, "0") == "1" for k in _ENV):
        return fx_code()
    try:
        code = _generate(graph, root_module)
    except Exception:  # _Unhandled, or a graph fx itself would refuse: fx's answer
        return fx_code()
    if _state["check"]:
        _compare(code, fx_code(), graph)
    return code


@contextlib.contextmanager
def fast_python_code(graph: fx.Graph) -> Iterator[None]:
    """Within: ``graph.python_code``, which ``GraphModule.recompile`` calls, is
    :func:`python_code`."""
    graph.python_code = functools.partial(python_code, graph)  # type: ignore[method-assign]
    try:
        yield
    finally:
        del graph.python_code


def recompile(gm: fx.GraphModule) -> _fxg.PythonCode:
    """``gm.recompile()`` with the source written by :func:`python_code`."""
    with fast_python_code(gm.graph):
        return gm.recompile()


def refresh(gm: fx.GraphModule) -> None:
    """:func:`lint` ``gm``'s graph, then :func:`recompile` it: what a changed graph needs
    before its module runs."""
    lint(gm.graph)
    recompile(gm)


def lint(graph: fx.Graph) -> None:
    """``graph.lint()``: the same checks (each node this graph's and in its lookup table, known
    op, unique name, arguments defined before use, call targets callable, attribute and module
    paths present on the owning module), each module path resolved once for all the paths
    under it. A graph that fails is handed to fx's lint, which raises its own message."""
    if not _lint_ok(graph):
        graph.lint()


def _lint_ok(graph: fx.Graph) -> bool:
    table = getattr(graph, "_find_nodes_lookup_table", None)
    if table is None:
        return False
    seen: set[fx.Node] = set()
    names: set[str] = set()
    for node in graph.nodes:
        if node.op not in _fxg._legal_ops or node.graph is not graph or node not in table:
            return False
        if not seen.issuperset(node._input_nodes):  # another graph's node is not in seen
            return False
        seen.add(node)
        if node.name in names:
            return False
        names.add(node.name)
    root = graph.owning_module
    if not root:
        return True
    # path -> (the object there, whether it and every object on the way is a module)
    found: dict[str, tuple[Any, bool]] = {"": (root, True)}

    def resolve(path: str) -> tuple[Any, bool]:
        if path in found:
            return found[path]
        parent_path, _, atom = path.rpartition(".")
        parent, modules = resolve(parent_path)
        value = None if parent is None else getattr(parent, atom, None)
        found[path] = (value, modules and isinstance(value, torch.nn.Module))
        return found[path]

    for node in graph.nodes:
        op, target = node.op, node.target
        if op == "call_function":
            if not callable(target):
                return False
            continue
        if not isinstance(target, str):
            return False
        if op == "get_attr" or op == "call_module":
            value, modules = resolve(target) if target else (None, False)
            if value is None or (op == "call_module" and not modules):
                return False
    return True


def _enabled() -> bool:
    if _state["ok"] is None:
        _state["ok"] = _AVAILABLE and _self_check()
    return bool(_state["ok"])


def _compare(fast: _fxg.PythonCode, slow: _fxg.PythonCode, graph: fx.Graph) -> None:
    same = (fast.src == slow.src and fast._lineno_map == slow._lineno_map
            and fast._prologue_start == slow._prologue_start
            and fast.globals.keys() == slow.globals.keys()
            and all(fast.globals[k] is slow.globals[k] for k in slow.globals))
    if not same:
        raise AssertionError(f"amprewrite.graph.codegen wrote a graph differently from torch.fx:\n"
                             f"--- fx\n{slow.src}\n--- amprewrite\n{fast.src}")


@functools.cache
def _takes_repr_fn(cls: type) -> bool:
    return "repr_fn" in inspect.signature(cls.generate_output).parameters


def _generate(graph: fx.Graph, root_module: str) -> _fxg.PythonCode:
    """fx's ``CodeGen._gen_python_code`` with its defaults (not verbose, no colours, no
    record_func), for the nodes and constants named in the module docstring."""
    codegen = graph._codegen
    if type(codegen) not in (_CodeGen, _PyTreeCodeGen) or codegen._body_transformer:
        raise _Unhandled("a codegen of its own")
    if not _takes_repr_fn(type(codegen)):
        raise _Unhandled("an fx whose generate_output prints nodes by their repr")
    namespace = _Namespace()
    create_name = namespace.create_name
    globals_: dict[str, Any] = {}
    names: dict[fx.Node, str] = {}

    def add_global(hint: str, obj: Any) -> str:
        if _is_from_torch(obj) and obj != torch.device:
            return _get_qualified_name(obj)
        name = create_name(hint, obj)
        if name in globals_:
            if globals_[name] is not obj:
                raise _Unhandled("one global name for two objects")
            return name
        globals_[name] = obj
        return name

    for hint, (_, obj) in _custom_builtins.items():
        add_global(hint, obj)
    callee: dict[Any, str] = {}  # a call's target -> its global name, asked once

    def global_of(target: Any) -> str:
        try:
            return callee[target]
        except KeyError:
            name = callee[target] = add_global(_get_qualified_name(target), target)
            return name

    def rep(a: Any) -> str:
        t = type(a)
        if t is fx.Node:
            return names[a]
        if t in _PLAIN:
            return repr(a)
        if t is tuple or t is torch.Size:
            return f"({rep(a[0])},)" if len(a) == 1 else "(" + ", ".join(map(rep, a)) + ")"
        if t is list or t is _immutable_list:
            return "[" + ", ".join(map(rep, a)) + "]"
        if t is slice:
            return f"slice({rep(a.start)}, {rep(a.stop)}, {rep(a.step)})"
        if isinstance(a, _OPS):
            return add_global(_get_qualified_name(a), a)
        if isinstance(a, enum.Enum) and not isinstance(a, (tuple, torch.Tensor)):
            return f"{add_global(type(a).__name__, type(a))}.{a.name}"
        raise _Unhandled(f"an argument of type {t.__name__}")

    def call_args(args: tuple, kwargs: dict) -> str:
        out = [rep(a) for a in args]
        out += [f"{k} = {rep(v)}" for k, v in kwargs.items()]
        return ", ".join(out)

    nodes = list(graph.nodes)
    if not nodes:
        raise _Unhandled("an empty graph")
    # The last use of each value, found as fx finds it (walking back), in the same order:
    # the names a line sets to None after it.
    last_use: dict[fx.Node, fx.Node] = {}
    dies_after: dict[fx.Node, list[fx.Node]] = {}
    for node in reversed(nodes):
        for arg in node._input_nodes:
            if arg not in last_use:
                last_use[arg] = node
                dies_after.setdefault(node, []).append(arg)

    free_vars: list[str] = []
    wrapped: dict[str, None] = {}
    texts: list[str] = []
    for node in nodes:
        if node.type is not None:
            raise _Unhandled("a type annotation")
        op, target, args = node.op, node.target, node.args
        if op == "placeholder":
            default = f" = {rep(args[0])}" if args else ""
            free_vars.append(f"{target}{default}")
            name = names[node] = create_name(node.name, node)
            raw = target.replace("*", "")
            texts.append(f"{name} = {raw}\n" if raw != name else "")
            continue
        if op == "output":
            texts.append(codegen.generate_output(args[0], repr_fn=rep) + "\n")
            continue
        if op == "call_function":
            module = getattr(target, "__module__", "")
            if module == "_operator" and target.__name__ in _magic:
                name = names[node] = create_name(node.name, node)
                line = f"{name} = {_magic[target.__name__].format(*map(rep, args))}"
            elif module == "_operator" and target.__name__ in _inplace:
                raise _Unhandled("an in-place operator")
            else:
                fn = global_of(target)
                name = names[node] = create_name(node.name, node)
                if (fn == "getattr" and isinstance(args[1], str) and args[1].isidentifier()
                        and len(args) == 2):
                    line = f"{name} = {_format_target(rep(args[0]), args[1])}"
                else:
                    line = f"{name} = {fn}({call_args(args, node.kwargs)})"
                    if node.meta.get("is_wrapped", False):
                        wrapped.setdefault(fn)
        elif op == "call_method":
            name = names[node] = create_name(node.name, node)
            line = (f"{name} = {_format_target(rep(args[0]), target)}"
                    f"({call_args(args[1:], node.kwargs)})")
        elif op == "call_module":
            name = names[node] = create_name(node.name, node)
            line = f"{name} = {_format_target(root_module, target)}({call_args(args, node.kwargs)})"
        elif op == "get_attr":
            name = names[node] = create_name(node.name, node)
            line = f"{name} = {_format_target(root_module, target)}"
        else:
            raise _Unhandled(f"op {op}")
        dead = dies_after.get(node, [])
        if not node.users:
            dead = [*dead, node]
        if dead:
            line += ";  " + " = ".join([names[n] for n in dead]) + " = None"
        texts.append(line + "\n")

    wrap_stmts = ""
    if wrapped:
        wrap = add_global("wrap", torch.fx.wrap)
        wrap_stmts = "\n".join(f'{wrap}("{name}")' for name in wrapped)
    for hint, value in codegen.additional_globals():
        add_global(hint, value)
    prologue = codegen.gen_fn_def(free_vars, "")

    # fx numbers the lines of the body after the prologue: line -> index of the node that
    # wrote it (the body's last, empty line belongs to the last node).
    first = prologue.count("\n") + 1
    lineno_map: dict[int, int | None] = {}
    lines: list[str] = []
    for i, text in enumerate(texts):
        if text:
            for line in text.split("\n")[:-1]:
                lineno_map[len(lines) + first] = i
                lines.append(line)
    lineno_map[len(lines) + first] = len(texts) - 1 if texts else None
    lines.append("")
    code = "\n".join(lines).lstrip("\n")
    code = "\n".join("    " + line for line in code.split("\n"))
    src = f"\n{wrap_stmts}\n\n{prologue}\n{code}"
    return _PythonCode(src, globals_, _lineno_map=lineno_map,
                       _prologue_start=wrap_stmts.count("\n") + 4)


class _Colour(enum.Enum):
    RED = 1


def _self_check() -> bool:
    """Does this writer spell, on this torch, a graph with every node and argument kind it
    handles exactly as fx does?"""
    graph = fx.Graph()
    x = graph.placeholder("x")
    y = graph.placeholder("y", default_value=2)
    w = graph.get_attr("layers.0.weight")
    m = graph.call_module("layers.0", (x,))
    a = graph.call_function(operator.add, (m, w))
    b = graph.call_function(torch.nn.functional.linear, (a, w), {"bias": None})
    c = graph.call_method("to", (b, torch.bfloat16))
    d = graph.call_function(operator.getitem, (c, (slice(None, 2, None), ..., None)))
    e = graph.call_function(getattr, (d, "shape"))
    f = graph.call_function(torch.ops.aten.sum.dim_IntList, ([d, e], [0, 1], True))
    g = graph.call_function(_check_fn, (f, _Colour.RED, (1.5,), torch.device("cpu")))
    g.meta["is_wrapped"] = True
    graph.call_function(_check_fn, (g, y))  # unused: deleted at once
    h = graph.call_function(operator.mul, (g, y))
    graph.output((h, [d], c))
    try:
        fast = _generate(graph, "self")
        slow = fx.Graph.python_code(graph, "self")
        _compare(fast, slow, graph)
    except Exception:
        return False
    return True


def _check_fn(*args: Any) -> Any:  # a function outside torch, for the self-check's graph
    return args


_check_fn.__module__ = __name__
