"""normalize_modules: leaf-module calls become functional calls on ``get_attr`` parameters.

Matches:   ``y = self.fc(x)``                        (call_module, nn.Linear)
Rewrite to: ``w = self.fc.weight; b = self.fc.bias; y = F.linear(x, w, b)``

so that every later pass sees one IR — the one dynamo (and so the torch.compile backend)
produces — and LOW ops can have their weights cast in the graph. Modules whose behaviour depends
on ``module.training`` (BatchNorm, Dropout) stay ``call_module`` so ``gm.train()``/``gm.eval()``
switch them at run time; so do subclasses (their ``forward`` may differ) and hooked modules.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.fx.passes.infra.pass_base import PassResult

from .. import meta as M
from ..report import record

__all__ = ["normalize_modules"]

Lowering = Callable[[nn.Module, fx.Node, "_Attrs"], tuple]
# Each rule returns (target, args, kwargs) given the module, its input node and a node maker.

_CONV = {nn.Conv1d: F.conv1d, nn.Conv2d: F.conv2d, nn.Conv3d: F.conv3d}
_CONV_T = {nn.ConvTranspose1d: F.conv_transpose1d, nn.ConvTranspose2d: F.conv_transpose2d,
           nn.ConvTranspose3d: F.conv_transpose3d}


def _conv(m, x, attr):
    if m.padding_mode != "zeros":
        # Conv._conv_forward's own lowering: pad explicitly, then convolve without padding.
        x = attr.pad(x, m._reversed_padding_repeated_twice, m.padding_mode)
        return _CONV[type(m)], (x, attr("weight"), attr("bias"), m.stride, 0, m.dilation,
                                m.groups), {}
    return _CONV[type(m)], (x, attr("weight"), attr("bias"), m.stride, m.padding, m.dilation,
                            m.groups), {}


def _conv_t(m, x, attr):
    return _CONV_T[type(m)], (x, attr("weight"), attr("bias"), m.stride, m.padding,
                              m.output_padding, m.groups, m.dilation), {}


_RULES: dict[type, Lowering] = {
    nn.Linear: lambda m, x, attr: (F.linear, (x, attr("weight"), attr("bias")), {}),
    nn.Embedding: lambda m, x, attr: (F.embedding, (
        x, attr("weight"), m.padding_idx, m.max_norm, m.norm_type, m.scale_grad_by_freq, m.sparse),
        {}),
    nn.LayerNorm: lambda m, x, attr: (F.layer_norm, (x, m.normalized_shape, attr("weight"),
                                                     attr("bias"), m.eps), {}),
    nn.GroupNorm: lambda m, x, attr: (F.group_norm, (x, m.num_groups, attr("weight"),
                                                     attr("bias"), m.eps), {}),
    nn.ReLU: lambda m, x, attr: (F.relu, (x,), {"inplace": m.inplace}),
    nn.GELU: lambda m, x, attr: (F.gelu, (x,), {"approximate": m.approximate}),
    nn.SiLU: lambda m, x, attr: (F.silu, (x,), {"inplace": m.inplace}),
    nn.Sigmoid: lambda m, x, attr: (torch.sigmoid, (x,), {}),
    nn.Tanh: lambda m, x, attr: (torch.tanh, (x,), {}),
    nn.Softmax: lambda m, x, attr: (F.softmax, (x,), {"dim": m.dim}),
    nn.LogSoftmax: lambda m, x, attr: (F.log_softmax, (x,), {"dim": m.dim}),
    nn.Flatten: lambda m, x, attr: (torch.flatten, (x, m.start_dim, m.end_dim), {}),
    nn.Upsample: lambda m, x, attr: (F.interpolate, (x,), {
        "size": m.size, "scale_factor": m.scale_factor, "mode": m.mode,
        "align_corners": m.align_corners, "recompute_scale_factor": m.recompute_scale_factor}),
    **{cls: _conv for cls in _CONV},
    **{cls: _conv_t for cls in _CONV_T},
}
if hasattr(nn, "RMSNorm"):
    _RULES[nn.RMSNorm] = lambda m, x, attr: (F.rms_norm, (x, m.normalized_shape, attr("weight"),
                                                          m.eps), {})
_RULES[nn.UpsamplingNearest2d] = _RULES[nn.Upsample]
_RULES[nn.UpsamplingBilinear2d] = _RULES[nn.Upsample]


class _Attrs:
    """Makes the nodes a lowering needs, before the module call and with its metadata."""

    def __init__(self, graph: fx.Graph, node: fx.Node, mod: nn.Module, path: str):
        self.graph, self.node, self.mod, self.path = graph, node, mod, path

    def _new(self, op: str, target, args=(), kwargs=None) -> fx.Node:
        with self.graph.inserting_before(self.node):
            n = self.graph.create_node(op, target, args, kwargs or {})
        n.meta.update({k: v for k, v in self.node.meta.items()
                       if k in (M.MODULE_PATH, M.MODULE_TYPES, "stack_trace", "nn_module_stack")})
        return n

    def __call__(self, name: str) -> fx.Node | None:
        value = getattr(self.mod, name, None)
        if value is None:
            return None
        n = self._new("get_attr", f"{self.path}.{name}")
        n.meta[M.ORIG] = M.info_from_value(value)
        return n

    def pad(self, x: fx.Node, pad: tuple, mode: str) -> fx.Node:
        n = self._new("call_function", F.pad, (x, pad), {"mode": mode})
        if M.ORIG in self.node.meta:
            n.meta[M.ORIG] = self.node.meta[M.ORIG]
        return n


def _hooked(m: nn.Module) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks)


def normalize_modules(gm: fx.GraphModule) -> PassResult:
    """Lower known leaf modules to their functional form (see module docstring)."""
    changed = False
    graph = gm.graph
    for node in M.each_node(graph, "call_module"):
        mod = gm.get_submodule(str(node.target))
        rule = _RULES.get(type(mod))
        if rule is None or _hooked(mod) or node.kwargs or len(node.args) != 1:
            continue
        (x,) = node.args
        path = str(node.target)

        target, args, kwargs = rule(mod, x, _Attrs(graph, node, mod, path))
        with graph.inserting_before(node):
            new = graph.call_function(target, args, kwargs)
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        record(gm, new, "normalize_modules", f"call_module {type(mod).__name__} -> "
               f"{getattr(target, '__name__', target)}", "one functional IR for every pass")
        changed = True
    # The lowered modules stay in gm (unused): they hold the parameters under their names.
    return PassResult(gm, changed)

