"""plan_casts: decide the dtype every float value is stored in (``meta[LABEL]``), the cast plan.

No graph change: :func:`amprewrite.precision.cast_plan.plan_labels` picks, per value, whether it is
stored fp32 (HIGH) or low (LOW) so that the bytes the casts move are fewest (a min-cut over the
data-flow graph, see DESIGN.md and docs/guide.md "The cast plan"); ``insert_casts`` then realises
the plan with ``Tensor.to`` nodes.

>>> import torch
>>> from amprewrite.capture.trace import capture
>>> from amprewrite.passes import run_until
>>> from amprewrite.precision.policy import Policy
>>> from amprewrite.precision.report import REPORT_KEY, Report
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Softmax(-1))
>>> gm = capture(model).gm
>>> gm.meta[REPORT_KEY] = Report(dtype="bfloat16", capture="symbolic_trace")
>>> gm = run_until(gm, Policy(dtype=torch.bfloat16), "plan_casts")
>>> from amprewrite.graph import meta as M
>>> {n.name: n.meta[M.LABEL].value for n in gm.graph.nodes if n.meta.get(M.LABEL)}
... # doctest: +NORMALIZE_WHITESPACE
{'input_1': 'high', '_0_weight': 'high', '_0_bias': 'high', 'linear': 'low',
 'softmax': 'high'}
"""

from __future__ import annotations

from torch import fx

from ..graph import meta as M
from ..precision.cast_plan import plan_labels
from .base import Kind, Pass

__all__ = ["PlanCasts"]


class PlanCasts(Pass):
    """Set ``meta[LABEL]`` on every float value (:mod:`amprewrite.precision.cast_plan`)."""

    name, kind = "plan_casts", Kind.ANALYSIS
    requires = (M.ORIG, M.CLASS, M.NATURAL, M.TIED, M.MIXED)
    writes = (M.LABEL,)

    def run(self, gm: fx.GraphModule) -> bool:
        plan_labels(gm, self.policy.keep_io_dtype, self.policy.dtype, training=gm.training)
        return False  # meta only
