"""Programs that load where users load them: outputs in torch's own containers, and a check in
a new process.

``torch.export.save`` writes the program's output structure by the names its types were
registered under with torch's pytree, and ``torch.export.load`` refuses a name that is not
registered in the loading process. A transformers model returns a ``ModelOutput`` dataclass
(registered when its modeling module is imported) and, with ``use_cache=True``, a cache
(registered only by ``transformers.exporters``, or by amprewrite's capture while a graph lives).
So a program returning them loads only in a process that has imported and registered the same
classes. :func:`portable_module` gives the graph outputs made of tensors, tuples, lists and
dicts only, which every process with torch can load:

- a dataclass (a ``ModelOutput`` too) or a namedtuple becomes a ``dict`` of its fields (a
  ``ModelOutput``'s fields that are set, in its order, as ``ModelOutput.keys()``);
- a transformers cache becomes its layers as iterating it gives them, without the ``None``
  of a layer with no sliding window: ``((keys, values), ...)`` for a ``DynamicCache`` (a
  sliding-window layer's window tensor third), ``((self_keys, self_values, cross_keys,
  cross_values), ...)`` for an ``EncoderDecoderCache``; ``DynamicCache(data)`` and
  ``EncoderDecoderCache(data)`` rebuild the cache from it. A cache whose layers do not hold
  exactly the tensors its pytree flattening gives becomes the list of those tensors;
- any other object torch's pytree flattens becomes the list of its children.

Compare a program's outputs with the model's in this form (``plain(model(...))``): a cache's
layers order its tensors otherwise than pytree flattening (an ``EncoderDecoderCache`` flattens
every self-attention tensor first). :func:`loads_alone` loads a saved program in a new Python
process that imports only torch.
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import os
import subprocess
import sys
from collections.abc import Iterable, Mapping

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

__all__ = ["LOAD_TIMEOUT", "foreign_types", "loads_alone", "plain", "portable_module"]

LOAD_TIMEOUT = 600.0
"""Seconds :func:`loads_alone` waits for the new process (importing torch takes a few)."""

# The containers a fresh process's torch unflattens without any registration.
_TORCH_CONTAINERS = (tuple, list, dict, collections.OrderedDict, collections.defaultdict,
                     collections.deque, type(None))


def foreign_types(spec: pytree.TreeSpec | None) -> list[type]:
    """The types in a pytree spec that a process importing only torch cannot unflatten
    (everything but tuples, lists, dicts, ``OrderedDict``, ``defaultdict``, ``deque``)."""
    found: list[type] = []
    todo = [spec] if spec is not None else []
    while todo:
        node = todo.pop()
        if node.type is not None and node.type not in _TORCH_CONTAINERS \
                and node.type not in found:
            found.append(node.type)
        todo += [node.child(i) for i in range(node.num_children)]
    return found


def plain(value: object) -> object:
    """``value`` with every dataclass, namedtuple, cache or other registered pytree node turned
    into tuples, lists and dicts (see the module docstring); tensors are the same objects.

    >>> import torch, dataclasses
    >>> @dataclasses.dataclass
    ... class Out:
    ...     logits: torch.Tensor
    ...     extra: tuple
    >>> x = torch.zeros(1)
    >>> out = plain(Out(x, (x, None)))
    >>> list(out), out["logits"] is x
    (['logits', 'extra'], True)
    """
    cls = type(value)
    if isinstance(value, torch.Tensor) or cls in (type(None), bool, int, float, str):
        return value
    if cls in (tuple, list):
        return cls(plain(v) for v in value)
    if cls is dict:
        return {k: plain(v) for k, v in value.items()}
    if pytree.is_namedtuple_instance(value):
        return {k: plain(v) for k, v in value._asdict().items()}
    if isinstance(value, Mapping):  # a ModelOutput (an OrderedDict dataclass), an OrderedDict
        return {k: plain(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if cls not in pytree.SUPPORTED_NODES:
        return value  # a leaf to pytree (a constant): left as it is
    leaves = pytree.tree_leaves(value)
    if isinstance(value, Iterable):  # a transformers cache: its own per-layer data
        # Without the None a layer gives for "no sliding window": the cache rebuilds from both
        # forms, and pytree counts None as a leaf, the program would return a constant.
        layers = tuple(tuple(x for x in layer if x is not None) if isinstance(layer, Iterable)
                       else layer for layer in value)
        if sorted(map(id, pytree.tree_leaves(layers))) == sorted(map(id, leaves)):
            return plain(layers)
    return list(leaves)


def portable_module(gm: fx.GraphModule) -> nn.Module:
    """``gm`` as a module whose outputs are :func:`plain`; ``gm`` itself when they are already.

    The module shares ``gm``'s submodules, parameters and buffers under the same names (its
    ``state_dict`` keys are ``gm``'s) and has ``gm``'s signature, so ``torch.export.export``
    takes the same inputs and ``dynamic_shapes`` for it as for ``gm``.
    """
    info = getattr(gm.graph._codegen, "pytree_info", None)
    if not foreign_types(getattr(info, "out_spec", None)):
        return gm
    module = nn.Module()
    module._modules, module._parameters, module._buffers = gm._modules, gm._parameters, \
        gm._buffers
    module._non_persistent_buffers_set = gm._non_persistent_buffers_set
    module.train(gm.training)

    def forward(*args: object, **kwargs: object) -> object:
        return plain(gm(*args, **kwargs))

    forward.__signature__ = inspect.signature(gm.forward)
    module.forward = forward
    return module


# Run in the new process: load, build the module (which unflattens nothing yet, but checks
# the program), and name every non-torch package the process imported.
_LOAD = """\
import sys, torch
program = torch.export.load(sys.argv[1])
program.module()
print(" ".join(sorted({m.split(".")[0] for m in sys.modules} & {"amprewrite", "transformers",
                                                                  "diffusers"})))
"""


def loads_alone(path: str | os.PathLike, timeout: float = LOAD_TIMEOUT) -> str | None:
    """Load the ``torch.export`` program at ``path`` with ``torch.export.load`` in a new Python
    process that imports only torch, as a deployment would. None when it loads; else why not,
    in one line (the new process's last line of error, or what it imported besides torch)."""
    try:
        done = subprocess.run([sys.executable, "-c", _LOAD, os.fspath(path)],
                              capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return f"loading took more than {timeout:g} s"
    if done.returncode != 0:
        # torch logs the cause (a type "in pytree is not registered") as a warning, then raises
        # a generic error; the cause is the line to show, without the log prefix.
        lines = [line.split("] ", 1)[-1].strip() if line.startswith(("W", "E")) else line.strip()
                 for line in done.stderr.splitlines() if line.strip()]
        causes = [line for line in lines if "not registered" in line]
        return (causes or lines or [f"exit status {done.returncode}"])[-1]
    imported = done.stdout.strip().splitlines()[-1:] if done.stdout.strip() else []
    if imported and imported[0]:
        return (f"the process imported {imported[0]} besides torch (a sitecustomize or .pth "
                "file?), so loading alone is not shown")
    return None
