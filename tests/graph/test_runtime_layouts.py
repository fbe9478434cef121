"""graph/runtime.py's helpers take any layout their torch counterparts take: transposed,
sliced, channels-last inputs, eager and compiled, equal to the reference bit for bit.

The norms are what CUDA's kernels make the plan use (a low input with fp32 weights refused):
``group_norm_fp32`` on a transposed ``(N, C, L)`` tensor raised ``Expected
X.is_contiguous`` where ``F.group_norm`` runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import amprewrite
from amprewrite.graph import runtime
from amprewrite.precision import kernels

BF16 = torch.bfloat16


def _layouts():
    torch.manual_seed(0)
    return {
        "transposed": torch.randn(2, 5, 8).transpose(1, 2),
        "sliced": torch.randn(2, 16, 6)[:, ::2],
        "channels_last": torch.randn(2, 8, 3, 4).to(memory_format=torch.channels_last),
        "channels_last_3d": torch.randn(2, 8, 2, 3, 4).to(memory_format=torch.channels_last_3d),
        "expanded": torch.randn(2, 8, 1).expand(2, 8, 5),
    }


def _norms(x):
    w, b = torch.rand(8), torch.rand(8)
    shape = tuple(x.shape[-1:])
    lw, lb = torch.rand(shape), torch.rand(shape)
    return [
        (lambda t: runtime.group_norm_fp32(t, 2, w, b),
         lambda t: F.group_norm(t.float(), 2, w, b).to(t.dtype)),
        (lambda t: runtime.layer_norm_fp32(t, shape, lw, lb),
         lambda t: F.layer_norm(t.float(), shape, lw, lb).to(t.dtype)),
    ]


@pytest.mark.parametrize("layout", list(_layouts()))
def test_fp32_norms_take_any_layout_forward_and_backward(layout):
    base = _layouts()[layout].to(BF16)
    for helper, island in _norms(base):
        x = base.detach().clone(memory_format=torch.preserve_format).requires_grad_()
        ref = base.detach().clone(memory_format=torch.preserve_format).requires_grad_()
        y, r = helper(x), island(ref)
        assert torch.equal(y, r)
        g = torch.randn(y.shape).to(BF16)
        y.backward(g)
        r.backward(g)
        assert torch.equal(x.grad, ref.grad)


def test_group_norm_fp32_compiled_on_a_transposed_input():
    x = torch.randn(2, 5, 8).to(BF16).transpose(1, 2).requires_grad_()
    w = torch.rand(8, requires_grad=True)
    compiled = torch.compile(lambda t, w: runtime.group_norm_fp32(t, 2, w), backend="aot_eager")
    y = compiled(x, w)
    ref = F.group_norm(x.detach().float(), 2, w.detach()).to(BF16)
    assert torch.equal(y, ref)
    y.float().sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape


def test_a_graph_planned_with_the_mixed_kernel_refused_runs_on_a_transposed_input(monkeypatch):
    """What a CUDA machine plans: the kernel probe refuses a bf16 input with fp32 weights, so
    the GroupNorm runs as group_norm_fp32, here on the (N, C, L) transpose of a Conv1d-free
    sequence model's (N, L, C) activations."""
    from amprewrite.precision.ops import Mixed

    probe = kernels._probe_mixed

    def like_cuda(fn, template, signature, dtype, device):
        if signature is Mixed.FP32_HELPER:  # the helper is probed as it is
            return probe(fn, template, signature, dtype, device)
        return "refused (the test stands in for CUDA's kernel)"

    monkeypatch.setattr(kernels, "_CACHE", kernels._Verdicts())
    monkeypatch.setattr(kernels, "_probe_mixed", like_cuda)

    class Seq(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj, self.norm = torch.nn.Linear(8, 8), torch.nn.GroupNorm(2, 8)
            self.out = torch.nn.Linear(8, 4)

        def forward(self, x):  # the norm's output feeds a low linear: it is stored low
            return self.out(self.norm(self.proj(x).transpose(1, 2)).transpose(1, 2))

    torch.manual_seed(0)
    model, x = Seq(), torch.randn(2, 5, 8)
    gm = amprewrite.transform(model, BF16, verify=False)
    assert "group_norm_fp32" in gm.code
    out = gm(x)
    def linear(m, t):
        return F.linear(t, m.weight.to(BF16), m.bias.to(BF16))

    low = linear(model.proj, x.to(BF16)).transpose(1, 2)
    normed = F.group_norm(low.float(), 2, model.norm.weight, model.norm.bias).to(BF16)
    ref = linear(model.out, normed.transpose(1, 2)).float()
    assert torch.equal(out, ref)  # the same fp32 island, bit for bit
    out.sum().backward()
    assert model.proj.weight.grad is not None


@pytest.mark.parametrize("layout", ["transposed", "sliced", "channels_last"])
def test_the_other_helpers_take_any_layout(layout):
    t = _layouts()[layout]
    index = torch.zeros(t.shape[0], 3, *t.shape[2:], dtype=torch.long)
    assert torch.equal(runtime.batch_gather(t, index),
                       torch.stack([torch.gather(t[i], 0, index[i]) for i in range(len(t))]))
    rows = torch.tensor([[1, 0], [2, 2]])
    assert torch.equal(runtime.batch_index(t, rows),
                       torch.stack([t[i][rows[i]] for i in range(len(t))]))
    out = runtime.setitem(t, (slice(None), 0), 7.0)
    expected = t.clone()
    expected[:, 0] = 7.0
    assert torch.equal(out, expected) and not torch.equal(out, t)
    steps = (("transpose", (0, 1), {}), ("__getitem__", (1,), {}))
    value = torch.ones_like(runtime.replay_view(t, steps))
    written = runtime.write_view(t, value, steps)
    expected = t.clone()
    expected.transpose(0, 1)[1].copy_(value)
    assert torch.equal(written, expected)
    assert runtime.cast_if_float(t, BF16).stride() == t.to(BF16).stride()
