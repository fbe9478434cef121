"""Text generation (Hugging Face ``generate()``) with amprewrite's precision plan.

:func:`amprewrite.transform` returns a GraphModule, which has no ``generate()``: its graph returns
the model's KV cache (with ``use_cache=True``, the default) but is captured for one call's
sizes, while ``generate()`` calls the model with a growing cache. Generation goes through the
``torch.compile`` backend instead: :func:`for_generation` returns a copy of the model whose
``forward`` is compiled with the ``"amprewrite"`` backend, so ``generate()``, its logits
processors and its cache work as usual while every forward runs in the rewritten graph. Causal
LMs and encoder-decoder models work with their default config (GPT-2, LLaMA, T5, BART tested).

It also sets the copy's default cache to a static one (``cache_implementation="static"``): the
cache tensors then have a fixed size, so dynamo captures two graphs in all (the prompt, and one
token) instead of a new graph when the cache first grows and another with symbolic lengths.
(With transformers 5.23, autocast with that cache failed when tried: its low-precision keys do
not fit the fp32 cache.)

>>> import torch, amprewrite
>>> from transformers import LlamaConfig, LlamaForCausalLM
>>> cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
...                   num_attention_heads=2, num_key_value_heads=1)
>>> model = LlamaForCausalLM(cfg).eval()
>>> fast = amprewrite.for_generation(model, dtype=torch.bfloat16, inner="eager")
>>> fast.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False).shape
torch.Size([1, 7])
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from ..errors import ModelError
from .backend import backend

__all__ = ["for_generation"]


def for_generation(model: nn.Module, dtype: torch.dtype | str = torch.bfloat16, *,
                   inner: str | Callable = "eager", static_cache: bool = True,
                   **options: object) -> nn.Module:
    """A copy of an HF generative ``model`` whose forward runs through the amprewrite backend.

    Args:
        model: a transformers model with ``generate()`` (causal LM, encoder-decoder). Not
            modified: the copy shares its parameters and submodules (no weight is copied), and
            gets its own ``forward`` and ``generation_config``.
        dtype: the low-precision dtype, as for :func:`amprewrite.transform`.
        inner: the backend that runs the rewritten graphs: ``"eager"`` (default; compiles in
            seconds, best for short runs and CPU) or ``"inductor"`` (fused kernels: compiles
            for tens of seconds on CPU, pays off over long generations on GPU), or a
            backend callable.
        static_cache: make ``cache_implementation="static"`` the copy's default (two graphs
            in all); ``False`` keeps the model's cache (a DynamicCache compiles three graphs,
            the last with symbolic lengths).
        **options: further :func:`amprewrite.transform` options the backend takes
            (``keep_fp32``, ``allow_low``, ``upsample``, ...).

    Returns:
        The copy; call ``generate()`` on it as on the model.
    """
    if not (isinstance(model, nn.Module) and hasattr(model, "generate")
            and hasattr(model, "generation_config")):
        raise ModelError(
            f"amprewrite.for_generation expects a Hugging Face transformers model with "
            f"generate() (a *ForCausalLM or *ForConditionalGeneration), got "
            f"{type(model).__name__}. For other models, use amprewrite.transform or "
            "torch.compile(model, backend='amprewrite')."
        )
    new = copy.copy(model)  # shares _modules, _parameters and _buffers with the model
    config = copy.deepcopy(model.generation_config)
    if static_cache:
        config.cache_implementation = "static"
    # transformers would wrap forward in its own torch.compile (inductor) for static caches on
    # GPU; the amprewrite-compiled forward is the one to run.
    config.disable_compile = True
    new.generation_config = config
    forward = type(model).forward.__get__(new)
    new.forward = torch.compile(forward, backend=backend(inner=inner, dtype=dtype, **options))
    return new
