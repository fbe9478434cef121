"""The inner compiler the trainer switches give the backend by default: the one that fits the
device the graphs run on.

inductor compiles a training graph (forward and backward) into C++ on a CPU: measured on a
2-layer Qwen2 through transformers' Trainer (issue 65), 6 fp16 steps took 247 s instead of fp32's
13 s, 234 s of it the first step, and a resumed run compiled again. ``"eager"`` runs the planned
graphs as they are, the same plan and casts, started at once: in docs/benchmarks.md ("Trainer
switches on a CPU", its own 2-layer Qwen2) the first step takes 2.7-4.4 s against inductor's
56-60 s, and the later steps cost what inductor's do (fp16's slowed by the CPU's fp16
arithmetic with either). On a GPU inductor's fused kernels are what the compile buys. So
``inner="auto"``, the switches' default, picks per graph, from the device of the tensors dynamo
hands the backend: ``"eager"`` where they are all on the CPU, ``"inductor"`` elsewhere; and says
which it picked, once, on the ``amprewrite`` logger. Any other ``inner=`` is used as given.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
from torch import fx

__all__ = ["AUTO", "by_device", "device_choice", "inner_for"]

AUTO = "auto"
"""``inner=`` of the trainer switches that picks by device (:func:`by_device`)."""

_log = logging.getLogger("amprewrite")
_SAID: set[str] = set()


def inner_for(inner: str | Callable) -> str | Callable:
    """The inner backend to give :func:`amprewrite.backend` for a switch's ``inner=``:
    :func:`by_device` for :data:`AUTO`, else ``inner`` as given.

    >>> inner_for("auto") is by_device, inner_for("inductor")
    (True, 'inductor')
    """
    return by_device if isinstance(inner, str) and inner == AUTO else inner


def device_choice(example_inputs: Sequence[object]) -> str:
    """``"eager"`` where every tensor among ``example_inputs`` is on the CPU, else
    ``"inductor"``.

    >>> device_choice([torch.ones(2), 3]), device_choice([torch.ones(2, device="meta")])
    ('eager', 'inductor')
    """
    devices = {v.device.type for v in example_inputs if isinstance(v, torch.Tensor)}
    return "eager" if devices <= {"cpu"} else "inductor"


def by_device(gm: fx.GraphModule, example_inputs: list) -> Callable:
    """An inner backend: ``gm`` compiled by the backend :func:`device_choice` names."""
    from torch._dynamo.backends.registry import lookup_backend

    name = device_choice(example_inputs)
    if name not in _SAID:
        _SAID.add(name)
        if name == "eager":
            _log.info(
                "amprewrite: the trainer's graphs are on the CPU, so they run with "
                "inner='eager' (inner='auto'): inductor's compile of a training graph takes "
                "minutes there. Pass inner='inductor' to compile them anyway.")
        else:
            _log.info("amprewrite: the trainer's graphs are compiled by inductor "
                      "(inner='auto' on %s).", sorted({v.device.type for v in example_inputs
                                                       if isinstance(v, torch.Tensor)}))
    return lookup_backend(name)(gm, example_inputs)
