"""One plan for every block, every rank and every step (DESIGN.md, "One plan at scale").

The ``torch.compile`` backend plans a graph from the call dynamo compiles it on. Three things
make that one call too little where large models are trained:

- **Blocks.** Compiled per block, the blocks of one class share one graph: dynamo compiles
  block 0's call and reuses the code for every other block, whose parameters are the graph's
  inputs. A :class:`GraphPlan` (what the backend returns to dynamo) notices parameters it has
  not planned with, records that call's value ranges once and, where they outgrow the plan,
  plans again with the widest ranges and recompiles. Later calls cost a tuple of ``id``\\ s.
- **Ranks.** Under ``torch.distributed`` every rank records its own batch. The ranges are
  widened across ranks (:func:`across_ranks`, the largest magnitude of each value) before a plan
  is fixed, so every rank compiles the same graph.
- **Steps.** A forward that overflows in fp16 training makes :class:`amprewrite.GradScaler`
  (``found_inf``) mark every plan stale: each block's next call records its ranges again and
  plans again if they grew, where ``torch.amp.GradScaler`` alone would skip every later step.

What each graph's plan was made from, and every re-plan with its reason, is in
``amprewrite.report(compiled_model)`` (:class:`CompiledReport`).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
from torch import fx, nn

from ..errors import DistributedError
from ..graph.meta import CAST, FLOAT8, FP8_ERRORS_KEY, RANGES_KEY, REPORT_KEY
from ..graph.runtime import no_enclosing_autocast
from ..precision.ranges import (
    TINY_SHARE,
    ValueRange,
    describe_limit,
    narrower_than_fp32,
    range_limit,
    widest,
)
from ..precision.report import COMPILED_LOOKUPS, CompiledReport, GraphReport, PlanEvent, Report

__all__ = ["CompiledReport", "GraphPlan", "GraphReport", "PlanEvent", "across_ranks",
           "communicates", "compiled_report", "copy_graph", "count_step", "distributed",
           "float8_parameters", "fsdp_params", "mark_overflow", "outgrown", "plans_of",
           "plans_version", "spmd_call", "this_rank"]


def copy_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """A GraphModule with a copy of ``gm``'s graph (names and meta kept, meta dicts copied) and of
    every subgraph it calls (checkpointed regions), sharing ``gm``'s other attributes: the passes
    rewrite graphs in place, and a plan made again starts from the graph dynamo captured."""
    graph = fx.Graph(tracer_cls=gm.graph._tracer_cls)
    graph._codegen = gm.graph._codegen
    out = graph.graph_copy(gm.graph, {})
    old_output = next(iter(gm.graph.find_nodes(op="output")))
    graph.output(out, type_expr=old_output.type).meta = dict(old_output.meta)
    new = fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    new.meta.update({k: v for k, v in gm.meta.items() if k != REPORT_KEY})
    for name, sub in gm.named_children():
        if isinstance(sub, fx.GraphModule):
            setattr(new, name, copy_graph(sub))
    return new


def distributed() -> bool:
    """Is this process one of several ranks of an initialised ``torch.distributed``?"""
    return (torch.distributed.is_available() and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() > 1)


def this_rank(values: dict[str, object],
              combine: Callable[[object, object], object] = widest) -> dict[str, object]:
    """:func:`across_ranks` for a call that need not run on every rank: ``values`` as they are."""
    del combine
    return values


def spmd_call(module: nn.Module | None) -> bool:
    """Whether this call is one every rank makes (so a collective may widen its values): a
    training forward, gradients on and the module in train mode, under ``torch.distributed``.
    An evaluation, sampling or logging forward (``model.eval()`` or ``torch.no_grad()``) may run
    on some ranks only (rank 0 evaluates while the others wait at a barrier), and a collective
    there would wait for the process group's whole timeout: it plans from this rank's values."""
    return (distributed() and torch.is_grad_enabled()
            and (module is None or bool(module.training)))


def communicates(gm: fx.GraphModule, example_inputs: Sequence[object] = ()) -> bool:
    """Whether the graph holds a collective: a DTensor among its inputs or values (tensor
    parallel: its ops redistribute shards), or a call of ``torch.distributed``. Every rank
    runs such a graph at the same point, in evaluation too (its collectives would wait for
    the others otherwise), so its plan is made from every rank's values: one collective's
    input in one dtype on every rank."""
    def dtensor(v: object) -> bool:  # as record_ranges and float8_linears tell one
        return isinstance(v, torch.Tensor) and hasattr(v, "to_local")

    if any(dtensor(v) for v in example_inputs):
        return True
    for n in gm.graph.nodes:
        if dtensor(n.meta.get("example_value", n.meta.get("val"))):
            return True
        if n.op != "call_function":
            continue
        module = getattr(n.target, "__module__", "") or ""
        space = getattr(n.target, "namespace", "")  # a torch.ops overload's
        if module.startswith("torch.distributed") or space in ("_c10d_functional", "c10d"):
            return True
    return False


def across_ranks(values: dict[str, object],
                combine: Callable[[object, object], object] = widest) -> dict[str, object]:
    """``values`` by node name widened over every rank with ``combine(a_or_None, b)`` (ranges:
    :func:`amprewrite.precision.ranges.widest`, the largest magnitude and subnormal share of each
    value; float8 errors: the worse pair), or as they are outside ``torch.distributed``.

    A collective: every rank calls it at the same point, as every rank compiles the same graph
    at the same call under SPMD training."""
    if not distributed():
        return values
    _every_rank_arrives()
    gathered: list[dict | None] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, values)
    out: dict[str, object] = {}
    for rank_values in gathered:
        for name, v in (rank_values or {}).items():
            out[name] = combine(out.get(name), v)
    return out


# How long a rank that plans a training forward waits for every other rank to reach the same
# plan before it says they are not compiling (seconds; AMPREWRITE_RANK_WAIT_S overrides it).
RANK_WAIT_S = 30.0
_ARRIVALS = itertools.count()  # this process's across_ranks calls: the n-th on every rank


def _every_rank_arrives() -> None:
    """Return once every rank has reached this process's n-th :func:`across_ranks` call, or
    raise :class:`~amprewrite.errors.DistributedError` after ``RANK_WAIT_S`` seconds.

    The ranks meet through the process group's store, with a bounded wait: at the collective
    itself (``all_gather_object``) a training forward that only some ranks run (rank 0
    sampling in train mode with gradients on while the others wait at a barrier) waited for
    the group's whole timeout (torch's default 10-30 minutes), then failed without saying why
    (issue 65)."""
    dist = torch.distributed
    store = dist.distributed_c10d._get_default_store()
    rank, world, call = dist.get_rank(), dist.get_world_size(), next(_ARRIVALS)
    keys = [f"amprewrite/spmd/{call}/{r}" for r in range(world)]
    store.set(keys[rank], "1")
    wait = float(os.environ.get("AMPREWRITE_RANK_WAIT_S", RANK_WAIT_S))
    try:
        store.wait(keys, timedelta(seconds=wait))
    except (RuntimeError, TimeoutError):  # the store's timeout (DistStoreError)
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        raise DistributedError(
            f"amprewrite: rank {rank} is compiling a graph whose plan widens its values across "
            "every rank (a training forward: gradients on, the module in train mode; or, in any "
            f"mode, a graph that holds collectives, as tensor parallel's do), and rank(s) "
            f"{missing} did not reach the same compile within {wait:g} s: a forward that only "
            "some ranks run would wait there for the process group's timeout. Run such forwards "
            "on every rank, or under torch.no_grad() (or model.eval()), which plan a graph "
            "without collectives from this rank's values alone (docs/guide.md, \"Evaluating or "
            "sampling on rank 0\"). Ranks that only compile at different speeds: set "
            "AMPREWRITE_RANK_WAIT_S to a longer wait.") from None


def _excess(r: ValueRange, low: torch.dtype) -> int:
    """By how many powers of two ``r`` passes the range limit of ``low`` (0: within it)."""
    if r.absmax <= range_limit(low):
        return 0
    return max(1, math.ceil(math.log2(r.absmax / range_limit(low))))


def outgrown(planned: Mapping[str, ValueRange], seen: Mapping[str, ValueRange],
             low: torch.dtype, params: frozenset[str] = frozenset()) -> list[str]:
    """Why a plan made from ``planned`` ranges does not hold for ``seen`` (empty: it holds).

    A value outgrows the plan when it passes the limit by a larger power of two than planned
    (the limit itself, or a rescaled matmul's scale); a parameter (``params``: node names) when
    fp16 would store most of it subnormal where the planned one was not.

    >>> low = torch.float16
    >>> outgrown({"fc1": ValueRange(100.0)}, {"fc1": ValueRange(3e5)}, low)
    ['fc1: |x| up to 3e+05 > fp16 max 65504 / headroom 16 (planned for 100)']
    >>> outgrown({"fc1": ValueRange(5e3)}, {"fc1": ValueRange(6e3)}, low)
    []
    """
    out = []
    for name, r in seen.items():
        old = planned.get(name)
        if _excess(r, low) > (_excess(old, low) if old is not None else 0):
            was = f" (planned for {old.absmax:.3g})" if old is not None else ""
            out.append(f"{name}: |x| up to {r.absmax:.3g} > {describe_limit(low)}{was}")
        elif name in params and r.tiny_share > TINY_SHARE and (
                old is None or old.tiny_share <= TINY_SHARE):
            out.append(f"{name}: {r.tiny_share:.0%} of its nonzero values are subnormal in "
                       f"{low}")
    return out


# Every live plan, for mark_overflow and report(model).
_PLANS: weakref.WeakSet[GraphPlan] = weakref.WeakSet()
_STEP: list[int | None] = [None]  # optimizer steps amprewrite.GradScaler.update has seen
_VERSION: list[int] = [0]  # bumped by every plan event: which plan serves which block changed
_FLOAT8_SEEN: list = [-1, frozenset()]  # float8_parameters() at a version


def count_step() -> None:
    """One optimizer step is done (:meth:`amprewrite.GradScaler.update`)."""
    _STEP[0] = (_STEP[0] or 0) + 1


def mark_overflow() -> None:
    """A training forward overflowed: every plan records its ranges again on the next call of
    each of its blocks (and plans again where they grew). :class:`amprewrite.GradScaler` calls
    it when ``found_inf``; call it yourself after a non-finite loss without one."""
    for plan in list(_PLANS):
        plan.seen.clear()
        plan.stale = "a training forward overflowed (GradScaler found inf)"


def _step() -> int | None:
    return _STEP[0]


# How many plans one graph may keep for blocks whose values differ (each a compile); past it,
# the last plan is widened to hold for the new block too.
MAX_PLANS = 4


@dataclass
class _Plan:
    """One plan of a graph: the transformed graph, its compiled callable, the ranges it holds
    for (by node name)."""

    gm: fx.GraphModule
    fn: Callable
    ranges: dict[str, ValueRange]


class GraphPlan:
    """The callable the backend gives dynamo for one captured graph: the planned graph compiled
    by the inner backend, and what it takes to plan again (DESIGN.md, "One plan at scale").

    ``plan(gm, values, prior, fp8_prior) -> gm`` transforms a copy of the captured graph on a
    call's values with ranges and float8 errors by node name the plan must also hold for;
    ``compile(gm, example_inputs)`` is the inner backend (``example_inputs`` as dynamo gave
    them, symbolic sizes included; ``values``: the same with each size's value on that call).

    With ``watch`` (fp16: where values decide the plan), a call whose parameters (the inputs at
    ``params``: a block) the graph has not seen records its ranges first, and runs on the first
    plan they fit in (:func:`outgrown` says none). A block that fits in none gets a plan of its
    own, made from its ranges: the blocks whose values stay small keep their plan, where one
    plan widened for all would keep every block's matmul out of fp16 for one block's sake. At
    most :data:`MAX_PLANS`; past that the last plan is widened. Later calls cost a dict lookup.
    """

    def __init__(self, captured: fx.GraphModule, example_inputs: Sequence[object],
                 values: Sequence[object], low: torch.dtype, plan: Callable[..., fx.GraphModule],
                 compile: Callable[[fx.GraphModule, list], Callable], watch: bool,
                 fp8: bool = False, reduce: Callable[..., dict] = across_ranks):
        self.fp32 = copy_graph(captured)
        # across_ranks where every rank makes this graph's calls (SPMD training), else
        # this_rank (an evaluation on rank 0): see spmd_call.
        self.reduce = reduce
        self.low, self._plan, self._compile = low, plan, compile
        self.params = [i for i, v in enumerate(example_inputs) if isinstance(v, nn.Parameter)]
        self.param_names = frozenset(
            n.name for n, v in zip(captured.graph.find_nodes(op="placeholder"), example_inputs)
            if isinstance(v, nn.Parameter))
        self.example_inputs = list(example_inputs)  # what the inner backend compiles on
        self.context = _tracing_context()
        self.watch = watch
        self.fp8 = fp8  # float8 verdicts are checked on every block too
        self.ranged = narrower_than_fp32(low)  # ranges decide the plan (fp16)
        self.calls = 0
        self.events: list[PlanEvent] = []
        self._event_keys: list[tuple[int, ...]] = []
        self.blocks: dict[tuple[int, ...], list[weakref.ref]] = {}
        self.block_ranges: dict[tuple[int, ...], dict[str, ValueRange]] = {}
        self.assigned: dict[tuple[int, ...], _Plan] = {}
        self.seen: set[tuple[int, ...]] = set()
        self.stale: str | None = None
        self.ranks = (torch.distributed.get_world_size()
                      if distributed() and reduce is across_ranks else 1)
        gm = plan(captured, tuple(values), None, None)
        self.fp8_errors: dict[str, tuple[float, float]] = dict(gm.meta.get(FP8_ERRORS_KEY, {}))
        first = _Plan(gm, compile(gm, self.example_inputs), dict(gm.meta.get(RANGES_KEY, {})))
        self.plans = [first]
        key = self._key(example_inputs)
        self._saw(key, example_inputs)
        self.block_ranges[key] = dict(first.ranges)
        self.assigned[key] = first
        self._event(key, "the call dynamo compiled the graph on", True)
        _PLANS.add(self)

    @property
    def gm(self) -> fx.GraphModule:
        """The first plan's graph."""
        return self.plans[0].gm

    @property
    def report(self) -> Report:
        return self.gm.meta[REPORT_KEY]

    def _key(self, args: Sequence[object]) -> tuple[int, ...]:
        return tuple(id(args[i]) for i in self.params)

    def _saw(self, key: tuple[int, ...], args: Sequence[object]) -> None:
        self.seen.add(key)
        if key not in self.blocks:
            self.blocks[key] = [weakref.ref(args[i]) for i in self.params]

    def _event(self, key: tuple[int, ...], reason: str, replanned: bool) -> None:
        _VERSION[0] += 1
        self.events.append(PlanEvent(self.calls, _step(), reason, replanned))
        self._event_keys.append(key)

    def __call__(self, *args: object) -> object:
        key = self._key(args)
        if key not in self.seen:
            if self.watch:
                self._observe(key, args)
            else:  # one plan serves every block: only which blocks ran is kept (the report)
                self._saw(key, args)
                self.assigned[key] = self.plans[0]
        self.calls += 1
        return self.assigned[key].fn(*args)

    def _observe(self, key: tuple[int, ...], args: Sequence[object]) -> None:
        """Record this call's ranges (fp16) and float8 errors (fp8); run it on a plan they fit
        in, or plan for them."""
        why = ("new parameters (another block)" if key not in self.blocks
               else self.stale or "recorded again")
        self._saw(key, args)
        with no_enclosing_autocast():  # the fp32 graph's ranges are fp32's, in a trainer too
            if self.ranged:
                self._fit_ranges(key, args, why)
            else:
                self.assigned.setdefault(key, self.plans[0])
            if self.fp8:
                self._check_fp8(key, args, why)

    def _fit_ranges(self, key: tuple[int, ...], args: Sequence[object], why: str) -> None:
        from ..passes.record_ranges import by_name, record_ranges

        with torch.no_grad():
            seen = self.reduce(by_name(record_ranges(self.fp32, [tuple(args)], self.low),
                                       self.fp32))
        ranges = dict(self.block_ranges.get(key, {}))
        for name, r in seen.items():
            ranges[name] = widest(ranges.get(name), r)
        self.block_ranges[key] = ranges
        current = self.assigned.get(key)
        if current is not None and not outgrown(current.ranges, ranges, self.low,
                                                self.param_names):
            self._event(key, f"{why}: within its plan", False)
            return
        for k, plan in enumerate(self.plans):
            if not outgrown(plan.ranges, ranges, self.low, self.param_names):
                self.assigned[key] = plan
                self._event(key, f"{why}: within plan {k}", False)
                return
        grown = outgrown((current or self.plans[0]).ranges, ranges, self.low, self.param_names)
        shown = "; ".join(grown[:3]) + (f"; and {len(grown) - 3} more" if len(grown) > 3 else "")
        if len(self.plans) < MAX_PLANS:
            plan = self._make(args, ranges)
            self.plans.append(plan)
            self._event(key, f"{why}: {shown}; plan {len(self.plans) - 1} made for it", True)
        else:  # widen the last plan: every block it serves runs the wider one
            plan = self.plans[-1]
            wider = dict(plan.ranges)
            for name, r in ranges.items():
                wider[name] = widest(wider.get(name), r)
            made = self._make(args, wider)
            plan.gm, plan.fn, plan.ranges = made.gm, made.fn, made.ranges
            self._event(key, f"{why}: {shown}; plan {len(self.plans) - 1} widened for it", True)
        self.assigned[key] = plan

    def _check_fp8(self, key: tuple[int, ...], args: Sequence[object], why: str) -> None:
        """Measure this block's float8 errors (a plan made on its call, with every earlier
        block's errors); where the worse errors turn a float8 linear to bf16, every plan is
        made again with them."""
        plan = self.assigned[key]
        trial = self._plan(copy_graph(self.fp32), tuple(args), plan.ranges or None,
                           self.fp8_errors)
        self.fp8_errors = dict(trial.meta.get(FP8_ERRORS_KEY, self.fp8_errors))
        before, after = _float8_nodes(plan.gm), _float8_nodes(trial)
        if before == after:
            self._event(key, f"{why}: float8 verdicts hold", False)
            return
        turned = sorted(before - after)
        for other in self.plans:  # the trial is this block's plan made again; the rest anew
            made = (self._compiled(trial, other.ranges) if other is plan
                    else self._make(args, other.ranges))
            other.gm, other.fn, other.ranges = made.gm, made.fn, made.ranges
        self._event(key, f"{why}: float8 error on this call turns {', '.join(turned)} to bf16 "
                         "in every plan", True)

    def _make(self, args: Sequence[object], ranges: dict[str, ValueRange]) -> _Plan:
        """A plan made on this call's values for ``ranges``, compiled."""
        gm = self._plan(copy_graph(self.fp32), tuple(args), ranges or None, self.fp8_errors)
        return self._compiled(gm, ranges)

    def _compiled(self, gm: fx.GraphModule, ranges: dict[str, ValueRange]) -> _Plan:
        with _tracing(self.context):
            fn = self._compile(gm, self.example_inputs)
        return _Plan(gm, fn, dict(gm.meta.get(RANGES_KEY, ranges)))

    def graph_report(self, names: Mapping[int, str]) -> GraphReport:
        """The :class:`GraphReport`, blocks named by ``names`` (parameter id -> name, of the
        module asked about; blocks outside it are counted, not named)."""
        paths: dict[tuple[int, ...], str | None] = {}
        for key, refs in self.blocks.items():
            found = [names[id(p)] for p in (r() for r in refs) if p is not None and id(p) in names]
            paths[key] = _block_path(found) if found else None
        events = [PlanEvent(e.call, e.step, e.reason, e.replanned, paths.get(k) or "")
                  for e, k in zip(self.events, self._event_keys)]
        inside = [p for p in paths.values() if p is not None]
        index = {id(p): k for k, p in enumerate(self.plans)}
        which = {paths[k]: index[id(p)] for k, p in self.assigned.items()
                 if paths.get(k) is not None}
        return GraphReport(self.report, inside, self.ranks, self.calls, events,
                           len(paths) - len(inside),
                           [p.gm.meta[REPORT_KEY] for p in self.plans], which)


def _float8_nodes(gm: fx.GraphModule) -> frozenset[str]:
    """The nodes of a planned graph (and of its checkpointed bodies, by qualified name) that run
    in float8."""
    from ..passes.record_ranges import qualified_names

    return frozenset(name for n, name in qualified_names(gm).items()
                     if str(n.meta.get(FLOAT8, "")).startswith("fp8"))


def _float8_weights(gm: fx.GraphModule) -> frozenset[int]:
    """The indices of ``gm``'s placeholders that a float8 linear reads as its weight (through
    the plan's casts, and into checkpointed and wrapped bodies)."""
    from ..passes.record_ranges import _body

    def inputs(g: fx.GraphModule, outer: list[object]) -> set[int]:
        found: set[int] = set()
        place = {n: outer[i] for i, n in enumerate(g.graph.find_nodes(op="placeholder"))
                 if i < len(outer)}
        for n in g.graph.nodes:
            if str(n.meta.get(FLOAT8, "")).startswith("fp8") and len(n.args) > 1:
                w = n.args[1]
                while isinstance(w, fx.Node) and CAST in w.meta and w.args:
                    w = w.args[0]
                if w in place and place[w] is not None:
                    found.add(place[w])  # type: ignore[arg-type]
            elif (body := _body(g, n)) is not None:  # its operands are the body's inputs
                found |= inputs(body, [place.get(a) if isinstance(a, fx.Node) else None
                                       for a in n.args[1:]])
        return found

    return frozenset(inputs(gm, list(range(len(gm.graph.find_nodes(op="placeholder"))))))


def plans_version() -> int:
    """A counter that changes whenever a plan is made, remade or assigned to a block."""
    return _VERSION[0]


def float8_parameters() -> frozenset[int]:
    """``id`` of each parameter a float8 linear reads as its weight in the plan serving its
    block (the unsharded parameters FSDP2 hands the graph, under ``fully_shard``)."""
    if _FLOAT8_SEEN[0] == _VERSION[0]:
        return _FLOAT8_SEEN[1]
    found: set[int] = set()
    for plan in list(_PLANS):
        for key, served in plan.assigned.items():
            weights = _float8_weights(served.gm)
            refs = plan.blocks.get(key, [])
            for pos, index in enumerate(plan.params):
                if index in weights and pos < len(refs) and (p := refs[pos]()) is not None:
                    found.add(id(p))
    _FLOAT8_SEEN[:] = [_VERSION[0], frozenset(found)]
    return _FLOAT8_SEEN[1]


def _block_path(names: list[str]) -> str:
    """The module path the parameters ``names`` share (``layers.2`` of ``layers.2.fc.weight``
    and ``layers.2.norm.weight``), without the wrappers torch adds."""
    parts = [[p for p in n.split(".") if p not in _WRAPPERS] for n in names if n]
    if not parts:
        return ""
    common = []
    for level in zip(*parts):
        if len(set(level)) > 1:
            break
        common.append(level[0])
    if len(parts) == 1:
        common = common[:-1]
    return ".".join(common)


# The attribute names torch's wrappers put in parameter names.
_WRAPPERS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module",
                       "module"})


def fsdp_params(module: nn.Module) -> list[object]:
    """torch's ``FSDPParam`` objects of ``module``'s own ``fully_shard`` group (FSDP2 internals,
    torch 2.13), none for a module not sharded."""
    state = getattr(module, "_get_fsdp_state", None)
    group = getattr(state(), "_fsdp_param_group", None) if callable(state) else None
    return list(getattr(group, "fsdp_params", ()))


def _parameter_names(module: nn.Module) -> dict[int, str]:
    """``id`` -> name of ``module``'s parameters, and of the unsharded parameters FSDP2 hands
    its graphs in their place (a sharded module's ``parameters()`` are the shards)."""
    names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
    for sub in module.modules():
        for fsdp_param in fsdp_params(sub):
            name = names.get(id(getattr(fsdp_param, "sharded_param", None)))
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if name is not None and unsharded is not None:
                names[id(unsharded)] = name
    return names


def plans_of(module: nn.Module) -> list[GraphPlan]:
    """The live plans whose graphs ran with ``module``'s parameters."""
    ids = _parameter_names(module)
    return [plan for plan in list(_PLANS)
            if any(r() is not None and id(r()) in ids
                   for refs in plan.blocks.values() for r in refs)]


def compiled_report(module: nn.Module) -> CompiledReport | None:
    """The :class:`CompiledReport` of ``module``, or None when no plan ran with its parameters."""
    found = plans_of(module)
    if not found:
        return None
    names = _parameter_names(module)
    graphs = [plan.graph_report(names) for plan in found]
    order = {_unwrapped(name): k
             for k, (name, _) in reversed(list(enumerate(module.named_modules())))}
    graphs.sort(key=lambda g: min((order.get(b, len(order)) for b in g.blocks),
                                  default=len(order)))  # in the order of the model's blocks
    planned = {b for g in graphs for b in g.blocks}
    unplanned = [path for path in _compiled_blocks(module)
                 if path not in planned and not any(b.startswith(path + ".") or not path
                                                    for b in planned)]
    import torch._dynamo  # imported already: a plan exists

    return CompiledReport(graphs, unplanned, torch._dynamo.config.recompile_limit)


def _unwrapped(name: str) -> str:
    """A submodule's path without torch's wrappers (``layers.0._orig_mod`` -> ``layers.0``)."""
    return ".".join(p for p in name.split(".") if p and p not in _WRAPPERS)


def _compiled_blocks(module: nn.Module) -> list[str]:
    """The paths (without torch's wrappers) of ``module`` and its submodules that were compiled
    with ``torch.compile`` (``block.compile(...)``, or ``torch.compile(block)`` put in its
    place) and have parameters, in module order."""
    from torch._dynamo.eval_frame import OptimizedModule

    found: list[str] = []
    for name, sub in module.named_modules():
        if (getattr(sub, "_compiled_call_impl", None) is not None
                or isinstance(sub, OptimizedModule)):
            path = _unwrapped(name)
            if path not in found and next(sub.parameters(), None) is not None:
                found.append(path)
    return found


COMPILED_LOOKUPS.append(compiled_report)


def _tracing_context() -> object:
    from torch._guards import TracingContext

    return TracingContext.try_get()


def _tracing(context: object):
    """The tracing context of the compile the plan was made in: the inner backend compiles again
    with dynamo's fake tensors and shape environment, outside dynamo."""
    from torch._guards import tracing

    return tracing(context) if context is not None else contextlib.nullcontext()
