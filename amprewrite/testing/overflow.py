"""Models whose fp32 values pass fp16's 65504 while their outputs stay finite: the cases a
plan decided by op type alone leaves to overflow (DESIGN.md, "Values are facts too").

Each builder returns an :class:`OverflowCase`: the model (eval mode, random weights from a fixed
seed, scaled where the class of overflow needs it), its example inputs, and ``by_hand``: the
modules a user would keep in fp32 by hand to fix it (``keep_fp32=``), the baseline the
automatic plan is measured against. Shared by tests/test_ranges.py and
``python -m benchmarks overflow``.

Three small classes, as they appear in the field:

- ``t5_ff``: a T5-style feed-forward, ``x + wo(relu(wi(x)))``, whose hidden activations reach
  ~2e5 (T5's known fp16 overflow);
- ``scores``: attention scores computed before the ``1/sqrt(d)`` scaling, ~3e5;
- ``residual``: a residual stack without norms whose stream grows to ~9e5.

And real architectures (transformers, small configs) scaled until they overflow: GPT-2 and LLaMA
with their MLP's up projection scaled, T5 with its ``wi`` scaled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import fx, nn

from ..graph import meta as M
from ..passes.base import matmul_flops as node_flops
from ..precision.ops import Precision

__all__ = ["CASES", "OverflowCase", "matmul_flops", "overflowing_modules"]


@dataclass
class OverflowCase:
    name: str
    model: nn.Module
    inputs: tuple | dict
    # What a user would keep in fp32 by hand to fix it: the leaf modules that read or write a
    # value past fp16's 65504 in fp32 (overflowing_modules), and the root's own ops named so.
    by_hand: list[str]


def overflowing_modules(model: nn.Module, inputs: tuple | dict,
                        limit: float = 65504.0) -> list[str]:
    """Paths of the leaf modules that read or write a value past ``limit`` in fp32."""
    from .zoo import call

    found: list[str] = []

    def big(value: object) -> bool:
        return (isinstance(value, torch.Tensor) and value.is_floating_point()
                and bool((value.detach().abs() > limit).any()))

    def hook(name: str):
        def check(module, args, out):
            if (any(big(a) for a in args) or big(out)) and name not in found:
                found.append(name)
        return check

    handles = [m.register_forward_hook(hook(name)) for name, m in model.named_modules()
               if name and not any(True for _ in m.children())]
    try:
        with torch.no_grad():
            call(model, inputs)
    finally:
        for h in handles:
            h.remove()
    return found


class T5FeedForward(nn.Module):
    def __init__(self, d: int = 64, f: int = 256, layers: int = 2):
        super().__init__()
        self.wi = nn.ModuleList(nn.Linear(d, f, bias=False) for _ in range(layers))
        self.wo = nn.ModuleList(nn.Linear(f, d, bias=False) for _ in range(layers))
        self.norm = nn.ModuleList(nn.LayerNorm(d) for _ in range(layers))

    def forward(self, x):
        for wi, wo, norm in zip(self.wi, self.wo, self.norm):
            x = x + wo(torch.relu(wi(norm(x))))
        return x


class ScoresBeforeScaling(nn.Module):
    def __init__(self, d: int = 64):
        super().__init__()
        self.d = d
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        with torch.no_grad():
            self.q.weight.mul_(150.0)
            self.k.weight.mul_(150.0)

    def forward(self, x):
        scores = self.q(x) @ self.k(x).transpose(-1, -2)  # ~3e5, before the scaling
        attn = torch.softmax(scores / math.sqrt(self.d) / 3000.0, -1)
        return self.o(attn @ self.v(x))


class ResidualStack(nn.Module):
    def __init__(self, d: int = 64, layers: int = 10):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))
        self.head = nn.Linear(d, 16)
        with torch.no_grad():
            for layer in self.layers:
                layer.weight.mul_(6.0)

    def forward(self, x):
        for layer in self.layers:
            x = x + torch.relu(layer(x))
        return self.head(x / 1e6)


def _seed() -> None:
    torch.manual_seed(0)


def t5_ff() -> OverflowCase:
    _seed()
    model, inputs = T5FeedForward().eval(), (torch.randn(2, 32, 64),)
    _scale_to(model, inputs, "wi.1", 2e5)
    return OverflowCase("t5_ff", model, inputs, overflowing_modules(model, inputs))


def scores() -> OverflowCase:
    _seed()
    model, inputs = ScoresBeforeScaling().eval(), (torch.randn(2, 32, 64),)
    return OverflowCase("scores", model, inputs,
                        [*overflowing_modules(model, inputs), "node:scores"])


def residual() -> OverflowCase:
    _seed()
    model, inputs = ResidualStack().eval(), (torch.randn(4, 64),)
    return OverflowCase("residual", model, inputs, overflowing_modules(model, inputs))


def _scale_to(model: nn.Module, inputs: tuple | dict, grow: str, target: float) -> None:
    """Scale the modules whose path ends with ``grow`` so that their largest fp32 output on
    ``inputs`` reaches ``target``: larger weights, as training makes them, not smaller ones
    after (a shrunk weight would be an fp16-subnormal case of its own)."""
    from .zoo import call

    grown = [m for name, m in model.named_modules() if name.endswith(grow)]
    peak = [0.0]

    def hook(module, args, out):
        peak[0] = max(peak[0], float(out.detach().abs().amax()))

    handles = [m.register_forward_hook(hook) for m in grown]
    with torch.no_grad():
        call(model, inputs)
        for h in handles:
            h.remove()
        for m in grown:
            for p in m.parameters():
                p.mul_(target / peak[0])


def gpt2() -> OverflowCase:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=256, n_positions=128, n_embd=64, n_layer=2, n_head=4,
                     use_cache=False)
    _seed()
    model = GPT2LMHeadModel(cfg).eval()
    inputs = (torch.randint(0, 256, (2, 32)),)
    _scale_to(model, inputs, "mlp.c_fc", 2e5)
    return OverflowCase("gpt2", model, inputs, overflowing_modules(model, inputs))


def llama() -> OverflowCase:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, use_cache=False)
    _seed()
    model = LlamaForCausalLM(cfg).eval()
    inputs = (torch.randint(0, 256, (2, 32)),)
    _scale_to(model, inputs, "mlp.up_proj", 2e5)
    return OverflowCase("llama", model, inputs, overflowing_modules(model, inputs))


def t5() -> OverflowCase:
    from transformers import T5Config, T5Model

    cfg = T5Config(vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                   use_cache=False)
    _seed()
    model = T5Model(cfg).eval()
    ids = torch.randint(0, 256, (2, 16))
    inputs = {"input_ids": ids, "decoder_input_ids": ids[:, :8]}
    _scale_to(model, inputs, "DenseReluDense.wi", 2e5)
    return OverflowCase("t5", model, inputs, overflowing_modules(model, inputs))


CASES = {"t5_ff": t5_ff, "scores": scores, "residual": residual, "gpt2": gpt2,
         "llama": llama, "t5": t5}


def matmul_flops(gm: fx.GraphModule) -> tuple[float, float]:
    """(FLOPs of the matmul-like ops planned low, FLOPs of all of them) in a transformed graph,
    from the shapes capture recorded (:func:`amprewrite.passes.base.matmul_flops`)."""
    low = total = 0.0
    for node in gm.graph.nodes:
        flops = node_flops(gm, node)
        if flops is None:
            continue
        total += flops
        if node.meta.get(M.CLASS) == Precision.LOW:
            low += flops
    return low, total
