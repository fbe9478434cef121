"""Functions that transformed graphs call at run time.

They are plain functions of their arguments (no state, no registration): a pass puts a
``call_function`` node with one of them as target into the graph, and ``amprewrite/ops.py``
gives each a row in the op table.

>>> import torch
>>> x = torch.zeros(2, 3)
>>> y = setitem(x, (0, slice(None)), 1.0)
>>> y.tolist(), x.sum().item()
([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]], 0.0)
>>> write_view(x, torch.ones(2), (("t", (), {}), ("__getitem__", (1,), {}))).tolist()
[[0.0, 1.0, 0.0], [0.0, 1.0, 0.0]]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["ViewStep", "replay_view", "setitem", "write_view"]

ViewStep = tuple[str, tuple, dict]
"""One view op as data: a Tensor attribute name (``"transpose"``, ``"__getitem__"``, ``"T"``),
its positional arguments after the tensor, and its keyword arguments."""


def replay_view(base: torch.Tensor, steps: Sequence[ViewStep]) -> torch.Tensor:
    """Apply the view ops ``steps`` to ``base`` in order (a property such as ``T`` takes none)."""
    view = base
    for name, args, kwargs in steps:
        attr = getattr(view, name)
        view = attr(*args, **kwargs) if callable(attr) else attr
    return view


def setitem(base: torch.Tensor, index: object, value: object) -> torch.Tensor:
    """``base`` with ``base[index] = value`` applied, as a new tensor (``base`` is unchanged)."""
    out = base.clone()
    out[index] = value
    return out


def write_view(base: torch.Tensor, value: torch.Tensor, steps: Sequence[ViewStep]) -> torch.Tensor:
    """``base`` with the view ``replay_view(base, steps)`` overwritten by ``value``, as a new
    tensor: what an in-place write through that view does to ``base``."""
    out = base.clone()
    replay_view(out, steps).copy_(value)
    return out
