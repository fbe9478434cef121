"""Inductor's own accounting of a compiled step: the bytes every scheduled node reads and
writes (``GraphLowering.count_bytes()``, extern mm/conv calls included) and the launches (fused
kernels generated + extern calls), summed over every graph a step compiles (forward and
backward). The yardstick for a step's memory traffic without a GPU; counts, not times, so one
run on a shared machine is enough.

    from benchmarks.compile.step_bytes import count
    figures = count(lambda: compiled(x).sum().backward())
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from unittest import mock

import torch

__all__ = ["count", "differences", "group"]

# compile_fx counts a graph's bytes when its metrics logger is enabled at INFO; this one is,
# and prints nothing (no handler, no propagation).
_QUIET = logging.getLogger("benchmarks.inductor_metrics")
_QUIET.setLevel(logging.INFO)
_QUIET.propagate = False
_QUIET.addHandler(logging.NullHandler())


def count(step: Callable[[], object]) -> dict[str, int]:
    """``step()`` run once with a fresh dynamo and no compile caches (a cached graph is not
    scheduled, so its bytes would not be counted); returns ``bytes``, ``kernels`` (fused
    kernels generated), ``extern`` (extern kernel calls: mm, conv, SDPA), ``launches`` and
    ``groups`` (bytes by :func:`group`)."""
    from torch._inductor import compile_fx, config, metrics
    from torch._inductor.scheduler import ExternKernelSchedulerNode

    torch._dynamo.reset()
    metrics.reset()
    with mock.patch.object(compile_fx, "inductor_metrics_log", _QUIET), \
            config.patch(fx_graph_cache=False, autotune_local_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        step()
    extern = sum(isinstance(node, ExternKernelSchedulerNode)
                 for node, _ in metrics.nodes_num_elem)
    kernels = int(metrics.generated_kernel_count)
    groups: dict[str, int] = {}
    for node, elements in metrics.nodes_num_elem:
        key = group(node)
        groups[key] = groups.get(key, 0) + 4 * int(elements)  # count_bytes' bytes // 4
    return {"bytes": int(metrics.num_bytes_accessed), "kernels": kernels, "extern": extern,
            "launches": kernels + extern, "groups": groups}


def group(node: object) -> str:
    """A scheduled node's group, for saying where two variants differ: the aten ops it was
    made from (``mm``, ``_to_copy+mul``, ...), an extern call by its kernel."""
    ops: set[str] = set()
    for part in getattr(node, "get_nodes", lambda: [node])():
        for origin in getattr(getattr(part, "node", None), "origins", ()) or ():
            if origin.op == "call_function":
                ops.add(str(getattr(origin.target, "__name__", origin.target))
                        .replace(".default", ""))
    return "+".join(sorted(ops)[:4]) + ("+..." if len(ops) > 4 else "") or type(node).__name__


def differences(a: dict[str, int], b: dict[str, int], top: int = 4) -> list[tuple[str, int]]:
    """The node groups whose bytes differ most between two counts' ``groups`` (b - a)."""
    keys = set(a) | set(b)
    diff = sorted(((k, b.get(k, 0) - a.get(k, 0)) for k in keys), key=lambda kv: -abs(kv[1]))
    return [(k, d) for k, d in diff[:top] if d]
