"""freeze_dtype_reads alone: ``x.dtype`` reads become the dtype the fp32 model had.

Property: every ``getattr(x, "dtype")`` whose value infer_dtypes knows is replaced by that
dtype (a constant), so the model's ``h.to(x.dtype)`` is a visible conversion to float32 that
painting sees and that stays float32 however the plan stores ``x``; other attribute reads and
dtypes nobody knows stay live reads. The constants are the fp32 model's, whatever the target.
"""

import builtins

import pytest
import torch
from torch import nn

import amprewrite
from amprewrite.graph import meta as M
from amprewrite.passes import run_pass
from amprewrite.precision.ops import conversion_target, is_conversion

from ..helpers import LOW_DTYPES, graph_signature, prepared, rewrites, runtime_dtypes


class Back(nn.Module):
    """The RMSNorm idiom: compute in fp32, then convert back to the input's dtype."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        return h.float().pow(2).to(h.dtype), x.to(self.lin.weight.dtype)


def test_dtype_reads_become_constants():
    gm, p = prepared(Back(), "freeze_dtype_reads")
    reads = [n for n in gm.graph.nodes if n.target is builtins.getattr and n.args[1] == "dtype"]
    assert len(reads) == 2
    assert run_pass(gm, p)
    assert not [n for n in gm.graph.nodes if n.target is builtins.getattr
                and n.args[1:] == ("dtype",)]
    tos = [n for n in gm.graph.nodes if n.target == "to"]
    assert [n.args[1] for n in tos] == [torch.float32, torch.float32]
    assert [r.action for r in rewrites(gm, "freeze_dtype_reads")] == [
        "x.dtype -> torch.float32"] * 2
    x = torch.randn(3, 4)
    model = Back()
    model.load_state_dict(gm.state_dict())
    for got, want in zip(gm(x), model(x)):
        assert torch.equal(got, want)


def test_unknown_dtype_is_left_as_a_live_read():
    """A graph input's dtype is unknown without example inputs: nothing to freeze."""

    class ReadInput(nn.Module):
        def forward(self, x):
            return torch.ones(3).to(x.dtype)

    gm, p = prepared(ReadInput(), "freeze_dtype_reads")
    assert not run_pass(gm, p)
    assert any(n.target is builtins.getattr for n in gm.graph.nodes)


def _dtype_reads(gm) -> list:
    return [n for n in gm.graph.nodes if n.target is builtins.getattr and n.args[1:] == ("dtype",)]


def _model_conversions(gm) -> list:
    """The model's own ``.to(...)`` nodes (not the casts amprewrite inserted)."""
    return [n for n in gm.graph.nodes if n.target == "to" and M.CAST not in n.meta]


def test_frozen_graph_is_the_same_for_both_dtypes():
    graphs = []
    for dtype in LOW_DTYPES:
        gm, p = prepared(Back(), "freeze_dtype_reads", dtype=dtype)
        # Before: the registry cannot name what the model converts to (a run-time value).
        assert [conversion_target(n) for n in _model_conversions(gm)] == [None, None]
        assert run_pass(gm, p)
        assert not _dtype_reads(gm)
        assert [conversion_target(n) for n in _model_conversions(gm)] == [torch.float32] * 2
        graphs.append(graph_signature(gm))
    assert graphs[0] == graphs[1]


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=["bf16", "fp16"])
def test_conversion_back_to_the_input_dtype_becomes_visible(dtype):
    """After the pass, painting sees ``h.to(h.dtype)`` as a conversion to float32: fp32 by
    nature (before it, the registry could not name the conversion's target)."""
    gm, p = prepared(Back(), "paint_precision", dtype=dtype)
    run_pass(gm, p)
    back = _model_conversions(gm)
    assert len(back) == 2
    for n in back:
        assert is_conversion(n) and conversion_target(n) == torch.float32, n.format_node()
        assert n.meta[M.NATURAL] == M.HIGH, n.format_node()


@pytest.mark.parametrize("params", ["fp32", "low"])
@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=["bf16", "fp16"])
def test_model_conversions_keep_float32_at_run_time(dtype, params):
    """In the transformed graph the linear runs low and ``params="low"`` stores its weight
    low, yet the model's ``.to(h.dtype)`` and ``.to(lin.weight.dtype)`` still produce float32:
    live reads would have returned the low dtype there."""
    model = Back().eval()
    gm = amprewrite.transform(model, dtype=dtype, params=params, verify=False)
    x = torch.randn(3, 4)
    seen = runtime_dtypes(gm, x)
    back = _model_conversions(gm)
    assert len(back) == 2
    assert [seen[n.name][1] for n in back] == [torch.float32, torch.float32]
    (lin,) = [n for n in gm.graph.nodes if n.meta.get(M.FAMILY) == "linear"]
    assert seen[lin.name][1] == dtype  # h itself is low: a live h.dtype would say so
    if params == "low":
        assert gm.get_parameter("lin.weight").dtype == dtype


class OtherReads(nn.Module):
    """A factory that reads a dtype, next to shape and device reads."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        z = torch.zeros(h.shape, dtype=h.dtype, device=h.device)
        return h + z


def test_only_dtype_reads_are_frozen():
    gm, p = prepared(OtherReads(), "freeze_dtype_reads")
    assert run_pass(gm, p)
    assert not _dtype_reads(gm)
    left = sorted(n.args[1] for n in gm.graph.nodes if n.target is builtins.getattr)
    assert left == ["device", "shape"]
    (zeros,) = [n for n in gm.graph.nodes if n.target is torch.zeros]
    assert zeros.kwargs["dtype"] == torch.float32
    model = OtherReads()
    model.load_state_dict(gm.state_dict())
    x = torch.randn(2, 4)
    assert torch.equal(gm(x), model(x))


# --- finfo sentinels the capture froze --------------------------------------------------------


class MaskedAttention(nn.Module):
    """transformers' additive mask: masked keys get ``finfo(dtype).min``, read from the
    model's dtype (fp32 at capture: a constant -3.40e38 in the graph)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, keep):
        scores = self.q(x) @ self.k(x).transpose(-1, -2)
        bias = torch.where(keep, 0.0, torch.finfo(x.dtype).min)
        return torch.softmax(scores + bias, -1) @ self.v(x)


def _masked_inputs():
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1))
    keep = torch.ones(2, 5, 5, dtype=torch.bool)
    keep[1, :2] = False  # two rows with every key masked (left padding): fp32 gives them uniform
    keep[0, :, 3:] = False  # and partly masked rows
    return x, keep


def _sentinel_literals(gm) -> list[float]:
    return [a for n in gm.graph.nodes for a in (*n.args, *n.kwargs.values())
            if isinstance(a, float) and abs(a) > 1e38]


def test_an_fp32_mask_sentinel_becomes_bf16s_and_a_fully_masked_row_stays_finite():
    model, inputs = MaskedAttention().eval(), _masked_inputs()
    with torch.no_grad():
        ref = model(*inputs)
    gm = amprewrite.transform(model, torch.bfloat16, example_inputs=inputs)
    assert _sentinel_literals(gm) == [-torch.finfo(torch.bfloat16).max]
    (rw,) = rewrites(gm, "freeze_dtype_reads")
    assert rw.action == "finfo(float32).min -> finfo(bfloat16).min"
    with torch.no_grad():
        out = gm(*inputs)
    assert torch.isfinite(out).all()
    # bf16 matmuls: within 2e-2 of fp32, the fully masked rows (uniform weights) included
    assert float((out - ref).norm() / ref.norm()) < 2e-2
    assert float((out[1, :2] - ref[1, :2]).norm() / ref[1, :2].norm()) < 2e-2


def test_without_the_rewrite_the_bf16_sentinel_is_inf_and_the_row_nan():
    """What the rewrite prevents: fp32's -3.40e38 rounds to -inf in bf16."""
    assert torch.tensor(torch.finfo(torch.float32).min).bfloat16().isinf()
    scores = torch.zeros(5, dtype=torch.bfloat16)
    assert torch.softmax(scores + torch.tensor(torch.finfo(torch.float32).min).bfloat16(),
                         -1).isnan().all()
    assert not torch.softmax(scores + torch.finfo(torch.bfloat16).min, -1).isnan().any()


def test_fp16_keeps_the_fp32_sentinel_where_the_ranges_keep_it_fp32():
    model, inputs = MaskedAttention().eval(), _masked_inputs()
    gm = amprewrite.transform(model, torch.float16, example_inputs=inputs)
    assert _sentinel_literals(gm) == [torch.finfo(torch.float32).min]
    assert not rewrites(gm, "freeze_dtype_reads")
    with torch.no_grad():
        assert torch.isfinite(gm(*inputs)).all()


def test_t5_with_a_left_padded_decoder_transforms_in_bf16_within_autocasts_error():
    """The zoo T5 with padding in both masks: before, the bf16 transform's check failed
    (output error 0.242 against autocast's 0.006: NaN from the decoder's padded rows)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.T5Config(vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                num_heads=4, decoder_start_token_id=0)
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(cfg).eval()
    g = torch.Generator().manual_seed(0)
    mask, dmask = torch.ones(2, 10, dtype=torch.long), torch.ones(2, 5, dtype=torch.long)
    mask[1, 6:], dmask[1, :2] = 0, 0
    inputs = {"input_ids": torch.randint(0, 256, (2, 10), generator=g), "attention_mask": mask,
              "decoder_input_ids": torch.randint(0, 256, (2, 5), generator=g),
              "decoder_attention_mask": dmask}
    gm = amprewrite.transform(model, torch.bfloat16, example_inputs=inputs)  # verified
    with torch.no_grad():
        ref, out = model(**inputs).logits, gm(**inputs).logits
        with torch.autocast("cpu", torch.bfloat16):
            auto = model(**inputs).logits.float()
    assert torch.isfinite(out).all()
    err = float((out - ref).norm() / ref.norm())
    assert err <= 1.5 * float((auto - ref).norm() / ref.norm()) + 1e-3, err


class Clamped(nn.Module):
    def forward(self, x):
        big = torch.finfo(x.dtype).max
        return (x * 2).clamp(-big, big), torch.full_like(x, big)


def test_fp32_max_in_any_argument_becomes_bf16s_and_the_report_says_which():
    x = torch.randn(3, 4)
    gm = amprewrite.transform(Clamped(), torch.bfloat16, example_inputs=(x,))
    big = torch.finfo(torch.bfloat16).max
    assert sorted(_sentinel_literals(gm)) == [-big, big, big]
    assert sorted(r.action for r in rewrites(gm, "freeze_dtype_reads")) == [
        "finfo(float32).max -> finfo(bfloat16).max",
        "finfo(float32).max/min -> finfo(bfloat16).max/min"]
    out, full = gm(x)
    assert torch.equal(out, (x * 2).to(out.dtype)) and torch.isfinite(full).all()
