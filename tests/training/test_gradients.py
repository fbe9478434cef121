"""Gradients through a transformed real model match fp32 gradients to low-precision tolerance.

Measured on the LLaMA config of amprewrite/testing/zoo.py (max relative error over parameters):
bf16 0.0085 (autocast 0.0086), fp16 0.0042 (autocast 0.0044).
"""

import copy

import pytest
import torch
import torch.nn.functional as F

import amprewrite
from amprewrite.testing.zoo import llama

from ..helpers import rel_err

pytest.importorskip("transformers")
TOL = {torch.bfloat16: 2e-2, torch.float16: 1e-2}


def _loss(model, ids):
    logits = model(ids).logits
    vocab = logits.shape[-1]
    return F.cross_entropy(logits[:, :-1].reshape(-1, vocab).float(), ids[:, 1:].reshape(-1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("how", ["transform", "backend"])
def test_llama_gradients_match_fp32(dtype, how):
    torch._dynamo.reset()
    model, (ids,) = llama()
    model.train()
    ref = copy.deepcopy(model)
    _loss(ref, ids).backward()
    if how == "transform":
        run = amprewrite.transform(model, dtype=dtype, example_inputs=(ids,))
    else:
        run = torch.compile(model, backend=amprewrite.backend(dtype=dtype, inner="aot_eager"))
    _loss(run, ids).backward()
    ref_grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32, name
        assert rel_err(p.grad, ref_grads[name].grad) < TOL[dtype], name
