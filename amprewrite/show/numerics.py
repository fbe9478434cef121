"""Numerics tools: per-node error against fp32, the first non-finite node, and a guided search
for the fp32 nodes that make a model meet a tolerance.

>>> import torch, amprewrite
>>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Softmax(-1))
>>> result = amprewrite.check_numerics(model, (torch.randn(2, 8),), dtype=torch.bfloat16)
>>> result.finite and result.output_error < 1e-2
True
"""

from __future__ import annotations

import torch
from torch import fx, nn

from ..api import transform
from ..capture.trace import keep_captured
from ..capture.verify import (
    CheckResult,
    NodeError,
    compare,
    culprit_node,
    float_leaves,
    rel_err,
    verify_bound,
    verify_graph,
)
from ..progress import status

__all__ = ["CheckResult", "NodeError", "check_numerics", "find_fp32_nodes", "float_leaves",
           "rel_err", "verify_bound", "verify_graph"]


def check_numerics(model: nn.Module, example_inputs: object, dtype=torch.bfloat16,
                   gm: fx.GraphModule | None = None, **options) -> CheckResult:
    """Run ``model`` in fp32 and transformed on the same inputs; compare outputs and nodes.

    ``options`` are :func:`amprewrite.transform`'s keywords (``gm``: an already transformed
    graph to compare instead). Nodes are matched by name between the fp32 captured graph and
    the transformed one (amprewrite keeps the names it captured). Every run starts from the
    same random state with random ops drawing as in fp32, so a model in train mode is compared
    with equal dropout masks; buffers (BatchNorm statistics) are restored after each run, so
    ``model`` ends as it began.
    """
    if gm is not None:
        return compare(model, gm, example_inputs)
    options.setdefault("verify", False)  # measuring the error is this function's job
    return _transformed_and_compared(model, example_inputs, dtype, **options)[1]


def _transformed_and_compared(model: nn.Module, example_inputs: object, dtype, **options
                              ) -> tuple[fx.GraphModule, CheckResult]:
    """``transform`` then :func:`compare`, with one capture: the fp32 reference is the graph the
    transform captured, kept as captured."""
    with keep_captured():
        gm = transform(model, dtype=dtype, example_inputs=example_inputs, **options)
        return gm, compare(model, gm, example_inputs)


def find_fp32_nodes(model: nn.Module, example_inputs: object, rtol: float = 1e-2,
                    dtype=torch.bfloat16, max_nodes: int = 16, **options) -> list[str]:
    """A small ``keep_fp32`` list of graph nodes with which ``model`` meets ``rtol``.

    Guided by the per-node errors of :func:`check_numerics`: each round keeps the first
    non-finite node (or the node that adds the most error) in fp32 and checks again. Returns
    selectors such as ``["node:linear"]`` to pass as ``keep_fp32=``; raises ``RuntimeError`` when
    ``max_nodes`` nodes are not enough.

    >>> import torch, amprewrite
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Softmax(-1))
    >>> amprewrite.find_fp32_nodes(model, (torch.randn(2, 4),), rtol=0.5)
    []
    """
    inputs = example_inputs
    keep = [s for s in options.pop("keep_fp32", ())]
    options.setdefault("verify", False)  # the search starts from graphs that fail
    with keep_captured():  # one capture for every round (and the caller's, inside one)
        for k in range(max_nodes + 1):
            status(f"round {k + 1}: {len(keep)} nodes kept in fp32", log=True)
            gm, result = _transformed_and_compared(model, inputs, dtype, keep_fp32=keep,
                                                   **options)
            if result.passed(rtol):
                return keep
            node = culprit_node(gm, result, {k[5:] for k in keep if isinstance(k, str)})
            if node is None:
                break
            keep.append(f"node:{node.name}")
    raise RuntimeError(
        f"find_fp32_nodes: {len(keep)} fp32 nodes did not bring the output error under "
        f"rtol={rtol} (last: {result.output_error:.3g}, finite={result.finite}). Raise rtol or "
        "max_nodes, or keep whole modules in fp32 with keep_fp32=[<module path>]."
    )
