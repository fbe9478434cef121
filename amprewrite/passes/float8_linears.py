"""float8_linears: with ``fp8=``, the bf16 linears that pay and stay accurate run in float8.

Matches (after the casts are placed, in a bf16 plan):
    ``y = linear(x_bf16, w.to(bf16), b.to(bf16))`` a LOW linear whose weight is a parameter
    (a get_attr, or a graph input in the torch.compile backend), K and N divisible by 16; and
    the weight matmuls ``addmm(b, x, w)`` (GPT-2's Conv1D), ``mm(x, w)``, ``x @ w`` (w.t()
    is the linear's weight)
Rewrite to:
    ``y = float8.graph_linear(x_bf16, w, b.to(bf16), recipe)``: torchao's Float8Linear forward
    and backward on the fp32 master weight where a gradient is asked for, the same forward in
    plain ops otherwise (inference, and always under torch.export); the weight's bf16 cast goes
    when nothing else reads it

Each candidate gets a verdict, recorded in ``meta[FLOAT8]`` and the report: the
``include``/``exclude`` selectors first, then the cost model
(:func:`amprewrite.precision.float8.speedup` on the example inputs' rows), then the numerics check:
the graph runs once on the example inputs and each candidate's float8 error on its own inputs is
compared with its bf16 error (:func:`errors`; docs/guide.md, "float8", and docs/design-notes.md).
Without example inputs (fake inputs in the backend, a checkpointed region's body) nothing is
measured and every linear stays bf16, saying so.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import fx

from ..capture.verify import rel_err, replayed
from ..graph import meta as M
from ..graph.shapes import split_inputs
from ..precision import float8 as f8
from ..precision.ops import Precision, is_plain_matmul
from ..precision.policy import matches
from ..precision.report import record
from .base import Kind, Pass, arguments, given_parameters, matmul_operands

__all__ = ["Float8Linears", "errors", "worse"]


def worse(a: tuple[float, float] | None, b: tuple[float, float]) -> tuple[float, float]:
    """Of two (bf16 error, float8 error) pairs of one linear (on two blocks, ranks or
    batches), the one whose float8 error is the larger multiple of its bf16 error.

    >>> worse((1e-3, 2e-3), (1e-3, 9e-3))
    (0.001, 0.009)
    """
    if a is None:
        return b
    return max(a, b, key=lambda e: f8.accepted(e[0], e[1], 1.0)[1])


def _source(value: object) -> object:
    """The value an inserted cast converts (a weight's fp32 parameter), else ``value``."""
    if isinstance(value, fx.Node) and M.CAST in value.meta and value.args:
        return value.args[0]
    return value


def _operands(gm: fx.GraphModule, node: fx.Node) -> tuple | None:
    """(data, weight, bias, transposed) of a plain matmul, else None: ``linear(x, w, b)`` with
    w (N, K); ``addmm(b, x, w)``, ``mm(x, w)``, ``x @ w`` with w (K, N) (``transposed``)."""
    if not is_plain_matmul(node):
        return None
    found = matmul_operands(node, arguments(gm, node))
    if found is None:
        return None
    args, data, weight, bias = found
    return args[data], args[weight], args.get(bias) if bias else None, weight != "weight"


@torch.no_grad()
def errors(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, recipe: str,
           low: torch.dtype = torch.bfloat16) -> tuple[float, float]:
    """(bf16 error, float8 error) of one linear on these operands: the relative L2 error of
    ``F.linear`` in ``low`` and of :func:`amprewrite.precision.float8.linear` against fp64."""
    ref = F.linear(input.double(), weight.double(), None if bias is None else bias.double())
    x = input.to(low)
    b = None if bias is None else bias.to(low)
    return (rel_err(F.linear(x, weight.to(low), b), ref),
            rel_err(f8.linear(x, weight, b, recipe), ref))


def _local_shapes(gm: fx.GraphModule, example_inputs: object) -> dict[fx.Node, tuple]:
    """The shape of each placeholder handed a DTensor (tensor parallel) on this rank: the
    matmul this rank runs is its shard's, which the cost model and the divisible-by-16 rule
    must read."""
    given = example_inputs if isinstance(example_inputs, (tuple, list)) else ()
    holders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return {n: tuple(v.to_local().shape) for n, v in zip(holders, given)
            if isinstance(v, torch.Tensor) and hasattr(v, "to_local")}


class _Candidate:
    def __init__(self, node: fx.Node, x: fx.Node, w: fx.Node, b: object, m: int, k: int, n: int):
        self.node, self.x, self.w, self.b = node, x, w, b
        self.m, self.k, self.n = m, k, n
        self.errors: tuple[float, float] | None = None
        self.pays = 0.0  # the cost model's speedup
        self.transposed = False  # the weight is stored (K, N): addmm / matmul, not linear
        self.failed: str | None = None  # why float8 could not run on the example inputs


class _ErrorRecorder(fx.Interpreter):
    """Runs the graph and, at each candidate, measures its bf16 and float8 errors on the values
    it reads (the bf16 plan's input, the weight's source)."""

    def __init__(self, gm: fx.GraphModule, found: dict[fx.Node, _Candidate], recipe: str,
                 low: torch.dtype):
        super().__init__(gm)
        self.found, self.recipe, self.low = found, recipe, low

        self.weights = {c.w for c in found.values()}
        self.kept: dict[fx.Node, torch.Tensor] = {}  # the weights: the interpreter frees them

    def run_node(self, n: fx.Node) -> object:
        out = super().run_node(n)
        if n in self.weights:
            self.kept[n] = out
        c = self.found.get(n)
        if c is not None:
            # n's own arguments are still in env here (freed after run_node returns)
            x = self.env[c.x]
            b = self.env[c.b] if isinstance(c.b, fx.Node) else c.b
            w = self.kept[c.w]
            try:
                c.errors = errors(x, w.t() if c.transposed else w, b, self.recipe, self.low)
            except Exception as exc:  # a float8 kernel that refuses these operands: bf16
                first = str(exc).splitlines()[0] if str(exc) else ""
                c.failed = f"{type(exc).__name__}: {first}"
        return out


class Float8Linears(Pass):
    name, kind = "float8_linears", Kind.REWRITE
    requires = (M.CLASS, M.FAMILY, M.CAST)
    writes = (M.ORIG, M.FLOAT8, M.CLASS, M.FAMILY, M.REASON, M.LABEL, M.NATURAL)
    example_inputs: object = None  # set by passes.pipeline(...)
    # Set by passes.pipeline(...): (bf16 error, float8 error) by node name measured on other
    # blocks the plan must also hold for, and a function that widens them across ranks
    # (amprewrite.compile.block_plans.across_ranks), or None. The worse pair of each linear decides.
    prior: dict[str, tuple[float, float]] | None = None
    reduce: object = None

    @property
    def needs_code(self) -> bool:
        return self.policy is not None and self.policy.fp8 is not None and (
            self.example_inputs is not None)

    def run(self, gm: fx.GraphModule) -> bool:
        spec = self.policy.fp8 if self.policy is not None else None
        if spec is None:
            return False
        candidates, verdicts = self._candidates(gm, spec)
        checked = [c for c in candidates if verdicts[c.node] is None]
        if checked and self.example_inputs is not None:
            self._measure(gm, {c.node: c for c in checked}, spec.recipe)
            self._widen(gm, checked)
        changed = False
        f8.configs(spec.recipe)  # made here, outside any torch.compile (see float8._CONFIGS)
        for c in candidates:
            verdict = verdicts[c.node] or self._judge(c, spec)
            c.node.meta[M.FLOAT8] = verdict
            if verdict.startswith("fp8"):
                self._rewrite(gm, c, spec.recipe, verdict)
                changed = True
        return changed

    def _saved_verdicts(self, gm: fx.GraphModule) -> dict[fx.Node, str]:
        """With a saved plan: each linear's float8 verdict as saved (not measured again)."""
        plan = self.policy.plan
        if plan is None:
            return {}
        keys = {n: k for n in gm.graph.nodes if (k := n.meta.get(M.PLAN_KEY)) is not None}
        decided = [n for n in keys if n.meta.get(M.CLASS) not in (None, Precision.NONFLOAT)]
        found = plan.match(keys, decided)
        return {n: str(e["fp8"]) for n, e in found.entries.items() if e.get("fp8")}

    def _candidates(self, gm: fx.GraphModule, spec: f8.Float8):
        training = gm.training
        out, verdicts = [], {}
        saved = self._saved_verdicts(gm)
        params = given_parameters(gm, self.example_inputs)
        local = _local_shapes(gm, self.example_inputs)
        for node in list(gm.graph.nodes):
            if node.meta.get(M.CLASS) != Precision.LOW:
                continue
            found = _operands(gm, node)
            if found is None:
                continue
            x, w, b, transposed = found
            w = _source(w)
            if not (isinstance(x, fx.Node) and isinstance(w, fx.Node)
                    and (w.op == "get_attr" or w in params)):
                continue
            xi, wi = M.info(x), M.info(w)
            if not (xi.shape and wi.shape and len(wi.shape) == 2 and None not in wi.shape
                    and xi.numel):
                continue
            shape = local.get(w, wi.shape)  # under tensor parallel: this rank's shard
            n, k = reversed(shape) if transposed else shape
            c = _Candidate(node, x, w, b, xi.numel // max(wi.shape[0 if transposed else 1], 1),
                           k, n)
            c.transposed = transposed
            out.append(c)
            size = f"{k}x{n} on {c.m} rows"
            if node in saved:
                verdicts[node] = saved[node]
            elif any(matches(node, s) for s in spec.exclude):
                verdicts[node] = f"bf16: {size}, excluded by fp8 exclude"
            elif k % 16 or n % 16:
                verdicts[node] = (f"bf16: {size}, float8 GEMMs need K and N divisible by 16")
            elif any(matches(node, s) for s in spec.include):
                verdicts[node] = f"fp8 ({spec.recipe}): {size}, included by fp8 include"
            else:
                pays = f8.speedup(c.m, k, n, training, spec.target,
                                  weight_bytes=(wi.dtype or torch.float32).itemsize)
                if pays < spec.min_speedup:
                    verdicts[node] = (f"bf16: {size}, too small to pay (cost model: "
                                      f"{pays:.2g}x bf16's speed on {spec.target}, needs "
                                      f"{spec.min_speedup:g}x)")
                elif self.example_inputs is None:
                    verdicts[node] = (f"bf16: {size}, no example inputs to check its float8 "
                                      "numerics on")
                else:
                    c.pays = pays
                    verdicts[node] = None  # to check
        return out, verdicts

    def _measure(self, gm: fx.GraphModule, found: dict[fx.Node, _Candidate], recipe: str
                 ) -> None:
        args, kwargs = split_inputs(self.example_inputs)
        bound = inspect.signature(gm.forward).bind(*args, **kwargs).args
        with replayed(gm) as replay, torch.no_grad():
            replay(lambda _: _ErrorRecorder(gm, found, recipe, self.policy.dtype).run(*bound),
                   self.example_inputs)

    def _widen(self, gm: fx.GraphModule, checked: list[_Candidate]) -> None:
        """Each candidate's errors widened with the prior ones and across ranks; kept by name
        in ``gm.meta[FP8_ERRORS_KEY]`` for the next plan of the same graph."""
        named = {c.node.name: c.errors for c in checked if c.errors is not None}
        for name, pair in (self.prior or {}).items():
            named[name] = worse(named.get(name), pair)
        if self.reduce is not None:
            named = self.reduce(named, worse)
        for c in checked:
            if c.node.name in named and c.failed is None:
                c.errors = named[c.node.name]
        # merged with a checkpointed body's, which transform_bodies put there by qualified name
        gm.meta[M.FP8_ERRORS_KEY] = {**gm.meta.get(M.FP8_ERRORS_KEY, {}), **named}

    @staticmethod
    def _judge(c: _Candidate, spec: f8.Float8) -> str:
        size = f"{c.k}x{c.n} on {c.m} rows"
        if c.failed is not None:
            return f"bf16: {size}, float8 failed on the example inputs ({c.failed})"
        if c.errors is None:
            return f"bf16: {size}, not reached on the example inputs"
        e_low, e_fp8 = c.errors
        ok, ratio = f8.accepted(e_low, e_fp8, spec.bound)
        limit = spec.bound * f8.E4M3_VS_BF16
        pays = (f"{c.pays:.2g}x bf16's speed on {spec.target}" if spec.min_speedup > 0
                else "cost model off (min_speedup=0)")
        if ok:
            return (f"fp8 ({spec.recipe}): {size}, {pays}, error {ratio:.1f}x bf16's "
                    f"(bound {limit:g}x)")
        return (f"bf16: {size}, float8 error {ratio:.1f}x bf16's on the example inputs, "
                f"above the bound {limit:g}x ({e_fp8:.3g} against {e_low:.3g})")

    def _rewrite(self, gm: fx.GraphModule, c: _Candidate, recipe: str, verdict: str) -> None:
        node = c.node
        # The operands as they are now: an earlier rewrite may have replaced the data input
        # (two float8 linears in a row).
        x, old_w, b, _ = _operands(gm, node)
        with gm.graph.inserting_before(node):
            fn = f8.graph_linear  # torchao's function, or plain ops where no gradient is asked
            w = gm.graph.call_function(torch.t, (c.w,)) if c.transposed else c.w
            if w is not c.w:
                w.meta.update({k: v for k, v in node.meta.items() if k in M.PROVENANCE})
                w.meta[M.ORIG] = M.ValueInfo("tensor", M.info(c.w).dtype, M.info(c.w).numel,
                                             shape=(c.n, c.k))
            new = gm.graph.call_function(fn, (x, w, b, recipe))
        new.meta.update(node.meta)
        name = node.name
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        new._rename(name)  # the report's and selectors' name for it stays
        if isinstance(old_w, fx.Node) and old_w is not c.w and not old_w.users:
            gm.graph.erase_node(old_w)  # the weight's bf16 cast, read by nothing else now
        record(gm, new, "float8", verdict)
