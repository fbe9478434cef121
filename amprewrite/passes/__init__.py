"""The pass pipeline: one list, in order, with the reason for each position.

A pass is a callable ``GraphModule -> PassResult``. After each pass the graph is linted and the
module recompiled; a failing pass is re-raised as :class:`~amprewrite.errors.PassError` naming
the pass and the node it was on.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from torch import fx
from torch.fx.passes.infra.pass_base import PassResult

from ..errors import AmpRewriteError, PassError
from ..meta import current_node
from ..policy import Policy
from .freeze_dtype_reads import freeze_dtype_reads
from .functionalize import functionalize
from .infer_dtypes import infer_dtypes
from .insert_casts import InsertCasts
from .normalize import normalize_modules
from .paint_precision import PaintPrecision
from .replace_upsample import ReplaceUpsample
from .store_params import StoreParams
from .vectorize_loops import vectorize_loops

__all__ = ["pipeline", "run_pipeline"]

Pass = Callable[[fx.GraphModule], PassResult]


def pipeline(policy: Policy) -> list[tuple[str, Pass]]:
    """The passes of a transform, in the order they run."""
    return [
        # First: every later pass sees functional ops with get_attr weights, like dynamo's IR.
        ("normalize_modules", normalize_modules),
        # Needs the get_attr nodes normalize made; everything after reads meta[ORIG].
        ("infer_dtypes", infer_dtypes),
        # Right after: every later pass may assume no node changes a value another one reads
        # (casts are placed right after values). Needs dtypes for in-place type promotion and
        # after normalize, which lowers ReLU(inplace=True) to F.relu(..., inplace=True).
        ("functionalize", functionalize),
        # Before painting: a frozen x.dtype turns h.to(x.dtype) into a visible conversion.
        ("freeze_dtype_reads", freeze_dtype_reads),
        # Rewrite passes (exact, dtype-independent) go here: painting sees the final ops.
        # First of them: re-rolling shrinks an unrolled loop B-fold for every later pass.
        ("vectorize_loops", vectorize_loops),
        # Needs meta[ORIG] (ranks) from infer_dtypes; forces fp32 islands that painting honours.
        ("replace_upsample", ReplaceUpsample(policy)),
        ("paint_precision", PaintPrecision(policy)),
        ("insert_casts", InsertCasts(policy)),
        # Last: it replaces weight casts that insert_casts made with stored low copies.
        ("store_params", StoreParams(policy)),
    ]


def run_pipeline(gm: fx.GraphModule, passes: list[tuple[str, Pass]],
                 timings: dict[str, float] | None = None,
                 on_pass: Callable[[str, fx.GraphModule], None] | None = None
                 ) -> fx.GraphModule:
    """Run ``passes`` on ``gm`` in order, linting and recompiling after each.

    ``on_pass(name, gm)`` is called after each pass (the CLI's ``--per-pass`` dumps).
    """
    done: list[str] = []
    for name, fn in passes:
        start = time.perf_counter()
        try:
            result = fn(gm)
            gm = result.graph_module
            gm.graph.lint()
            gm.recompile()
        except AmpRewriteError:
            raise
        except Exception as exc:
            node = current_node()
            where = f" on node {node.format_node()}" if node is not None else ""
            raise PassError(
                f"amprewrite pass '{name}' failed{where} (after {', '.join(done) or 'no pass'}): "
                f"{type(exc).__name__}: {exc}. This is a bug in amprewrite; please report it "
                "with the model. keep_fp32=[<module path>] around the failing node may work "
                "around it."
            ) from exc
        done.append(name)
        if timings is not None:
            timings[name] = time.perf_counter() - start
        if on_pass is not None:
            on_pass(name, gm)
    return gm
