"""Dynamic shapes in, dynamic shapes out: ``transform(..., dynamic_shapes=...)`` and
``torch.export``.

A graph transformed with a dynamic batch (the default, or torch.export's ``dynamic_shapes``)
exports with a dynamic batch; the exported program, saved and loaded, runs at other batch sizes
with the GraphModule's outputs (within 1e-6 relative) and an error against fp32 within 1.1x
autocast's; sizes outside the range asked for raise ShapeError from the GraphModule.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.export import Dim

import amprewrite
from amprewrite import CaptureError, ShapeError
from amprewrite.show.numerics import rel_err
from amprewrite.testing import zoo
from amprewrite.testing.zoo import first_tensor


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.conv2, self.bn2 = nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32)
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = F.relu(self.bn2(self.conv2(h)))
        return self.head(h.mean((2, 3)))


class SmallTransformer(nn.Module):
    def __init__(self, vocab=128, d=64, heads=4):
        super().__init__()
        self.heads = heads
        self.emb, self.pos = nn.Embedding(vocab, d), nn.Embedding(64, d)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.out = nn.Linear(d, vocab)

    def forward(self, ids):
        b, t = ids.shape
        h = self.emb(ids) + self.pos(torch.arange(t, device=ids.device))
        q, k, v = self.qkv(self.ln1(h)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.proj(a.transpose(1, 2).reshape(b, t, -1))
        h = h + self.fc2(F.gelu(self.fc1(self.ln2(h))))
        return self.out(h)


def _cnn():
    torch.manual_seed(0)
    return SmallCNN().eval(), torch.randn(4, 3, 16, 16), "x"


def _transformer():
    torch.manual_seed(0)
    return SmallTransformer().eval(), torch.randint(0, 128, (4, 32)), "ids"


def _zoo(name):
    def build():
        model, (x,) = zoo.MODELS[name]()
        return model, x, {"resnet": "x", "vit": "pixel_values"}.get(name, "input_ids")
    return build


def _batch(x, n):
    """n examples like x's (new random values of its dtype and range)."""
    if x.is_floating_point():
        return torch.randn(n, *x.shape[1:])
    return torch.randint(0, int(x.max()) + 1, (n, *x.shape[1:]))


def _autocast_err(model, x, ref):
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        return rel_err(first_tensor(model(x)).float(), ref)


def _export_roundtrip(gm, x, name, dim, tmp_path):
    ep = torch.export.export(gm, (x,), dynamic_shapes={name: {0: dim}})
    path = tmp_path / "model.pt2"
    torch.export.save(ep, path)
    return torch.export.load(path).module()


CASES = {"cnn": _cnn, "transformer": _transformer, "gpt2": _zoo("gpt2")}
SLOW = {name: _zoo(name) for name in ("llama", "bert", "vit", "resnet")}


@pytest.mark.parametrize("case", [*CASES, *[pytest.param(n, marks=pytest.mark.slow)
                                           for n in SLOW]])
def test_dynamic_batch_exports_saves_loads_and_runs_at_other_batches(case, tmp_path):
    model, x, name = {**CASES, **SLOW}[case]()
    batch = Dim("batch", min=2, max=16)
    gm = amprewrite.transform(model, torch.bfloat16, example_inputs=(x,),
                              dynamic_shapes={name: {0: batch}})
    notes = " ".join(amprewrite.report(gm).notes)
    assert f"dynamic sizes: {name}[0] in [2, 16]" in notes
    loaded = _export_roundtrip(gm, x, name, batch, tmp_path)
    for n in (3, 7):
        xb = _batch(x, n)
        with torch.no_grad():
            out = first_tensor(loaded(xb))
            want = first_tensor(gm(xb))
            ref = first_tensor(model(xb)).float()
        assert out.shape[0] == n and out.dtype == want.dtype
        assert rel_err(out, want) <= 1e-6
        assert rel_err(out, ref) <= 1.1 * _autocast_err(model, xb, ref)
    assert not gm._amp_variants  # one graph served every batch size
    # Outside the range asked for: the GraphModule says so; the exported program refuses too.
    with pytest.raises(ShapeError, match=r"dimension 0 has size 17, outside the range \[2, 16\]"):
        gm(_batch(x, 17))
    with pytest.raises((AssertionError, RuntimeError), match="<= 16"):
        loaded(_batch(x, 17))


def test_batch_is_dynamic_by_default_and_exports_as_the_issue_asked(tmp_path):
    model, x, name = _cnn()
    gm = amprewrite.transform(model, torch.bfloat16, example_inputs=(x,))
    assert "dynamic sizes: x[0] in [2, inf]" in " ".join(amprewrite.report(gm).notes)
    # The example tensor is left unmarked: a static transform of it stays static.
    assert not [k for k in vars(x) if k.startswith("_dynamo")]
    static = amprewrite.transform(model, torch.bfloat16, example_inputs=(x,), dynamic_shapes=None)
    assert [i.sizes for i in static._amp_inputs.inputs] == [tuple(x.shape)]
    loaded = _export_roundtrip(gm, x, name, Dim("batch"), tmp_path)  # min 0, as in the issue
    for n in (2, 33):  # a conv on mkldnn picks its kernel by batch (< 16): not in the graph
        xb = _batch(x, n)
        with torch.no_grad():
            assert rel_err(loaded(xb), gm(xb)) <= 1e-6
    # A new batch size is served by the same graph; another image size is a new shape class.
    gm(_batch(x, 9))
    assert not gm._amp_variants


def test_tuple_spec_and_explicit_static():
    model, x, _ = _transformer()
    gm = amprewrite.transform(model, torch.bfloat16, example_inputs=(x,),
                              dynamic_shapes=({0: Dim("b", max=8), 1: Dim("t", max=64)},))
    assert [i.sizes for i in gm._amp_inputs.inputs] == [(None, None)]
    static = amprewrite.transform(model, torch.bfloat16, example_inputs=(x,),
                                  dynamic_shapes=None)
    assert [i.sizes for i in static._amp_inputs.inputs] == [tuple(x.shape)]
    assert "every input size is static" in " ".join(amprewrite.report(static).notes)
    with pytest.raises(amprewrite.PolicyError, match="dynamic_shapes must be"):
        amprewrite.transform(model, example_inputs=(x,), dynamic_shapes="everything")


class FixedBatch(nn.Module):
    """Fixes its batch: a per-sample loop dynamo unrolls."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.stack([self.fc(x[i]) for i in range(x.shape[0])])


def test_a_model_that_fixes_its_batch_stays_static_and_says_so():
    model, x = FixedBatch().eval(), torch.randn(3, 8)
    gm = amprewrite.transform(model, torch.bfloat16, example_inputs=(x,))
    # It says why, where "static (dynamic_shapes='batch')" read as a contradiction.
    assert any(n.startswith("shapes: every input size is static: dynamic_shapes='batch' left "
                            "no batch dimension dynamic") for n in amprewrite.report(gm).notes)
    with torch.no_grad():  # another batch: transformed again, as before
        assert gm(torch.randn(5, 8)).shape == (5, 8)
    # Asked for explicitly, a batch the model fixes is an error naming the dimension.
    with pytest.raises(CaptureError, match="Constraints violated"):
        amprewrite.transform(model, torch.bfloat16, example_inputs=(x,),
                             dynamic_shapes={"x": {0: Dim("batch", max=8)}})
