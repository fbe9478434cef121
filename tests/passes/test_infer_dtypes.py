"""infer_dtypes alone: what the fp32 model produces at each node of a symbolic trace."""

import torch
from torch import nn

from amprewrite import meta as M
from amprewrite.passes import run_pass

from ..helpers import prepared


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

    def forward(self, x, ids):
        pos = torch.arange(ids.shape[-1]).float()  # int -> float
        mask = ids > 0  # bool
        h = self.lin(x) + pos[None, :, None] * 0.5
        count = self.steps + 1  # int64 stays int64
        return h.masked_fill(~mask[..., None], 0.0), count


def _dtypes(gm):
    return {n.name: M.info(n).dtype for n in gm.graph.nodes if n.op != "output"}


def test_dtypes_follow_factories_conversions_comparisons_and_promotion():
    gm, p = prepared(Mixed(), "infer_dtypes")
    assert not run_pass(gm, p)  # meta only: the graph's code is unchanged
    d = _dtypes(gm)
    assert d["x"] is None and d["ids"] is None  # graph inputs traced without examples
    assert d["arange"] == torch.int64 and d["float_1"] == torch.float32
    assert d["gt"] == torch.bool and d["invert"] == torch.bool
    assert d["_tensor_constant0"] == torch.int64  # steps + 1, which tracing computed once
    assert d["masked_fill"] == torch.float32
    lin = [n for n in gm.graph.nodes if "linear" in str(n.target) or n.target == "lin"]
    assert lin and all(M.info(n).dtype == torch.float32 for n in lin)  # fp32 weights decide


def test_existing_value_infos_are_kept():
    """Dynamo graphs carry exact fake values: the pass fills only what is missing."""
    x, ids = torch.randn(2, 3, 4), torch.randint(0, 5, (2, 3))
    gm, p = prepared(Mixed(), "infer_dtypes", example_inputs=(x, ids))
    before = {n.name: n.meta[M.ORIG] for n in gm.graph.nodes if M.ORIG in n.meta}
    run_pass(gm, p)
    for n in gm.graph.nodes:
        if n.name in before:
            assert n.meta[M.ORIG] is before[n.name]
    assert M.info(gm.graph.find_nodes(op="placeholder")[0]).shape == (2, 3, 4)
