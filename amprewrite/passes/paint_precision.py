"""paint_precision: give every node a precision class and the precision it is computed in.

Order of the rules, each overriding the previous (the reason of the last one is recorded):

1. the op registry (``amprewrite/precision/ops.py``); an op it does not know runs in FP32 with its
inputs
   cast up (named in the report), unknown leaf modules run in FP32 on their own fp32
   parameters; ops whose low-precision kernel the probe finds missing or wrong are FP32 islands
   (``amprewrite/precision/kernels.py``); non-float values NONFLOAT;
2. **position cones**: a float computed from an integer tensor (``arange``, ``position_ids``,
   timesteps) is FP32 up to and including the first bounded op (sin/cos/sigmoid/tanh/softmax) or
   LOW op: bf16 keeps only 769 distinct values of 0..4095, so positions would collide; and
   **static LOW ops**: a matmul-like op on parameters, buffers and constants only (SwinV2's
   position-bias MLP) runs in FP32: no input reaches it, so its cost does not grow with the batch;
3. **declarations**: ops that read a parameter the model's authors declare fp32
   (transformers' ``_keep_in_fp32_modules`` in fp16, ``_keep_in_fp32_modules_strict`` in fp16
   and bf16; :func:`amprewrite.precision.ranges.declared_fp32`), through views of it, run in FP32;
4. **ranges** (``meta[RANGE]``, recorded by record_ranges): a value whose magnitude on the
   example inputs passes :func:`amprewrite.precision.ranges.range_limit` is computed and stored in
   FP32, and so is a LOW op that reads one, or reads a weight the low dtype would store mostly
   subnormal (a 1e-6 layer scale in fp16; a bias alone rescale_matmuls has split off, to be
   added in fp32); where they keep more than half of the matmul FLOPs fp32, a note says so;
5. a **saved plan** (``transform(..., plan=...)``, :mod:`amprewrite.precision.saved_plan`):
   each node it has an entry for takes the entry's class, reason and mixed signature, as
   saved or as edited; its kernels are not probed again. A node it has none for keeps the
   rules above (and is named in the report; ``strict=True`` refuses it);
6. the user's ``keep_fp32`` / ``allow_low`` overrides (module path, module type, family name);
   ``allow_low`` also gives back the class a range or a non-strict declaration took. With a
   plan, only the selectors the plan was not made with: the others are in its decisions.

Every node gets its key in a saved plan (``meta[PLAN_KEY]``) here, where the graph holds the
nodes the rules decide.

Then the *natural* precision of each float value follows in topological order: LOW ops are
low, FP32 ops high, PROMOTE and NEUTRAL ops the widest of their float inputs (autocast's rule,
which keeps the residual stream of a transformer in fp32).
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from ..errors import PolicyError
from ..graph import meta as M
from ..graph.meta import HIGH, LOW, info
from ..graph.modules import submodule
from ..precision.kernels import low_kernel_problem, mixed_problem
from ..precision.ops import (
    FAMILIES,
    Family,
    Mixed,
    Out,
    Precision,
    conversion_target,
    family_of,
    fp32_helper_of,
    is_conversion,
    number_inputs,
    op_qualname,
    precision_of,
    qualified_name,
    writes_in_place,
)
from ..precision.policy import Selector, matches
from ..precision.ranges import (
    TINY_SHARE,
    declared_fp32,
    describe_limit,
    narrower_than_fp32,
    range_limit,
    short_name,
)
from ..precision.report import REPORT_KEY, PlanUse
from ..precision.saved_plan import PlanMatch, node_keys, selector_name
from .base import LOW_FLOPS, Kind, Pass, matmul_flops

__all__ = ["PaintPrecision", "matches"]

# Nodes without a precision class, and why.
_NO_CLASS = {"placeholder": "graph input", "get_attr": "parameter or buffer",
             "output": "graph output"}
_CALLS = ("call_function", "call_method")
# The precision classes as plain names: each ``Precision.X`` costs an enum lookup (~60 ns in
# Python 3.11), and the loops below compare classes several times per node.
_P_LOW, _P_FP32, _P_PROMOTE, _P_NEUTRAL, _P_NONFLOAT = (
    Precision.LOW, Precision.FP32, Precision.PROMOTE, Precision.NEUTRAL, Precision.NONFLOAT)
_CONVERT = Out.CONVERT
# Classes whose low-precision kernel may run: probed.
_MAY_RUN_LOW = (_P_LOW, _P_PROMOTE, _P_NEUTRAL)


def _own_floats(module: torch.nn.Module, low: torch.dtype) -> bool:
    """Does ``module`` hold a float parameter or buffer that is not already ``low``?"""
    return any(t.is_floating_point() and t.dtype != low
               for t in (*module.parameters(), *module.buffers()))


def range_reason(node: fx.Node, low: torch.dtype, where: str = "the example inputs",
                 own: bool = True, reads: bool = True) -> str | None:
    """Why the ranges record_ranges wrote keep ``node`` out of ``low`` (None: they do not):
    with ``own``, its value passes :func:`~amprewrite.precision.ranges.range_limit`; with ``reads``
    (a LOW op), it reads an input past the limit, or a weight past ``low``'s largest number or
    that ``low`` would store mostly subnormal. ``where``: what the ranges were taken on."""
    if not narrower_than_fp32(low):
        return None
    limit = range_limit(low)
    r = node.meta.get(M.RANGE)
    if own and r is not None and r.absmax > limit:
        return (f"range: |{node.name}| up to {r.absmax:.3g} on {where} > "
                f"{describe_limit(low)}")
    if not reads:
        return None
    short = short_name(low)
    for arg in node.all_input_nodes:
        ra = arg.meta.get(M.RANGE)
        if ra is None:
            continue
        what = "weight" if arg.op == "get_attr" else "input"
        # A parameter is known, not sampled: its own range is the dtype's.
        if ra.absmax > (limit if what == "input" else torch.finfo(low).max):
            seen = "" if arg.op == "get_attr" else f" on {where}"
            name = arg.target if arg.op == "get_attr" else arg.name
            bound = (describe_limit(low) if what == "input"
                     else f"{short} max {torch.finfo(low).max:.6g}")
            return (f"range: reads {what} '{name}' with |x| up to {ra.absmax:.3g}"
                    f"{seen} > {bound}")
        if arg.op == "get_attr" and ra.tiny_share > TINY_SHARE:
            return (f"range: {short} would store weight '{arg.target}' mostly "
                    f"subnormal ({ra.tiny_share:.0%} of its nonzero values below "
                    f"{torch.finfo(low).tiny:.2g})")
    return None


class PaintPrecision(Pass):
    """Set ``meta[CLASS]``, ``meta[REASON]``, ``meta[FAMILY]``, ``meta[TIED]`` and
    ``meta[NATURAL]``."""

    name, kind = "paint_precision", Kind.ANALYSIS
    requires = (M.ORIG, M.MODULE_PATH, M.MODULE_TYPES, M.FORCE, M.RANGE)
    writes = (M.FAMILY, M.CLASS, M.REASON, M.TIED, M.NATURAL, M.MIXED, M.PLAN_KEY)
    # Parameters and buffers the model declares fp32, by the target of the get_attr (or, in a
    # torch.compile graph, placeholder) node that reads them: (declaring attribute, the
    # parameter's name). Set by passes.pipeline where the graph does not name them as the
    # model does (a torch.compile graph); else found on ``model`` (ranges.declared_fp32).
    declared: dict[str, tuple[str, str]] | None = None
    model: torch.nn.Module | None = None

    def run(self, gm: fx.GraphModule) -> bool:
        low = self.policy.dtype
        # FP32 nodes as the registry classed them (the reason object: nothing overrode it).
        self._registry_fp32: dict[fx.Node, str] = {}
        # Facts of each node, found once by _classify and read by every later step: its
        # family, whether it writes into its first argument, and what its value holds.
        self._family: dict[fx.Node, Family | None] = {}
        self._writes: set[fx.Node] = set()  # writes_in_place
        self._floats: set[fx.Node] = set()  # info(n).has_float()
        self._float_tensors: set[fx.Node] = set()  # ... and a tensor (info(n).is_float)
        self._ints: set[fx.Node] = set()  # integer tensors, or tensors of unknown dtype
        self._module: dict[fx.Node, torch.nn.Module] = {}  # what a call_module node calls
        for node in M.each_node(gm.graph):
            self._classify(gm, node, low)
        keys = node_keys(gm, {n: n.meta.get(M.FAMILY) for n in gm.graph.nodes})
        for node, key in keys.items():
            node.meta[M.PLAN_KEY] = key
        # Nodes whose class and reason come from a saved plan: their reason as saved.
        self._planned: dict[fx.Node, str] = {}
        plan = self._match(gm, keys) if self.policy.plan is not None else None
        self._cones(gm)
        self._static(gm)
        # What a declaration or a range took, for allow_low to give back: node -> (class, why).
        self._taken: dict[fx.Node, tuple[Precision, str]] = {}
        self._strict: set[fx.Node] = set()  # declared by _keep_in_fp32_modules_strict
        declared = self.declared
        if declared is None and self.model is not None:
            declared = {name: (attr, name)
                        for name, attr in declared_fp32(self.model, low).items()}
        if declared:
            self._declarations(gm, declared)
        self._ranges(gm, low)
        if plan is not None:
            self._apply_plan(plan)
        keep, allow = self._selectors()
        if keep or allow:
            for node in M.each_node(gm.graph):
                self._override(node, keep, allow)
        if self._taken:
            self._note_ranges(gm)
        self._probe_kernels(gm, low)
        self._mixed(gm, low)
        self._note_unknown(gm)
        self._natural(gm, low)
        for node, why in self._planned.items():
            node.meta[M.REASON] = why  # as saved (a rule above may have added to it)
        return False  # meta only: the graph's code is unchanged

    def _match(self, gm: fx.GraphModule, keys: dict[fx.Node, str]) -> PlanMatch:
        """The saved plan's entry of each node; the report says which nodes it did not know."""
        plan = self.policy.plan
        wanted = [n for n in keys if n.meta.get(M.CLASS) not in (None, _P_NONFLOAT)]
        found = plan.match(keys, wanted)
        if self.policy.strict and (found.new or found.missing):
            new = ", ".join(f"{n.name} ({keys[n]})" for n in found.new[:5])
            gone = ", ".join(found.missing[:5])
            raise PolicyError(
                f"strict=True: the graph does not match the plan {plan.source}"
                + (f"; {len(found.new)} node(s) it has no entry for: {new}" if found.new else "")
                + (f"; {len(found.missing)} of its entries name no node of this graph: {gone}"
                   if found.missing else "")
                + ". The model changed since the plan was saved: transform without strict=True "
                "to decide those nodes afresh (the report names them), then save_plan the "
                "result and review it with `amprewrite plan diff`.")
        rep = gm.meta.get(REPORT_KEY)
        if rep is not None:
            rep.plan = PlanUse(plan.source, len(wanted) - len(found.new),
                               [n.name for n in found.new], found.missing)
        return found

    def _apply_plan(self, found: PlanMatch) -> None:
        """Each node the plan has an entry for takes its class, reason and mixed signature."""
        source = self.policy.plan.source
        for node, entry in found.entries.items():
            cls = node.meta.get(M.CLASS)
            saved = entry.get("class")
            if (cls in (None, _P_NONFLOAT) or saved in (None, "nonfloat")
                    or node in self._writes):
                continue  # no decision to take: structure, as the graph has it
            new = Precision(saved)
            why = _saved_reason(entry)
            dtype = entry.get("dtype")
            if (new == _P_FP32 and dtype not in (None, "float32")) or (
                    new == _P_LOW and dtype == "float32"):
                # the class was edited by hand (the dtype says what it was saved as)
                why = f"{saved} in the plan {source}, edited by hand (saved: {why})"
            node.meta[M.CLASS] = new
            node.meta[M.REASON] = why
            if new == _P_FP32:
                node.meta.pop(M.TIED, None)
            mixed = entry.get("mixed")
            if mixed and new == _P_FP32:
                node.meta[M.MIXED] = Mixed(mixed)
            self._planned[node] = why

    def _selectors(self) -> tuple[tuple[Selector, ...], tuple[Selector, ...]]:
        """The keep_fp32 / allow_low selectors to apply: with a plan, those it was not made
        with (its decisions hold the others)."""
        keep, allow = self.policy.keep_fp32, self.policy.allow_low
        plan = self.policy.plan
        if plan is None:
            return keep, allow
        saved = plan.policy
        return (tuple(s for s in keep if selector_name(s) not in saved.get("keep_fp32", ())),
                tuple(s for s in allow if selector_name(s) not in saved.get("allow_low", ())))

    def _classify(self, gm: fx.GraphModule, node: fx.Node, low: torch.dtype) -> None:
        op, meta, value = node.op, node.meta, info(node)
        has_float = value.has_float()
        if has_float:
            self._floats.add(node)
            if value.kind == "tensor":
                self._float_tensors.add(node)
                if value.dtype is None:
                    self._ints.add(node)  # of unknown dtype: may hold integers
        elif value.is_int:
            self._ints.add(node)
        if op in _NO_CLASS:  # no family, no class, writes nothing
            meta[M.FAMILY] = self._family[node] = None
            meta[M.CLASS], meta[M.REASON] = None, _NO_CLASS[op]
            return
        module = None
        if op == "call_module":
            module = self._module[node] = submodule(gm, str(node.target))
        fam = family_of(node, module)
        name = fam.name if fam else None
        meta[M.FAMILY] = name
        self._family[node] = FAMILIES.get(name or "")
        writes = op in _CALLS and writes_in_place(node)
        if writes:
            self._writes.add(node)
        if not has_float:
            complex_ = value.kind == "tensor" and value.dtype is not None and value.dtype.is_complex
            cls, why = _P_NONFLOAT, ("complex value: its inputs keep the model's dtypes"
                                            if complex_ else "integer, bool or non-tensor value")
        elif value.float_dtype() not in (None, torch.float32, low):
            cls = _P_NONFLOAT
            why = f"{value.float_dtype()} value: computed as the model does"
        elif (forced := meta.get(M.FORCE)) is not None:
            cls, why = forced
        elif writes:
            # After functionalize, only writes into a private clone or back into a graph input.
            cls, why = _P_NEUTRAL, "in-place op: runs in the dtype of the tensor it writes"
            meta[M.TIED] = True
        elif fam is not None:
            cls, why = precision_of(node, fam, module, low)
            if cls == _P_FP32:
                self._registry_fp32[node] = why
            if cls == _P_LOW and module is not None and _own_floats(module, low):
                # Called as a whole (hooks, kwargs, a class without a lowering): its own
                # parameters are read inside, where no cast can reach them.
                cls, why = _P_FP32, (f"{type(module).__name__} is called as a module "
                                            "(hooks or no functional form): runs on its own "
                                            "fp32 parameters")
        elif op == "call_module":
            cls, why = _P_FP32, (f"unknown module {type(module).__name__}: runs with its "
                                        "own fp32 parameters")
        else:
            # Unknown means fp32: safe for any op; allow_low opts a node back in.
            qualname = op_qualname(node.target)
            shown = qualname.split(".")[0] if qualname is not None else f"node:{node.name}"
            cls, why = _P_FP32, (f"unknown op '{qualified_name(node)}': fp32; "
                                        f"allow_low=['{shown}'] to override")
        if (node.target is operator.getitem and node.args
                and info(node.args[0]).kind == "seq"):
            meta[M.TIED] = True  # an element of a tuple: cast the tuple's producer
        meta[M.CLASS] = cls
        meta[M.REASON] = why

    def _cones(self, gm: fx.GraphModule) -> None:
        """Mark position cones FP32: from int->float conversions to the first bounded/LOW op."""
        # Only a node that reads an integer tensor (or one of unknown dtype) or makes positions
        # can be a seed: _is_seed asks the registry about those alone, in graph order.
        maybe = {user for n in self._ints for user in n.users}
        maybe.update(n for n, fam in self._family.items() if fam is not None and fam.positions)
        seeds = [n for n in gm.graph.nodes if n in maybe and self._is_seed(n)] if maybe else []
        seen: set[fx.Node] = set()
        stack = [(n, n) for n in seeds]
        while stack:
            node, seed = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            cls = node.meta.get(M.CLASS)
            fam = self._family[node]
            ends = cls == _P_LOW or (fam is not None and fam.bounded)
            if node in self._writes:
                # It runs in the dtype of the tensor it writes (t.copy_(ids) on a private
                # clone): that tensor joins the cone, and what reads the write is in it too.
                written = node.args[0] if node.args else None
                if node is seed and isinstance(written, fx.Node):
                    self._paint_cone(written, seed)
            else:
                self._paint_cone(node, seed)
                if ends:
                    continue
            for user in node.users:
                if user.op != "output" and self._carries_numbers(user):
                    stack.append((user, seed))

    def _carries_numbers(self, node: fx.Node) -> bool:
        """Can ``node`` be in a position cone? Float values, float64 ones included: the model
        computes those as it does (NONFLOAT, never repainted), but ``ids.double().float()``
        still carries the positions on to what reads them."""
        cls = node.meta.get(M.CLASS)
        return cls is not None and (cls != _P_NONFLOAT or node in self._floats)

    def _paint_cone(self, node: fx.Node, seed: fx.Node) -> None:
        if node.meta.get(M.CLASS) in (None, _P_NONFLOAT) or node in self._writes:
            return
        node.meta[M.CLASS] = _P_FP32
        node.meta[M.REASON] = f"position cone from '{seed.name}' (integer values as floats)"
        node.meta.pop(M.TIED, None)

    def _static(self, gm: fx.GraphModule) -> None:
        """LOW ops on values computed from parameters, buffers and constants only (no graph
        input reaches them) run in fp32: SwinV2's continuous position bias (an MLP on a
        coordinate table), a LoRA merge. Their cost does not grow with the batch, and rounding
        them adds an error every input shares (measured: 16 * sigmoid(cpb_mlp(table)) in bf16
        is 0.03 RMS on the attention logits)."""
        static: set[fx.Node] = set()
        family = self._family
        for node in gm.graph.nodes:
            if node.op == "get_attr":
                static.add(node)
            elif node.op in _CALLS:
                first = node.args[0] if node.args else None
                if isinstance(first, fx.Node) and first not in static:
                    continue  # an input that is not static: the common case, asked cheaply
                if static.issuperset(node.all_input_nodes) and not (
                        (fam := family[node]) is not None and fam.random):
                    static.add(node)
        for node in static:
            if node.meta.get(M.CLASS) == _P_LOW and node.all_input_nodes:
                node.meta[M.CLASS] = _P_FP32
                node.meta[M.REASON] = ("computed from parameters and buffers only (no input "
                                       "reaches it): fp32, its cost does not grow with the batch")

    def _declarations(self, gm: fx.GraphModule,
                      declared: dict[str, tuple[str, str]]) -> None:
        """Ops that read a declared parameter (or a view of one) compute in FP32: what
        transformers' ``from_pretrained(dtype=...)`` gives by loading it fp32 (T5's ``wo`` in
        fp16, a MoE router's gate in bf16 too)."""
        for node in gm.graph.nodes:
            found = (declared.get(str(node.target)) if node.op in ("get_attr", "placeholder")
                     else None)
            if found is None:
                continue
            attr, name = found
            why = f"declared fp32 by the model ({attr}): reads '{name}'"
            todo, seen = list(node.users), set()
            while todo:
                user = todo.pop()
                cls = user.meta.get(M.CLASS)
                if user in seen or cls in (None, _P_NONFLOAT) or user in self._writes:
                    continue
                seen.add(user)
                if cls == _P_NEUTRAL and (fam := self._family[user]) is not None and (
                        fam.out is not _CONVERT or (is_conversion(user)
                                                    and conversion_target(user) == torch.float32)):
                    # A view of the parameter, or the model's own .float() of it (a router's
                    # F.linear(h.float(), self.weight.type(torch.float32))): what reads it, too.
                    todo.extend(user.users)
                self._take(user, why, strict=attr.endswith("_strict"))

    def _ranges(self, gm: fx.GraphModule, low: torch.dtype) -> None:
        """Values past the low dtype's range (with headroom) are computed and stored in FP32,
        and so are LOW ops reading one, or reading a weight stored mostly subnormal."""
        if not narrower_than_fp32(low):
            return  # bfloat16: fp32's exponent range, nothing a range can rule out
        extra = len(self.policy.calibration)
        where = "the example inputs" + (
            f" and {extra} calibration batch{'es' * (extra > 1)}" if extra else "")
        for node in gm.graph.nodes:
            cls = node.meta.get(M.CLASS)
            if cls in (None, _P_NONFLOAT) or node in self._writes:
                continue
            why = range_reason(node, low, where, own=cls != _P_FP32, reads=cls == _P_LOW)
            if why is not None:
                self._take(node, why)

    def _note_ranges(self, gm: fx.GraphModule) -> None:
        """Say so where the ranges keep more than half of the matmul FLOPs out of the low dtype
        (rescale_matmuls' goal, :data:`~amprewrite.passes.rescale_matmuls.LOW_FLOPS`): a
        plan that runs mostly fp32 for its values should not look like a low-precision one."""
        taken = [n for n, (before, _) in self._taken.items()
                 if before == _P_LOW and n.meta.get(M.CLASS) == _P_FP32
                 and str(n.meta.get(M.REASON)).startswith("range:")]
        flops = {n: f for n in taken if (f := matmul_flops(gm, n))}
        if not flops:
            return
        total = sum(f for n in gm.graph.nodes
                    if (f := (flops.get(n) or matmul_flops(gm, n))))
        share = sum(flops.values()) / total
        if share <= 1 - LOW_FLOPS:
            return
        names = [n.name for n in flops]
        shown = ", ".join(f"'node:{n}'" for n in names[:3]) + (", ..." if len(names) > 3 else "")
        low = short_name(self.policy.dtype)
        _note(gm, f"ranges: {share:.0%} of the matmul FLOPs stay fp32 for the values they read "
                  f"or make ({len(names)} op{'s' * (len(names) > 1)}; each reason names its "
                  f"value); allow_low=[{shown}] runs them in {low} as the model wrote them")

    def _take(self, node: fx.Node, why: str, strict: bool = False) -> None:
        """Make ``node`` FP32 for ``why``, remembering what it was (allow_low gives it back)."""
        if node not in self._taken:
            self._taken[node] = (node.meta[M.CLASS], node.meta[M.REASON])
        if strict:
            self._strict.add(node)
        node.meta[M.CLASS] = _P_FP32
        node.meta[M.REASON] = why
        node.meta.pop(M.TIED, None)

    def _is_seed(self, node: fx.Node) -> bool:
        """Does ``node`` turn integer values into floats (a position cone's start)?

        The registry says which arguments an op reads as numbers (``ops.number_inputs``):
        ``ids.type_as(f)``, ``ids.to(f)``, ``t.copy_(ids)``, ``t[:] = ids``, ``ids * f`` and
        ``f.new_tensor(ids)`` all read ``ids`` as numbers; ``embedding(ids, w)`` and
        ``grouped_mm(x, w, offs=ids)`` read it as indices.
        """
        if not self._carries_numbers(node):
            return False
        fam = self._family[node]
        if fam is not None and fam.positions:
            return True  # arange(..., dtype=float), linspace: positions born as floats
        if self._ints.isdisjoint(node.all_input_nodes):
            return False  # what follows needs an integer input (or one of unknown dtype)
        numbers = number_inputs(node)
        if numbers is not None:
            if is_conversion(node) and any(info(a).kind == "tensor" and info(a).dtype is None
                                           for a in numbers):
                return True  # ids.float() of a graph input traced without a known dtype
            return any(info(a).is_int for a in numbers)
        args: list[fx.Node] = []
        fx.node.map_arg((node.args, node.kwargs), lambda n: args.append(n) or n)
        # An op the registry does not know: floats born from integers only (an unknown op
        # that also reads float tensors may use its integers as indices or offsets).
        return any(info(a).is_int for a in args) and not any(info(a).is_float for a in args)

    def _override(self, node: fx.Node, keep: tuple[Selector, ...],
                  allow: tuple[Selector, ...]) -> None:
        cls = node.meta.get(M.CLASS)
        if cls in (None, _P_NONFLOAT) or node in self._writes:
            return  # an in-place op (after functionalize: on a private copy) stays tied to it
        if any(matches(node, sel) for sel in (*keep, *allow)):
            self._planned.pop(node, None)  # the call's own selector decides it
        for sel in keep:
            if matches(node, sel):
                node.meta[M.CLASS] = _P_FP32
                node.meta[M.REASON] = f"keep_fp32={_show(sel)}"
                node.meta.pop(M.TIED, None)
                return
        for sel in allow:
            if matches(node, sel) and node in self._taken and node not in self._strict:
                # A range or a non-strict declaration took it: the user vouches for its class.
                before, why = self._taken[node]
                node.meta[M.CLASS] = before
                node.meta[M.REASON] = f"allow_low={_show(sel)}: {why} (was: {node.meta[M.REASON]})"
                return
            if matches(node, sel) and cls == _P_FP32 and node not in self._strict:
                node.meta[M.CLASS] = _P_PROMOTE
                node.meta[M.REASON] = f"allow_low={_show(sel)}: runs in its inputs' precision"
                return

    def _device(self) -> torch.device | None:
        """The target device, or None when it is not available here (nothing to probe on)."""
        device = torch.device(self.policy.device or "cpu")
        try:
            torch.empty(1, device=device)
        except (RuntimeError, AssertionError):
            return None
        return device

    def _probe_kernels(self, gm: fx.GraphModule, low: torch.dtype) -> None:
        """Nodes that may run low get an fp32 island where the low kernel is missing or wrong."""
        family, writes, floats = self._family, self._writes, self._floats
        # Those that may run low, in a family the probe runs for, writing nothing, with a float
        # value and a float tensor among their inputs; not those a saved plan decided (probed
        # where it was made).
        probed = [n for n in gm.graph.nodes
                  if n.meta.get(M.CLASS) in _MAY_RUN_LOW and (fam := family[n]) is not None
                  and fam.probe and n not in writes and n in floats
                  and n not in self._planned
                  and not self._float_tensors.isdisjoint(n.all_input_nodes)]
        device = self._device()
        if device is None:
            if probed or not self._planned:
                _note(gm, f"kernels not probed: device '{self.policy.device}' is not available "
                          "here; transform on a machine that has it to check its low-precision "
                          "kernels")
            return
        # Imported here: the rest of this module needs only low_kernel_problem.
        from ..precision.kernels import NOT_CONFIRMED

        unconfirmed: dict[str, list[str]] = {}  # op -> nodes whose low kernel no probe ran
        verdicts: dict = {}  # nodes of the same signature: one template, one cache lookup
        for node in M.each_node_of(probed):
            fam = family[node]
            # A parameter-free module left as a call (nn.AvgPool3d in a Sequential) runs the
            # same kernels as its functional form: probed by calling it.
            module = self._module.get(node)
            problem = low_kernel_problem(node, low, device, fam, module, memo=verdicts)
            if problem is None:
                continue
            if problem.startswith(NOT_CONFIRMED):
                # No probe, no trust -- unless the user vouches for the kernel.
                if any(matches(node, sel) for sel in self.policy.allow_low):
                    continue
                op = type(module).__name__ if module is not None else qualified_name(node)
                unconfirmed.setdefault(op, []).append(node.name)
            node.meta[M.CLASS] = _P_FP32
            node.meta[M.REASON] = f"fp32 island: {problem}"
            node.meta.pop(M.TIED, None)
        for op, names in unconfirmed.items():
            shown = ", ".join(f"'node:{n}'" for n in names[:3]) + (", ..." if len(names) > 3
                                                                    else "")
            _note(gm, f"'{op}' ({len(names)} node{'s' * (len(names) > 1)}): {low} kernel on "
                      f"{device.type} not confirmed by a probe (no example inputs to take "
                      f"shapes from, or sizes the probe cannot rebuild): fp32; "
                      f"allow_low=[{shown}] to override")

    def _mixed(self, gm: fx.GraphModule, low: torch.dtype) -> None:
        """FP32 nodes whose kernel reads a low data input and computes in fp32 (a mixed
        signature of its family, confirmed by a probe on the target device) get
        ``meta[MIXED]``: the plan then needs no fp32 copy of that input."""
        device = self._device()
        if device is None:
            return  # not probed, not used (no probe, no trust)
        verdicts: dict = {}  # nodes of the same signature: one template, one cache lookup
        for node, why in self._registry_fp32.items():
            fam = self._family[node]
            # Only the registry's FP32: not a position cone, a keep_fp32 or an fp32 island;
            # nor a node a saved plan decided (its mixed signature is the plan's).
            if (node in self._planned or fam is None or not fam.mixed
                    or node.meta.get(M.REASON) is not why
                    or node.meta.get(M.CLASS) != _P_FP32 or info(node).kind != "tensor"):
                continue
            data = node.args[0] if node.args else None
            if not isinstance(data, fx.Node) or data not in self._float_tensors:
                continue
            module = self._module.get(node)
            problems = []
            for sig in fam.mixed:
                if sig is Mixed.DTYPE_ARG and node.kwargs.get("dtype") is not None:
                    if node.kwargs["dtype"] == torch.float32:  # the model's own spelling (or
                        node.meta[M.MIXED] = sig  # a transformed graph's): reads any input
                        break
                    continue  # converts to another dtype
                helper = None
                if sig is Mixed.FP32_HELPER:
                    helper = fp32_helper_of(node)
                    if helper is None:
                        continue  # a spelling the helper does not take (native_group_norm)
                problem = mixed_problem(node, sig, low, device, module, helper, memo=verdicts)
                if problem is None:
                    node.meta[M.MIXED] = sig
                    if problems:  # the helper, after the kernel refused: say why
                        node.meta[M.REASON] = f"{why}; the kernel itself refused: {problems[0]}"
                    break
                problems.append(problem)
            else:
                if problems:
                    node.meta[M.REASON] = f"{why}; reads an fp32 copy: {problems[0]}"

    @staticmethod
    def _note_unknown(gm: fx.GraphModule) -> None:
        unknown: dict[str, list[str]] = {}
        for node in gm.graph.nodes:
            if node.meta.get(M.FAMILY) is None and node.op in ("call_function", "call_method") \
                    and str(node.meta.get(M.REASON, "")).startswith("unknown op"):
                unknown.setdefault(qualified_name(node), []).append(node.name)
        for op, names in unknown.items():
            shown = ", ".join(f"'node:{n}'" for n in names[:3]) + (", ..." if len(names) > 3
                                                                    else "")
            _note(gm, f"unknown op '{op}' ({len(names)} node{'s' * (len(names) > 1)}): fp32; "
                      f"allow_low=[{shown}] to override")

    def _natural(self, gm: fx.GraphModule, low: torch.dtype) -> None:
        """Set ``meta[NATURAL]`` of every node, in topological order."""
        floats, family = self._floats, self._family
        for node in M.each_node(gm.graph):
            meta = node.meta
            cls = meta.get(M.CLASS)
            if node.op == "output" or cls == _P_NONFLOAT or node not in floats:
                natural = None
            elif cls is None:  # graph inputs and parameters: as given
                natural = LOW if info(node).float_dtype() == low else HIGH
            elif cls == _P_LOW:
                natural = LOW
            elif cls == _P_FP32:
                mixed = meta.get(M.MIXED)
                natural = HIGH
                if mixed is not None and mixed.stores_input_dtype:
                    # Computed in fp32 from a low input, stored as its input: autocast's rule
                    # for the value (a norm after a conv is low, one on the fp32 residual
                    # stream fp32).
                    data = node.args[0]
                    if isinstance(data, fx.Node) and data.meta.get(M.NATURAL) == LOW:
                        natural = LOW
            elif cls == _P_NEUTRAL and (fam := family[node]) is not None and (
                    fam.out is _CONVERT and is_conversion(node)
                    and conversion_target(node) == torch.float32):
                natural = HIGH  # an upcast in the model: fp32 by nature (ops._convert)
            elif cls == _P_PROMOTE and (fill := _inexact_fill(node, low)) is not None:
                # full_like(h, 0.01): the model makes the constant in h's dtype, fp32 there;
                # rounded to the low dtype (0.010002 in fp16) it moves every value computed
                # from it (a Normal's log_prob divides by its square). Made in fp32, as the
                # model makes it; a fill the low dtype holds exactly (0, 1, 0.5) follows h.
                natural = HIGH
                meta[M.REASON] = (f"{meta.get(M.REASON)}; fill value {fill!r} is not exact in "
                                  f"{low}: made in fp32, as the model makes it")
            else:
                inputs = [n.meta.get(M.NATURAL) for n in node.all_input_nodes if n in floats]
                if not inputs:
                    natural = HIGH  # a factory such as torch.ones(...): fp32 like the model
                elif meta.get(M.TIED):
                    natural = inputs[0]
                else:
                    natural = HIGH if HIGH in inputs or None in inputs else LOW
            meta[M.NATURAL] = natural

# Factories that make a tensor of their input's dtype filled with a number: (position, keyword).
_FILLS = {"full_like": (1, "fill_value"), "new_full": (2, "fill_value")}


def _inexact_fill(node: fx.Node, low: torch.dtype) -> float | None:
    """The fill value of ``full_like(x, v)`` / ``x.new_full(size, v)`` with no ``dtype=``, when
    the low dtype cannot hold it exactly; else None."""
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", None)
    where = _FILLS.get(name) if isinstance(name, str) else None
    if where is None or node.kwargs.get("dtype") is not None:
        return None
    pos, key = where
    fill = node.kwargs.get(key, node.args[pos] if len(node.args) > pos else None)
    if isinstance(fill, bool) or not isinstance(fill, (int, float)):
        return None
    exact = torch.tensor(fill, dtype=torch.float32)
    return None if bool(exact.to(low).float() == exact) else fill


def _saved_reason(entry: dict) -> str:
    """An entry's reason as painting gave it: without what insert_casts adds to a mixed-dtype
    op's reason (``"; reads bfloat16, ... (probed)"``), which it adds again."""
    why = str(entry.get("reason") or "decided by the saved plan")
    head, sep, tail = why.rpartition("; reads ")
    if sep and entry.get("mixed") and tail.endswith("(probed)"):
        return head
    return why


def _note(gm: fx.GraphModule, text: str) -> None:
    rep = gm.meta.get(REPORT_KEY)
    if rep is not None and text not in rep.notes:
        rep.notes.append(text)


def _show(sel: Selector) -> str:
    return sel.__name__ if isinstance(sel, type) else repr(sel)
