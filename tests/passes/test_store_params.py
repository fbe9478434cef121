"""store_params alone: with params='low', weights only LOW ops read become low copies.

Property: a float Parameter whose every reader is a LOW op (or an embedding lookup) is stored
once in the target dtype under its own name, and its casts leave the graph; a Parameter or buffer
that an fp32 op reads (a norm's scale, BatchNorm's statistics) stays fp32 and is the caller's
tensor. ``gm.state_dict()`` keys are the model's, the caller's model is unchanged, and the
outputs are the fp32-params graph's bit for bit (the same rounding, done once).
"""

import copy

import pytest
import torch
from torch import nn

import amprewrite
from amprewrite.graph import meta as M
from amprewrite.passes import run_pass

from ..helpers import LOW_DTYPES, prepared, rewrites, unchanged


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2)).eval()


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=["bf16", "fp16"])
def test_low_copies_for_weights_of_low_ops_only(dtype):
    model = _model()
    with unchanged(model):  # the caller's tensors, modes and identities
        gm, p = prepared(model, "store_params", dtype=dtype, params="low")
        casts_before = sum(M.CAST in n.meta for n in gm.graph.nodes)
        assert run_pass(gm, p)
    assert gm.get_parameter("0.weight").dtype == dtype
    assert gm.get_parameter("2.bias").dtype == dtype
    assert gm.get_parameter("1.weight").dtype == torch.float32  # LayerNorm: fp32 and shared
    assert gm.get_parameter("1.weight") is model[1].weight
    assert gm.state_dict().keys() == model.state_dict().keys()
    assert sum(M.CAST in n.meta for n in gm.graph.nodes) == casts_before - 4
    assert {r.action for r in rewrites(gm, "store_params")} == {
        f"store {t} as {dtype}" for t in ("0.weight", "0.bias", "2.weight", "2.bias")}
    x = torch.randn(3, 8)
    ref = amprewrite.transform(model, dtype)
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


class _ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Conv2d(4, 2, 1)
        with torch.no_grad():  # statistics and scales far from their initial values
            self.bn.running_mean.uniform_(-1, 1)
            self.bn.running_var.uniform_(0.5, 2)
            self.bn.weight.uniform_(0.5, 2)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.conv(x))))


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=["bf16", "fp16"])
def test_batch_norm_parameters_and_statistics_stay_fp32_and_shared(dtype):
    model = _ConvBN().eval()
    with unchanged(model):
        gm, p = prepared(model, "store_params", dtype=dtype, params="low")
        assert run_pass(gm, p)
    for name in ("conv.weight", "conv.bias", "head.weight", "head.bias"):
        assert gm.get_parameter(name).dtype == dtype, name
    kept = dict(gm.named_parameters()) | dict(gm.named_buffers())
    for name, t in (*model.bn.named_parameters(), *model.bn.named_buffers()):
        assert kept[f"bn.{name}"] is t, name  # fp32, and the caller's tensor
    assert gm.state_dict().keys() == model.state_dict().keys()
    x = torch.randn(2, 3, 5, 5)
    ref = amprewrite.transform(model, dtype)  # params="fp32": the same roundings, every call
    assert torch.equal(gm(x), ref(x))


class _SharedWeight(nn.Module):
    """One Parameter read by a LOW op and by an FP32 op (a sum): it must stay fp32."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) * self.fc.weight.sum()


@pytest.mark.parametrize("dtype", LOW_DTYPES, ids=["bf16", "fp16"])
def test_a_weight_an_fp32_op_also_reads_stays_fp32(dtype):
    model = _SharedWeight().eval()
    gm, p = prepared(model, "store_params", dtype=dtype, params="low")
    assert run_pass(gm, p)  # the bias: read by the linear only
    assert gm.get_parameter("fc.weight") is model.fc.weight
    assert gm.get_parameter("fc.bias").dtype == dtype
    (total,) = [n for n in gm.graph.nodes if n.meta.get(M.FAMILY) == "sum"]
    weight = [n for n in gm.graph.find_nodes(op="get_attr") if n.target == "fc.weight"]
    assert weight and any(total in n.users for n in weight)  # the sum reads the fp32 tensor
    x = torch.randn(3, 4)
    ref = amprewrite.transform(model, dtype)
    assert torch.equal(gm(x), ref(x))


def test_low_copies_are_parameters_that_keep_requires_grad():
    model = _model()
    model[2].bias.requires_grad_(False)
    gm, p = prepared(model, "store_params", dtype=torch.float16, params="low")
    run_pass(gm, p)
    for name, param in model.named_parameters():
        stored = gm.get_parameter(name)
        assert isinstance(stored, nn.Parameter)
        assert stored.requires_grad == param.requires_grad, name
    assert [name for name, t in gm.named_parameters() if t.dtype == torch.float16] == [
        "0.weight", "0.bias", "2.weight", "2.bias"]


def test_low_copies_in_train_mode_say_who_gets_the_gradients():
    """params='low' on a model in train mode: backward reaches the graph's low copies, and the
    model's own parameters get no .grad; the call says so (a warning and a report note), and
    in eval mode it says nothing."""
    import warnings

    import amprewrite

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    with pytest.warns(UserWarning, match=r"params='low' in train mode: 4 weights"):
        gm = amprewrite.transform(model.train(), "bf16", params="low", verify=False)
    gm(torch.randn(4, 8)).sum().backward()
    assert all(p.grad is None for p in model.parameters())  # what the warning says
    assert any("amprewrite.optimizer(gm" in n for n in amprewrite.report(gm).notes)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        amprewrite.transform(model.eval(), "bf16", params="low", verify=False)
