"""store_params: with ``params="low"``, keep low-precision copies of weights only LOW ops read.

Matches:   ``w = self.fc.weight; w_bf16 = w.to(torch.bfloat16)`` where every use of ``fc.weight``
           is that one cast
Rewrite to: ``w = self.fc.weight`` with ``gm.fc.weight`` a bfloat16 copy (same name, so
           ``gm.state_dict()`` keys stay the model's). The caller's tensor is untouched; weights
           an FP32 op reads (BatchNorm statistics, norm scales) stay fp32 and shared.

Embedding tables too: ``emb = F.embedding(ids, w)`` (w fp32) becomes
``emb = F.embedding(ids, w_bf16).to(torch.float32)``. The lookup copies rows, so only the table's
rounding changes the values (measured: error 1.04-1.08x autocast's on LLaMA, Mistral, GPT-2
and T5), and the residual stream the rows start stays fp32. People who ask for
``params="low"`` want the memory: the zoo LLaMA's weights go from 0.58x fp32's to 0.50x.
"""

from __future__ import annotations

import warnings
from collections import defaultdict

import torch
from torch import fx, nn

from ..graph import meta as M
from ..graph.meta import HIGH, LOW
from ..graph.modules import set_attr
from ..precision.ops import Precision
from ..precision.report import REPORT_KEY, record
from .base import Kind, Pass
from .insert_casts import add_cast

__all__ = ["StoreParams"]


class StoreParams(Pass):
    name, kind = "store_params", Kind.REWRITE
    requires = (M.CAST, M.LABEL)
    writes = (M.ORIG, M.LABEL, M.CAST, M.CLASS, M.NATURAL, M.FAMILY, M.REASON)

    def run(self, gm: fx.GraphModule) -> bool:
        if self.policy.params != "low":
            return False
        # One group per tensor, not per name: a tied weight read under two names (an
        # embedding and the head a symbolic trace reads it through) is stored low only when
        # every reader under every name is low.
        by_tensor: dict[int, list[fx.Node]] = defaultdict(list)
        for node in M.each_node(gm.graph, "get_attr"):
            if _is_param(gm, str(node.target)):
                by_tensor[id(gm.get_parameter(str(node.target)))].append(node)
        changed = False
        trained: list[str] = []
        for nodes in by_tensor.values():
            target = str(nodes[0].target)
            value = gm.get_parameter(target)
            if value.dtype != torch.float32:
                continue
            users = [u for n in nodes for u in n.users]
            lookups = [u for u in users if _is_lookup(u, nodes)]
            if not users or not all(u in lookups or (u.meta.get(M.CAST) == self.policy.dtype
                                                     and u.op == "call_method") for u in users):
                continue
            low = nn.Parameter(value.detach().to(self.policy.dtype),
                               requires_grad=value.requires_grad)
            for name in _names_of(gm, value):  # a tied weight stays tied (GPT-2's head)
                set_attr(gm, name, low)
            trained += [target] if gm.training and low.requires_grad else []
            for node in nodes:
                node.meta[M.ORIG] = M.info_from_value(value)
                node.meta[M.LABEL] = LOW
                for cast in [u for u in node.users if u not in lookups]:
                    cast.replace_all_uses_with(node)
                    gm.graph.erase_node(cast)
                record(gm, node, f"store {target} as {self.policy.dtype}",
                       "params='low' and every reader is a low-precision op"
                       + (" or an embedding lookup (its rows are cast up after it)"
                          if lookups else ""))
            for lookup in lookups:
                self._rows_up(gm, lookup)
            changed = True
        if trained:
            _say_low_copies_train(gm, trained, self.policy.dtype)
            _own_the_rest(gm)
        return changed

    def _rows_up(self, gm: fx.GraphModule, lookup: fx.Node) -> None:
        """The lookup now returns low rows: cast them up for its fp32 readers."""
        readers = list(lookup.users)
        up = add_cast(gm, lookup, torch.float32, HIGH,
                      f"the embedding table is stored as {self.policy.dtype} (params='low')")
        for r in readers:
            r.replace_input_with(lookup, up)
        lookup.meta[M.LABEL] = LOW


def _names_of(gm: nn.Module, value: torch.Tensor) -> list[str]:
    return [n for n, p in gm.named_parameters(remove_duplicate=False) if p is value]


def _own_the_rest(gm: fx.GraphModule) -> None:
    """In train mode the graph trains its own tensors: the fp32 parameters and buffers it
    still shares with the caller's model (norm scales, BatchNorm statistics) become copies too,
    so that ``amprewrite.optimizer(gm, ...)`` trains ``gm`` and never the caller's model. Tied
    names stay tied (one copy for all of a tensor's names)."""
    copies: dict[int, torch.Tensor] = {}
    for name, p in list(gm.named_parameters(remove_duplicate=False)):
        if p.dtype == torch.float32:
            new = copies.setdefault(id(p), nn.Parameter(p.detach().clone(),
                                                        requires_grad=p.requires_grad))
            set_attr(gm, name, new)
    for name, b in list(gm.named_buffers(remove_duplicate=False)):
        owner = gm.get_submodule(name.rpartition(".")[0])
        leaf = name.rpartition(".")[2]
        set_attr(gm, name, copies.setdefault(id(b), b.detach().clone()),
                 persistent=leaf not in owner._non_persistent_buffers_set)


def _is_lookup(node: fx.Node, table: list[fx.Node]) -> bool:
    """An embedding lookup that reads ``table`` as its weight only, into an fp32 value."""
    if (node.meta.get(M.FAMILY) != "embedding" or node.meta.get(M.LABEL) != HIGH
            or node.meta.get(M.CLASS) == Precision.FP32):  # keep_fp32 names it: fp32 table
        return False
    weight = node.kwargs.get("weight", node.args[1] if len(node.args) > 1 else None)
    others = [a for i, a in enumerate(node.args) if i != 1] + [
        v for k, v in node.kwargs.items() if k != "weight"]
    return weight in table and not any(a in table for a in others)


def _is_param(gm: nn.Module, target: str) -> bool:
    try:
        gm.get_parameter(target)
        return True
    except AttributeError:
        return False


def _say_low_copies_train(gm: fx.GraphModule, targets: list[str], low: torch.dtype) -> None:
    """params='low' in train mode: backward reaches the graph's low copies, not the model's
    weights. Said at the call (a warning) and in the report: an optimizer over
    ``model.parameters()`` would train nothing, silently."""
    text = (f"params='low' in train mode: {len(targets)} weights ({', '.join(targets[:3])}"
            f"{', ...' if len(targets) > 3 else ''}) are {low} copies in the graph, so backward "
            "gives gradients to those copies (gm.parameters()) and none to the model's own "
            "parameters, and the graph's other parameters and buffers are copies too (the "
            "model is never modified): an optimizer over model.parameters() would train "
            "nothing. Train the graph with amprewrite.optimizer(gm, torch.optim.AdamW, ...), "
            "which keeps an fp32 master or a compensation where a low weight would lose its "
            "updates; or use params='fp32' (the default: the graph shares the model's weights)")
    report = gm.meta.get(REPORT_KEY)
    if report is not None:
        report.notes.append(text)
    warnings.warn(f"amprewrite.transform: {text}.", stacklevel=2)
