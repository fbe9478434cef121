"""Ground-floor helpers for modules: attribute paths, structural copies, installed tensors.

Every module of the package that reads or writes ``root.a.b.c`` by a dotted name, copies a
module without copying its tensors, or asks whether a module has hooks uses these; nothing here
imports another amprewrite module.

>>> import torch
>>> m = torch.nn.Sequential(torch.nn.Linear(2, 2))
>>> get_attr(m, "0.weight") is m[0].weight
True
>>> get_attr(m, "0.nothing", None) is None
True
>>> submodule(m, "0") is m[0] and tensor_attr(m[0], "bias") is m[0].bias
True
>>> copy = share_copy(m)
>>> copy is not m and copy[0] is not m[0] and copy[0].weight is m[0].weight
True
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import fx, nn
from torch.nn.modules import module as _module

__all__ = ["buffer_clone_copy", "get_attr", "has_attr", "hooked", "install_tensors", "rebuild",
           "set_attr", "share_copy", "submodule", "tensor_attr", "tensor_names"]

_MISSING = object()  # no default given: a missing part raises


def get_attr(root: object, qualname: str, default: object = _MISSING) -> object:
    """``root.a.b.c`` for ``qualname`` ``"a.b.c"``; ``default`` (when given) if a part is
    missing, else ``AttributeError``."""
    obj = root
    for part in qualname.split("."):
        if default is _MISSING:
            obj = getattr(obj, part)
        else:
            obj = getattr(obj, part, _MISSING)
            if obj is _MISSING:
                return default
    return obj


def submodule(root: nn.Module, qualname: str) -> nn.Module:
    """``root.get_submodule(qualname)``, read from the ``_modules`` dicts: where
    ``get_submodule``'s ``getattr`` finds a submodule (nn.Module keeps a submodule's name out of
    its parameters, buffers and instance dict), at a sixth of the cost (that ``getattr`` runs
    ``nn.Module.__getattr__`` after a failed lookup). A missing part goes to ``get_submodule``,
    which raises its error."""
    mod = root
    for part in qualname.split("."):
        child = mod._modules.get(part)
        if child is None:
            return root.get_submodule(qualname)
        mod = child
    return mod


def tensor_attr(mod: nn.Module, name: str) -> object:
    """``getattr(mod, name, None)``, read from ``_parameters`` or ``_buffers`` when ``name`` is
    there: where ``nn.Module.__getattr__`` finds it (nn.Module registers no parameter or buffer
    under a name another attribute has), without the failed lookup before that call."""
    for table in (mod._parameters, mod._buffers):
        if name in table:
            return table[name]
    return getattr(mod, name, None)


def has_attr(root: object, qualname: str) -> bool:
    """Whether ``root`` has ``qualname`` (a dotted path)."""
    try:
        get_attr(root, qualname)
    except AttributeError:
        return False
    return True


def set_attr(root: nn.Module, qualname: str, value: object, persistent: bool = True) -> None:
    """Install ``value`` at ``qualname`` under ``root``, creating container modules on the way."""
    *path, leaf = qualname.split(".")
    mod = root
    for part in path:
        child = getattr(mod, part, None)
        if not isinstance(child, nn.Module):
            child = nn.Module()
            mod.add_module(part, child)
        mod = child
    if isinstance(value, nn.Parameter):
        mod.register_parameter(leaf, value)
    elif isinstance(value, torch.Tensor):
        if leaf in mod._parameters:
            del mod._parameters[leaf]
        mod.register_buffer(leaf, value, persistent=persistent)
    elif isinstance(value, nn.Module):
        mod.add_module(leaf, value)
    else:
        setattr(mod, leaf, value)


def hooked(m: nn.Module) -> bool:
    """Whether calling ``m`` runs hooks (its own or global ones) besides its ``forward``."""
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
                or m._backward_pre_hooks or _module._global_forward_hooks
                or _module._global_forward_pre_hooks or _module._global_backward_hooks
                or _module._global_backward_pre_hooks)


def share_copy(module: nn.Module) -> nn.Module:
    """A new module object with the same parameters and buffers (no tensor is copied).

    The copy is made from the instance dict, not with ``copy.copy``: that goes through the
    pickling protocol, which parametrized modules (``weight_norm``, ``spectral_norm``,
    ``register_parametrization``) refuse ("only supported through state_dict()"). Their
    parametrizations are submodules, so they are copied structurally like any other; the
    parametrized class (with its ``weight`` property) is kept.
    """
    new = object.__new__(type(module))
    d = new.__dict__
    d.update(module.__dict__)
    d["_parameters"] = dict(module._parameters)
    d["_buffers"] = dict(module._buffers)
    d["_non_persistent_buffers_set"] = set(module._non_persistent_buffers_set)
    d["_modules"] = {k: None if v is None else share_copy(v) for k, v in module._modules.items()}
    return new


def buffer_clone_copy(module: nn.Module) -> nn.Module:
    """A structural copy (see :func:`share_copy`) whose buffers are clones: tracing runs forward
    for real on buffers, and an in-place update there must not reach the caller's model."""
    new = share_copy(module)
    for mod in new.modules():
        for name, b in mod._buffers.items():
            if b is not None:
                mod._buffers[name] = b.clone()
    return new


def tensor_names(model: nn.Module) -> dict[int, str]:
    """``id(tensor)`` -> the first qualified name of each parameter and buffer of ``model``."""
    names: dict[int, str] = {}
    for name, t in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(t), name)
    for name, t in model.named_buffers(remove_duplicate=False):
        names.setdefault(id(t), name)
    return names


def install_tensors(gm: nn.Module, model: nn.Module) -> None:
    """Give ``gm`` every parameter and buffer of ``model`` under its original name (shared)."""
    for name, p in model.named_parameters(remove_duplicate=False):
        if not has_attr(gm, name):
            set_attr(gm, name, p)
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for b_name, b in mod._buffers.items():
            name = f"{mod_name}.{b_name}" if mod_name else b_name
            if b is not None and not has_attr(gm, name):
                set_attr(gm, name, b, persistent=b_name not in mod._non_persistent_buffers_set)


def _persistent(model: nn.Module, qualname: str) -> bool:
    """Whether ``model``'s buffer at ``qualname`` is in its state dict (True for anything else):
    a non-persistent buffer (LLaMA's rotary ``inv_freq``) stays one in the graph module."""
    *path, leaf = qualname.split(".")
    owner = get_attr(model, ".".join(path), None) if path else model
    return not (isinstance(owner, nn.Module) and leaf in owner._non_persistent_buffers_set)


def rebuild(model: nn.Module, graph: fx.Graph, resolve: Callable[[str], object],
            cls: type[fx.GraphModule]) -> fx.GraphModule:
    """A GraphModule over ``graph`` holding the model's tensors under their original names:
    modules the graph calls are structural copies (:func:`share_copy`) of ``resolve(target)``."""
    root = nn.Module()
    for node in graph.nodes:
        if node.op == "call_module" and not has_attr(root, str(node.target)):
            set_attr(root, str(node.target), share_copy(resolve(str(node.target))))
    for node in graph.nodes:
        target = str(node.target)
        if node.op == "get_attr" and not has_attr(root, target):
            set_attr(root, target, get_attr(model, target) if has_attr(model, target)
                     else resolve(target))
    gm = cls(root, graph, class_name=type(model).__name__)
    for node in graph.nodes:  # GraphModule registers every buffer it copies as persistent
        if node.op == "get_attr" and not _persistent(model, str(node.target)):
            *path, leaf = str(node.target).split(".")
            gm.get_submodule(".".join(path))._non_persistent_buffers_set.add(leaf)
    install_tensors(gm, model)
    gm.train(model.training)
    return gm
