"""Random models for property-based testing: a program of ops from a fixed vocabulary.

A model is a list of steps; each step applies one op kind to values made earlier (any earlier
value, so values get several consumers), and the model returns the last value and one earlier
one. Values are float tensors of shape (N, F); an integer input ``ids`` of shape (N,) feeds the
integer-to-float paths. Ops are written to keep values O(1) (tanh before exp, ``abs() + 1``
before log and division) so that a tolerance against fp32 means something.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import nn

N, FEAT, VOCAB = 4, 8, 16


def _attention(x):
    scores = x.unsqueeze(-1) @ x.unsqueeze(-2) / math.sqrt(FEAT)
    return (scores.softmax(-1) @ x.unsqueeze(-1)).squeeze(-1)


def _sdpa(x):
    q = x.reshape(1, 1, N, FEAT)
    return F.scaled_dot_product_attention(q, q, q).reshape(N, FEAT)


def _max_multi(x):
    values, index = x.max(-1, keepdim=True)  # a multi-output node, with an int output
    return x - values + index.float() / FEAT


def _chunk_cat(x):
    a, b = x.chunk(2, -1)
    return torch.cat([b, a * 2], -1)


def _topk(x):
    values, _ = x.topk(2, -1)
    return x * values.mean(-1, keepdim=True).tanh()


def _bmm(x):
    h = x.reshape(N, 2, FEAT // 2)
    return (torch.bmm(h, h.transpose(1, 2)) / FEAT).reshape(N, 4).repeat(1, FEAT // 4)


def _upsample_nearest(x):
    up = F.interpolate(x.reshape(N, 1, 1, FEAT), scale_factor=2, mode="nearest")
    return up[:, 0, 0, ::2].reshape(N, FEAT)


def _upsample_bilinear(x):
    up = F.interpolate(x.reshape(N, 1, 2, FEAT // 2), scale_factor=2, mode="bilinear")
    return F.avg_pool2d(up, 2).reshape(N, FEAT)


def _positions(x):
    angles = torch.arange(FEAT, device=x.device).float() * 0.3  # integer -> float position path
    return x + torch.sin(angles)


# name -> (arity, function(module, *values, ids)); module is the step's parameters or None.
UNARY = {
    "linear": lambda m, x, ids: m(x),
    "functional_linear": lambda m, x, ids: F.linear(x, m.weight, m.bias),
    "matmul_param": lambda m, x, ids: x @ m.weight,
    "conv1d": lambda m, x, ids: m(x.unsqueeze(1)).squeeze(1),
    "bmm": lambda m, x, ids: _bmm(x),
    "attention": lambda m, x, ids: _attention(x),
    "sdpa": lambda m, x, ids: _sdpa(x),
    "softmax": lambda m, x, ids: x.softmax(-1),
    "log_softmax": lambda m, x, ids: F.log_softmax(x, -1) / FEAT,
    "layer_norm": lambda m, x, ids: m(x),
    "batch_norm": lambda m, x, ids: m(x),
    "group_norm": lambda m, x, ids: m(x),
    "rms_norm": lambda m, x, ids: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6),
    "exp": lambda m, x, ids: torch.exp(torch.tanh(x)),
    "log": lambda m, x, ids: torch.log(x.abs() + 1),
    "logsumexp": lambda m, x, ids: x - torch.logsumexp(x, -1, keepdim=True),
    "cross_entropy": lambda m, x, ids: x + F.cross_entropy(x, ids % FEAT),
    "gelu": lambda m, x, ids: F.gelu(x),
    "silu": lambda m, x, ids: F.silu(x),
    "relu": lambda m, x, ids: torch.relu(x),
    "tanh": lambda m, x, ids: torch.tanh(x),
    "sigmoid": lambda m, x, ids: torch.sigmoid(x),
    "mean_center": lambda m, x, ids: x - x.mean(-1, keepdim=True),
    "sum_gate": lambda m, x, ids: x * x.sum(-1, keepdim=True).tanh(),
    "cumsum": lambda m, x, ids: x.cumsum(-1) / FEAT,
    "norm": lambda m, x, ids: x / (x.norm(dim=-1, keepdim=True) + 1),
    "pow": lambda m, x, ids: x.pow(2) / (1 + x.pow(2)),
    "transpose": lambda m, x, ids: x.t().contiguous().t(),
    "reshape_flip": lambda m, x, ids: x.reshape(N, 2, FEAT // 2).flip(1).reshape(N, FEAT),
    "upsample_nearest": lambda m, x, ids: _upsample_nearest(x),
    "upsample_bilinear": lambda m, x, ids: _upsample_bilinear(x),
    "max_multi": lambda m, x, ids: _max_multi(x),
    "chunk_cat": lambda m, x, ids: _chunk_cat(x),
    "topk": lambda m, x, ids: _topk(x),
    "positions": lambda m, x, ids: _positions(x),
    "embedding": lambda m, x, ids: x + m(ids),
    "ids_float": lambda m, x, ids: x * (ids.float().unsqueeze(-1) / VOCAB),
    "where": lambda m, x, ids: torch.where(x > 0, x, 0.1 * x),
    "clamp": lambda m, x, ids: x.clamp(-2, 2),
    "dropout_eval": lambda m, x, ids: F.dropout(x, 0.5, training=False),
    # Families of the op registry beyond the first table (FFT, special, operator forms, ...).
    "rfft_abs": lambda m, x, ids: torch.fft.irfft(torch.fft.rfft(x).abs(), n=FEAT) / FEAT,
    "lgamma": lambda m, x, ids: torch.lgamma(x.abs() + 1) / FEAT,
    "logit": lambda m, x, ids: torch.logit(torch.sigmoid(x), 1e-4) / 4,
    "square": lambda m, x, ids: torch.square(torch.tanh(x)),
    "self_mul": lambda m, x, ids: torch.tanh(x) * torch.tanh(x),
    "reciprocal_op": lambda m, x, ids: 1.0 / (x.abs() + 1),
    "atanh": lambda m, x, ids: torch.atanh(torch.tanh(x).clamp(-0.9, 0.9)),
    "logcumsumexp": lambda m, x, ids: torch.logcumsumexp(x, -1) / FEAT,
    "avg_pool1d": lambda m, x, ids: F.avg_pool1d(x.unsqueeze(1), 2).repeat_interleave(2, -1)
    .squeeze(1),
    "quantile": lambda m, x, ids: x - torch.quantile(x, 0.5, dim=-1, keepdim=True),
    "in_place_exp": lambda m, x, ids: torch.tanh(x).clone().exp_(),
}
BINARY = {
    "add": lambda m, a, b, ids: a + b,
    "mul": lambda m, a, b, ids: a * b,
    "sub": lambda m, a, b, ids: a - 0.5 * b,
    "div": lambda m, a, b, ids: a / (b.abs() + 1),
    "mse_loss": lambda m, a, b, ids: a + F.mse_loss(a, b),
    "bce_logits": lambda m, a, b, ids: a + F.binary_cross_entropy_with_logits(a, torch.sigmoid(b)),
    "smooth_l1": lambda m, a, b, ids: a - F.smooth_l1_loss(a, b),
    "logaddexp": lambda m, a, b, ids: torch.logaddexp(a, b) / 2,
    "kl_div": lambda m, a, b, ids: a + torch.kl_div(F.log_softmax(a, -1), F.softmax(b, -1))
    .mean(),
}
OPS = {**UNARY, **BINARY}


def _params(kind: str) -> nn.Module | None:
    if kind in ("linear", "functional_linear", "matmul_param"):
        return nn.Linear(FEAT, FEAT)
    if kind == "conv1d":
        return nn.Conv1d(1, 1, 3, padding=1)
    if kind == "layer_norm":
        return nn.LayerNorm(FEAT)
    if kind == "group_norm":
        return nn.GroupNorm(2, FEAT)
    if kind == "embedding":
        return nn.Embedding(VOCAB, FEAT)
    if kind == "batch_norm":
        bn = nn.BatchNorm1d(FEAT).eval()
        with torch.no_grad():
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
        return bn
    return None


class Program(nn.Module):
    """``steps``: (op kind, indices of the values it reads); value 0 is the input ``x``."""

    def __init__(self, steps: list[tuple[str, tuple[int, ...]]], extra_output: int):
        super().__init__()
        self.steps = steps
        self.extra_output = extra_output
        self.mods = nn.ModuleDict({str(i): m for i, (kind, _) in enumerate(steps)
                                   if (m := _params(kind)) is not None})

    def forward(self, x, ids):
        values = [x]
        for i, (kind, reads) in enumerate(self.steps):
            mod = self.mods[str(i)] if str(i) in self.mods else None
            values.append(OPS[kind](mod, *(values[r] for r in reads), ids))
        return values[-1], values[self.extra_output]

    def __repr__(self) -> str:
        return f"Program({self.steps!r}, extra_output={self.extra_output})"


@st.composite
def programs(draw, max_steps: int = 8) -> Program:
    count = draw(st.integers(1, max_steps))
    steps = []
    for i in range(count):
        kind = draw(st.sampled_from(sorted(OPS)))
        arity = 2 if kind in BINARY else 1
        reads = tuple(draw(st.integers(0, i)) for _ in range(arity))
        steps.append((kind, reads))
    extra = draw(st.integers(0, count))
    seed = draw(st.integers(0, 2**16))
    torch.manual_seed(seed)
    return Program(steps, extra).eval()


@st.composite
def inputs(draw):
    seed = draw(st.integers(0, 2**16))
    scale = draw(st.sampled_from([0.1, 1.0, 4.0]))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(N, FEAT, generator=gen) * scale
    ids = torch.randint(0, VOCAB, (N,), generator=gen)
    return x, ids


# --- position programs: integers turned into floats, every spelling ------------------------------
# An integer source, a conversion spelling, float ops that keep the cone going, and an op that
# ends it (bounded or LOW). Positions reach 5,000: bf16 keeps 769 distinct of 0..4095 and fp16
# is exact only to 2048, so a cone that breaks anywhere shows as an O(1) error after sin/cos.
SEQ = 600  # long enough that cumsum of a mask passes 256 (where bf16 stops being exact)

SOURCES = {
    "arange": lambda pos, mask, t, off: torch.arange(mask.shape[-1], device=mask.device) + off,
    "position_ids": lambda pos, mask, t, off: pos,
    "cumsum_mask": lambda pos, mask, t, off: mask.cumsum(-1) + off,
    "timesteps": lambda pos, mask, t, off: t[:, None] * 5 + torch.arange(4, device=t.device),
    "arange_float_grid": lambda pos, mask, t, off: torch.arange(
        mask.shape[-1], device=mask.device, dtype=torch.float32) + off,
}

FLOAT_SOURCES = {"arange_float_grid"}


def _copy_into(p, buf):
    out = torch.empty(p.shape, device=p.device)
    out.copy_(p)
    return out


def _setitem(p, buf):
    out = torch.zeros(p.shape, device=p.device)
    out[...] = p
    return out


# name -> (function(int tensor, fp32 buffer) -> float tensor, symbolic_trace can follow it)
CONVERSIONS = {
    "float": (lambda p, buf: p.float(), True),
    "to_dtype": (lambda p, buf: p.to(torch.float32), True),
    "to_dtype_kw": (lambda p, buf: p.to(dtype=torch.float32), True),
    "to_tensor": (lambda p, buf: p.to(buf), True),
    "to_buffer_dtype": (lambda p, buf: p.to(buf.dtype), True),
    "to_device_dtype": (lambda p, buf: p.to(buf.device, torch.float32), True),
    "type_as": (lambda p, buf: p.type_as(buf), True),
    "type_dtype": (lambda p, buf: p.type(torch.float32), True),
    "type_name": (lambda p, buf: p.type("torch.FloatTensor"), True),
    "double_then_float": (lambda p, buf: p.double().float(), True),
    "copy_into": (_copy_into, True),
    "setitem": (_setitem, False),
    "new_tensor": (lambda p, buf: buf.new_tensor(p), False),
    "as_tensor": (lambda p, buf: torch.as_tensor(p, dtype=torch.float32), False),
    "mul_float_tensor": (lambda p, buf: p * buf.new_ones(()), True),
    "add_zeros": (lambda p, buf: torch.zeros(p.shape, device=p.device) + p, True),
    "mul_scalar": (lambda p, buf: p * 1.0, True),
    "div_int": (lambda p, buf: p / 1, True),
    "where": (lambda p, buf: torch.where(p >= 0, p, torch.zeros((), device=p.device)), True),
    "cumsum_dtype": (lambda p, buf: torch.ones_like(p).cumsum(-1, dtype=torch.float32)
                     + p.float() * 0 + p[..., :1], True),
}
# Sources that are graph inputs, and spellings that convert them without naming a dtype: traced
# without example inputs, an input's dtype is unknown, so amprewrite cannot see that ``zeros +
# ids`` turns integers into floats (docs/guide.md, "Position cones"). Explicit conversions
# (``ids.float()``, ``ids.type_as(f)``) of an input of unknown dtype do start a cone.
INPUT_SOURCES = {"position_ids", "cumsum_mask"}
IMPLICIT = {"add_zeros", "copy_into", "div_int", "mul_float_tensor", "mul_scalar", "where"}
# Float ops inside the cone: (function(value, buffer) -> value).
CONE_OPS = {
    "scale": lambda v, buf: v * buf[0],
    "add": lambda v, buf: v + 0.5,
    "div": lambda v, buf: v / 1.5,
    "neg": lambda v, buf: -v,
    "view": lambda v, buf: v.unsqueeze(-1).squeeze(-1),
}
# Ends of the cone, each from a value of shape (..., S) to (..., S, 4): the RoPE angle makers
# and what follows them.
ENDS = {
    "outer_sin": lambda v, buf, lin: torch.sin(v[..., None] * buf),
    "outer_cos": lambda v, buf, lin: torch.cos(v[..., None] * buf),
    "matmul_sin": lambda v, buf, lin: torch.sin(v[..., None] @ buf[None, :]),
    "linear_tanh": lambda v, buf, lin: torch.tanh(lin(v[..., None] * buf * 0.01)),
    "sigmoid": lambda v, buf, lin: torch.sigmoid(v[..., None] * buf - 5.0),
    "softmax": lambda v, buf, lin: torch.softmax(v[..., None] * buf * 0.01, -1),
}


class PositionProgram(nn.Module):
    """source -> conversion -> cone ops -> end, then an optional low-precision linear."""

    def __init__(self, source: str, conversion: str, cone: list[str], end: str, offset: int,
                 tail: bool):
        super().__init__()
        self.source, self.conversion, self.cone, self.end = source, conversion, cone, end
        self.offset, self.tail = offset, tail
        self.register_buffer("inv_freq", torch.tensor([1.0, 0.37, 0.1, 0.011]))
        self.lin = nn.Linear(4, 4)
        self.out = nn.Linear(4, 4)

    def forward(self, pos, mask, t):
        p = SOURCES[self.source](pos, mask, t, self.offset)
        born_float = self.source in FLOAT_SOURCES  # known statically: fx cannot branch
        v = p if born_float else CONVERSIONS[self.conversion][0](p, self.inv_freq)
        for op in self.cone:
            v = CONE_OPS[op](v, self.inv_freq)
        y = ENDS[self.end](v, self.inv_freq, self.lin)
        return self.out(y) if self.tail else y

    def __repr__(self) -> str:
        return (f"PositionProgram({self.source!r}, {self.conversion!r}, {self.cone!r}, "
                f"{self.end!r}, offset={self.offset}, tail={self.tail})")


@st.composite
def position_programs(draw) -> PositionProgram:
    model = PositionProgram(
        draw(st.sampled_from(sorted(SOURCES))), draw(st.sampled_from(sorted(CONVERSIONS))),
        draw(st.lists(st.sampled_from(sorted(CONE_OPS)), max_size=3)),
        draw(st.sampled_from(sorted(ENDS))), draw(st.sampled_from([0, 1000, 4000])),
        draw(st.booleans()))
    torch.manual_seed(draw(st.integers(0, 2**16)))
    model.lin.reset_parameters()
    model.out.reset_parameters()
    return model.train() if draw(st.booleans()) else model.eval()


@st.composite
def position_inputs(draw):
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    start = draw(st.sampled_from([0, 500, 4000]))
    pos = start + torch.arange(SEQ).expand(2, SEQ).clone()
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[1, : int(torch.randint(0, SEQ // 2, (), generator=gen))] = 0  # left padding
    t = torch.randint(0, 1000, (2,), generator=gen)
    return pos, mask, t
