"""Cast placement: fewest bytes, one cast per (value, dtype), no round trips."""

import copy
import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from amprewrite.graph import meta as M

from ..helpers import (
    LOW_DTYPES,
    assert_classes_respected,
    casts,
    rel_err,
    rewrites,
    runtime_dtypes,
    transform,
    transform_via,
)


def _between(gm, first: str, last: str) -> list:
    """Nodes strictly between two nodes on every path (here: the chain between them)."""
    names = [n.name for n in gm.graph.nodes]
    return [n for n in list(gm.graph.nodes)[names.index(first) + 1: names.index(last)]]


@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_linear_gelu_linear_has_no_cast_between(dtype):
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    gm = transform(model, dtype=dtype)
    x = torch.randn(4, 16)
    assert_classes_respected(gm, x, low=dtype)
    lin1, lin2 = [n for n in gm.graph.nodes if n.meta.get(M.FAMILY) == "linear"]
    (gelu,) = [n for n in gm.graph.nodes if n.meta.get(M.FAMILY) == "activation"]
    assert gelu.args[0] is lin1 and lin2.args[0] is gelu  # wired directly: no cast between
    assert gelu.meta[M.LABEL] == M.LOW
    # Casts: input, two weights, two biases down; the output up. Nothing else.
    assert len(casts(gm)) == 6
    assert rel_err(gm(x), model(x)) < 3e-2


@pytest.mark.parametrize("dtype", LOW_DTYPES)
def test_bn_relu_bn_stays_fp32_without_round_trip(dtype):
    model = nn.Sequential(nn.BatchNorm1d(8), nn.ReLU(), nn.BatchNorm1d(8)).eval()
    gm = transform(model, dtype=dtype)
    (relu,) = [n for n in gm.graph.nodes if n.meta.get(M.FAMILY) == "relu"]
    assert relu.meta[M.LABEL] == M.HIGH
    assert casts(gm) == []  # nothing here is low precision: no cast at all
    x = torch.randn(4, 8)
    assert torch.equal(gm(x), model(x))


def test_cast_moves_after_a_shrinking_neutral_op():
    """fp32 input -> max-pool (neutral, 4x smaller) -> conv: cast after the pool."""
    model = nn.Sequential(nn.MaxPool2d(2), nn.Conv2d(3, 4, 1))
    gm = transform(model, dtype=torch.bfloat16, example_inputs=(torch.randn(1, 3, 8, 8),))
    (pool,) = [n for n in gm.graph.nodes if n.meta.get(M.FAMILY) == "max_pool"]
    assert pool.meta[M.LABEL] == M.HIGH
    (down,) = [c for c in casts(gm) if c.args[0] is pool]
    assert down.meta[M.CAST] == torch.bfloat16


def test_cast_moves_before_a_growing_neutral_op():
    """low conv output -> expand (neutral, 8x bigger) -> fp32 consumer: cast before expand.
    (exp: an FP32 op without a mixed signature, so it needs an fp32 copy of its input.)"""

    class Grow(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 1)

        def forward(self, x):
            y = self.conv(x)
            return y[:, :, :, None, :, None].expand(-1, -1, -1, 2, -1, 4).exp()

    gm = transform(Grow(), dtype=torch.bfloat16, example_inputs=(torch.randn(1, 3, 8, 8),))
    (conv,) = [n for n in gm.graph.nodes if n.meta.get(M.FAMILY) == "conv"]
    (up,) = [c for c in casts(gm) if c.meta[M.CAST] == torch.float32]
    # Upcast before the expand: the cast value is the conv output's size (not 8x it).
    assert up.args[0].meta[M.ORIG].numel == conv.meta[M.ORIG].numel == 4 * 64


def test_one_cast_per_value_and_dtype():
    class Fan(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            return self.a(x) + self.b(x) + self.c(x)

    gm = transform(Fan(), dtype=torch.bfloat16)
    (x,) = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert len([c for c in casts(gm) if c.args[0] is x]) == 1
    keys = [(c.args[0], c.meta[M.CAST]) for c in casts(gm)]
    assert len(keys) == len(set(keys))


def test_no_low_high_low_round_trip_on_natural_high_values():
    """A fp32 value feeding both a low and a high consumer is never rounded on the way."""

    class Both(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            h = x.reshape(4, 8)  # neutral, natural high
            return self.fc(h), h.softmax(-1)

    gm = transform(Both(), dtype=torch.bfloat16)
    (reshape,) = [n for n in gm.graph.nodes if n.meta.get(M.FAMILY) == "shape"]
    assert reshape.meta[M.LABEL] == M.HIGH
    x = torch.randn(32)
    assert torch.equal(gm(x)[1], x.reshape(4, 8).softmax(-1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_dtype_arg_op_reads_an_fp32_value_unrounded(dtype, train):
    """softmax (``Mixed.DTYPE_ARG``: reads either dtype) on an fp32 value that a growing
    neutral op (``repeat``) also feeds to a low op: casting before the repeat moves fewer bytes,
    but the softmax would then read the rounded value. It reads the fp32 value (bit-equal to
    the fp32 softmax); the plan once let it read the low copy (eval, with example inputs)."""

    class Both(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            h = x.repeat(4, 1)
            return self.fc(h), h.softmax(-1)

    x = torch.randn(4, 8) * 3
    gm = transform(Both().train(train), dtype=dtype, example_inputs=(x,))
    assert torch.equal(gm(x)[1], x.repeat(4, 1).softmax(-1))


@pytest.mark.parametrize("keep_io", [True, False])
def test_keep_io_dtype(keep_io):
    model = nn.Linear(4, 4)
    gm = transform(model, dtype=torch.float16, keep_io_dtype=keep_io)
    assert gm(torch.randn(2, 4)).dtype == (torch.float32 if keep_io else torch.float16)


def test_integer_inputs_are_not_cast():
    class Emb(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.fc = nn.Embedding(10, 8), nn.Linear(8, 2)

        def forward(self, ids, mask):
            return self.fc(self.emb(ids)).sum(-1) * mask.sum()

    ids, mask = torch.randint(0, 10, (3, 5)), torch.ones(3, 5, dtype=torch.bool)
    model = Emb()
    gm = transform(model, dtype=torch.bfloat16)
    seen = runtime_dtypes(gm, ids, mask)
    (mask_sum,) = [n for n in gm.graph.nodes
                   if n.meta.get(M.FAMILY) == "sum" and n.args[0].op == "placeholder"]
    assert seen[mask_sum.name][1] == torch.int64  # the bool mask was summed as integers
    out = gm(ids, mask)
    assert out.dtype == torch.float32
    assert rel_err(out, model(ids, mask)) < 3e-2


def test_explicit_model_casts_are_honoured():
    class Up(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return F.gelu(self.fc(x).float())  # the author asked for fp32 here

    gm = transform(Up(), dtype=torch.bfloat16)
    assert gm(torch.randn(2, 8)).dtype == torch.float32
    (gelu,) = [n for n in gm.graph.nodes if n.meta.get(M.FAMILY) == "activation"]
    assert gelu.meta[M.LABEL] == M.HIGH


class ChunkAttention(nn.Module):
    """q, k, v = linear(x).chunk(3): tuple elements follow their producer's dtype."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        return torch.softmax(q @ k.transpose(-1, -2), -1) @ v


@pytest.mark.parametrize("capture", ["symbolic", "dynamo"])
def test_tuple_elements_follow_their_producer(capture):
    model = ChunkAttention()
    x = torch.randn(2, 5, 8)
    gm = transform_via(capture, model, x, dtype=torch.bfloat16)
    assert_classes_respected(gm, x, low=torch.bfloat16)
    (chunk,) = [n for n in gm.graph.nodes if n.target == "chunk"]
    assert chunk.meta[M.LABEL] == M.LOW  # no upcast of the qkv projection just to split it
    assert rel_err(gm(x), model(x)) < 3e-2


class _Upcasts(nn.Module):
    """A model's own upcast of an fp32 value: before a low op (diffusers' attention output,
    ``h.to(query.dtype)``) and before arithmetic the author wanted in fp32 (``s.float() - m``)."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.out = nn.Linear(8, 8)

    def forward(self, x):
        q = self.q(x)
        h = q.reshape(2, 5, 8).to(q.dtype)  # a no-op in the fp32 model
        s = q.float()
        return self.out(h), s - s.amax(-1, keepdim=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_models_upcast_before_a_low_op_costs_no_round_trip(dtype):
    x = torch.randn(10, 8)
    gm = transform(_Upcasts(), dtype=dtype, example_inputs=(x,))
    (out,) = [n for n in gm.graph.nodes if n.meta.get(M.FAMILY) == "linear"
              and n.meta.get(M.MODULE_PATH) == "out"]
    # q (low) -> reshape -> the out projection: no cast up and back down in between.
    assert M.CAST not in out.args[0].meta and out.args[0].meta[M.LABEL] == M.LOW
    assert any(r.action.startswith("remove ") for r in rewrites(gm, "insert_casts"))
    # The other upcast feeds arithmetic: it stays fp32 there, as under autocast.
    (sub,) = [n for n in gm.graph.nodes if n.target is operator.sub]
    assert sub.meta[M.LABEL] == M.HIGH
    # Numerics: each output within autocast's error (x 1.1, + 1e-6) against float64.
    torch.manual_seed(0)
    model = _Upcasts()
    gm = transform(model, dtype=dtype, example_inputs=(x,))
    ref = copy.deepcopy(model).double()(x.double())
    with torch.autocast("cpu", dtype=dtype):
        theirs = model(x)
    for ours, auto, r in zip(gm(x), theirs, ref):
        assert rel_err(ours, r) <= 1.1 * rel_err(auto, r) + 1e-6
