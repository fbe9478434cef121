"""store_params alone: with params='low', weights only LOW ops read become low copies."""

import copy

import pytest
import torch
from torch import nn

import amprewrite
from amprewrite import meta as M
from amprewrite.passes import run_pass

from ..helpers import prepared, rewrites


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2)).eval()


def test_low_copies_for_weights_of_low_ops_only():
    model = _model()
    gm, p = prepared(model, "store_params", params="low")
    casts_before = sum(M.CAST in n.meta for n in gm.graph.nodes)
    assert run_pass(gm, p)
    assert gm.get_parameter("0.weight").dtype == torch.bfloat16
    assert gm.get_parameter("2.bias").dtype == torch.bfloat16
    assert gm.get_parameter("1.weight").dtype == torch.float32  # LayerNorm: fp32 and shared
    assert gm.get_parameter("1.weight") is model[1].weight
    assert model[0].weight.dtype == torch.float32  # the caller's model is untouched
    assert sum(M.CAST in n.meta for n in gm.graph.nodes) == casts_before - 4
    assert {r.action for r in rewrites(gm, "store_params")} == {
        f"store {t} as torch.bfloat16" for t in ("0.weight", "0.bias", "2.weight", "2.bias")}
    x = torch.randn(3, 8)
    ref = amprewrite.transform(model, torch.bfloat16)
    assert torch.equal(gm(x), ref(x))  # the same numbers, cast once instead of every call


def test_params_fp32_changes_nothing():
    gm, p = prepared(_model(), "store_params")
    assert not run_pass(gm, p)
    assert all(t.dtype == torch.float32 for t in gm.parameters())


class _Tokens(nn.Module):
    """An embedding table read by a lookup into an fp32 residual stream, and tied to the head
    (a LOW linear reading the same Parameter), as Hugging Face ties them."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(50, 16)
        self.ln = nn.LayerNorm(16)
        self.fc = nn.Linear(16, 16)

    def forward(self, ids):
        h = self.emb(ids)
        h = h + self.fc(self.ln(h))
        return torch.nn.functional.linear(h, self.emb.weight)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_embedding_tables_are_stored_low_and_rows_cast_up(dtype):
    model = _Tokens().eval()
    ids = torch.randint(0, 50, (2, 7))
    gm = amprewrite.transform(model, dtype=dtype, params="low", example_inputs=(ids,))
    assert gm.get_parameter("emb.weight").dtype == dtype
    assert model.emb.weight.dtype == torch.float32  # the caller's table is untouched
    assert gm.state_dict().keys() == model.state_dict().keys()
    (lookup,) = [n for n in gm.graph.nodes if n.meta.get(M.FAMILY) == "embedding"]
    (up,) = lookup.users  # the rows, cast up once for the fp32 residual stream
    assert up.meta[M.CAST] == torch.float32 and lookup.meta[M.LABEL] == M.LOW
    # The values: the fp32-params graph with the table rounded once (the lookup copies rows).
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        rounded.emb.weight.copy_(rounded.emb.weight.to(dtype).float())
    ref = amprewrite.transform(rounded, dtype=dtype, example_inputs=(ids,))
    assert torch.equal(gm(ids), ref(ids))


def test_params_fp32_keeps_the_embedding_table_fp32():
    model = _Tokens().eval()
    gm = amprewrite.transform(model, dtype=torch.bfloat16,
                              example_inputs=(torch.randint(0, 50, (2, 7)),))
    assert gm.get_parameter("emb.weight") is model.emb.weight


def test_keep_fp32_embedding_keeps_its_table_fp32():
    """Found by the fuzz test: keep_fp32=['embedding'] with params='low' stored the table low
    under an FP32 lookup."""
    model = _Tokens().eval()
    gm = amprewrite.transform(model, dtype=torch.bfloat16, params="low", keep_fp32=["embedding"],
                              example_inputs=(torch.randint(0, 50, (2, 7)),))
    assert gm.get_parameter("emb.weight").dtype == torch.float32
