"""``params="low"`` where a model is compiled in place (the trainer switches): the weights the
plan reads low stored low in the model itself, and the trainer's optimizer made an
:func:`amprewrite.optimizer`.

``transform(model, params="low")`` finds the weights to store low in its graph (every reader a
low op) and stores them in the GraphModule, never in the model. A trainer switch compiles the
caller's model in place with the backend, where dynamo passes the parameters as graph inputs:
the weights must already be low when the graph is captured. So the switch stores them low
first, by the ops that read them: the weights (and biases) of linear, convolution and
transformers' ``Conv1D`` layers (read by matmuls and convolutions, planned low) and embedding
tables (lookups: copies, exact in either dtype); never a module named by ``keep_fp32`` or by
the model's ``_keep_in_fp32_modules`` / ``_keep_in_fp32_modules_strict``; norm scales and
every other parameter stay fp32, as the plan computes them. The backend plans bf16 parameter
inputs as it plans any input: in their dtype, cast up (exactly) where an fp32 op reads them.

>>> import torch
>>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
>>> store_low(net, torch.bfloat16)
['0.weight', '0.bias']
>>> net[1].weight.dtype
torch.float32
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..errors import PolicyError
from ..precision.ops import Precision, family_for_module
from .optimizer import Optimizer, optimizer

__all__ = ["check_params", "from_torch", "reads_low", "store_low"]

def reads_low(module: nn.Module) -> bool:
    """Whether the plan reads ``module``'s own weights low: a module of a LOW family in the
    registry (linear, convolutions, ...) or an embedding table (its lookups copy rows); also
    transformers' ``Conv1D`` (GPT-2's linear, an ``addmm`` in the graph)."""
    family = family_for_module(type(module))
    if family is not None:
        return family.precision is Precision.LOW or family.name == "embedding"
    return type(module).__name__ == "Conv1D"


def _kept(path: str, module: nn.Module, keep: Iterable[Any], declared: list[str]) -> bool:
    for k in keep:
        if isinstance(k, type) and isinstance(module, k):
            return True
        if isinstance(k, str) and (path == k or path.startswith(k + ".")):
            return True
    return any(name in path.split(".") for name in declared)


def store_low(model: nn.Module, dtype: torch.dtype, keep_fp32: Iterable[Any] = ()) -> list[str]:
    """Store the weights low-precision ops read as ``dtype``, in place; returns their names.
    Tied weights stay tied (one Parameter, converted once)."""
    keep = list(keep_fp32)
    declared = [*(getattr(model, "_keep_in_fp32_modules", None) or []),
                *(getattr(model, "_keep_in_fp32_modules_strict", None) or [])]
    done: set[int] = set()
    names = []
    for path, module in model.named_modules():
        if not reads_low(module):
            continue
        if _kept(path, module, keep, declared):
            continue
        for leaf, p in module.named_parameters(recurse=False):
            if p.dtype != torch.float32:
                continue
            if id(p) not in done:
                p.data = p.data.to(dtype)
                done.add(id(p))
            names.append(f"{path}.{leaf}" if path else leaf)
    return names


def from_torch(torch_optimizer: torch.optim.Optimizer, module: nn.Module | None = None,
               **options: Any) -> Optimizer:
    """An :func:`amprewrite.optimizer` doing what ``torch_optimizer`` (not stepped yet) was
    made to do: its class, its param groups with their hyperparameters, its constructor's
    arguments. ``module`` names the parameters in the report."""
    if isinstance(torch_optimizer, Optimizer):
        return torch_optimizer
    if torch_optimizer.state:
        raise PolicyError(
            f"the {type(torch_optimizer).__name__} has stepped already: its states are fp32 "
            "tensors of the weights as they were. Switch to params='low' before training "
            "starts (or train from a checkpoint with a new optimizer).")
    cls = type(torch_optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    kwargs = {k: v for k, v in torch_optimizer.defaults.items() if k in accepted}
    groups = [dict(g) for g in torch_optimizer.param_groups]
    made = optimizer(groups, cls, module=module, **options, **kwargs)
    # One set of param groups for both: a learning-rate scheduler made on the torch optimizer
    # (before a trainer swapped it) sets this one's learning rate.
    torch_optimizer.param_groups = made.param_groups
    return made


def check_params(params: str, where: str) -> str:
    if params not in ("fp32", "low"):
        raise PolicyError(
            f"{where}(params={params!r}): params is 'fp32' (the default: fp32 weights, cast in "
            "the graph) or 'low' (the weights low-precision ops read stored low, trained by "
            "amprewrite.optimizer)")
    return params
