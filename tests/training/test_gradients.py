"""Gradients through a transformed real model: as close to fp32's as autocast's are.

Measured on the LLaMA config of amprewrite/testing/zoo.py, relative error of each parameter's
gradient against fp32's (torch 2.13 CPU; transform and backend alike):
bf16: largest 0.0085 (autocast 0.0086), smallest 0.0049; per parameter 0.99-1.22x autocast's,
at most 6.4e-4 above 1.1x it (model.layers.0.input_layernorm.weight).
fp16: largest 0.0042 (autocast 0.0044), smallest 0.00052; per parameter 0.92-1.08x autocast's.
So each parameter's error must be at most RATIO x autocast's plus SLACK (1.6x the largest excess
measured; fp16 had none), and at least 0.1x autocast's: below that the model did not run low.
Wrong policies, measured: everything in fp32 (keep_fp32=[every family]) gives errors of 0 and
fails the lower bound and the class check; norms/softmax following their inputs (allow_low=[every
FP32 family]) changes nothing here, because LLaMA casts to fp32 itself before its RMSNorm and
rotary embedding (transformers' code), so the error bounds cannot tell, and the class check
reads the same fp32 ops.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.backends.registry import lookup_backend

import amprewrite
from amprewrite.testing.zoo import llama

from ..helpers import assert_policy_intent, rel_err

pytest.importorskip("transformers")
RATIO = 1.1
SLACK = {torch.bfloat16: 1e-3, torch.float16: 2e-4}
FLOOR = 0.1  # x autocast's error: at least this much, or the low-precision ops ran in fp32
# The policy's intent on LLaMA: projections and attention low; RMSNorm's pow/mean/rsqrt and
# the rotary embedding's sin/cos in fp32.
EXPECT = {"linear": "low", "scaled_dot_product_attention": "low", "mean": "fp32",
          "rsqrt": "fp32", "trig": "fp32"}


def _loss(model, ids):
    logits = model(ids).logits
    vocab = logits.shape[-1]
    return F.cross_entropy(logits[:, :-1].reshape(-1, vocab).float(), ids[:, 1:].reshape(-1))


# Each way in one dtype in the default run (both dtypes among them); the other two are slow.
@pytest.mark.parametrize(("how", "dtype"), [
    ("transform", torch.bfloat16), ("backend", torch.float16),
    pytest.param("transform", torch.float16, marks=pytest.mark.slow),
    pytest.param("backend", torch.bfloat16, marks=pytest.mark.slow)])
def test_llama_gradients_match_fp32(dtype, how):
    torch._dynamo.reset()
    model, (ids,) = llama()
    model.train()
    ref, auto = copy.deepcopy(model), copy.deepcopy(model)
    _loss(ref, ids).backward()
    with torch.autocast("cpu", dtype=dtype):
        auto_loss = _loss(auto, ids)
    auto_loss.backward()
    graphs = []
    if how == "transform":
        run = amprewrite.transform(model, dtype=dtype, example_inputs=(ids,))
        graphs.append((run, (ids,)))
    else:
        def inner(gm, example_inputs):  # keeps the graph amprewrite hands to aot_eager
            graphs.append((gm, tuple(example_inputs)))
            return lookup_backend("aot_eager")(gm, example_inputs)

        run = torch.compile(model, backend=amprewrite.backend(dtype=dtype, inner=inner))
    _loss(run, ids).backward()
    ((gm, inputs),) = graphs
    assert_policy_intent(gm, *inputs, low=dtype, expect=EXPECT)
    ref_grads, auto_grads = dict(ref.named_parameters()), dict(auto.named_parameters())
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32, name
        fp32 = ref_grads[name].grad
        err, err_auto = rel_err(p.grad, fp32), rel_err(auto_grads[name].grad, fp32)
        assert FLOOR * err_auto <= err <= RATIO * err_auto + SLACK[dtype], (name, err, err_auto)
