"""The transform report: every rewrite and every precision decision, with its reason."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import fx

from ..graph import meta as M
from ..graph import runtime
from ..graph.meta import POLICY_KEY, REPORT_KEY  # graph-level keys live in meta; re-exported here
from ..graph.shapes import BATCH
from .ops import FAMILIES
from .policy import Policy, matches
from .ranges import ValueRange

__all__ = ["CAPTURE_TOOL", "POLICY_KEY", "REPORT_KEY", "CompiledReport", "Decision", "GraphReport",
           "PlanEvent", "PlanUse", "Report", "Rewrite", "StateDecision", "decisions_of",
           "range_cell", "record", "report", "text_table", "transform_notes"]


@dataclass(frozen=True)
class Rewrite:
    """One change a pass made to the graph."""

    node: str
    pass_name: str
    action: str
    reason: str
    module_path: str = ""
    key: str | None = None  # the node's key in a saved plan, where it has one


@dataclass(frozen=True)
class Decision:
    """The precision chosen for one node of the final graph."""

    node: str
    op: str
    target: str
    module_path: str
    family: str | None
    precision: str  # low / fp32 / promote / neutral / nonfloat
    dtype: str | None  # the dtype the node computes in, None for non-float values
    reason: str
    source: str | None = None
    # The dtype its output is stored in: differs from ``dtype`` for an fp32 op that reads and
    # writes the low dtype (a norm after a conv; DESIGN.md, "Compute dtype is not storage").
    storage: str | None = None
    # The fp32 value's range on the example inputs (a parameter's: its own), when recorded.
    range: ValueRange | None = None
    # With fp8=: a candidate linear's float8 verdict and why ("fp8 (tensorwise): ..." or
    # "bf16: ..."); None for every other node. A chosen one computes in float8_e4m3fn.
    fp8: str | None = None
    # Its key in a saved plan: module path, op and occurrence (``layers.0.mlp:linear#1``;
    # a cast's is its value's key and dtype, ``...#1->float32``), None for nodes made after
    # the plan (amprewrite.save_plan, docs/guide.md "Plans").
    key: str | None = None
    # The mixed-dtype signature a probe confirmed for an fp32 op (``"low_io"``, ...), else None.
    mixed: str | None = None


@dataclass
class StateDecision:
    """How :func:`amprewrite.optimizer` stores one tensor of the training state: a weight
    (``tensor="weight"``) or one of its optimizer states (``"exp_avg"``, ...), and why."""

    param: str
    tensor: str
    storage: str  # low / low+sr / low+kahan / fp32 master / fp32
    dtype: str
    reason: str
    step: int  # the optimizer step that made the choice (0: before the first)


@dataclass
class PlanUse:
    """How a transform applied a saved plan (``transform(..., plan=...)``): where it came from,
    how many nodes took its decisions, the nodes it did not know (decided afresh: the model
    changed) and the nodes it has that the graph does not."""

    source: str
    applied: int
    new: list[str] = field(default_factory=list)  # node names, decided afresh
    missing: list[str] = field(default_factory=list)  # plan keys

    def __str__(self) -> str:
        text = f"plan: {self.source}, {self.applied} nodes as saved"
        if self.new:
            text += f"; decided afresh (not in the plan): {_first(self.new)}"
        if self.missing:
            text += f"; in the plan but not in this graph: {_first(self.missing)}"
        return text


@dataclass
class Report:
    """What :func:`amprewrite.transform` did. ``print(report)`` shows a readable summary.

    >>> import torch
    >>> import amprewrite
    >>> gm = amprewrite.transform(torch.nn.Linear(4, 4), dtype=torch.bfloat16)
    >>> [d.precision for d in amprewrite.report(gm).decisions if d.family == "linear"]
    ['low']
    """

    dtype: str
    capture: str
    rewrites: list[Rewrite] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    training_state: list[StateDecision] = field(default_factory=list)  # amprewrite.optimizer's
    # The options the plan was made with, as a saved plan records them (amprewrite.save_plan).
    policy: dict = field(default_factory=dict)
    plan: PlanUse | None = None  # transform(..., plan=...): how the saved plan was applied

    @property
    def casts(self) -> list[Rewrite]:
        return [r for r in self.rewrites if r.action.startswith("cast")]

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for d in self.decisions:
            out[d.precision] = out.get(d.precision, 0) + 1
        return out

    def table(self, include_nonfloat: bool = False) -> str:
        """One line per node: name, module path, family, precision, compute and storage
        dtype (``float32->bfloat16`` where they differ), reason."""
        ranges = any(d.range is not None for d in self.decisions)
        rows = [["node", "module", "family", "class", "dtype", *(["|x| max"] * ranges),
                 "reason"]]
        for d in self.decisions:
            if d.precision == "nonfloat" and not include_nonfloat:
                continue
            dtype = (d.dtype or "-").replace("torch.", "")
            if d.storage is not None and d.storage != d.dtype:
                dtype += "->" + d.storage.replace("torch.", "")
            shown = [] if not ranges else ["-" if d.range is None else range_cell(d.range)]
            rows.append([d.node, d.module_path or "-", d.family or "-", d.precision, dtype,
                         *shown, d.reason])
        return text_table(rows, caps=NAME_CAPS)

    def __str__(self) -> str:
        counts = ", ".join(f"{v} {k}" for k, v in sorted(self.counts().items()))
        lines = [f"amprewrite report: dtype={self.dtype}, capture={self.capture}",
                 f"nodes: {counts}; casts inserted: {len(self.casts)}"]
        if self.timings:
            times = ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in self.timings.items())
            lines.append(f"time: {times}")
        lines += [f"note: {n}" for n in self.notes]
        if self.plan is not None:
            lines.append(str(self.plan))
        other = [r for r in self.rewrites if not r.action.startswith("cast")]
        if other:
            lines.append("rewrites:")
            lines += [f"  [{r.pass_name}] {r.node} ({r.module_path or '-'}): {r.action}"
                      f" — {r.reason}" for r in other]
        fp8 = [d for d in self.decisions if d.fp8]
        if fp8:
            chosen = sum(d.fp8.startswith("fp8") for d in fp8)
            lines.append(f"float8: {chosen} of {len(fp8)} linears")
            lines += [f"  {d.node} ({d.module_path or '-'}): {d.fp8}" for d in fp8]
        lines.append("precision decisions:")
        lines.append(self.table())
        if self.training_state:
            lines.append("training state (amprewrite.optimizer):")
            lines += [f"  {d.param}{'' if d.tensor == 'weight' else ':' + d.tensor}: "
                      f"{d.storage} ({d.dtype}, step {d.step}) — {d.reason}"
                      for d in self.training_state]
        return "\n".join(lines)


def _first(names: list[str]) -> str:
    """The first 8 of ``names``, and how many more there are."""
    more = len(names) - 8
    return ", ".join(names[:8]) + (f" and {more} more" if more > 0 else "")


def range_cell(r: ValueRange) -> str:
    """``2.2e+05``, with the share of fp16-subnormal values where it is 1% or more."""
    cell = f"{r.absmax:.3g}"
    return cell + (f" ({r.tiny_share:.0%} subnormal)" if r.tiny_share >= 0.01 else "")


# How wide the node, module and family columns of a report's table grow: every node name of
# the zoo's models but the parameters' (dynamo names them after their path: up to 127
# characters on a UNet) fits in 32; a longer entry pushes the rest of its row right
# (text_table), as a scaled_dot_product_attention does past 20.
NAME_CAPS = (32, 40, 20)


def text_table(rows: list[list[str]], caps: Sequence[int | None] = ()) -> str:
    """Rows as aligned columns two spaces apart, each as wide as its longest entry; the last
    column is not padded. Nothing is cut, so a grep for a full node name finds its row.

    ``caps[i]``: column ``i`` is only as wide as its longest entry of at most that many
    characters. A longer entry is written whole and pushes the rest of its row right, which
    lines up again at the first column it reaches in time: a few 80-character parameter names
    do not widen the column of every other row.

    >>> print(text_table([["node", "class"], ["a_long_node_name", "low"]]))
    node              class
    a_long_node_name  low
    >>> print(text_table([["node", "class", "dtype"], ["add", "low", "bf16"],
    ...                   ["a_very_long_parameter_name", "param", "fp32"]], caps=[8]))
    node  class  dtype
    add   low    bf16
    a_very_long_parameter_name  param  fp32
    """
    last = len(rows[0]) - 1
    widths = []
    for i in range(last):
        cap = caps[i] if i < len(caps) else None
        fitting = [len(r[i]) for r in rows if cap is None or len(r[i]) <= cap]
        widths.append(max(fitting, default=cap or 0))
    starts = [sum(widths[:i]) + 2 * i for i in range(last + 1)]
    lines = []
    for r in rows:
        line = ""
        for i, cell in enumerate(r):
            if i:
                line += " " * max(2, starts[i] - len(line))
            line += cell
        lines.append(line.rstrip())
    return "\n".join(lines)


def record(gm: fx.GraphModule, node: fx.Node, action: str, reason: str) -> None:
    """Add a Rewrite for ``node`` to the report being built on ``gm``, under the running pass."""
    rep: Report | None = gm.meta.get(REPORT_KEY)
    if rep is not None:
        rep.rewrites.append(Rewrite(node.name, M.current_pass() or "", action, reason,
                                    node.meta.get(M.MODULE_PATH, ""),
                                    node.meta.get(M.PLAN_KEY)))


# --- what the torch.compile backend decided (amprewrite.compile.block_plans) ---
@dataclass(frozen=True)
class PlanEvent:
    """One time a graph was planned: the first call, a new block, a step after an overflow.

    ``call``: how many calls of the graph came before it; ``step``: how many optimizer steps
    did (:class:`amprewrite.GradScaler`'s ``update()`` calls; None without one);
    ``block``: the parameters' module path (filled in by :func:`amprewrite.report`);
    ``reason``: why; ``replanned``: whether the plan changed (a recompile)."""

    call: int
    step: int | None
    reason: str
    replanned: bool
    block: str = ""


@dataclass
class GraphReport:
    """What the backend decided for one graph: its first plan (:class:`~amprewrite.Report`;
    ``plans``: every plan, ``plan_of``: which plan each block runs), the blocks it holds for
    (module paths in the module asked about, ``""`` for that module itself; ``other_blocks``:
    how many more, outside it), the ranks, how many calls it served, and its events."""

    report: Report
    blocks: list[str]
    ranks: int
    calls: int
    events: list[PlanEvent]
    other_blocks: int = 0  # blocks of other modules that share the graph
    plans: list[Report] = field(default_factory=list)  # every plan; report is plans[0]
    plan_of: dict[str, int] = field(default_factory=dict)  # block -> its plan's index


    def __str__(self) -> str:
        shown = [b or "(the module)" for b in self.blocks]
        if self.other_blocks:
            shown.append(f"{self.other_blocks} outside this module")
        head = (f"graph planned in {self.report.dtype} from "
                f"{len(self.blocks) + self.other_blocks} block(s) "
                f"[{', '.join(shown)}], "
                f"{self.ranks} rank(s), {self.calls} call(s); "
                f"{len(self.plans) or 1} plan(s), {sum(e.replanned for e in self.events) - 1} "
                "re-plan(s)")
        events = [f"  call {e.call}{f' (step {e.step})' if e.step is not None else ''}"
                  f"{f' {e.block}' if e.block else ''}: "
                  f"{'planned' if e.replanned else 'checked'}: {e.reason}" for e in self.events]
        which = []
        for k in range(len(self.plans)):
            served = [b or "(the module)" for b, i in self.plan_of.items() if i == k]
            which.append(f"  plan {k}: {', '.join(served)}")
        bodies = [str(self.report)] + [f"plan {k}:\n{r}" for k, r in enumerate(self.plans)
                                       if k > 0]
        return "\n".join([head, *events, *(which if len(self.plans) > 1 else []), *bodies])


@dataclass
class CompiledReport:
    """:func:`amprewrite.report` of a module compiled with the backend (or of a model whose
    blocks were compiled one by one): one :class:`GraphReport` per graph dynamo compiled.

    ``report.graphs[0].report.decisions`` are that graph's decisions as
    :func:`amprewrite.transform`'s report gives them."""

    graphs: list[GraphReport] = field(default_factory=list)
    # Blocks compiled with torch.compile with which no planned graph ran (their calls ran
    # without amprewrite: dynamo gave up on them, or they were not called yet).
    unplanned: list[str] = field(default_factory=list)
    recompile_limit: int | None = None  # torch._dynamo.config.recompile_limit when reported

    def __str__(self) -> str:
        head = []
        if self.unplanned:
            shown = _first(self.unplanned)
            head.append(
                f"not planned: {shown}: compiled with torch.compile, but no graph amprewrite "
                "planned ran with their parameters, so their calls ran without amprewrite (in "
                "the model's own dtype), or they were not called yet. Dynamo compiles a block "
                "again when its guards fail (with a transformers DynamicCache each layer guards on "
                "its own slot of the cache; use_cache=False lets the layers share one graph) and "
                f"stops compiling a function after torch._dynamo.config.recompile_limit "
                f"({self.recompile_limit}) graphs; TORCH_LOGS=recompiles says why.")
        return "\n\n".join([*head, *(f"[{k}] {g}" for k, g in enumerate(self.graphs))])

    @property
    def replans(self) -> list[PlanEvent]:
        """Every event that changed a plan after the first, over all graphs."""
        return [e for g in self.graphs for e in g.events[1:] if e.replanned]


# Functions that find the report of a module compiled with the backend
# (amprewrite.compile.block_plans registers its compiled_report on import: without a plan there is
# nothing to find).
COMPILED_LOOKUPS: list = []


def report(gm: fx.GraphModule | torch.export.ExportedProgram | torch.nn.Module
           ) -> Report | CompiledReport:
    """The :class:`Report` of a GraphModule (or ExportedProgram) returned by
    :func:`amprewrite.transform`; for a module compiled with ``backend="amprewrite"`` (or a
    model whose blocks were compiled one by one), after its first call, the
    :class:`~amprewrite.compile.block_plans.CompiledReport` of every graph the backend planned:
    each graph's report, the blocks, ranks and steps its plan was made from, and every re-plan with
    its reason (DESIGN.md, "One plan at scale").

    >>> import torch, amprewrite
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Softmax(-1))
    >>> compiled = torch.compile(model, backend=amprewrite.backend(dtype="fp16", inner="eager"))
    >>> _ = compiled(torch.randn(2, 4))
    >>> [d.family for d in amprewrite.report(compiled).graphs[0].report.decisions if d.family]
    ['linear', 'softmax']
    """
    if isinstance(gm, torch.export.ExportedProgram):
        gm = gm.graph_module  # where transform(ep) keeps it; not saved by torch.export.save
    rep = getattr(gm, "meta", {}).get(REPORT_KEY)
    if rep is None and isinstance(gm, torch.nn.Module):
        for lookup in COMPILED_LOOKUPS:  # amprewrite.compile.block_plans, once a plan was made
            rep = lookup(gm)
            if rep is not None:
                break
    if rep is None:
        from ..errors import PolicyError

        raise PolicyError(
            "this module carries no amprewrite report: pass a module returned by "
            "amprewrite.transform (the report is kept in gm.meta['amprewrite_report']), or a "
            "module compiled with torch.compile(..., backend='amprewrite') after it has run "
            "once (the backend plans on the first call)."
        )
    return rep


def region_bodies(gm: fx.GraphModule) -> dict[fx.Node, fx.GraphModule]:
    """The body of each ``runtime.recompute`` call of ``gm`` (recompute_islands), by call node."""
    return {n: gm.get_submodule(str(n.args[0].target)) for n in gm.graph.nodes
            if n.op == "call_function" and n.target is runtime.recompute
            and isinstance(n.args[0], fx.Node) and n.args[0].op == "get_attr"}


def _nodes_with_bodies(gm: fx.GraphModule):
    """The graph's nodes, each ``runtime.recompute`` call followed by its body's ops."""
    bodies = region_bodies(gm)
    for node in gm.graph.nodes:
        yield node
        if node in bodies:
            yield from (n for n in bodies[node].graph.nodes
                        if n.op not in ("placeholder", "output"))


def _region_body(gm: fx.GraphModule, node: fx.Node) -> tuple[str, Report] | None:
    """(body name, body report) where ``node`` calls a region body transformed as a graph of
    its own (an activation checkpoint's, :mod:`amprewrite.passes.transform_bodies`)."""
    if not (node.op == "call_function" and node.args
            and isinstance(node.target, torch._ops.HigherOrderOperator)
            and isinstance(node.args[0], fx.Node) and node.args[0].op == "get_attr"):
        return None
    name = str(node.args[0].target)
    try:
        body = gm.get_submodule(name)
    except AttributeError:
        return None
    report = getattr(body, "meta", {}).get(REPORT_KEY)
    return (name, report) if isinstance(report, Report) else None


def decisions_of(gm: fx.GraphModule, policy: object) -> list[Decision]:
    """One :class:`Decision` per node of a transformed graph (``policy.dtype`` is the low dtype).

    A region whose body was transformed as a graph of its own (an activation checkpoint's) is
    listed as its call followed by its body's decisions, each node named ``<body>.<node>``; the
    body's ``get_attr`` is not a parameter and is left out."""
    out = []
    regions = {n: body for n in gm.graph.nodes if (body := _region_body(gm, n)) is not None}
    bodies = {name for name, _ in regions.values()}
    for node in _nodes_with_bodies(gm):
        if node.op == "get_attr" and str(node.target) in bodies:
            continue
        out.append(_decision(node, policy))
        if node in regions:
            name, report = regions[node]
            out += [dataclasses.replace(d, node=f"{name}.{d.node}",
                                        key=d.key and f"{name}/{d.key}")
                    for d in report.decisions if d.op not in ("placeholder", "output")]
    return out


def _decision(node: fx.Node, policy: object) -> Decision:
    label = node.meta.get(M.LABEL)
    cls = node.meta.get(M.CLASS)
    precision = M.node_kind(node)
    storage = None if label is None else str(torch.float32 if label == M.HIGH
                                              else policy.dtype)
    # An FP32 op computes in float32 whatever it stores (a norm reading and writing low).
    dtype = (str(torch.float32) if storage and getattr(cls, "value", None) == "fp32"
             else storage)
    fp8 = node.meta.get(M.FLOAT8)
    if fp8 is not None and fp8.startswith("fp8"):
        dtype = str(torch.float8_e4m3fn)
    target = node.target if isinstance(node.target, str) else getattr(
        node.target, "__name__", str(node.target))
    key = node.meta.get(M.PLAN_KEY)
    if M.CAST in node.meta and node.args and isinstance(node.args[0], fx.Node):
        source = node.args[0].meta.get(M.PLAN_KEY)
        key = source and f"{source}->{str(node.meta[M.CAST]).replace('torch.', '')}"
    mixed = node.meta.get(M.MIXED)
    return Decision(node.name, node.op, str(target), node.meta.get(M.MODULE_PATH, ""),
                    node.meta.get(M.FAMILY), precision, dtype, node.meta.get(M.REASON, ""),
                    M.source_line(node), storage, node.meta.get(M.RANGE), fp8, key,
                    getattr(mixed, "value", None))


# What each capture method is called in a note.
CAPTURE_TOOL = {"dynamo": "dynamo", "export": "torch.export (non-strict)"}


def _output_casts(gm: fx.GraphModule, policy: Policy | None) -> str | None:
    """What ``keep_io_dtype=True`` costs: the casts that give the outputs back in the model's
    dtype, and the bytes each call moves for them (read low, write fp32) at the sizes the
    graph was captured with."""
    if policy is not None and not policy.keep_io_dtype:
        return None
    output = next((n for n in gm.graph.nodes if n.op == "output"), None)
    if output is None:
        return None
    # the casts insert_casts made for the output: of a low value (an fp32 one needs none)
    casts = [a for a in _flat_nodes(output.args)
             if a.meta.get(M.CAST) == torch.float32 and a.op == "call_method"]
    if not casts or policy is None:
        return None
    known = [M.info(c.args[0]).numel for c in casts if M.info(c.args[0]).numel is not None]
    size = policy.dtype.itemsize
    moved = sum(known) * (4 + size)
    names = ", ".join(c.name for c in casts[:3]) + (", ..." if len(casts) > 3 else "")
    cost = (f"{moved:,} bytes a call at the captured sizes ({sum(known):,} elements read in "
            f"{size} bytes, written in 4)") if len(known) == len(casts) else (
        "bytes unknown without example inputs")
    return (f"keep_io_dtype=True: {len(casts)} output{'s' * (len(casts) > 1)} ({names}) cast "
            f"back to float32, {cost}; keep_io_dtype=False returns them in the low dtype (for "
            "inference that feeds a sampler, a loss that upcasts itself, or another low model)")


def _flat_nodes(args: object) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg(args, found.append)
    return found


def transform_notes(gm: fx.GraphModule, method: str, policy: Policy | None = None) -> list[str]:
    """The report's notes on a transformed graph that only the whole transform knows of: the
    ``keep_fp32`` / ``allow_low`` selectors that select no node, functional dropout frozen by
    a symbolic trace, and the capture (its tool, the mode it fixed, the sizes it serves)."""
    notes = []
    for option, selectors in (("keep_fp32", policy.keep_fp32 if policy else ()),
                              ("allow_low", policy.allow_low if policy else ())):
        for sel in selectors:
            if isinstance(sel, str) and (sel in FAMILIES or sel.startswith("node:") or "::" in sel):
                continue  # families may simply be absent; node names are checked at capture
            if not any(matches(n, sel) for n in gm.graph.nodes):
                shown = sel.__name__ if isinstance(sel, type) else repr(sel)
                notes.append(f"{option}={shown} selects no node of this graph: the module runs "
                             "no op in this forward, so the option changes nothing")
    said = _output_casts(gm, policy)
    if said:
        notes.append(said)
    if method == "symbolic_trace":
        for node in gm.graph.nodes:
            if node.meta.get(M.FAMILY) == "dropout" and node.op == "call_function":
                notes.append(f"{node.name}: functional dropout with a training flag fixed at "
                             "trace time; use nn.Dropout to have gm.train()/gm.eval() switch it")
    else:
        notes.append(f"captured by {CAPTURE_TOOL.get(method, method)} in "
                     f"{'train' if gm.training else 'eval'} mode; the mode is fixed in the graph")
        guard = getattr(gm, "_amp_inputs", None)
        if guard is not None:  # which sizes torch.export.export(gm, dynamic_shapes=...) may vary
            asked = policy.dynamic_shapes if policy else None
            said = guard.describe()
            if not guard.dynamic_dims() and isinstance(asked, str) and asked == BATCH:
                said += (": dynamic_shapes='batch' left no batch dimension dynamic (the "
                         "model fixes it, as a per-sample loop does, or the example's batch is "
                         "1); another batch size is transformed again")
            else:
                said += f" (dynamic_shapes={asked!r})"
            notes.append(f"shapes: {said}")
    return notes
