"""Every graph amprewrite returns compiles with ``torch.compile(gm, fullgraph=True)``.

The graph carries amprewrite's own run-time helpers (writes through a view,
``amprewrite/graph/runtime.py``) and custom ``torch.autograd.Function``s as dynamo captured them;
both must be traceable by dynamo. Compiles are slow on a small CPU: the default run compiles two zoo
models and the two special cases, ``-m slow`` every other zoo model.

Tolerances: inductor fuses the casts and computes fused pointwise ops in fp32, so a compiled
output may differ from the GraphModule's by bf16 rounding (relative error up to 2e-2 of the
output's norm); against fp32, its error stays within 1.1x the GraphModule's (+1e-4).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import amprewrite
from amprewrite.show.numerics import rel_err
from amprewrite.testing import zoo
from amprewrite.testing.zoo import call, first_tensor

# The two zoo models in the default run: a CNN and a transformer, the fastest to compile.
FAST = ["bert"]  # resnet (29 s at load) and the rest: -m slow
SLOW = [n for n in [*zoo.MODELS, *zoo.MORE] if n not in FAST]

ROUNDING = 2e-2  # compiled vs GraphModule: bf16 rounding of a fused computation


def _compiled_matches(gm, inputs, ref):
    torch._dynamo.reset()
    compiled = torch.compile(gm, fullgraph=True)
    with torch.no_grad():
        out = first_tensor(call(compiled, inputs))
        eager = first_tensor(call(gm, inputs))
    torch._dynamo.reset()
    assert out.dtype == eager.dtype and out.shape == eager.shape
    assert rel_err(out, eager) <= ROUNDING
    assert rel_err(out, ref) <= 1.1 * rel_err(eager, ref) + 1e-4
    return out


@pytest.mark.parametrize("name", [*FAST, *[pytest.param(n, marks=pytest.mark.slow)
                                           for n in SLOW]])
def test_zoo_model_compiles_with_fullgraph(name):
    builders = {**zoo.MODELS, **zoo.MORE}
    model, inputs = builders[name]()
    with torch.no_grad():
        ref = first_tensor(call(model, inputs)).float()
    gm = amprewrite.transform(model, torch.bfloat16, example_inputs=inputs)
    _compiled_matches(gm, inputs, ref)


# --- writes through a view: amprewrite.graph.runtime.write_view -------------------------


class WritesThroughViews(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        h[:, :2].mul_(2)  # __getitem__ view
        h.T.add_(1)  # a property step (T), replayed without calling it
        h.view(-1, 2, 4)[:, 0].sub_(0.5)  # a chain of view() and select
        return h.softmax(-1)


def test_writes_through_views_compile_with_fullgraph():
    model = WritesThroughViews().eval()
    x = torch.randn(4, 8)
    gm = amprewrite.transform(model, torch.bfloat16, example_inputs=(x,))
    assert any("write_view" in str(n.target) for n in gm.graph.nodes)
    with torch.no_grad():
        ref = model(x)
    _compiled_matches(gm, (x,), ref)


def test_replay_view_reads_properties_and_calls_methods():
    from amprewrite.graph.runtime import replay_view, write_view

    x = torch.arange(6.0).reshape(2, 3)
    steps = (("T", (), {}), ("__getitem__", ((0,),), {}))
    assert torch.equal(replay_view(x, steps), x.T[0])
    y = write_view(x, torch.zeros(2), steps)
    assert y[:, 0].tolist() == [0.0, 0.0] and x[0, 0] == 0.0 and x[1, 0] == 3.0


# --- custom autograd Functions ------------------------------------------------------------------


class ClampSTE(torch.autograd.Function):
    """Clamps forward; passes gradients straight through backward, also where it clamped
    (autograd's own derivative would be zero there): a backward that must survive capture."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.save_for_backward(x)
        ctx.scale = scale
        return torch.clamp(x * scale, -1.0, 1.0)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * ctx.scale * torch.ones_like(x), None


class Quantized(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(ClampSTE.apply(self.fc1(x), 4.0))


def _grads(fn, model, x):
    x = x.clone().requires_grad_(True)
    for p in model.parameters():
        p.grad = None
    out = fn(x)
    out.float().square().sum().backward()
    return out.detach(), x.grad.clone(), model.fc1.weight.grad.clone()


def test_custom_autograd_function_keeps_its_backward_and_compiles():
    torch.manual_seed(0)
    model = Quantized().train()
    x = torch.randn(6, 8)
    gm = amprewrite.transform(model, torch.bfloat16, example_inputs=(x,))
    targets = [str(n.target) for n in gm.graph.nodes]
    assert not any("higher_order" in t for t in targets)
    assert any("autograd_function_apply" in t for t in targets)

    out_ref, gx_ref, gw_ref = _grads(model, model, x)
    out, gx, gw = _grads(gm, model, x)
    # The straight-through backward: autograd's derivative of clamp is 0 where it clamped.
    clamped = (model.fc1(x).detach() * 4.0).abs() > 1.0
    assert clamped.any()
    assert rel_err(_grads(lambda v: model.fc2(torch.clamp(model.fc1(v) * 4.0, -1.0, 1.0)),
                          model, x)[1], gx_ref) > 0.1
    # The Function itself runs fp32; the linears around it run bf16.
    for got, want in ((out, out_ref), (gx, gx_ref), (gw, gw_ref)):
        assert rel_err(got, want) <= 5e-2

    torch._dynamo.reset()
    compiled = torch.compile(gm, fullgraph=True)
    out_c, gx_c, gw_c = _grads(compiled, model, x)
    torch._dynamo.reset()
    for got, want in ((out_c, out), (gx_c, gx), (gw_c, gw)):
        assert rel_err(got, want) <= ROUNDING


@pytest.mark.slow
def test_bloom_gelu_function_compiles_and_keeps_its_gradient():
    from transformers import BloomConfig, BloomForCausalLM

    cfg = BloomConfig(vocab_size=256, hidden_size=64, n_layer=2, n_head=4, use_cache=False)
    torch.manual_seed(0)
    model = BloomForCausalLM(cfg).train()  # BloomGelu uses its autograd.Function in training
    ids = torch.randint(0, 256, (2, 16))
    gm = amprewrite.transform(model, torch.bfloat16, example_inputs=(ids,))
    assert any("autograd_function_apply" in str(n.target) for n in gm.graph.nodes)

    def loss_and_grad(fn):
        model.zero_grad()
        logits = fn(ids).logits
        logits.float().logsumexp(-1).mean().backward()
        return logits.detach(), model.transformer.h[0].mlp.dense_h_to_4h.weight.grad.clone()

    ref, g_ref = loss_and_grad(model)
    out, g = loss_and_grad(gm)
    torch._dynamo.reset()
    out_c, g_c = loss_and_grad(torch.compile(gm, fullgraph=True))
    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto, g_auto = loss_and_grad(model)
    assert rel_err(out_c, out) <= ROUNDING and rel_err(g_c, g) <= ROUNDING
    assert rel_err(out, ref) <= 1.1 * rel_err(auto, ref) + 1e-3
    assert rel_err(g, g_ref) <= 1.5 * rel_err(g_auto, g_ref) + 1e-3


@pytest.mark.slow
def test_diffusers_unet1d_writes_through_views_and_compiles():
    from diffusers import UNet1DModel

    torch.manual_seed(0)
    model = UNet1DModel(block_out_channels=(32, 32, 64), extra_in_channels=64, in_channels=2,
                        out_channels=2).eval()
    inputs = (torch.randn(2, 2, 64), torch.tensor([10]))
    with torch.no_grad():
        ref = model(*inputs).sample
    gm = amprewrite.transform(model, torch.bfloat16, example_inputs=inputs)
    assert any("write_view" in str(n.target) for n in gm.graph.nodes)
    _compiled_matches(gm, inputs, ref)


def test_a_graph_returning_a_transformers_cache_compiles_with_fullgraph():
    """The guide's quickstart, `torch.compile(gm, fullgraph=True)`, on a causal LM with its
    default config (`use_cache=True`): the graph returns a DynamicCache, which transformers'
    pytree unflatten rebuilds by importing each class by name, and dynamo refused the import."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 1000, (2, 16))
    gm = amprewrite.transform(model, dtype=torch.bfloat16, example_inputs=(ids,))
    want = gm(ids)
    got = torch.compile(gm, fullgraph=True, backend="eager")(ids)
    assert type(got.past_key_values) is type(want.past_key_values) is transformers.DynamicCache
    leaves = torch.utils._pytree.tree_leaves
    assert torch.equal(got.logits, want.logits)
    assert all(torch.equal(a, b) for a, b in zip(leaves(got.past_key_values),
                                                 leaves(want.past_key_values), strict=True))
