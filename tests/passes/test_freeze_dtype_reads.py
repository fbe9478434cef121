"""freeze_dtype_reads alone: ``x.dtype`` reads become the dtype the fp32 model had."""

import builtins

import torch
from torch import nn

from amprewrite.passes import run_pass

from ..helpers import prepared, rewrites


class Back(nn.Module):
    """The RMSNorm idiom: compute in fp32, then convert back to the input's dtype."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        return h.float().pow(2).to(h.dtype), x.to(self.lin.weight.dtype)


def test_dtype_reads_become_constants():
    gm, p = prepared(Back(), "freeze_dtype_reads")
    reads = [n for n in gm.graph.nodes if n.target is builtins.getattr and n.args[1] == "dtype"]
    assert len(reads) == 2
    assert run_pass(gm, p)
    assert not [n for n in gm.graph.nodes if n.target is builtins.getattr
                and n.args[1:] == ("dtype",)]
    tos = [n for n in gm.graph.nodes if n.target == "to"]
    assert [n.args[1] for n in tos] == [torch.float32, torch.float32]
    assert [r.action for r in rewrites(gm, "freeze_dtype_reads")] == [
        "x.dtype -> torch.float32"] * 2
    x = torch.randn(3, 4)
    model = Back()
    model.load_state_dict(gm.state_dict())
    for got, want in zip(gm(x), model(x)):
        assert torch.equal(got, want)


def test_unknown_dtype_is_left_as_a_live_read():
    """A graph input's dtype is unknown without example inputs: nothing to freeze."""

    class ReadInput(nn.Module):
        def forward(self, x):
            return torch.ones(3).to(x.dtype)

    gm, p = prepared(ReadInput(), "freeze_dtype_reads")
    assert not run_pass(gm, p)
    assert any(n.target is builtins.getattr for n in gm.graph.nodes)
