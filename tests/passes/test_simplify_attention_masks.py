"""simplify_attention_masks: transformers' traced masks that mask nothing go, causal ones become
``is_causal=True``, padded ones stay; outputs bit-equal to the graph that keeps them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.export import Dim

import amprewrite
from amprewrite.passes.simplify_attention_masks import SimplifyAttentionMasks, mask_pattern
from amprewrite.testing import zoo

PASS = "simplify_attention_masks"


def _sdpa(gm):
    """(has a mask, is_causal) of each SDPA call in the graph."""
    calls = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and "scaled_dot_product_attention" in str(n.target):
            mask = n.kwargs.get("attn_mask", n.args[3] if len(n.args) > 3 else None)
            calls.append((mask is not None, bool(n.kwargs.get("is_causal", False))))
    return calls


def _without_pass(monkeypatch, model, inputs, **kw):
    with monkeypatch.context() as m:
        m.setattr(SimplifyAttentionMasks, "run", lambda self, gm: False)
        return amprewrite.transform(model, "bf16", example_inputs=inputs, **kw)


def _padded(ids):
    mask = torch.ones_like(ids)
    mask[0, -5:] = 0
    return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.parametrize("name, causal", [("bert", False), ("llama", True)])
def test_no_sdpa_call_gets_a_mask_without_padding_and_every_one_keeps_it_with(
        monkeypatch, name, causal):
    model, inputs = getattr(zoo, name)()
    gm = amprewrite.transform(model, "bf16", example_inputs=inputs)
    old = _without_pass(monkeypatch, model, inputs)
    assert _sdpa(old) and all(has for has, _ in _sdpa(old))  # what the capture hands SDPA
    assert _sdpa(gm) == [(False, causal)] * len(_sdpa(old))
    assert torch.equal(zoo.first_tensor(gm(*inputs)), zoo.first_tensor(old(*inputs)))
    done = [r for r in amprewrite.report(gm).rewrites if r.pass_name == PASS]
    assert len(done) == len(_sdpa(gm))
    assert ("is_causal=True" in done[0].action) == causal
    assert "input sizes alone" in done[0].reason

    padded = _padded(inputs[0])
    gp = amprewrite.transform(model, "bf16", example_inputs=padded)
    assert _sdpa(gp) and all(has and not c for has, c in _sdpa(gp))
    assert not [r for r in amprewrite.report(gp).rewrites if r.pass_name == PASS]
    with torch.no_grad():
        ref = zoo.first_tensor(model(**padded)).float()
    got = zoo.first_tensor(gp(**padded)).float()
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()  # bf16 of an fp32 reference


def test_vit_and_gpt2_masks_go_and_a_sliding_window_stays(monkeypatch):
    model, inputs = zoo.vit()
    assert _sdpa(amprewrite.transform(model, "bf16", example_inputs=inputs)) == [(False, False)] * 2
    model, inputs = zoo.gpt2()
    assert _sdpa(amprewrite.transform(model, "bf16", example_inputs=inputs)) == [(False, True)] * 2
    model, inputs = zoo.mistral()  # sliding_window=32 at 64 tokens: not causal
    assert _sdpa(amprewrite.transform(model, "bf16", example_inputs=inputs)) == [(True, False)] * 2


def test_a_dynamic_length_is_checked_at_its_bound_and_an_unbounded_one_keeps_the_mask():
    model, inputs = zoo.mistral()
    short = (inputs[0][:, :8],)  # within the window of 32 at 8, 9 and 17 tokens
    spec = ({0: Dim("b", max=64), 1: Dim("s", min=2, max=128)},)
    gm = amprewrite.transform(model, "bf16", example_inputs=short, dynamic_shapes=spec)
    assert _sdpa(gm) == [(True, False)] * 2  # at 128 tokens the window masks
    model, inputs = zoo.llama()
    spec = ({0: Dim("b", max=64), 1: Dim("s", min=2, max=128)},)
    gm = amprewrite.transform(model, "bf16", example_inputs=inputs, dynamic_shapes=spec)
    assert _sdpa(gm) == [(False, True)] * 2
    for n in (16, 100):
        ids = torch.randint(0, 256, (3, n))
        with torch.no_grad():
            ref = model(ids).logits
        got = gm(ids).logits.float()
        assert (got - ref).abs().max() < 0.05 * ref.abs().max()
    unbounded = ({0: Dim("b", max=64), 1: Dim("s", min=2)},)
    gm = amprewrite.transform(model, "bf16", example_inputs=inputs, dynamic_shapes=unbounded)
    assert _sdpa(gm) == [(True, False)] * 2


class _Buffered(nn.Module):
    """A mask read from a buffer (all true now, but a state that may change): kept."""

    def __init__(self):
        super().__init__()
        self.register_buffer("keep", torch.ones(8, 8, dtype=torch.bool))
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        q = self.proj(x).view(2, 8, 2, 8).transpose(1, 2)
        return F.scaled_dot_product_attention(q, q, q, attn_mask=self.keep)


class _Built(nn.Module):
    """A causal mask built from arange as a decoder builds it: becomes is_causal."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        q = self.proj(x).view(x.shape[0], 8, 2, 8).transpose(1, 2)
        i = torch.arange(q.shape[-2])
        bias = torch.zeros(8, 8).masked_fill(i[None, :] > i[:, None], float("-inf"))
        return F.scaled_dot_product_attention(q, q, q, attn_mask=bias)


def test_a_buffer_mask_stays_and_an_additive_causal_one_becomes_is_causal():
    x = torch.randn(2, 8, 16)
    gm = amprewrite.transform(_Buffered(), "bf16", example_inputs=(x,))
    assert _sdpa(gm) == [(True, False)]
    model = _Built()
    gm = amprewrite.transform(model, "bf16", example_inputs=(x,))
    assert _sdpa(gm) == [(False, True)]
    with torch.no_grad():
        ref = model(x)
    assert (gm(x).float() - ref).abs().max() < 0.05 * ref.abs().max()


def test_mask_pattern():
    t = torch.ones(2, 1, 4, 4, dtype=torch.bool)
    assert mask_pattern(t) == "none"
    assert mask_pattern(torch.zeros(1, 1, 4, 4)) == "none"
    assert mask_pattern(t.tril()) == "causal"
    low = torch.finfo(torch.bfloat16).min
    additive = torch.zeros(4, 4, dtype=torch.bfloat16).masked_fill(~t[0, 0].tril(), low)
    assert mask_pattern(additive) == "causal"
    assert mask_pattern(t.tril(-1)) is None  # nothing on the diagonal
    assert mask_pattern(torch.full((4, 4), -1.0)) is None  # a bias, not a mask
    assert mask_pattern(t[..., :1, :].tril()) is None  # (1, S): not a causal plane
    assert mask_pattern(torch.ones(4, 4, dtype=torch.long)) is None


class _Drawn(nn.Module):
    """A mask of random numbers (all true on every draw here, but drawn): kept."""

    def forward(self, q):
        return F.scaled_dot_product_attention(q, q, q, attn_mask=torch.rand(8, 8) >= 0)


def test_a_mask_of_random_numbers_stays():
    gm = amprewrite.transform(_Drawn(), "bf16", example_inputs=(torch.randn(2, 2, 8, 8),))
    assert _sdpa(gm) == [(True, False)]
