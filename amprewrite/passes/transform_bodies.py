"""transform_bodies: the body of each activation-checkpoint (or ``wrap``) region becomes a graph
transformed on its own, its outputs in the model's dtypes.

Matches:   ``out = tag_activation_checkpoint(body, x, ...)`` (``checkpoint_wrapper``,
           ``torch.utils.checkpoint`` under dynamo) and dynamo's plain ``wrap``
Rewrite to: the same call, ``body`` transformed by the whole pipeline (its decisions are listed
           in the outer report as ``<body>.<node>``), the call itself NONFLOAT
           (``meta[FORCE]``): its inputs enter as they come and its outputs leave in the
           model's dtypes.

The passes do not look inside a subgraph: without this the region is one op they do not know,
run in fp32, and a checkpointed transformer block would not run low at all. The boundary is
fp32, so the outer graph's plan stays valid whatever happens inside; the price is a cast at each
region input and output. Other higher-order ops (``cond``, ``map``, ``while_loop``) keep fp32
bodies: their bodies are called under conditions the passes do not model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from torch import fx

from ..capture.trace import annotate_dynamo_graph
from ..graph import meta as M
from ..precision.ops import Precision
from ..precision.report import REPORT_KEY, Report, decisions_of
from .base import Kind, Pass

__all__ = ["BODY_OPS", "TransformBodies"]

# Higher-order ops whose first argument is a subgraph called once on the other arguments, its
# outputs returned as they are.
BODY_OPS = frozenset({"tag_activation_checkpoint", "wrap"})


class TransformBodies(Pass):
    """Transform each region body with the pipeline ``run_inner`` (set by
    :func:`amprewrite.passes.pipeline`), and force the region call FP32."""

    name, kind = "transform_bodies", Kind.REWRITE
    writes = (M.FORCE,)
    # (body, policy, inputs, fp8_prior) -> the transformed body: the whole pipeline, its float8
    # check run on ``inputs`` (set by passes.pipeline).
    run_inner: Callable[..., fx.GraphModule] | None = None
    # Set by passes.pipeline(...): float8 errors by qualified node name (``<body>.<node>``) the
    # plan must also hold for (amprewrite.compile.block_plans), as Float8Linears.prior.
    fp8_prior: Mapping[str, tuple[float, float]] | None = None
    # across ranks (amprewrite.compile.block_plans.across_ranks)
    reduce: Callable[..., dict] | None = None

    def run(self, gm: fx.GraphModule) -> bool:
        inner = dataclasses.replace(self.policy, keep_io_dtype=True)
        # Each body's inputs on the example inputs (record_ranges keeps them with fp8): its
        # float8 candidates are checked on them, as the outer graph's are on its own.
        inputs = gm.meta.pop(M.BODY_INPUTS_KEY, {})
        changed = False
        for node in list(gm.graph.nodes):
            name = getattr(node.target, "__name__", "")
            if node.op != "call_function" or name not in BODY_OPS or not node.args:
                continue
            body_ref = node.args[0]
            if not (isinstance(body_ref, fx.Node) and body_ref.op == "get_attr"):
                continue
            body = gm.get_submodule(str(body_ref.target))
            if not isinstance(body, fx.GraphModule) or self.run_inner is None:
                continue
            node.meta[M.FORCE] = (Precision.NONFLOAT, f"{name} region: its body is transformed "
                                  "as its own graph, its inputs and outputs in the model's dtypes")
            if REPORT_KEY in body.meta:
                continue  # transformed already: a body two regions call
            annotate_dynamo_graph(body.graph)
            for inner_node in body.graph.nodes:  # the body's nodes belong to the outer module
                if not inner_node.meta.get(M.MODULE_PATH):
                    inner_node.meta[M.MODULE_PATH] = node.meta.get(M.MODULE_PATH, "")
            report = Report(dtype=str(inner.dtype).replace("torch.", ""), capture="dynamo")
            body.meta[REPORT_KEY] = report
            prefix = str(body_ref.target)
            prior = {k[len(prefix) + 1:]: v for k, v in (self.fp8_prior or {}).items()
                     if k.startswith(prefix + ".")}
            # a saved plan's entries for this body (saved as <body>/<key>, decisions_of)
            scoped = inner if inner.plan is None else dataclasses.replace(
                inner, plan=inner.plan.scoped(prefix))
            new_body = self.run_inner(body, scoped, inputs.get(prefix), prior, self.reduce)
            found = new_body.meta.get(M.FP8_ERRORS_KEY)
            # by qualified name, in the outer graph's errors (amprewrite.compile.block_plans)
            if found:
                errors = gm.meta.setdefault(M.FP8_ERRORS_KEY, {})
                errors.update({f"{prefix}.{k}": v for k, v in found.items()})
            report.decisions = decisions_of(new_body, inner)
            if new_body is not body:
                gm.set_submodule(str(body_ref.target), new_body)
            changed = True
            counts = report.counts()
            outer = gm.meta.get(REPORT_KEY)
            if outer is not None:
                outer.notes.append(
                    f"{node.name}: the {name} region's body was transformed as its own graph "
                    f"({counts.get('low', 0)} low ops, {counts.get('cast', 0)} casts; its "
                    f"nodes are listed as {prefix}.<node>), its inputs taken as they come and "
                    "its outputs in the model's dtypes")
        return changed
