"""The pass protocol and the rule driver every pass is built from.

A pass is a :class:`Pass`: it declares its ``name``, its :class:`Kind`, the ``node.meta`` keys it
``requires`` and the ones it ``writes``, and is bound to the policy by ``Pass(policy)``. Its
``run(gm)`` changes the graph in place and returns whether it changed anything. The pipeline
(:func:`amprewrite.passes.run_pipeline`) checks the declarations, makes the pass current (rewrites
are recorded under its name) and lints and recompiles once at the end.

A single-node rewrite is a :class:`Rule` in a pass's ``rules`` table: the nodes it matches, and
a handler that returns a :class:`Replacement` (or None when the node is not one it rewrites).
:func:`apply_rules` finds the nodes, normalises their arguments to keywords, inserts what the
handler builds (with the replaced node's provenance), replaces the node and records the rewrite.

>>> import torch
>>> from torch import fx
>>> def relu6_to_clamp(m: Match) -> Replacement:
...     return Replacement(m.build.call(torch.clamp, m.args["input"], 0.0, 6.0),
...                        "relu6 -> clamp", "an example rule")
>>> class Relu6(RulePass):
...     name, kind = "relu6_to_clamp", Kind.REWRITE
...     rules = (Rule((torch.nn.functional.relu6,), relu6_to_clamp),)
>>> gm = fx.symbolic_trace(lambda x: torch.nn.functional.relu6(x) + 1)
>>> Relu6(None).run(gm)
True
>>> [n.target.__name__ for n in gm.graph.nodes if n.op == "call_function"]
['clamp', 'add']
"""

from __future__ import annotations

import abc
import enum
import math
import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import fx
from torch.fx.operator_schemas import get_signature_for_torch_op, normalize_function
from torch.fx.passes.infra.pass_base import PassResult

from ..graph import meta as M
from ..graph.modules import submodule
from ..precision.ops import FAMILIES, Precision, family_of
from ..precision.policy import Policy
from ..precision.report import record

__all__ = ["LOW_FLOPS", "Builder", "Kind", "Match", "Pass", "Replacement", "Rule", "RulePass",
           "apply_rules", "arguments", "new_node"]

LOW_FLOPS = 0.5
"""The share of the matmul FLOPs a plan keeps low before its values cost it more:
rescale_matmuls' goal with ``overflow="auto"``, and where paint_precision's report says the
ranges took most of the FLOPs out of the low dtype."""

# Keys capture writes on every node: available to the first pass.
CAPTURED = (M.MODULE_PATH, M.MODULE_TYPES)


class Kind(enum.Enum):
    """What a pass does to the graph (reports and renderers draw the three differently)."""

    ANALYSIS = "analysis"  # writes node.meta only
    CANONICALIZE = "canonicalize"  # the same computation spelled the one way later passes expect
    REWRITE = "rewrite"  # changes which ops run (same result, exact where claimed)


class Pass(abc.ABC):
    """One step of the pipeline. Subclasses set the class attributes and implement ``run``."""

    name: ClassVar[str]
    kind: ClassVar[Kind]
    requires: ClassVar[tuple[str, ...]] = ()
    writes: ClassVar[tuple[str, ...]] = ()

    def __init__(self, policy: Policy | None) -> None:
        self.policy = policy

    @abc.abstractmethod
    def run(self, gm: fx.GraphModule) -> bool:
        """Change ``gm`` in place; True if anything changed."""

    def __call__(self, gm: fx.GraphModule) -> PassResult:
        return PassResult(gm, bool(self.run(gm)))

    def __repr__(self) -> str:
        return f"<pass {self.name} ({self.kind.value})>"


# --- rules --------------------------------------------------------------------------------------


class Builder:
    """Makes nodes before ``anchor``, each with ``anchor``'s provenance (module path, source)."""

    def __init__(self, gm: fx.GraphModule, anchor: fx.Node):
        self.gm, self.anchor = gm, anchor
        self.made: list[fx.Node] = []

    def node(self, op: str, target: Any, args: tuple = (), kwargs: dict | None = None,
             value: M.ValueInfo | None = None) -> fx.Node:
        with self.gm.graph.inserting_before(self.anchor):
            n = new_node(self.gm.graph, op, target, args, kwargs)
        M.copy_provenance(self.anchor, n)
        if value is not None:
            n.meta[M.ORIG] = value
        self.made.append(n)
        return n

    def call(self, target: Callable, *args: Any, value: M.ValueInfo | None = None,
             **kwargs: Any) -> fx.Node:
        return self.node("call_function", target, args, kwargs, value)

    def method(self, name: str, *args: Any, value: M.ValueInfo | None = None,
               **kwargs: Any) -> fx.Node:
        return self.node("call_method", name, args, kwargs, value)


def new_node(graph: fx.Graph, op: str, target: Any, args: tuple = (),
             kwargs: dict | None = None, name: str | None = None) -> fx.Node:
    """``graph.create_node(op, target, args, kwargs, name)`` at the insertion point, with the
    arguments set after: ``create_node`` scans them with pytree for raw SymInts (~5 us of the
    ~11 a node costs), and the passes' arguments are graph nodes and plain constants."""
    n = graph.create_node(op, target, name=name)
    if args:
        n.args = args
    if kwargs:
        n.kwargs = kwargs
    return n


@dataclass
class Match:
    """A node a rule matched: ``args`` are its arguments by parameter name, defaults filled in
    (None when they cannot be normalised: then read ``node.args``), ``build`` makes nodes."""

    gm: fx.GraphModule
    node: fx.Node
    args: dict[str, Any] | None
    build: Builder
    policy: Policy | None


@dataclass(frozen=True)
class Replacement:
    """What a rule does with its node: ``value`` replaces it (a new node, or a constant that
    its users read instead); ``value is node`` keeps it (a decision written to its meta)."""

    value: Any
    action: str
    reason: str


@dataclass(frozen=True)
class Rule:
    """Nodes whose ``op`` is ``op`` and whose target is in ``targets`` (functions, method names,
    or — for ``call_module`` — module types; empty: every node of that op) go to ``handler``."""

    targets: tuple
    handler: Callable[[Match], Replacement | None]
    op: str = "call_function"
    normalize: bool = True


def _candidates(gm: fx.GraphModule, rule: Rule) -> Iterable[fx.Node]:
    graph = gm.graph
    if not rule.targets:
        return [n for n in graph.nodes if n.op == rule.op]
    if rule.op == "call_module":
        return [n for n in graph.find_nodes(op="call_module")
                if isinstance(submodule(gm, str(n.target)), rule.targets)]
    found: list[fx.Node] = []
    for target in rule.targets:
        found += graph.find_nodes(op=rule.op, target=target, sort=False)
    return sorted(found)


_CONV = {"stride", "padding", "dilation", "groups", "transposed", "output_padding"}


def matmul_operands(node: fx.Node, args: dict[str, Any] | None
                    ) -> tuple[dict[str, Any], str, str, str | None] | None:
    """A matmul call's arguments by name (``args``: :func:`arguments`), and which of them are
    the data, the weight and the bias: ``linear(input, weight, bias)``, ``addmm(input=bias,
    mat1, mat2)`` (beta = alpha = 1), ``matmul(input, other)`` / ``mm(input, mat2)``, ``x @ w``,
    a convolution ``conv2d(input, weight, bias, stride, ...)`` (and its transposed and ATen
    spellings), and their ATen overloads (``self`` for ``input``); None for other spellings."""
    if node.target is operator.matmul and len(node.args) == 2 and not node.kwargs:
        return {"input": node.args[0], "other": node.args[1]}, "input", "other", None
    if args is None:
        return None
    data = "self" if "self" in args else "input"  # an ATen overload names it self
    keys = set(args) - {data} | {"input"}
    if {"input", "weight", "bias"} <= keys and keys - {"input", "weight", "bias"} <= _CONV:
        return args, data, "weight", "bias"  # linear, or a convolution with its settings
    if keys == {"input", "mat1", "mat2", "beta", "alpha"}:
        if args["beta"] != 1 or args["alpha"] != 1:
            return None
        return args, "mat1", "mat2", data
    if keys in ({"input", "other"}, {"input", "mat2"}):
        return args, data, ("other" if "other" in keys else "mat2"), None
    return None


def matmul_flops(gm: fx.GraphModule, node: fx.Node) -> float | None:
    """The FLOPs of a matmul-like op of a LOW family (linear, addmm, matmul, bmm, conv, ...) on
    the shapes capture recorded: 2 x output elements x reduced size; None for other nodes and
    where a shape is unknown. The reduced operand, by parameter name: addmm's input is the bias
    (mat1 is reduced), a linear's or a matmul's input is."""
    # Painted: the family painting gave it (None: none); before painting, the op's own.
    fam = (FAMILIES.get(node.meta[M.FAMILY] or "") if M.FAMILY in node.meta
           else family_of(node))
    if fam is None or fam.precision != Precision.LOW or M.CAST in node.meta:
        return None
    out = M.info(node)
    args = arguments(gm, node) or {}
    first = args.get("mat1", args.get("batch1", args.get("input", args.get("self"))))
    if first is None and node.args:
        first = node.args[0]  # a builtin without a signature: operator.matmul
    shape = M.info(first).shape if isinstance(first, fx.Node) else None
    if out.numel is None or not shape:
        return None
    if fam.name in ("conv", "conv_transpose"):  # each output (input, transposed) element
        weight = args.get("weight")  # reads in-channels/groups x kernel of the weight
        wshape = M.info(weight).shape if isinstance(weight, fx.Node) else None
        if not wshape or None in wshape or len(wshape) < 2:
            return None
        # conv_tbc's weight is (kernel, in, out); the others' (out or in, channels, kernel...)
        per = (math.prod(wshape[:-1]) if "conv_tbc" in str(getattr(node.target, "__name__", ""))
               else math.prod(wshape[1:]))
        transposed = fam.name == "conv_transpose" or bool(args.get("transposed"))
        count = M.info(first).numel if transposed else out.numel
        return None if count is None else 2.0 * count * per
    return 2.0 * out.numel * (shape[-1] or 1)


def given_parameters(gm: fx.GraphModule, example_inputs: object) -> frozenset[fx.Node]:
    """The placeholders a call hands an ``nn.Parameter``: the backend's graphs take the
    module's parameters as inputs (transform's graphs read them with get_attr, and their
    placeholders are the user's inputs)."""
    given = example_inputs if isinstance(example_inputs, (tuple, list)) else ()
    holders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return frozenset(n for n, v in zip(holders, given) if isinstance(v, torch.nn.Parameter))


def arguments(gm: fx.GraphModule, node: fx.Node) -> dict[str, Any] | None:
    """The arguments of a call by parameter name, defaults filled in; a method call
    ``x.index_select(0, i)`` binds like ``torch.index_select(x, 0, i)``. None when they cannot
    be bound (a builtin without a signature, an overload the arguments do not pick).
    Overloads that differ only by a ``str`` parameter (``conv2d``'s ``padding="same"`` or a
    list) are told apart by the value given: torch's normalisation calls them ambiguous."""
    if node.op == "call_function":
        fn = node.target
    elif node.op == "call_method" and callable(getattr(torch, str(node.target), None)):
        fn = getattr(torch, str(node.target))
    else:
        return None
    try:
        if node.op == "call_function":
            pair = node.normalized_arguments(gm, normalize_to_only_use_kwargs=True)
        else:
            pair = normalize_function(fn, node.args, node.kwargs,
                                      normalize_to_only_use_kwargs=True)
    except Exception:
        pair = None
    return _by_str_parameter(fn, node.args, node.kwargs) if pair is None else dict(pair.kwargs)


def _by_str_parameter(fn: object, args: tuple, kwargs: dict) -> dict[str, Any] | None:
    """The one signature of ``fn`` the arguments bind to where a parameter declared ``str``
    gets a str and no other parameter does (defaults filled in), else None."""
    try:
        signatures = get_signature_for_torch_op(fn) or []
    except Exception:
        return None
    found = []
    for sig in signatures:
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError:
            continue
        if all((sig.parameters[k].annotation is str) == isinstance(v, str)
               for k, v in bound.arguments.items()):
            bound.apply_defaults()
            found.append(dict(bound.arguments))
    return found[0] if len(found) == 1 else None


def apply_rules(gm: fx.GraphModule, rules: Iterable[Rule], policy: Policy | None = None,
                record_now: bool = True) -> list[tuple[fx.Node, Replacement]]:
    """Apply each rule to every node it matches, in graph order. Returns what was done, as
    (the node the rewrite is recorded on, replacement); with ``record_now=False`` the caller
    records them (a pass whose later steps may consume the rewritten nodes)."""
    done_all: list[tuple[fx.Node, Replacement]] = []
    for rule in rules:
        for node in M.each_node_of(_candidates(gm, rule)):
            args = arguments(gm, node) if rule.normalize else None
            build = Builder(gm, node)
            done = rule.handler(Match(gm, node, args, build, policy))
            if done is None:
                for n in reversed(build.made):  # a handler that gave up leaves nothing behind
                    gm.graph.erase_node(n)
                continue
            new = done.value
            on = new if isinstance(new, fx.Node) else node
            if record_now:
                record(gm, on, done.action, done.reason)
            done_all.append((on, done))
            if new is node:
                continue
            if isinstance(new, fx.Node):
                if M.ORIG not in new.meta and M.ORIG in node.meta:
                    new.meta[M.ORIG] = node.meta[M.ORIG]
                node.replace_all_uses_with(new)
            else:
                _substitute(node, new)
            gm.graph.erase_node(node)
    return done_all


def _substitute(node: fx.Node, constant: Any) -> None:
    """Every user of ``node`` reads ``constant`` instead."""
    def swap(a: fx.Node) -> Any:
        return constant if a is node else a

    for user in list(node.users):
        user.args = fx.node.map_arg(user.args, swap)
        user.kwargs = fx.node.map_arg(user.kwargs, swap)


class RulePass(Pass):
    """A pass that is its rule table."""

    rules: ClassVar[tuple[Rule, ...]] = ()

    def run(self, gm: fx.GraphModule) -> bool:
        return bool(apply_rules(gm, self.rules, self.policy))
