"""The pass pipeline: one list, in order, with the reason for each position.

Each pass is a :class:`~amprewrite.passes.base.Pass` bound to the policy. :func:`run_pipeline`
checks that every meta key a pass requires is written by capture or an earlier pass, runs the
passes with their names current (for the report and for errors), and lints and recompiles once
at the end (after every pass in debug mode: ``AMPREWRITE_DEBUG=1`` or ``debug=True``). A failing
pass is re-raised as :class:`~amprewrite.errors.PassError` naming the pass and the node it was on.

The passes import ``amprewrite.graph``, ``amprewrite.precision`` and ``amprewrite.capture``
(a pass that runs the model, as ``record_ranges`` and ``verify_output`` do); nothing above.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable, Mapping, Sequence

from torch import fx, nn

from ..errors import AmpRewriteError, PassError
from ..graph import meta as M
from ..graph.codegen import refresh
from ..precision.policy import Policy
from ..precision.ranges import ValueRange
from ..progress import detail
from .base import CAPTURED, Kind, Pass
from .float8_linears import Float8Linears
from .freeze_dtype_reads import FreezeDtypeReads
from .functionalize import Functionalize
from .guard_autocast import GuardAutocast
from .infer_dtypes import InferDtypes
from .insert_casts import InsertCasts
from .normalize import NormalizeModules
from .paint_precision import PaintPrecision
from .plan_casts import PlanCasts
from .recompute_islands import RecomputeIslands
from .record_ranges import RecordRanges
from .replace_upsample import ReplaceUpsample
from .rescale_matmuls import RescaleMatmuls
from .simplify_attention_masks import SimplifyAttentionMasks
from .store_params import StoreParams
from .transform_bodies import TransformBodies
from .vectorize_loops import VectorizeLoops
from .verify_output import VerifyOutput

__all__ = ["PASSES", "Kind", "Pass", "check_order", "pipeline", "rewrite_passes", "run_pass",
           "run_pipeline", "run_until"]

PASSES: tuple[type[Pass], ...] = (
    # First: every later pass sees functional ops with get_attr weights, like dynamo's IR.
    NormalizeModules,
    # Needs the get_attr nodes normalize made; everything after reads meta[ORIG].
    InferDtypes,
    # Right after: every later pass may assume no node changes a value another one reads
    # (casts are placed right after values). Needs dtypes for in-place type promotion and
    # after normalize, which lowers ReLU(inplace=True) to F.relu(..., inplace=True).
    Functionalize,
    # Before painting: a frozen x.dtype turns h.to(x.dtype) into a visible conversion.
    FreezeDtypeReads,
    # Rewrite passes (exact, dtype-independent) go here: painting sees the final ops.
    # First of them: re-rolling shrinks an unrolled loop B-fold for every later pass.
    VectorizeLoops,
    # Needs meta[ORIG] (ranks) from infer_dtypes; forces fp32 islands that painting honours.
    ReplaceUpsample,
    # A traced transformers model hands SDPA a mask built from sizes alone; where it masks
    # nothing (or is causal) it goes, before record_ranges and painting spend time on it.
    SimplifyAttentionMasks,
    # After every rewrite (it records the values of the ops painting will see), before
    # painting, which reads the ranges like a precision class.
    RecordRanges,
    # A checkpointed region's body is a graph of its own, transformed by this whole pipeline
    # (TransformBodies.run_inner), its call kept at the boundary. After record_ranges, which
    # records the bodies' values too (the inner pipeline has no inputs to run them on); before
    # painting, which reads the region call's class.
    TransformBodies,
    # Reads the ranges: a matmul past the range runs low on operands scaled by a power of two
    # (exact), scaled back in fp32; painting then classes the nodes it made.
    RescaleMatmuls,
    PaintPrecision,
    # The cast plan (which dtype each value is stored in), then the casts that realise it.
    PlanCasts,
    InsertCasts,
    # It replaces weight casts that insert_casts made with stored low copies.
    StoreParams,
    # With fp8=: after the casts and stored weights are final (it runs the bf16 graph to check
    # each candidate on the inputs it will really read, and takes the weight from before its
    # bf16 cast); before recompute_islands, which outlines what surrounds the matmuls.
    Float8Linears,
    # In train mode, after every cast is in place: fp32 pointwise regions that read low values
    # are outlined and recomputed in backward (the same values, fewer bytes kept).
    RecomputeIslands,
    # After every rewrite, so the graph's first and last calls stay first and last; before
    # verification, which runs the graph as the user will (inside an autocast too).
    GuardAutocast,
    # Last: the finished graph against fp32 and autocast on the example inputs.
    VerifyOutput,
)


def pipeline(policy: Policy, model: nn.Module | None = None,
             example_inputs: object = None,
             declared: dict[str, tuple[str, str]] | None = None,
             prior: Mapping[str, ValueRange] | None = None,
             reduce: Callable[..., dict] | None = None,
             fp8_prior: Mapping[str, tuple[float, float]] | None = None) -> list[Pass]:
    """The passes of a transform, in the order they run, bound to ``policy``; ``model`` and
    ``example_inputs`` are what ranges are recorded on and the last step verifies the graph
    against (none: no check), and ``model`` what declares parameters fp32 (``declared``: the
    graph's own names of declared parameters, by get_attr or placeholder target, each with
    (attribute, parameter name), where the graph does not name them as the model does).
    ``prior`` and ``reduce``: ranges by node name the plan must also hold for, and how ranges
    (and float8 errors) are widened across ranks
    (:class:`~amprewrite.passes.record_ranges.RecordRanges`); ``fp8_prior``: float8 errors by
    node name it must also hold for (:class:`~amprewrite.passes.float8_linears.Float8Linears`)."""
    passes = [cls(policy) for cls in PASSES]
    for p in passes:
        if isinstance(p, TransformBodies):
            # a body's nodes are named <body>.<node> (record_ranges.qualified_names)
            p.run_inner, p.reduce = _run_inner, reduce
            p.fp8_prior = {k: v for k, v in (fp8_prior or {}).items() if "." in k}
        elif isinstance(p, (RecordRanges, RescaleMatmuls, Float8Linears)):
            p.example_inputs = example_inputs
            if isinstance(p, RecordRanges):
                p.prior, p.reduce = prior, reduce
            elif isinstance(p, Float8Linears):
                p.prior = {k: v for k, v in (fp8_prior or {}).items() if "." not in k}
                p.reduce = reduce
        elif isinstance(p, PaintPrecision):
            p.declared, p.model = declared, model
        elif isinstance(p, VerifyOutput):
            p.model, p.example_inputs = model, example_inputs
    return passes


def _run_inner(gm: fx.GraphModule, policy: Policy, inputs: tuple | None = None,
               fp8_prior: Mapping[str, tuple[float, float]] | None = None,
               reduce: Callable[..., dict] | None = None) -> fx.GraphModule:
    """A region body through the whole pipeline: no inputs to record ranges on (the outer
    graph recorded them), its float8 candidates checked on ``inputs`` where given (with the
    outer graph's ``fp8_prior`` for the body and ``reduce``)."""
    passes = pipeline(policy)
    for p in passes:
        if isinstance(p, Float8Linears) and inputs is not None:
            p.example_inputs, p.prior, p.reduce = inputs, dict(fp8_prior or {}), reduce
    return run_pipeline(gm, passes)


def rewrite_passes() -> frozenset[str]:
    """Names of the passes whose nodes renderers draw as rewritten."""
    return frozenset(cls.name for cls in PASSES if cls.kind is Kind.REWRITE)


def check_order(passes: Sequence[Pass]) -> None:
    """Raise if a pass requires a meta key that neither capture nor an earlier pass writes."""
    available = set(CAPTURED)
    for p in passes:
        missing = [k for k in p.requires if k not in available]
        if missing:
            raise PassError(
                f"amprewrite pass '{p.name}' requires node.meta keys {missing} that no earlier "
                "pass writes; move it after the pass that writes them (see "
                "amprewrite/graph/meta.py)."
            )
        available.update(p.writes)


def _debug() -> bool:
    return os.environ.get("AMPREWRITE_DEBUG", "") not in ("", "0")


def run_pipeline(gm: fx.GraphModule, passes: Sequence[Pass],
                 timings: dict[str, float] | None = None,
                 on_pass: Callable[[str, fx.GraphModule], None] | None = None,
                 debug: bool | None = None) -> fx.GraphModule:
    """Run ``passes`` on ``gm`` in order; lint and recompile once at the end.

    ``on_pass(name, gm)`` is called after each pass with the module recompiled (the CLI's
    ``--per-pass`` dumps). ``debug`` (default: ``AMPREWRITE_DEBUG``) lints and recompiles after
    every pass that changed the graph, and checks that a pass wrote only the meta keys it declares.
    Python's cyclic garbage collector is paused while it runs (and left as it was).
    """
    check_order(passes)
    debug = _debug() if debug is None else debug
    # The passes allocate many small objects and free few: a full collection of the cyclic
    # collector traverses the whole graph for nothing (~10 us per node at 20,000 nodes, see
    # docs/benchmarks.md; the pause costs ~4% more peak memory). Paused for the passes and the
    # code generation, restored as it was.
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _run(gm, passes, timings, on_pass, debug)
    finally:
        if enabled:
            gc.enable()


def _run(gm: fx.GraphModule, passes: Sequence[Pass], timings: dict[str, float] | None,
         on_pass: Callable[[str, fx.GraphModule], None] | None, debug: bool) -> fx.GraphModule:
    done: list[str] = []
    stale = False
    for i, p in enumerate(passes):
        start = time.perf_counter()
        before = _meta_keys(gm) if debug else None
        try:
            detail(p.name)
            with M.running_pass(p.name):
                modified = p.run(gm)
            if before is not None:
                _check_writes(p, before, _meta_keys(gm))
        except AmpRewriteError:
            raise
        except Exception as exc:
            raise _pass_error(p.name, done, exc) from exc
        done.append(p.name)
        if timings is not None:
            timings[p.name] = time.perf_counter() - start
        stale = stale or bool(modified)
        following = passes[i + 1] if i + 1 < len(passes) else None
        # One lint and recompile at the end, and before a pass that runs the graph
        # (``needs_code``); after each pass that changed it where each is checked or shown.
        if stale and (following is None or getattr(following, "needs_code", False)
                      or debug or on_pass is not None):
            start = time.perf_counter()
            try:
                refresh(gm)
            except Exception as exc:
                raise _pass_error("lint and recompile", done, exc) from exc
            stale = False
            if timings is not None:
                timings["recompile"] = time.perf_counter() - start
        if on_pass is not None:
            on_pass(p.name, gm)
    return gm


def run_until(gm: fx.GraphModule, policy: Policy, last: str, *,
              include: bool = True) -> fx.GraphModule:
    """Run the pipeline up to the pass named ``last`` (and it, unless ``include=False``): a
    test prepares a graph with the passes before one, then runs that one with :func:`run_pass`."""
    passes = pipeline(policy)
    names = [p.name for p in passes]
    if last not in names:
        raise ValueError(f"no pass named {last!r}; the passes are {names}")
    return run_pipeline(gm, passes[:names.index(last) + include])


def run_pass(gm: fx.GraphModule, p: Pass) -> bool:
    """Run one pass alone (its name current), then lint and recompile; True if it changed gm."""
    with M.running_pass(p.name):
        modified = p.run(gm)
    refresh(gm)
    return bool(modified)


def _meta_keys(gm: fx.GraphModule) -> dict[fx.Node, frozenset[str]]:
    return {n: frozenset(k for k in n.meta if k.startswith("amp_")) for n in gm.graph.nodes}


def _check_writes(p: Pass, before: dict[fx.Node, frozenset[str]],
                  after: dict[fx.Node, frozenset[str]]) -> None:
    for node, keys in after.items():
        new = keys - before.get(node, frozenset()) - set(p.writes) - set(CAPTURED)
        if new:
            raise PassError(
                f"amprewrite pass '{p.name}' wrote node.meta keys {sorted(new)} on "
                f"{node.name} that it does not declare in `writes`."
            )


def _pass_error(name: str, done: list[str], exc: Exception) -> PassError:
    node = M.current_node()
    where = f" on node {node.format_node()}" if node is not None else ""
    return PassError(
        f"amprewrite pass '{name}' failed{where} (after {', '.join(done) or 'no pass'}): "
        f"{type(exc).__name__}: {exc}. This is a bug in amprewrite; please report it "
        "with the model. keep_fp32=[<module path>] around the failing node may work "
        "around it."
    )
