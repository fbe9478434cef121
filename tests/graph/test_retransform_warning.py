"""A transformed model called at a new sequence length is transformed again, once per new shape
class, which takes seconds (issue 65: 3.5-4.2 s of CPU for a 2-layer Qwen2, said only on an
INFO log line). The first re-transform of a graph now warns, once: what happened, what it took,
and the ``dynamic_shapes=`` that avoids it, bounded by the model's own maximum length; that
advice, followed, gives one graph for every length."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch.export import Dim

import amprewrite
from amprewrite.errors import RetransformWarning
from amprewrite.testing import zoo

transformers = pytest.importorskip("transformers")


def _qwen2() -> torch.nn.Module:
    cfg = transformers.Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=512,
                                   use_cache=False)
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(cfg).eval()


def _ids(batch: int, length: int) -> torch.Tensor:
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(length))


def _logits(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out[0]


@pytest.mark.parametrize("build", [_qwen2, lambda: zoo.gpt2()[0]], ids=["qwen2", "gpt2"])
def test_first_new_length_warns_once_with_the_dynamic_shapes_that_avoid_it(build):
    model = build()
    limit = model.config.max_position_embeddings if hasattr(
        model.config, "max_position_embeddings") else model.config.n_positions
    gm = amprewrite.transform(model, "bf16", example_inputs={"input_ids": _ids(2, 12)})
    with pytest.warns(RetransformWarning) as seen:
        gm(input_ids=_ids(2, 20))
    (warning,) = [w for w in seen if w.category is RetransformWarning]
    text = str(warning.message)
    assert "dimension 1 was captured with size 12" in text and "has size 20" in text
    assert re.search(r"which took \d+\.\d s", text)
    advice = re.search(r"dynamic_shapes=(\{.*?\}\})", text).group(1)
    assert advice == f"{{'input_ids': {{0: Dim.AUTO, 1: Dim.AUTO(max={limit})}}}}"
    assert warning.filename == __file__  # it points at the caller's line
    with warnings.catch_warnings():
        warnings.simplefilter("error", RetransformWarning)
        gm(input_ids=_ids(2, 28))  # the re-transformed graph takes every length
        gm(input_ids=_ids(3, 16))  # and every batch
    assert len(gm._amp_variants) == 1

    # The advice, as written, gives one graph for every length: no re-transform, no warning.
    dynamic = amprewrite.transform(model, "bf16", example_inputs={"input_ids": _ids(2, 12)},
                                   dynamic_shapes=eval(advice, {"Dim": Dim}))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RetransformWarning)
        for length in (20, 28):
            ids = _ids(2, length)
            with torch.no_grad():
                ref, got = _logits(model(input_ids=ids)), _logits(dynamic(input_ids=ids))
            assert (got - ref).norm() / ref.norm() < 2e-2  # bf16 against fp32 (measured ~4e-3)
    assert dynamic._amp_variants == ()


def test_on_new_shape_error_still_raises_and_warns_nothing():
    gm = amprewrite.transform(_qwen2(), "bf16", example_inputs={"input_ids": _ids(2, 12)},
                              on_new_shape="error")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RetransformWarning)
        with pytest.raises(amprewrite.errors.ShapeError, match="on_new_shape='error'"):
            gm(input_ids=_ids(2, 20))


class _Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x, scale: float = 1.0):
        return self.linear(x) * scale


class _Branches(torch.nn.Module):
    """Branches on its batch, as diffusers' ``Upsample2D`` does: dynamo bounds it at 7."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x, scale: float = 1.0):
        y = self.linear(x)
        return y.contiguous() * scale if x.shape[0] >= 8 else y * scale


# case: (model, captured batch, called batch, called scale, what the warning says)
_CASES = {
    "constant": (_Scaled, 3, 4, 5.0, "a non-tensor argument changed"),
    "batch 1": (_Scaled, 1, 4, 3.0, "size 2 or more in dimension 0 of 'x'"),
    "called at 1": (_Scaled, 3, 1, 3.0, "dynamo fixes a size of 0 or 1"),
    "past a bound": (_Branches, 3, 9, 3.0, "within the range the graph was captured for"),
}


@pytest.mark.parametrize("case", list(_CASES))
def test_where_no_dynamic_dimension_helps_the_warning_says_what_does(case):
    """A changed non-tensor argument, a batch captured at size 1 or called at size 1 (which
    dynamo fixes), or a batch past the bound the model's code sets: no ``dynamic_shapes=``
    would avoid the re-transform, and the warning says what would (and blames no non-tensor
    argument where a tensor's size changed)."""
    build, captured, called, scale, says = _CASES[case]
    torch.manual_seed(0)
    gm = amprewrite.transform(build(), "bf16", example_inputs=(torch.randn(captured, 8), 3.0))
    with pytest.warns(RetransformWarning) as seen:
        gm(torch.randn(called, 8), scale)
    text = " ".join(str(w.message) for w in seen if w.category is RetransformWarning)
    assert "dynamic_shapes={" not in text
    assert says in text, text
    assert (case == "constant") == ("a non-tensor argument changed" in text)
